"""Benchmark candidate configs safely and persist the winners (docs/cli.md, "sweep").

Every candidate is validated against the torch reference before it is timed, so a config that
computes wrong can never win; a case is timed by one method (`time_fn`), never two compared; a
candidate that fails to compile or runs out of resources or memory is recorded and skipped.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import pickle
import statistics
import time
import warnings
from collections import defaultdict
from typing import Callable

import torch

from . import backend, tuning_db
from .kernels._common import dtype_name, parse_dtype, validation_report
from .tuning_db.crossover import derive_crossover
from .tuning_db.rows import config_dict
from .tuning_db.store import fingerprint


class ArchMismatchError(RuntimeError):
    """A sweep was asked to measure for an arch that is not the hardware present."""


def _event_ms(fn: Callable[[], object]) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def graph_ms(fn: Callable[[], object], *, rep_ms: float = 30.0, replays: int = 10) -> float:
    """Device milliseconds per fn(): median over `replays` replays of one CUDA graph of enough
    unrolled calls to fill ~rep_ms, captured on a side stream after three warm calls there (torch's
    recipe for whole-network capture).  No host launch cost, no L2 flush: the kernels' own time."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        reps = int(min(200, max(3, rep_ms / max(_event_ms(fn), 1e-3))))
    # a one-call probe first: a failed capture keeps its private pool, so an uncapturable candidate
    # must fail holding one call's memory, not `reps` calls' (see host_syncs)
    try:
        probe = torch.cuda.CUDAGraph()
        with torch.cuda.graph(probe, stream=s):
            fn()
        del probe
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    except Exception:
        _release_cuda_rng()
        raise
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    return float(statistics.median_high(_event_ms(g.replay) / reps for _ in range(replays)))


def _release_cuda_rng() -> None:
    """Take the default CUDA generator out of capture mode (a fresh state, same seed and offset) after a
    capture failed in cudaStreamEndCapture, which skips the generator's epilogue: on the H200 (2026-12-03)
    every later draw then raised "Offset increment outside graph capture encountered unexpectedly"."""
    try:
        gen = torch.cuda.default_generators[torch.cuda.current_device()]
        fresh = torch.Generator(device="cuda")
        fresh.set_state(gen.get_state())
        gen.graphsafe_set_state(fresh)
    except Exception as exc:   # never hide the capture's own error behind this one
        warnings.warn(f"liger_rt: could not reset the CUDA generator after a failed capture ({_why(exc)})",
                      RuntimeWarning)


_GRAPH_FAILURES: set[str] = set()


def host_syncs(fn: Callable[[], object]) -> bool:
    """Whether fn() makes a synchronizing CUDA call (.item(), nonzero, a copy to the host), found by one
    call under torch's sync debug mode instead of a capture that fails: on the H200 (2026-12-03) failed
    captures of such references kept their graph pools, 138 GB after the MoE and loss cases, then OOM."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], device_type: str, *, quick: bool = False,
            method: str | None = None) -> tuple[float, str]:
    """(milliseconds per fn(), method): "cuda-graph" (`graph_ms`) where fn can be captured, else (or with
    method="do_bench") triton's do_bench median, host launch cost included; "cpu-wall" on CPU.  Device time
    is the only fair ranking of a launch-bound op's configs: on the H200 an RMSNorm fwd+bwd at 4096 x 4096
    takes ~50 us of kernels and ~300 us of host time, so wall-clock timing ranks configs by noise."""
    if device_type == "cuda":
        import triton.testing
        warmup, rep = (10, 30) if quick else (25, 100)
        fn()  # compile and allocate outside the capture: a candidate that cannot run fails here
        torch.cuda.synchronize()
        if method != "do_bench" and host_syncs(fn):
            method = "do_bench"   # never try to capture it: a failed capture keeps its memory pool
        try:
            if method != "do_bench":
                try:
                    return graph_ms(fn, rep_ms=rep), "cuda-graph"
                except Exception as exc:
                    torch.cuda.synchronize()
                    why = _why(exc)
                    if why not in _GRAPH_FAILURES:
                        _GRAPH_FAILURES.add(why)
                        warnings.warn(f"liger_rt: CUDA-graph timing failed ({why}); timing this case with "
                                      "do_bench (host launch cost included), recorded as such", RuntimeWarning)
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")), "do_bench"
        finally:
            # the graph's private memory pool (every unrolled call's outputs) goes back only once the
            # graph is collected: without this an H200 sweep ran out of its 141 GB at the eighth op
            gc.collect()
            torch.cuda.empty_cache()
    return _wall_ms(fn, device_type, 2 if quick else 3), "cpu-wall"


def measure(fn: Callable[[], object], device_type: str, *, quick: bool = False) -> float:
    """Milliseconds per fn() by `time_fn`, without the method (the bench harness's timer)."""
    return time_fn(fn, device_type, quick=quick)[0]


def _wall_ms(fn: Callable[[], object], device_type: str, repeats: int, calls: int = 1) -> float:
    """The median over `repeats` of the wall time of `calls` calls and one synchronisation, per call."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device_type)
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(out)


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _why(exc: BaseException, limit: int = 200) -> str:
    """"TypeName: the first line of the message" (at most `limit` characters of it)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:limit] if str(exc) else ''}"


