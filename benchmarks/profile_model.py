"""Where one training step's time goes, per arm (torch.profiler tables).

    python benchmarks/profile_model.py [--model qwen3 --preset qwen3-1.7b] [--arms baseline,liger_rt,liger_kernel]
                                       [--flags rope=1] [--batch 1 --seq 512] [--host]

Builds the preset with random weights (same seed per arm), patches it like `liger-tune bench model`
does, runs three warm-up steps, times two steps by wall clock, then profiles two steps and prints
the kernels by total CUDA time, so the step-time gap between two arms can be read kernel by kernel.
Each arm's line gives wall ms per step, kernel ms per step and kernel launches per step: a step
whose wall time far exceeds its kernel time is bound by the host. `--host` adds the CPU-side table
(self CPU time per op, Python functions included), which says where that host time goes.
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from liger_rt.tools.bench import model as B


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--arms", default="liger_rt,liger_kernel")
    ap.add_argument("--flags", default=None, help="extra liger_rt.patch flags, e.g. rope=1")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--host", action="store_true", help="also the CPU-side table (self CPU time, with Python stacks)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_model needs a GPU")
    preset = B.bench_preset(args.model, args.preset, None, None)
    flags = {"fused_linear_cross_entropy": True, **B.parse_flags(args.flags)}
    for arm in args.arms.split(","):
        model = B.build(preset, torch.bfloat16, "cuda", 0, {})
        model.train()
        undo = None
        if arm == "liger_rt":
            import liger_rt
            liger_rt.patch(model, **flags)
        elif arm == "liger_kernel":
            lk = B.LigerKernelPatch()
            lk.apply(model)
            undo = lk.undo
        ids = B.random_ids(model, args.batch, args.seq, 0, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 2 * 1e3
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in prof.key_averages()) / 2e3
        print(f"== {arm} ({args.preset} B{args.batch}xT{args.seq}, flags {flags}): {wall:.1f} ms wall per step "
              f"(unprofiled), {total:.1f} ms of kernels per step, {len(kernels) / 2:.0f} kernels per step")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        if args.host:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                            max_name_column_width=70))
        if undo:
            undo()
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
