"""Fused linear cross-entropy and cross-entropy (a training step's loss, fwd+bwd).

Eager: F.cross_entropy((x @ W.t()).float(), y) and F.cross_entropy(logits.float(), y).  Peers: torch.compile of the
same and Liger-Kernel's LigerFusedLinearCrossEntropyLoss / LigerCrossEntropyLoss; `liger_rt_inplace` is ours writing
dlogits into the logits buffer (inplace_backward=True on a non-leaf view, as an lm_head output is; Liger-Kernel always
does).  FLCE TFLOP/s count its three GEMMs (2*BT*H*V each); CE GB/s count reading the logits and writing their gradient
once.  Peak memory is everything the step allocates, the gradients it hands out included.

    case = build(dict(op="cross_entropy", rows=4, vocab=64), "fp32", "cpu")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Arm, Case, peer

SPECS = [dict(op="fused_linear_cross_entropy", tokens=8192, hidden=2048, vocab=65536, quick=True),
         dict(op="fused_linear_cross_entropy", tokens=8192, hidden=2560, vocab=151936),
         dict(op="cross_entropy", rows=8192, vocab=151936, quick=True)]


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    dt = parse_dtype(dtype)
    g = torch.Generator(device).manual_seed(0)
    v = spec["vocab"]
    if spec["op"] == "fused_linear_cross_entropy":
        t, h = spec["tokens"], spec["hidden"]
        x = torch.randn(t, h, generator=g, device=device).mul_(0.5).to(dt).requires_grad_()
        w = torch.randn(v, h, generator=g, device=device).mul_(0.02).to(dt).requires_grad_()
        y = torch.randint(0, v, (t,), generator=g, device=device)
        lk = peer("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss", echo)
        peers = {"liger_kernel": Arm(lambda x, w, y, m=lk(): m(w, x, y), "LigerFusedLinearCrossEntropyLoss")
                 } if lk else {}
        return Case(spec, (x, w, y), ops.fused_linear_cross_entropy,
                    Arm(lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y), "F.cross_entropy(x @ W.t())"),
                    (0, 6 * t * h * v), unit="TFLOPs", peers=peers, passes=("fwdbwd",))
    r = spec["rows"]
    logits = torch.randn(r, v, generator=g, device=device).mul_(2.0).to(dt).requires_grad_()
    y = torch.randint(0, v, (r,), generator=g, device=device)
    lk = peer("liger_kernel.transformers", "LigerCrossEntropyLoss", echo)
    peers = {"liger_rt_inplace": Arm(lambda z, y: ops.cross_entropy(z.view_as(z), y, inplace_backward=True),
                                     "ours, inplace_backward=True"),
             **({"liger_kernel": Arm(lambda z, y, m=lk(): m(z.view_as(z), y), "LigerCrossEntropyLoss")} if lk else {})}
    return Case(spec, (logits, y), ops.cross_entropy,
                Arm(lambda z, y: F.cross_entropy(z.float(), y), "F.cross_entropy(logits.float())"),
                (0, 2 * r * v * logits.element_size()), peers=peers, passes=("fwdbwd",))
