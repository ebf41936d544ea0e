"""Where one training step's time goes, per arm (torch.profiler tables).

    python benchmarks/profile/step_time.py [--model qwen3 --preset qwen3-1.7b | --run lfm2moerope]
        [--arms baseline,liger_rt,liger_kernel] [--flags rope=1] [--batch 1 --seq 512] [--host] [--gaps] [--steps 10]
        [--gc-freeze]

Builds the preset with random weights (same seed per arm), patches it like `liger-tune bench model`
does, runs three warm-up steps, times `--steps` steps by wall clock (median and min per step, with the
Python garbage collector's passes and time in them: a full collection walks every live object, so
a host-bound step pays for it), then profiles two steps and prints
the kernels by total CUDA time, so the step-time gap between two arms can be read kernel by kernel.
An arm ending in `+compile` (e.g. `baseline+compile,liger_rt+compile`) runs under `torch.compile` (inductor,
its own compile policy as in `bench_models.py --compile`).  Each arm's line gives wall ms per step, kernel ms per step and kernel launches per step: a step
whose wall time far exceeds its kernel time is bound by the host. `--host` adds the CPU-side table
(self CPU time per op, Python functions included), which says where that host time goes.  `--gaps`
lists the device's idle time between kernels, charged to the host ops that launched the kernel after
each gap: where a step's wall time exceeds its kernel time, this says which host work holds it.
"""
import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from liger_rt.tools.bench import model as B
from liger_rt.tools.bench.harness import profiled

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_models import RUNS, run_setup  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--run", default=None, choices=list(RUNS),
                    help="a bench_models.py run (model, preset, layers, flags) in place of --model/--preset/--flags")
    ap.add_argument("--arms", default="liger_rt,liger_kernel")
    ap.add_argument("--flags", default=None, help="extra liger_rt.patch flags, e.g. rope=1")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--host", action="store_true", help="also the CPU-side table (self CPU time, with Python stacks)")
    ap.add_argument("--steps", type=int, default=10, help="steps timed by wall clock")
    ap.add_argument("--gaps", action="store_true", help="the device's idle gaps per step, each named by the host op "
                                                         "that launched the kernel after it (a trace with CPU ops)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up: the model's objects "
                                                           "leave the collector's generations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_time.py needs a GPU")
    if args.run:
        preset, flags, overrides = run_setup(args.run)
        args.model, args.preset = RUNS[args.run]["model_type"], preset.name
    else:
        preset = B.bench_preset(args.model, args.preset, None, None)
        flags = {"fused_linear_cross_entropy": True, **B.parse_flags(args.flags)}
        overrides = B.config_overrides(args.model)
    for arm in args.arms.split(","):
        if arm not in B.ARMS:
            raise SystemExit(f"unknown arm {arm!r}; valid: {', '.join(B.ARMS)}")
        model = B.build(preset, torch.bfloat16, "cuda", 0, overrides)
        model.train()
        undo = B.apply_arm(model, arm.split("+")[0], flags)
        ids = B.random_ids(model, args.batch, args.seq, 0, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = arm in B.COMPILED
        if compiled:
            torch._dynamo.reset()
        with B.arm_env(arm):
            step = B.step_fn(torch.compile(model) if compiled else model, opt, ids)
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
            prof = profiled(step, warmup=0, calls=2, cpu=args.host or args.gaps)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            total = sum(e.self_device_time_total for e in prof.key_averages()) / 2e3
            frozen = ", gc frozen" if args.gc_freeze else ""
            print(f"== {arm} ({args.preset} B{args.batch}xT{args.seq}, flags {flags}{frozen}): "
                  f"{wall:.1f} ms wall per step (median of {args.steps}, min {min(times):.1f}; unprofiled), "
                  f"{total:.1f} ms of kernels per step, {len(kernels) / 2:.0f} kernels per step; "
                  f"garbage collector in those steps: {gc_log.summary()}; {len(gc.get_objects())} tracked objects")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
            if args.host:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                max_name_column_width=70))
            if args.gaps:
                print_gaps(prof, steps=2, rows=args.rows)
        if undo:
            undo()
        if compiled:
            torch._dynamo.reset()
        del model, opt, step
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()


def print_gaps(prof, steps: int, rows: int, min_us: float = 3.0) -> None:
    """Where the device idles between kernels: each gap (>= min_us) is charged to the host op whose
    launch ended it (the innermost CPU ops around the launch); "host late" means the kernel was
    launched after the device had gone idle, so the host, not a dependency, held the device."""
    import json
    import os
    import tempfile
    from collections import defaultdict
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    dev = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "cpu_op"))
    gaps, end = [], None     # (gap us, launch time or None, kernel name, host late)
    for k in dev:
        if end is not None and k["ts"] - end >= min_us:
            t = launch.get(k.get("args", {}).get("correlation"))
            gaps.append((k["ts"] - end, t, k["name"][:60], t is not None and t > end))
        end = max(end or 0.0, k["ts"] + k.get("dur", 0))
    chains, active, i = {}, [], 0    # the CPU ops around each launch time, swept in time order (linear, not ops x gaps)
    for t in sorted({g[1] for g in gaps if g[1] is not None}):
        while i < len(ops) and ops[i][0] <= t:
            active.append(ops[i])
            i += 1
        active = [o for o in active if o[1] >= t]
        inside = sorted(active, key=lambda o: o[1] - o[0], reverse=True)   # outermost first, the innermost three
        chains[t] = " > ".join(o[2] for o in inside[-3:]) or "(no CPU op)"
    by, total, late_total = defaultdict(lambda: [0, 0.0, 0]), 0.0, 0.0
    for gap, t, name, late in gaps:
        row = by[(chains[t] if t is not None else "(launch not traced)", name, late)]
        row[0] += 1
        row[1] += gap
        total += gap
        late_total += gap if late else 0.0
    print(f"device idle between kernels: {total / steps / 1e3:.2f} ms per step ({late_total / steps / 1e3:.2f} ms "
          f"with the host late), in gaps of >= {min_us:g} us; the largest by total:")
    print(f"{'ms/step':>8} {'gaps':>5}  host late  host ops around the launch  ->  the kernel after the gap")
    for (where, name, late), (n, us, _) in sorted(by.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"{us / steps / 1e3:8.3f} {n / steps:5.0f}  {'yes' if late else 'no ':9}  {where}  ->  {name}")


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
