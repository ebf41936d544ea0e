"""Kernel times of one MoE experts forward and backward, uniform vs skewed routing (torch.profiler; GPU).

    python benchmarks/profile/moe_gemms.py [--tokens 512] [--experts 32] [--set up_bwd_split=1,down_desc=1]

Shows which kernel of the fused path grows when routing is skewed (E32 T512 on an H200: the fused forward took
0.65 ms skewed against 0.32 ms uniform), and each GEMM family's share of the 18 * S * H * I FLOPs of a forward +
backward (S = tokens * top_k) at its device time: which one holds the whole back.
"""
import argparse

import torch

from liger_rt import dispatch
from liger_rt.autograd import call_impl
from liger_rt.registry import REGISTRY
from liger_rt.tools.bench.harness import profiled
from liger_rt.tools.bench.model import parse_config

# kernel -> FLOPs per forward + backward in units of S * H * I: up (x @ gate|up, 4), down (h @ down, 2, and the
# backward's dX, dgu @ gate_up, 4: one kernel), up_bwd (dy @ down, 2), weight gradients (dgate_up 4, ddown 2).
# up_bwd_split runs dy @ down in the down kernel (8) and the SwiGLU backward alone (no FLOPs counted).
FAMILIES = {"_moe_up_fwd_kernel": 4, "_moe_down_kernel": 6, "_moe_up_bwd_kernel": 2, "_moe_wgrad": 6}
SPLIT = {**FAMILIES, "_moe_down_kernel": 8, "_moe_up_bwd_kernel": 0, "_moe_swiglu_bwd_kernel": 0}


def family_rates(events, steps: int, shi: int, families=FAMILIES) -> list[tuple[str, float, float]]:
    """(family, device ms per step, TFLOP/s) from torch.profiler key averages over `steps` steps; the weight
    gradients sum both of their kernels (pointer and descriptor) and anything else is "other"."""
    ms = dict.fromkeys([*families, "other"], 0.0)
    for e in events:
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        ms[next((f for f in families if e.key.startswith(f)), "other")] += us / 1e3 / steps
    return [(f, t, families[f] * shi / t / 1e9 if families.get(f) and t > 0 else float("nan"))
            for f, t in ms.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--set", default="", help="knobs over the dispatched config, e.g. up_bwd_split=1,down_desc=1")
    args = ap.parse_args()
    knobs = parse_config(args.set)
    if not torch.cuda.is_available():
        raise SystemExit("moe_gemms.py needs a GPU")
    E, I = args.experts, (1792 if args.experts == 32 else 1536)
    dims = dict(tokens=args.tokens, experts=E, top_k=4, hidden=2048, intermediate=I)
    op = REGISTRY.get("moe_experts")
    for tag in ("uniform", "skewed"):
        case = op.new_case(dims, torch.bfloat16, "cuda", tag=tag)
        (x, gu, dn, idx, w, _), (dy,) = case.args, case.grads
        cfg = dispatch.decision(op, x, **dims).config.replace(**knobs)

        def step():
            y = call_impl(op, "triton", cfg, x, gu, dn, idx, w, True)
            return torch.autograd.grad(y, (x, gu, dn, w), dy)
        steps = 5
        prof = profiled(step, warmup=3, calls=steps)
        counts = torch.bincount(idx.flatten(), minlength=E)
        print(f"== E{E} T{args.tokens} {tag}: max rows/expert {int(counts.max())}, empty {int((counts == 0).sum())}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
        shi = dims["tokens"] * dims["top_k"] * dims["hidden"] * dims["intermediate"]
        rates = family_rates(prof.key_averages(), steps, shi, SPLIT if cfg.up_bwd_split else FAMILIES)
        total = sum(t for _, t, _ in rates)
        print(f"-- {cfg}\n-- per family (device ms per step, TFLOP/s), all: {total:.3f} ms, "
              f"{18 * shi / total / 1e9:.1f} TFLOP/s")
        for name, t, rate in rates:
            print(f"   {name:22s} {t:8.3f} ms  {rate:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
