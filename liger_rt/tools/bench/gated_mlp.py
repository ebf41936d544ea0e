"""SwiGLU (the gated MLP's silu(gate) * up): ours against eager, torch.compile and Liger-Kernel.

Effective bandwidth (M rows, N columns, s bytes per element): fwd 3MNs (read gate and up, write y), fwd+bwd 8MNs
(+ read dy, gate, up, write dgate, dup), at intermediate widths 8192 and 12288.

    case = build(dict(op="swiglu", rows=4, cols=32), "fp32", "cpu")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case, peer

SPECS = [dict(op="swiglu", rows=16384, cols=8192, quick=True), dict(op="swiglu", rows=8192, cols=12288)]


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    m, n = spec["rows"], spec["cols"]
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(parse_dtype(dtype))
    ins, dy = (rand(m, n, scale=3.0).requires_grad_(), rand(m, n).requires_grad_()), rand(m, n)
    lk = peer("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", echo)
    peers = {"liger_kernel": Arm(lambda a, b: lk.apply(a, b), "LigerSiLUMulFunction")} if lk else {}
    mns = m * n * dy.element_size()
    return Case(spec, ins, ops.swiglu, Arm(lambda a, b: F.silu(a) * b, "F.silu(g) * u"), (3 * mns, 8 * mns), dy=dy,
                peers=peers)