def unavailable(op, target, dims: dict, dtype: torch.dtype) -> dict[str, str]:
    """Implementations this target cannot measure for the shape, and why."""
    out = {}
    for impl in op.impls:
        if not impl.available(target):
            out[impl.name] = f"not available on {target.arch.name} ({target.device_type})"
        elif impl.supports is not None and (why := impl.supports(dims, dtype)) is not None:
            out[impl.name] = why
    return out


def tune(op, target, dtype: torch.dtype, dims: dict, *, quick: bool = False, tag: str = "",
         impls: list[str] | None = None) -> dict:
    """Measure every candidate of every available implementation; return the winner, the best
    row per implementation and the raw measurements (nothing persisted)."""
    dims = op.check_dims(dims)
    arch = target.arch
    device = "cuda" if target.device_type == "cuda" else "cpu"
    case = op.new_case(dims, dtype, device, tag)
    # the baseline first: if it cannot be captured, every candidate is timed by do_bench from the start
    names = ["torch", *(n for n in impls or op.available_impls(target, dims, dtype) if n != "torch")]
    # detached: a live output would keep this run's autograd graph, whose AccumulateGrad nodes
    # belong to the default stream, and every CUDA-graph capture on a side stream would then fail
    # (seen on the H200: "AccumulateGrad node's stream does not match", then a broken capture)
    reference = [r.detach() for r in op.impl("torch").run(case, {})]
    _sync(device)
    reduce_len, static_key, dname = op.reduce_len(dims), op.static_key(dims), dtype_name(dtype)
    axis = float(op.crossover_axis(dims)) if op.crossover_axis else None
    measurements, runs = [], []
    case_method = None       # "do_bench" once a capture failed: the case is re-timed that way anyway
    for name in names:
        impl = op.impl(name)
        for cfg in op.candidates_for(impl, arch, dims, dtype):
            rec = dict(op=op.name, variant=op.variant, arch=arch.name, dtype=dname, static_key=static_key,
                       dims=json.dumps(dims, sort_keys=True), axis=axis, tag=tag, impl=name,
                       config=config_dict(cfg), median_ms=None, ok=0, error="", method="")
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
                    run = (lambda impl=impl, cfg=cfg: impl.run(case, cfg))
                    rec["median_ms"], rec["method"] = time_fn(run, device, quick=quick, method=case_method)
                    if device == "cuda" and rec["method"] == "do_bench":
                        case_method = "do_bench"
                    rec["ok"] = 1
                    runs.append((rec, run, cfg))
            except Exception as exc:  # compile errors, OutOfResources, CUDA OOM: skip the candidate
                rec["error"] = _why(exc, 500)[:500]
                if device == "cuda" and (isinstance(exc, torch.cuda.OutOfMemoryError)
                                         or "out of memory" in str(exc).lower()):
                    torch.cuda.empty_cache()
            finally:
                outs = None
            measurements.append(rec)
    methods = {rec["method"] for rec, _, _ in runs}
    if len(methods) > 1:     # a capture failed for some candidate: one method for the whole case
        for rec, run, _ in runs:
            if rec["method"] != "do_bench":
                try:
                    rec["median_ms"], rec["method"] = time_fn(run, device, quick=quick, method="do_bench")
                except Exception as exc:
                    rec.update(ok=0, median_ms=None, error=f"{type(exc).__name__} when re-timed"[:500])
    best = {}       # impl -> (its fastest rec, run, config)
    for rec, run, cfg in runs:
        if rec["ok"] and (rec["impl"] not in best or rec["median_ms"] < best[rec["impl"]][0]["median_ms"]):
            best[rec["impl"]] = (rec, run, cfg)
    for rec, run, _ in best.values():     # host cost per call of each implementation's best config
        rec["host_ms"] = rec["median_ms"] if device == "cpu" else None    # on CPU the wall time is the host time
        if device == "cuda":
            with contextlib.suppress(Exception):     # after a warm call: launch-bound when near the device time
                run()
                _sync(device)
                rec["host_ms"] = _wall_ms(run, device, repeats=3, calls=10)
    # failed candidates take the case's method: do_bench where the runs were re-timed above
    method = "do_bench" if len(methods) > 1 else next(iter(methods), "cpu-wall" if device == "cpu" else "cuda-graph")
    for rec in measurements:
        rec["method"] = rec["method"] or method
    del case, reference, runs
    if device == "cuda":
        torch.cuda.empty_cache()
    baseline = best["torch"][0]["median_ms"] if "torch" in best else None
    winner = min((v[0] for v in best.values()), key=lambda r: r["median_ms"]) if best else None
    return {"op": op.name, "dims": dims, "dtype": dname, "arch": arch.name, "tag": tag, "winner": winner,
            "best": {k: v[0] for k, v in best.items()}, "configs": {k: v[2] for k, v in best.items()},
            "baseline_ms": baseline, "measurements": measurements, "unavailable": unavailable(op, target, dims, dtype),
            "fingerprint": fingerprint(arch, op.source_hash)}


