"""Benchmark candidate configs safely and persist the winners.

For one (op, dims, dtype) on one target: every available implementation and every candidate
config the arch admits is run once and validated against the torch reference (a config that
computes wrong can never win), then timed (device time of a CUDA-graph replay on a GPU, else
`triton.testing.do_bench`; a few wall-clock runs under the interpreter).  A candidate that fails to compile, runs out of
shared memory or registers, or hits a CUDA OOM is recorded and skipped, never fatal.  The
fastest implementation/config per bucket is upserted with the torch time as its baseline, and
every raw measurement is kept for crossovers.

In a torch.distributed job only rank 0 tunes; the decision is broadcast so every rank uses the
same config.  This needs every rank to reach the same miss at the same time (the usual case of
fixed-shape data-parallel steps); it is only used with LIGER_RT_AUTOTUNE=1.
"""
from __future__ import annotations

import gc
import json
import statistics
import time
import warnings
from typing import Callable

import torch

from . import backend
from .kernels._common import dtype_name, validation_report


def graph_ms(fn: Callable[[], object], *, rep_ms: float = 30.0, replays: int = 10) -> float:
    """Device milliseconds per fn(): median over `replays` replays of one CUDA graph holding enough
    unrolled calls to fill ~rep_ms, captured on a side stream after three warm calls there (the
    recipe torch documents for whole-network capture, autograd included).  No host launch cost
    and no L2 flush between calls: the kernels' own time."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    reps = int(min(200, max(3, rep_ms / max(a.elapsed_time(b), 1e-3))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    del g
    times.sort()
    return float(times[len(times) // 2])


_GRAPH_FAILURES: set[str] = set()


def measure(fn: Callable[[], object], device_type: str, *, quick: bool = False) -> float:
    """Milliseconds per fn(): `graph_ms` (device time) where the candidate can be captured in a
    CUDA graph, else the median of `triton.testing.do_bench` (wall time between events, so host
    launch cost is included) with one warning per kind of failure saying why.

    Device time is what an op costs inside a training step whose host runs ahead of the GPU, and
    the only fair ranking of configs of a launch-bound op: on the H200 here an RMSNorm fwd+bwd at
    4096 x 4096 takes ~50 us of kernels and ~300 us of host time, so wall-clock timing ranks
    configs by noise.
    """
    if device_type == "cuda":
        import triton.testing
        warmup, rep = (10, 30) if quick else (25, 100)
        fn()  # compile and allocate outside the capture: a candidate that cannot run fails here
        torch.cuda.synchronize()
        try:
            return graph_ms(fn, rep_ms=rep)
        except Exception as exc:
            torch.cuda.synchronize()
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if why not in _GRAPH_FAILURES:
                _GRAPH_FAILURES.add(why)
                warnings.warn(f"liger_rt: CUDA-graph timing failed ({why}); timing with do_bench (host "
                              f"launch cost included)", RuntimeWarning)
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        finally:
            # the graph's private memory pool (every unrolled call's outputs) goes back only once the
            # graph is collected: without this an H200 sweep ran out of its 141 GB at the eighth op
            gc.collect()
            torch.cuda.empty_cache()
    times = []
    for _ in range(2 if quick else 3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def tune(op, target, dtype: torch.dtype, dims: dict, *, quick: bool = False, tag: str = "",
         impls: list[str] | None = None, case=None) -> dict:
    """Measure every candidate; return the winner and the raw measurements (not persisted)."""
    dims = op.check_dims(dims)
    arch = target.arch
    device = "cuda" if target.device_type == "cuda" else "cpu"
    if case is None:
        case = op.new_case(dims, dtype, device, tag)
    names = impls or op.available_impls(target, dims, dtype)
    if "torch" not in names:
        names = ["torch", *names]
    # detached: a live output would keep this run's autograd graph, whose AccumulateGrad nodes
    # belong to the default stream, and every CUDA-graph capture on a side stream would then fail
    # (seen on the H200: "AccumulateGrad node's stream does not match", then a broken capture)
    reference = [r.detach() for r in op.impl("torch").run(case, {})]
    _sync(device)
    reduce_len = op.reduce_len(dims)
    static_key, dname = op.static_key(dims), dtype_name(dtype)
    axis = float(op.crossover_axis(dims)) if op.crossover_axis else None
    measurements, best = [], {}
    for name in names:
        impl = op.impl(name)
        for cfg in op.candidates(impl, arch, dims, dtype):
            rec = dict(op=op.name, variant=op.variant, arch=arch.name, device_name=arch.device_name,
                       dtype=dname, static_key=static_key, dims=json.dumps(dims, sort_keys=True), axis=axis,
                       tag=tag, impl=name, config=cfg, median_ms=None, ok=0, error="",
                       source_hash=op.source_hash)
            try:
                outs = impl.run(case, cfg)
                _sync(device)
                bad = [f"output {i}: {msg}" for i, (o, r) in enumerate(zip(outs, reference))
                       if (msg := validation_report(o, r, dtype, reduce_len))]
                if len(outs) != len(reference):
                    bad.append(f"{len(outs)} outputs, reference has {len(reference)}")
                outs = None   # no graph of a default-stream run alive during the capture (see above)
                if bad:
                    rec["error"] = "wrong result: " + "; ".join(bad)[:500]
                else:
                    rec["median_ms"] = measure(lambda: impl.run(case, cfg), device, quick=quick)
                    rec["ok"] = 1
            except Exception as exc:  # compile errors, OutOfResources, CUDA OOM: skip the candidate
                rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
                if _is_oom(exc) and device == "cuda":
                    torch.cuda.empty_cache()
            finally:
                outs = None
            measurements.append(rec)
            if rec["ok"] and (name not in best or rec["median_ms"] < best[name]["median_ms"]):
                best[name] = rec
    del case, reference
    if device == "cuda":
        torch.cuda.empty_cache()
    baseline = best["torch"]["median_ms"] if "torch" in best else None
    winner = min(best.values(), key=lambda r: r["median_ms"]) if best else None
    return {"op": op.name, "dims": dims, "dtype": dname, "arch": arch.name, "winner": winner,
            "best": best, "baseline_ms": baseline, "measurements": measurements}


def persist(op, result: dict, store, *, origin: str = "sweep") -> int:
    """Upsert the best row per implementation and append the raw measurements."""
    import triton  # noqa: F401  (versions are recorded)
    from .tuning_db.store import _versions
    tv, pv = _versions()
    dims = result["dims"]
    n = 0
    for name, rec in result["best"].items():
        store.put_tuning(dict(
            op=op.name, variant=op.variant, arch=rec["arch"], device_name=rec["device_name"], dtype=rec["dtype"],
            static_key=rec["static_key"], bucket=op.bucket_key(dims), impl=name, config=rec["config"],
            median_ms=rec["median_ms"], baseline_ms=result["baseline_ms"], source_hash=op.source_hash,
            config_schema=op.schema_version, triton_version=tv, torch_version=pv, origin=origin))
        n += 1
    store.put_measurements(result["measurements"])
    return n


def _dist_world() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def tune_online(op, target, dtype, dims) -> dict | None:
    """LIGER_RT_AUTOTUNE=1 on a DB miss: tune (rank 0 only), persist, broadcast the winner."""
    rank, world = _dist_world()
    decision = None
    if rank == 0:
        try:
            result = tune(op, target, dtype, dims, quick=True)
            win = result["winner"]
            if win is not None:
                decision = {"impl": win["impl"], "config": win["config"], "median_ms": win["median_ms"],
                            "baseline_ms": result["baseline_ms"]}
                try:
                    from .tuning_db import open_store, reset
                    store = open_store()
                    persist(op, result, store, origin="online")
                    store.close()
                    reset()
                except Exception as exc:
                    warnings.warn(f"liger_rt: could not persist the tuned {op.name} config ({exc})", RuntimeWarning)
        except Exception as exc:
            warnings.warn(f"liger_rt: online tuning of {op.name} failed ({exc}); using the heuristic", RuntimeWarning)
    if world > 1:
        import torch.distributed as dist
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        decision = box[0]
    return decision


def check_arch_matches(arch_name: str) -> backend.Arch:
    """`sweep` measures only on the hardware it writes for."""
    # the real hardware: LIGER_RT_ARCH (a planning switch) does not count here
    found = backend._detect_device(torch.cuda.current_device()) if backend.gpu_present() else backend.profile("cpu")
    if found.name != arch_name:
        raise SystemExit(f"refusing to measure for --arch {arch_name}: this machine is {found.name} "
                         f"({found.device_name}). Use --dry-run to print the plan, or run on {arch_name} hardware.")
    return found
