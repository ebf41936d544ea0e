"""Shared benchmark helpers: timing, peak memory, ceilings, CSV rows with GPU and versions.

Run on the H200 (the device tool); results go to benchmarks/results/*.csv and docs/perf.md.
Effective bandwidth counts the minimum bytes an op must move; TFLOP/s counts its GEMM flops.
"""
from __future__ import annotations

import csv
import datetime
import os
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
COPY_CEILING_GBPS = 4250.0     # measured device copy on the H200 here (shared/anchors)
MATMUL_CEILING_TFLOPS = 722.0  # measured bf16 matmul on the H200 here (shared/anchors)


def versions() -> dict:
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": datetime.date.today().isoformat()}
    for mod in ("triton", "transformers", "liger_kernel"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception:
            out[mod] = ""
    if not out["liger_kernel"]:
        try:
            from importlib.metadata import version
            out["liger_kernel"] = version("liger-kernel")
        except Exception:
            pass
    return out


def bench_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn) -> float:
    """Device milliseconds per fn() from a CUDA-graph replay (liger_rt.autotune.graph_ms: no host
    launch cost, no L2 flush between calls)."""
    from liger_rt.autotune import graph_ms as _graph_ms
    try:
        return _graph_ms(fn)
    finally:
        torch.cuda.empty_cache()


def peak_extra_gb(fn) -> float:
    """Peak memory fn() allocates beyond what is live before it (GB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def liger_kernel():
    """The liger_kernel module (the peer) or None when it is not installed."""
    try:
        import liger_kernel  # noqa: F401
        return liger_kernel
    except Exception:
        return None


def write_csv(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    info = versions()
    rows = [{**r, **{k: v for k, v in info.items() if k not in r}} for r in rows]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    out = os.environ.get("OUT")
    if out:  # the device tool brings $OUT back
        (Path(out) / name).write_text(path.read_text())
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))
    sys.stdout.flush()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def forced_decision(op_name: str, x, impl: str = "triton", **dims):
    """The dispatch decision with LIGER_RT_IMPL_<OP>=impl (DB config if there is one, else heuristic)."""
    from liger_rt import dispatch
    key = f"LIGER_RT_IMPL_{op_name.upper()}"
    old = os.environ.get(key)
    os.environ[key] = impl
    dispatch.reset()
    try:
        return dispatch.get_op(op_name).select(x, **dims)
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
        dispatch.reset()


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
