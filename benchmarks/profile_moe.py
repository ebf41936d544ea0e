"""Kernel times of one MoE experts forward and backward, uniform vs skewed routing (torch.profiler).

    python benchmarks/profile_moe.py [--tokens 512] [--experts 32]

Shows which kernel of the fused path grows when routing is skewed (E32 T512: the fused forward
took 0.65 ms skewed against 0.32 ms uniform on the H200).
"""
import argparse

import torch

import liger_rt  # noqa: F401
from liger_rt.kernels import moe_experts as M
from liger_rt.tools.bench.harness import profiled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_moe needs a GPU")
    E, I = args.experts, (1792 if args.experts == 32 else 1536)
    dims = dict(tokens=args.tokens, experts=E, top_k=4, hidden=2048, intermediate=I)
    for tag in ("uniform", "skewed"):
        case = M._make_case(dims, torch.bfloat16, "cuda", tag=tag)
        (x, gu, dn, idx, w, _), (dy,) = case.args, case.grads
        cfg = M.OP.select(x, **dims).config

        def step():
            y = M.OP.call_impl("triton", cfg, x, gu, dn, idx, w, True)
            return torch.autograd.grad(y, (x, gu, dn, w), dy)
        prof = profiled(step, warmup=3, calls=5)
        counts = torch.bincount(idx.flatten(), minlength=E)
        print(f"== E{E} T{args.tokens} {tag}: max rows/expert {int(counts.max())}, empty {int((counts == 0).sum())}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