def persist(op, result: dict, store, *, origin: str = "sweep") -> int:
    """Write the best row per implementation and every raw measurement of one tuning result in
    one transaction (a killed process leaves the case whole or absent).  Rows are validated."""
    dims, fp = result["dims"], result["fingerprint"]
    rows = [dict(op=op.name, variant=op.variant, arch=rec["arch"], dtype=rec["dtype"], static_key=rec["static_key"],
                 bucket=op.bucket_key(dims), impl=name, config=rec["config"], median_ms=rec["median_ms"],
                 baseline_ms=result["baseline_ms"], host_ms=rec.get("host_ms"), method=rec["method"],
                 config_schema=op.schema_version, origin=origin, **fp) for name, rec in result["best"].items()]
    meas = [{**{k: v for k, v in m.items() if k != "host_ms"}, "origin": origin, **fp}
            for m in result["measurements"]]
    with store.transaction():
        store.put_rows("tuning", rows)
        store.put_measurements(meas)
    return len(rows)


def crossovers(results: list[dict], ops: dict, margin: float = 0.05) -> list[dict]:
    """Crossover rows from tuning results of ops with a crossover axis: per (op, dtype, static
    dims), the best time of each implementation at each measured axis value (averaged over input
    variants), from points of one timing method (the most common one), at least two points."""
    # (op, dtype, static key, arch) -> method -> axis value -> impl -> times
    groups = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    for res in results:
        op = ops[res["op"]]
        if op.crossover_axis is None or len(res["best"]) < 2:
            continue
        method = next(iter(res["best"].values()))["method"]
        axis = float(op.crossover_axis(res["dims"]))
        at = groups[res["op"], res["dtype"], op.static_key(res["dims"]), res["arch"]][method][axis]
        for impl, rec in res["best"].items():
            at[impl].append(rec["median_ms"])
    out = []
    for (name, dtype, static_key, arch), by_method in groups.items():
        method, points = max(by_method.items(), key=lambda m: len(m[1]))
        if len(points) < 2:
            continue
        op = ops[name]
        pts = [(axis, {i: sum(v) / len(v) for i, v in impls.items()}) for axis, impls in points.items()]
        out.append(dict(op=name, variant=op.variant, arch=arch, dtype=dtype, static_key=static_key,
                        axis_name=op.crossover_axis_name, segments=derive_crossover(pts, margin=margin),
                        margin=margin, method=method))
    return out


