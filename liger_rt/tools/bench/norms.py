"""RMSNorm, SwiGLU and LayerNorm: ours against eager, torch.compile and Liger-Kernel.

Eager: HF LlamaRMSNorm.forward, F.silu(g) * u, F.layer_norm.  Effective bandwidth counts the bytes an op cannot avoid
(M rows, N columns, s bytes per element; weights are O(N), left out): RMSNorm and LayerNorm fwd 2MNs (read x, write
y), fwd+bwd 5MNs (+ read dy and x, write dx); SwiGLU fwd 3MNs, fwd+bwd 8MNs.  Targets (GB/s, fwd and fwd+bwd) at the
LLM widths; the SigLIP2 LayerNorm widths are reported without one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case, peer

_GBPS = {"rms_norm": (3800, 2600), "swiglu": (4000, 3400), "layer_norm": (3600, 2400)}
_PEER = {"rms_norm": "LigerRMSNormFunction", "swiglu": "LigerSiLUMulFunction", "layer_norm": "LigerLayerNormFunction"}


def _spec(op, dim, m, n, quick=False, target=True):
    t = _GBPS[op]
    return dict(op=op, rows=m, **{dim: n}, quick=quick,
                target={"fwd": {"GBps": t[0]}, "fwdbwd": {"GBps": t[1]}} if target else None)


SPECS = [_spec("rms_norm", "hidden", 16384, 4096, True), _spec("rms_norm", "hidden", 65536, 2048),
         _spec("rms_norm", "hidden", 262144, 64, False, False),           # per-head q/k norms (LFM2 q, Qwen3 q):
         _spec("rms_norm", "hidden", 131072, 128, False, False),          # the tiled backward; no target
         _spec("swiglu", "cols", 16384, 8192, True), _spec("swiglu", "cols", 8192, 12288),
         _spec("layer_norm", "hidden", 16384, 4096, True), _spec("layer_norm", "hidden", 65536, 2048),
         _spec("layer_norm", "hidden", 4096, 1152, True, False),             # SigLIP2 widths: no target
         _spec("layer_norm", "hidden", 23328, 1152, False, False)]


def hf_rms_norm(x, w, eps=1e-6):
    """LlamaRMSNorm.forward."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    op, m = spec["op"], spec["rows"]
    n = spec.get("hidden") or spec["cols"]
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device=device)).to(parse_dtype(dtype))
    dy = rand(m, n)
    if op == "rms_norm":
        ins, eager = (rand(m, n, scale=2.0), rand(n, scale=0.3, shift=1.0)), Arm(hf_rms_norm, "LlamaRMSNorm.forward")
    elif op == "swiglu":
        ins, eager = (rand(m, n, scale=3.0), rand(m, n)), Arm(lambda a, b: F.silu(a) * b, "F.silu(g) * u")
    else:
        ins = (rand(m, n, scale=2.0, shift=1.5), rand(n, scale=0.5, shift=1.0), rand(n, scale=0.5))
        eager = Arm(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-6), "F.layer_norm")
    eps = () if op == "swiglu" else (1e-6,)
    lk = peer(f"liger_kernel.ops.{op}", _PEER[op], echo)
    peers = {"liger_kernel": Arm(lambda *a: lk.apply(*a, *eps), _PEER[op])} if lk else {}
    mns = m * n * dy.element_size()
    return Case(spec, tuple(t.requires_grad_() for t in ins), lambda *a: getattr(ops, op)(*a, *eps), eager,
                (3 * mns, 8 * mns) if op == "swiglu" else (2 * mns, 5 * mns), dy=dy, peers=peers)
