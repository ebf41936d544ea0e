"""LFM2's gated short conv: ours against the HF code path and torch.compile.

Eager: Lfm2ShortConv.forward between in_proj and out_proj (transpose, B*x, depthwise F.conv1d with padding K-1 and
slicing, C*, transpose back).  Bytes per (batch, token, channel), s per element: fwd 4s (read B, C, x, write y),
fwd+bwd 11s (+ read B, C, x, dy, write dB, dC, dx).

    case = build(dict(op="short_conv", batch=1, seq=16, hidden=8, kernel=3), "fp32", "cpu")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case

SPECS = [dict(op="short_conv", batch=1, seq=65536, hidden=2048, kernel=3),
         dict(op="short_conv", batch=8, seq=4096, hidden=2048, kernel=3, quick=True),
         dict(op="short_conv", batch=1, seq=4096, hidden=2048, kernel=3, quick=True)]


def conv_eager(bcx, weight):
    """Lfm2ShortConv.forward between in_proj and out_proj (no cache)."""
    k = weight.shape[-1]
    b, c, x = bcx.transpose(-1, -2).chunk(3, dim=-2)
    h = b * x
    h = F.conv1d(h, weight.unsqueeze(1), None, padding=k - 1, groups=h.shape[1])[..., : h.shape[-1]]
    return (c * h).transpose(-1, -2).contiguous()


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(parse_dtype(dtype))
    b, t, h, k = (spec[n] for n in ("batch", "seq", "hidden", "kernel"))
    ins = (rand(b, t, 3 * h).requires_grad_(), rand(h, k, scale=k ** -0.5).requires_grad_())
    n, s = b * t * h, ins[0].element_size()
    return Case(spec, ins, lambda x, w: ops.short_conv(x, w), Arm(conv_eager, "Lfm2ShortConv (HF)"),
                (4 * n * s, 11 * n * s), dy=rand(b, t, h))