def sweep(plan: list, target, store, *, quick: bool = False, origin: str = "sweep", progress=None) -> dict:
    """Measure and persist each case of `plan` ([(op, dims, dtype, tag)]) in one transaction per case, then
    the crossovers derived from them.  A case that cannot be measured is skipped; a DB that cannot be written
    stops the sweep.  `progress` wraps the plan (e.g. tqdm).  Returns {"results", "skipped", "crossovers"}."""
    out, ops = {"results": [], "skipped": [], "crossovers": []}, {}
    cases = progress(plan) if progress else plan
    for case in cases:
        _keep(out, ops, case[0], _sweep_case(case, target, quick, cases), store, origin)
    out["crossovers"] = _persist_crossovers(out["results"], ops, target, store, origin)
    return out


def _keep(out: dict, ops: dict, op, case_out: tuple, store, origin: str) -> None:
    result, skip = case_out
    if skip is not None:
        out["skipped"].append(skip)
        return
    persist(op, result, store, origin=origin)
    ops[op.name] = op
    out["results"].append(result)


def _sweep_case(case, target, quick: bool, bar=None) -> tuple[dict | None, dict | None]:
    """(tune's result, None) for one plan case, or (None, the skipped record)."""
    op, dims, dt, tag = case
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(f"{op.name} {','.join(f'{k}={v}' for k, v in dims.items())} {dt} {tag}".strip())
    try:
        return tune(op, target, parse_dtype(dt), dims, quick=quick, tag=tag), None
    except Exception as exc:
        if target.device_type == "cuda":
            torch.cuda.empty_cache()
        return None, {"op": op.name, "dims": dims, "dtype": dt, "tag": tag, "error": _why(exc)}


def _persist_crossovers(results: list[dict], ops: dict, target, store, origin: str) -> list[dict]:
    rows = crossovers(results, ops)
    store.put_rows("crossover", [{**row, "origin": origin, **fingerprint(target.arch, ops[row["op"]].source_hash)}
                                 for row in rows])
    return rows


class ShardedSweepError(RuntimeError):
    """A rank of a sharded sweep failed outside a case (every rank raises it, naming the rank)."""


