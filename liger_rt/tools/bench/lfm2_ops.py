"""LFM2's gated short conv and the LFM2-MoE router: ours against the HF code paths and torch.compile.

Eager: Lfm2ShortConv.forward between in_proj and out_proj (transpose, B*x, depthwise F.conv1d with padding K-1 and
slicing, C*, transpose back) and Lfm2MoeTopKRouter.forward after the gate projection.  Bytes per (batch, token,
channel) of short conv (s per element): fwd 4s (read B, C, x, write y), fwd+bwd 11s (+ read B, C, x, dy, write dB, dC,
dx).  Router, per token with E experts and k chosen: fwd E*s + k*s + 8k (logits in, weights and int64 indices out),
fwd+bwd adds 2E*s + k*s + 8k.  Targets: fwd+bwd ms at issue 6's speed-ups over the anchor run's eager times (short conv
4x / 4x / 2x of 5.972, 3.278, 0.504 ms; router 5x / 3x of 0.525, 0.594 ms, fp32 logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case


def _ms(v):
    return {"fwdbwd": {"ms": v}} if v else None


SPECS = [dict(op="short_conv", batch=1, seq=65536, hidden=2048, kernel=3, target=_ms(5.972 / 4)),
         dict(op="short_conv", batch=8, seq=4096, hidden=2048, kernel=3, quick=True, target=_ms(3.278 / 4)),
         dict(op="short_conv", batch=1, seq=4096, hidden=2048, kernel=3, quick=True, target=_ms(0.504 / 2)),
         *[dict(op="moe_router", tokens=t, experts=e, top_k=4, dtype=dt, quick=q and dt == "bf16",
                target=_ms(ms) if dt == "fp32" else None)
           for dt in ("fp32", "bf16") for t, e, q, ms in ((65536, 32, True, 0.525 / 5), (4096, 32, True, 0.594 / 3),
                                                          (65536, 64, False, None))]]


def conv_eager(bcx, weight):
    """Lfm2ShortConv.forward between in_proj and out_proj (no cache)."""
    k = weight.shape[-1]
    b, c, x = bcx.transpose(-1, -2).chunk(3, dim=-2)
    h = b * x
    h = F.conv1d(h, weight.unsqueeze(1), None, padding=k - 1, groups=h.shape[1])[..., : h.shape[-1]]
    return (c * h).transpose(-1, -2).contiguous()


def route_eager(logits, top_k, expert_bias):
    """Lfm2MoeTopKRouter.forward after the gate projection (norm_topk_prob, scaling 1)."""
    p = logits.sigmoid()
    idx = torch.topk(p + expert_bias, k=top_k, dim=-1).indices
    w = torch.gather(p, 1, idx).type_as(logits)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-6), idx


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    dt = parse_dtype(dtype)
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dt)
    if spec["op"] == "short_conv":
        b, t, h, k = (spec[n] for n in ("batch", "seq", "hidden", "kernel"))
        ins = (rand(b, t, 3 * h).requires_grad_(), rand(h, k, scale=k ** -0.5).requires_grad_())
        n, s = b * t * h, ins[0].element_size()
        return Case(spec, ins, lambda x, w: ops.short_conv(x, w), Arm(conv_eager, "Lfm2ShortConv (HF)"),
                    (4 * n * s, 11 * n * s), dy=rand(b, t, h))
    t, e, k = spec["tokens"], spec["experts"], spec["top_k"]
    logits, bias = rand(t, e).requires_grad_(), 0.05 * torch.randn(e, generator=g, device=device)  # fp32 buffer
    s = logits.element_size()
    fwd = t * (e * s + k * s + 8 * k)
    return Case(spec, (logits, bias), lambda x, eb: ops.moe_router(x, k, eb),
                Arm(lambda x, eb: route_eager(x, k, eb), "Lfm2MoeTopKRouter (HF)"),
                (fwd, 2 * fwd + t * e * s), dy=rand(t, k))
