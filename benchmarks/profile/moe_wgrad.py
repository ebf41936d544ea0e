"""MoE experts forward+backward per config knob, beside grouped_mm (GPU): do_bench wall time in counterbalanced
rounds, TFLOP/s (18 * S * H * I per forward+backward, S = tokens * top_k), and the weight-gradient kernels' device
time from torch.profiler.  By default the weight gradients read gathered rows (wgrad_sorted=0), sorted copies (1) or
sorted copies through tensor descriptors (2: TMA).

    python benchmarks/profile/moe_wgrad.py [--rounds 3] [--csv PATH] [--desc] [--shapes 1,2]
        [--variants "split:up_bwd_split=1;split_d:up_bwd_split=1,down_desc=1"]

Each variant runs the Hopper heuristic's tiles (no DB row), so only wgrad_sorted differs.  --desc times
the up and down/dX GEMMs through tensor descriptors instead (up_desc, down_desc: 00, 10, 01, 11, on the
heuristic's TMA weight gradients); --variants names knob sets over the heuristic's config (each arm its
name:knob=v,...; the heuristic itself runs as `heuristic`); --shapes picks SHAPES by index (1,2: E32 and E64
at T16384).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from liger_rt import backend
from liger_rt.autograd import call_impl
from liger_rt.registry import REGISTRY
from liger_rt.tools.bench.harness import counterbalanced, profiled, write_csv
from liger_rt.tools.bench.model import parse_config

SHAPES = [dict(experts=8, top_k=2, hidden=4096, intermediate=14336, tokens=8192),      # mixtral-8x7b step
          dict(experts=32, top_k=4, hidden=2048, intermediate=1792, tokens=16384),     # LFM2-8B-A1B
          dict(experts=64, top_k=4, hidden=2048, intermediate=1536, tokens=16384)]     # LFM2-24B-A2B


def wgrad_ms(fn) -> float:
    prof = profiled(fn, warmup=1, calls=1)
    return sum(e.device_time_total for e in prof.key_averages() if "wgrad" in e.key) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", default=None, help="write every round's row to this CSV")
    ap.add_argument("--desc", action="store_true", help="time the up/down GEMM descriptor variants instead")
    ap.add_argument("--variants", default="", help='"name:knob=v,...;name2:..." over the heuristic config')
    ap.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_wgrad.py needs a GPU")
    op, rows = REGISTRY.get("moe_experts"), []
    for dims in [SHAPES[int(i)] for i in a.shapes.split(",")]:
        case = op.new_case(dims, torch.bfloat16, "cuda", tag="uniform")
        (x, gu, dn, idx, w, _), (dy,) = case.args, case.grads
        base = op.default_config("triton", backend.detect(), dims, torch.bfloat16)
        if a.variants:
            named = (arm.split(":") for arm in a.variants.split(";"))
            variants = {"triton_heuristic": {}} | {f"triton_{name}": parse_config(knobs) for name, knobs in named}
        elif a.desc:
            variants = {f"triton_desc{u}{d}": dict(up_desc=u, down_desc=d) for u in (0, 1) for d in (0, 1)}
        else:
            variants = {f"triton_sorted{s}": dict(wgrad_sorted=s) for s in (0, 1, 2)}
        arms = {k: (lambda c=base.replace(**v): call_impl(op, "triton", c, x, gu, dn, idx, w, True))
                for k, v in variants.items()}
        arms["grouped_mm"] = lambda: call_impl(op, "grouped_mm", {}, x, gu, dn, idx, w, True)
        steps = {k: (lambda f=f: torch.autograd.grad(f(), (x, gu, dn, w), dy)) for k, f in arms.items()}
        flop = 18 * dims["tokens"] * dims["top_k"] * dims["hidden"] * dims["intermediate"]
        times = counterbalanced(steps, a.rounds, warmup=50, rep=300)
        print(f"== {dims}: median of {a.rounds} rounds (range), TFLOP/s, weight-gradient kernels' device ms")
        for k, t in times.items():
            m, wg = statistics.median(t), (wgrad_ms(steps[k]) if k.startswith("triton") else float("nan"))
            print(f"  {k:16s} {m:8.3f} ms ({min(t):.3f}-{max(t):.3f})  {flop / m / 1e9:6.1f} TFLOP/s  "
                  f"wgrad {wg:.3f} ms")
            rows += [{**dims, "arm": k, "round": i, "ms": v, "TFLOPs": flop / v / 1e9, "wgrad_dev_ms": wg,
                      "method": "do_bench wall (warmup 50 ms, rep 300 ms); wgrad: profiler device time"}
                     for i, v in enumerate(t)]
    if a.csv:
        print(f"wrote {len(rows)} rows to {write_csv(rows, a.csv)}")   # with versions, device and date


if __name__ == "__main__":
    main()