def _one_line_error(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def sweep_sharded(plan: list, target, open_store: Callable[[], object], *, quick: bool = False,
                  origin: str = "sweep", progress=None, group=None) -> dict | None:
    """`sweep` split across the ranks of a torch.distributed job (a collective; docs/cli.md, "Sharded
    sweep"): case i on rank i % world, in rounds of one case per rank; rank 0 opens the store before the
    first exchange and persists each round in plan order.  A rank's failure outside a case is exchanged at
    the next round and every rank raises ShardedSweepError naming it.  Returns sweep's dict on rank 0."""
    import torch.distributed as dist
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    digest = hashlib.sha256(json.dumps([(op.name, dims, dt, tag) for op, dims, dt, tag in plan],
                                       sort_keys=True).encode()).hexdigest()
    rounds = range(-(-len(plan) // world))
    out, ops = {"results": [], "skipped": [], "crossovers": []}, {}
    store, error = None, None

    def exchange(payload: dict) -> list[dict]:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {**payload, "error": error, "plan": digest,
                                          "persisted": len(out["results"])}, group=group)
        bad = [f"rank {r}: {p['error']}" for r, p in enumerate(gathered) if p["error"]]
        bad += [f"rank {r} has another plan than rank 0 (the same command line on every rank?)"
                for r, p in enumerate(gathered) if p["plan"] != gathered[0]["plan"]]
        if bad:
            raise ShardedSweepError(f"sharded sweep stopped: {'; '.join(bad)} "
                                    f"({gathered[0]['persisted']} of {len(plan)} cases persisted)")
        return gathered

    try:
        if rank == 0:
            try:
                store = open_store()
            except Exception as exc:
                error = _one_line_error(exc)
            if progress:
                rounds = progress(rounds)
        for rnd in rounds:
            i, payload = rnd * world + rank, {"index": None}
            if error is None and i < len(plan):
                try:
                    payload.update(index=i, out=_sweep_case(plan[i], target, quick, rounds))
                    pickle.dumps(payload)    # here, not inside the collective that the other ranks wait in
                except Exception as exc:    # _sweep_case catches a case's own failures: this is the rank's
                    error, payload = _one_line_error(exc), {"index": None}
            for p in exchange(payload):
                if rank != 0 or p["index"] is None or error is not None:
                    continue
                try:
                    _keep(out, ops, plan[p["index"]][0], p["out"], store, origin)
                except Exception as exc:    # told to every rank at the next exchange
                    error = _one_line_error(exc)
        if rank == 0 and error is None:
            try:
                out["crossovers"] = _persist_crossovers(out["results"], ops, target, store, origin)
            except Exception as exc:
                error = _one_line_error(exc)
        exchange({"index": None})    # the closing barrier: a failure anywhere fails every rank
    finally:
        if store is not None:
            store.close()
    return out if rank == 0 else None


def tune_online(op, target, dtype, dims) -> dict | None:
    """LIGER_RT_AUTOTUNE=1 on a DB miss: tune (rank 0 only), broadcast the winner, persist it.  Every rank
    of a torch.distributed job reaches the miss at once and re-opens the DB after the barrier (when rank 0
    alone did, its next lookups hit while the others missed and waited in a broadcast rank 0 never joined).
    Ranks on other hosts need LIGER_RT_TUNING_DB shared."""
    import torch.distributed as dist
    joined = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if joined else (0, 1)
    decision, result = None, None
    if rank == 0:
        try:
            result = tune(op, target, dtype, dims, quick=True)
            win = result["winner"]
            if win is not None:
                decision = {"impl": win["impl"], "config": result["configs"][win["impl"]],
                            "median_ms": win["median_ms"], "baseline_ms": result["baseline_ms"]}
        except Exception as exc:
            warnings.warn(f"liger_rt: online tuning of {op.name} failed ({exc}); using the heuristic", RuntimeWarning)
    if world > 1:
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        decision = box[0]
    if rank == 0 and decision is not None:
        try:
            with tuning_db.open_store() as store:
                persist(op, result, store, origin="online")
        except Exception as exc:
            warnings.warn(f"liger_rt: could not persist the tuned {op.name} config ({exc})", RuntimeWarning)
    if world > 1:
        dist.barrier()
    tuning_db.reset()
    return decision


def check_arch_matches(arch_name: str) -> backend.Arch:
    """The hardware present, when it is `arch_name` (a sweep measures only on the hardware it
    writes for; LIGER_RT_ARCH, a planning switch, does not count); else ArchMismatchError."""
    found = backend.detect_hardware()
    if found.name != arch_name:
        raise ArchMismatchError(f"refusing to measure for --arch {arch_name}: this machine is {found.name} "
                                f"({found.device_name}). Use --dry-run to print the plan, or run on {arch_name} "
                                "hardware.")
    return found
