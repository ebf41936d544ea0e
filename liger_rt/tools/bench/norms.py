"""RMSNorm, residual add + RMSNorm and LayerNorm: ours against eager, torch.compile and Liger-Kernel.

Eager: HF LlamaRMSNorm.forward (after the decoder layer's ``residual + h`` for fused_add_rms_norm) and F.layer_norm.
Effective bandwidth counts the bytes an op cannot avoid (M rows, N columns, s bytes per element; weights are O(N),
left out): fwd 2MNs (read x, write y), fwd+bwd 5MNs (+ read dy and x, write dx); fused_add_rms_norm fwd 4MNs (read x
and the residual, write y and s), fwd+bwd 8MNs (+ read dy, ds and s, write the one gradient of both addends).  Its
backward gets an upstream gradient for each output, as in a decoder layer (s feeds the next residual add); the
`liger_rt_unfused` arm is the add in PyTorch, then liger_rt's rms_norm.  Cases: LLM widths, the per-head q/k norm
widths (64, 128: the tiled backward) and the SigLIP2 vision tower's LayerNorm (1152).

    case = build(dict(op="rms_norm", rows=4, hidden=32), "fp32", "cpu")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case, peer

_PEER = {"rms_norm": "LigerRMSNormFunction", "layer_norm": "LigerLayerNormFunction",
         "fused_add_rms_norm": "LigerFusedAddRMSNormFunction"}

SPECS = [dict(op="rms_norm", rows=16384, hidden=4096, quick=True), dict(op="rms_norm", rows=65536, hidden=2048),
         dict(op="rms_norm", rows=262144, hidden=64), dict(op="rms_norm", rows=131072, hidden=128),
         dict(op="fused_add_rms_norm", rows=16384, hidden=4096, quick=True),
         dict(op="fused_add_rms_norm", rows=8192, hidden=8192),
         dict(op="layer_norm", rows=16384, hidden=4096, quick=True), dict(op="layer_norm", rows=65536, hidden=2048),
         dict(op="layer_norm", rows=4096, hidden=1152, quick=True), dict(op="layer_norm", rows=23328, hidden=1152)]


def hf_rms_norm(x, w, eps=1e-6):
    """LlamaRMSNorm.forward."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _SecondGrad(torch.autograd.Function):
    """y, with `ds` as the upstream gradient of s: the harness differentiates one output, and a fused add + norm
    arm's backward must take both (no copy: y's view, a constant ds)."""

    @staticmethod
    def forward(ctx, y, s, ds):
        ctx.ds = ds
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy, ctx.ds, None


def _add_norm_arm(add_norm, ds):
    """An arm fn(x, residual, w) -> y whose backward also sends ds into s, for add_norm(x, residual, w) -> (y, s)."""
    return lambda x, r, w: _SecondGrad.apply(*add_norm(x, r, w), ds)


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    op, m, n = spec["op"], spec["rows"], spec["hidden"]
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device=device)).to(parse_dtype(dtype))
    dy = rand(m, n)
    if op == "fused_add_rms_norm":
        return _fused_add_case(spec, rand, dy, echo)
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


def _fused_add_case(spec: dict, rand, dy, echo) -> Case:
    from liger_rt import ops
    m, n = spec["rows"], spec["hidden"]
    ins = (rand(m, n, scale=2.0), rand(m, n, scale=4.0), rand(n, scale=0.3, shift=1.0))
    ds = rand(m, n)

    def hf(x, r, w):
        s = r + x
        return hf_rms_norm(s, w), s

    def unfused(x, r, w):
        s = r + x
        return ops.rms_norm(s, w, 1e-6), s

    lk = peer("liger_kernel.ops.fused_add_rms_norm", _PEER["fused_add_rms_norm"], echo)
    peers = {"liger_rt_unfused": Arm(_add_norm_arm(unfused, ds), "residual + h, then liger_rt.ops.rms_norm")}
    if lk:   # apply(X, R, W, eps, offset, casting_mode, in_place): in_place=False keeps the residual input intact
        peers["liger_kernel"] = Arm(_add_norm_arm(lambda x, r, w: lk.apply(x, r, w, 1e-6, 0.0, "llama", False), ds),
                                    _PEER["fused_add_rms_norm"])
    mns = m * n * dy.element_size()
    return Case(spec, tuple(t.requires_grad_() for t in ins),
                _add_norm_arm(lambda x, r, w: ops.fused_add_rms_norm(x, r, w, 1e-6), ds),
                Arm(_add_norm_arm(hf, ds), "residual + h, then LlamaRMSNorm.forward"), (4 * mns, 8 * mns), dy=dy,
                peers=peers)
