"""MoE experts and router.

Experts: ours (dispatched, fused Triton, grouped MM) against transformers' grouped_mm experts and Liger-Kernel's fused
MoE, at the LFM2-8B-A1B (E32) and LFM2-24B-A2B (E64) shapes.  The `eager` arm is an Lfm2MoeExperts module holding the
case's weights with transformers' grouped_mm experts; the reference is the same module's eager loop in fp32.  Routing
`uniform` (random distinct experts per token) or `skewed` (Zipf-like: a few hot experts, a quarter empty), the
inputs of the op's tuning cases.  FLOPs: fwd 2*T*k*(H*2I + I*H) (the two expert GEMMs), fwd+bwd 3x.

Router: Lfm2MoeTopKRouter.forward after the gate projection against ours.  Bytes per token with E experts and k
chosen: fwd E*s + k*s + 8k (logits in, weights and int64 indices out), fwd+bwd adds 2E*s + k*s + 8k.

    case = build(dict(op="moe_router", tokens=8, experts=4, top_k=2), "fp32", "cpu")
"""
from __future__ import annotations

import torch
from liger_rt.registry import REGISTRY

from .harness import Arm, Case, peer

STATICS = ((32, 4, 2048, 1792), (64, 4, 2048, 1536))
SPECS = [*[dict(op="moe_experts", tokens=t, experts=e, top_k=k, hidden=h, intermediate=i, routing=r,
                quick=t in (512, 4096) and r == "uniform")
           for e, k, h, i in STATICS for t in (512, 2048, 4096, 16384) for r in ("uniform", "skewed")],
         *[dict(op="moe_router", tokens=t, experts=e, top_k=4, dtype=dt, quick=q and dt == "bf16")
           for dt in ("fp32", "bf16") for t, e, q in ((65536, 32, True), (4096, 32, True), (65536, 64, False))]]


def hf_experts(e, k, h, i, implementation: str):
    """fn(x, gate_up, down, idx, w) through transformers' Lfm2MoeExperts with these weights."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts
    cfg = Lfm2MoeConfig(num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i)
    with torch.device("meta"):
        mod = Lfm2MoeExperts(cfg)
    cfg._experts_implementation = implementation
    return lambda x, gu, dn, idx, w: torch.func.functional_call(mod, {"gate_up_proj": gu, "down_proj": dn}, (x, idx, w))


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
    if spec["op"] == "moe_router":
        g = torch.Generator(device).manual_seed(0)
        t, e, k = spec["tokens"], spec["experts"], spec["top_k"]
        logits = torch.randn(t, e, generator=g, device=device).to(dt).requires_grad_()
        bias = 0.05 * torch.randn(e, generator=g, device=device)          # an fp32 buffer, as in the model
        s = logits.element_size()
        fwd = t * (e * s + k * s + 8 * k)
        return Case(spec, (logits, bias), lambda x, eb: ops.moe_router(x, k, eb),
                    Arm(lambda x, eb: route_eager(x, k, eb), "Lfm2MoeTopKRouter (HF)"),
                    (fwd, 2 * fwd + t * e * s), dy=torch.randn(t, k, generator=g, device=device).to(dt))
    t, e, k, h, i = (spec[n] for n in ("tokens", "experts", "top_k", "hidden", "intermediate"))
    dims = dict(tokens=t, experts=e, top_k=k, hidden=h, intermediate=i)
    tuning = REGISTRY.get("moe_experts").new_case(dims, dt, device, tag=spec["routing"])
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
