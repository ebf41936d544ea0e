"""MoE experts: ours (dispatched, fused Triton, grouped MM) against transformers' grouped_mm experts and Liger-Kernel's
fused MoE, at the LFM2-8B-A1B (E32) and LFM2-24B-A2B (E64) shapes.

The `eager` arm is an Lfm2MoeExperts module holding the case's weights with transformers' grouped_mm experts; the
reference is the same module's eager loop in fp32.  Routing `uniform` (random distinct experts per token) or `skewed`
(Zipf-like: a few hot experts, a quarter empty).  FLOPs: fwd 2*T*k*(H*2I + I*H) (the two expert GEMMs), fwd+bwd
3x.  Target (issue 7): the dispatched arm >= 450 TFLOP/s fwd+bwd at T=16384.
"""
from __future__ import annotations

import torch

from .harness import Arm, Case, peer

STATICS = ((32, 4, 2048, 1792), (64, 4, 2048, 1536))
SPECS = [dict(op="moe_experts", tokens=t, experts=e, top_k=k, hidden=h, intermediate=i, routing=r,
              quick=t in (512, 4096) and r == "uniform",
              target={"fwdbwd": {"TFLOPs": 450}} if t == 16384 else None)
         for e, k, h, i in STATICS for t in (512, 2048, 4096, 16384) for r in ("uniform", "skewed")]


def hf_experts(e, k, h, i, implementation: str):
    """fn(x, gate_up, down, idx, w) through transformers' Lfm2MoeExperts with these weights."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts
    cfg = Lfm2MoeConfig(num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i)
    with torch.device("meta"):
        mod = Lfm2MoeExperts(cfg)
    cfg._experts_implementation = implementation
    return lambda x, gu, dn, idx, w: torch.func.functional_call(mod, {"gate_up_proj": gu, "down_proj": dn}, (x, idx, w))


def build(spec: dict, dtype, device: str, echo=print) -> Case:
    from liger_rt import ops
    from liger_rt.dtypes import parse_dtype
    from liger_rt.kernels.moe_experts import _make_case         # the tuning cases' inputs (seed 0, dy ~ N(0, 1/16))
    t, e, k, h, i = (spec[n] for n in ("tokens", "experts", "top_k", "hidden", "intermediate"))
    tuning = _make_case(spec, parse_dtype(dtype), device, spec["routing"])
    (x, gu, dn, idx, w, _), (dy,) = tuning.args, tuning.grads
    lk = peer("liger_kernel.ops.fused_moe", "LigerFusedMoEFunction", echo)
    peers = {"liger_kernel": Arm(lambda x, gu, dn, idx, w: lk.apply(x, gu, dn, idx.to(torch.int32), w),
                                 "LigerFusedMoEFunction")} if lk else {}
    counts = torch.bincount(idx.flatten(), minlength=e)
    flops = 2.0 * t * k * 3 * h * i
    return Case(spec, (x, gu, dn, idx, w), ops.moe_experts,
                Arm(hf_experts(e, k, h, i, "grouped_mm"), "transformers grouped_mm"), (flops, 3 * flops),
                unit="TFLOPs", dy=dy, peers=peers, ref=hf_experts(e, k, h, i, "eager"), forced=("triton", "grouped_mm"),
                compile=False,
                extra={"rows_per_expert": t * k / e, "max_rows_expert": int(counts.max()),
                       "empty_experts": int((counts == 0).sum())})
