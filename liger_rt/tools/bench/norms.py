"""RMSNorm and LayerNorm: ours against eager, torch.compile and Liger-Kernel.

Eager: HF LlamaRMSNorm.forward and F.layer_norm.  Effective bandwidth counts the bytes an op cannot avoid (M rows,
N columns, s bytes per element; weights are O(N), left out): fwd 2MNs (read x, write y), fwd+bwd 5MNs (+ read dy and
x, write dx).  Cases: LLM widths, the per-head q/k norm widths (64, 128: the tiled backward) and the SigLIP2 vision
tower's LayerNorm (1152).

    case = build(dict(op="rms_norm", rows=4, hidden=32), "fp32", "cpu")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case, peer

_PEER = {"rms_norm": "LigerRMSNormFunction", "layer_norm": "LigerLayerNormFunction"}

SPECS = [dict(op="rms_norm", rows=16384, hidden=4096, quick=True), dict(op="rms_norm", rows=65536, hidden=2048),
         dict(op="rms_norm", rows=262144, hidden=64), dict(op="rms_norm", rows=131072, hidden=128),
         dict(op="layer_norm", rows=16384, hidden=4096, quick=True), dict(op="layer_norm", rows=65536, hidden=2048),
         dict(op="layer_norm", rows=4096, hidden=1152, quick=True), dict(op="layer_norm", rows=23328, hidden=1152)]


def hf_rms_norm(x, w, eps=1e-6):
    """LlamaRMSNorm.forward."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    op, m, n = spec["op"], spec["rows"], spec["hidden"]
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device=device)).to(parse_dtype(dtype))
    dy = rand(m, n)
    if op == "rms_norm":
        ins, eager = (rand(m, n, scale=2.0), rand(n, scale=0.3, shift=1.0)), Arm(hf_rms_norm, "LlamaRMSNorm.forward")
    else:
        ins = (rand(m, n, scale=2.0, shift=1.5), rand(n, scale=0.5, shift=1.0), rand(n, scale=0.5))
        eager = Arm(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-6), "F.layer_norm")
    lk = peer(f"liger_kernel.ops.{op}", _PEER[op], echo)
    peers = {"liger_kernel": Arm(lambda *a: lk.apply(*a, 1e-6), _PEER[op])} if lk else {}
    mns = m * n * dy.element_size()
    return Case(spec, tuple(t.requires_grad_() for t in ins), lambda *a: getattr(ops, op)(*a, 1e-6), eager,
                (2 * mns, 5 * mns), dy=dy, peers=peers)
