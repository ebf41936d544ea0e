"""Where one training step's time goes, per arm (torch.profiler tables).

    python benchmarks/profile_model.py [--model qwen3 --preset qwen3-1.7b] [--arms baseline,liger_rt,liger_kernel]
                                       [--flags rope=1] [--batch 1 --seq 512] [--host] [--steps 10] [--gc-freeze]

Builds the preset with random weights (same seed per arm), patches it like `liger-tune bench model`
does, runs three warm-up steps, times `--steps` steps by wall clock (median and min per step, with the
Python garbage collector's passes and time in them: a full collection walks every live object, so
a host-bound step pays for it), then profiles two steps and prints
the kernels by total CUDA time, so the step-time gap between two arms can be read kernel by kernel.
Each arm's line gives wall ms per step, kernel ms per step and kernel launches per step: a step
whose wall time far exceeds its kernel time is bound by the host. `--host` adds the CPU-side table
(self CPU time per op, Python functions included), which says where that host time goes.
"""
import argparse
import gc
import statistics
import time

import torch

from liger_rt.tools.bench import model as B
from liger_rt.tools.bench.harness import profiled


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
    ap.add_argument("--steps", type=int, default=10, help="steps timed by wall clock")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up: the model's objects "
                                                           "leave the collector's generations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_model needs a GPU")
    preset = B.bench_preset(args.model, args.preset, None, None)
    flags = {"fused_linear_cross_entropy": True, **B.parse_flags(args.flags)}
    for arm in args.arms.split(","):
        model = B.build(preset, torch.bfloat16, "cuda", 0, {})
        model.train()
        undo = B.apply_arm(model, arm, flags)
        ids = B.random_ids(model, args.batch, args.seq, 0, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = B.step_fn(model, opt, ids)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if args.gc_freeze:
            gc.freeze()
        gc_log = _GcLog()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        gc_log.stop()
        wall = statistics.median(times)
        prof = profiled(step, warmup=0, calls=2, cpu=args.host)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in prof.key_averages()) / 2e3
        print(f"== {arm} ({args.preset} B{args.batch}xT{args.seq}, flags {flags}{', gc frozen' if args.gc_freeze else ''}): "
              f"{wall:.1f} ms wall per step (median of {args.steps}, min {min(times):.1f}; unprofiled), "
              f"{total:.1f} ms of kernels per step, {len(kernels) / 2:.0f} kernels per step; "
              f"garbage collector in those steps: {gc_log.summary()}; {len(gc.get_objects())} tracked objects")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        if args.host:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                            max_name_column_width=70))
        if undo:
            undo()
        del model, opt
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()


class _GcLog:
    """Passes of the garbage collector per generation and the milliseconds spent in them."""

    def __init__(self):
        self.passes, self.ms, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.passes[g] += 1
            self.ms[g] += (time.perf_counter() - self._t0) * 1e3

    def stop(self):
        gc.callbacks.remove(self._on)

    def summary(self) -> str:
        return ", ".join(f"gen{g} {n} passes {ms:.1f} ms" for g, (n, ms) in enumerate(zip(self.passes, self.ms)))


if __name__ == "__main__":
    main()
