"""Per-call cost of a dispatch decision that hits the memo (CPU; the target is < 5 us).

    python benchmarks/dispatch_overhead.py [--calls 200000]

Writes benchmarks/results/dispatch_overhead.csv. A hit is one tuple build and one dict lookup:
no SQL, no env parsing.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from liger_rt import dispatch


def _op() -> dispatch.Op:
    return dispatch.Op(name="overhead_probe", static=("hidden",), dynamic=("rows",),
                       impls=[dispatch.Impl("torch", run=lambda case, cfg: [])],
                       make_case=lambda dims, dtype, device: {}, plan=lambda p, a, q: [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    op = _op()
    x = torch.empty(8, 4096, dtype=torch.bfloat16)
    op.select(x, rows=8, hidden=4096)                       # the miss: decided once
    rows = []
    for label, fn in (
        ("select (memo hit)", lambda: op.select(x, rows=8, hidden=4096)),
        ("baseline: x.device.type + dict.get", lambda: op._memo.get((x.device.type, x.dtype, 8, 4096))),
    ):
        for _ in range(1000):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        us = (time.perf_counter() - t0) / args.calls * 1e6
        rows.append({"what": label, "us_per_call": round(us, 3), "calls": args.calls,
                     "python": platform.python_version(), "cpu": platform.processor() or platform.machine()})
        print(f"{label:40s} {us:.3f} us/call")
    try:
        from _harness import write_csv
    except ImportError:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _harness import write_csv
    write_csv("dispatch_overhead.csv", rows)


if __name__ == "__main__":
    main()
