"""Tuning one case: validate and time every candidate config of every available implementation
(`tune`), then write the best row per implementation and the raw measurements (`persist`).  Configs are
ranked by device time; the implementations of an op that declares `wall_clock` by the wall clock per call
of each one's best config on a GPU (host cost included: what a training step pays for a launch-bound op).

    result = tune(OP, target, torch.bfloat16, {"rows": 4096, "hidden": 4096})
    result["winner"]          # the fastest validated measurement; result["best"]: per implementation
"""
from __future__ import annotations

import contextlib
import json
import re

import torch

from ..autograd import run_case
from ..config import config_dict
from ..dtypes import dtype_name
from ..freshness import source_hash
from ..numerics import validation_report
from ..tuning_db.store import fingerprint
from . import timing
from .timing import error_line, sync, wall_ms


class ReferenceTooLarge(RuntimeError):
    """The torch reference that validates a case's candidates ran out of device memory: the case cannot be tuned
    on this device, and dispatch serves its shape as any untuned one."""

    @classmethod
    def of(cls, exc: BaseException) -> "ReferenceTooLarge":
        text = str(exc)
        asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
        free = re.search(r"of which ([\d.]+ [KMGT]?i?B) is free", text)
        figures = ", ".join(filter(None, [asked and f"it asked for {asked[1]}", free and f"{free[1]} was free"]))
        return cls(f"the torch reference that validates the candidates does not fit this device's memory"
                   f"{f' ({figures})' if figures else ''}: no row for this shape, dispatch serves it as an untuned one")


# wall_ms's repeats and calls: the host cost of each implementation's best config, and the wall clock that ranks the
# implementations of a wall_clock op (more calls: the ranking rests on it)
HOST = {"repeats": 3, "calls": 10}
WALL_CLOCK = {"repeats": 5, "calls": 25}


def by_wall_clock(rec: dict) -> dict:
    """A best-config record of a wall_clock op timed by wall clock: its wall time per call (`host_ms`) as its
    time, method "wall-clock", the device time kept as `device_ms` (the raw measurements keep it too)."""
    return {**rec, "device_ms": rec["median_ms"], "median_ms": rec["host_ms"], "method": "wall-clock"}


def unavailable(op, target, dims: dict, dtype: torch.dtype) -> dict[str, str]:
    """Implementations this target cannot measure for the shape, and why."""
    out = {}
    for impl in op.impls:
        if not impl.available(target):
            out[impl.name] = f"not available on {target.arch.name} ({target.device_type})"
        elif impl.supports is not None and (why := impl.supports(dims, dtype)) is not None:
            out[impl.name] = why
    return out


def _reference(op, case) -> list[torch.Tensor]:
    """The torch implementation's outputs on the case, detached; ReferenceTooLarge where they do not fit, raised
    after the out-of-memory error is gone (its frames hold the reference's partial tensors)."""
    try:
        return [r.detach() for r in run_case(op, op.impl("torch"), case, {})]
    except torch.OutOfMemoryError as exc:
        too_large = ReferenceTooLarge.of(exc)
    raise too_large


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
    reference = _reference(op, case)
    sync(device)
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
                outs = run_case(op, impl, case, cfg)
                sync(device)
                bad = [f"output {i}: {msg}" for i, (o, r) in enumerate(zip(outs, reference))
                       if (msg := validation_report(o, r, dtype, reduce_len))]
                if len(outs) != len(reference):
                    bad.append(f"{len(outs)} outputs, reference has {len(reference)}")
                outs = None   # no graph of a default-stream run alive during the capture (see above)
                if bad:
                    rec["error"] = "wrong result: " + "; ".join(bad)[:500]
                else:
                    run = (lambda impl=impl, cfg=cfg: run_case(op, impl, case, cfg))
                    rec["median_ms"], rec["method"] = timing.time_fn(run, device, quick=quick, method=case_method)
                    if device == "cuda" and rec["method"] == "do_bench":
                        case_method = "do_bench"
                    rec["ok"] = 1
                    runs.append((rec, run, cfg))
            except Exception as exc:  # compile errors, OutOfResources, CUDA OOM: skip the candidate
                rec["error"] = error_line(exc, 500)[:500]
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
                    rec["median_ms"], rec["method"] = timing.time_fn(run, device, quick=quick, method="do_bench")
                except Exception as exc:
                    rec.update(ok=0, median_ms=None, error=f"{type(exc).__name__} when re-timed"[:500])
    best = {}       # impl -> (its fastest rec, run, config)
    for rec, run, cfg in runs:
        if rec["ok"] and (rec["impl"] not in best or rec["median_ms"] < best[rec["impl"]][0]["median_ms"]):
            best[rec["impl"]] = (rec, run, cfg)
    wall = op.wall_clock and device == "cuda"
    for rec, run, _ in best.values():     # host cost per call of each implementation's best config
        rec["host_ms"] = rec["median_ms"] if device == "cpu" else None    # on CPU the wall time is the host time
        if device == "cuda":
            with contextlib.suppress(Exception):     # after a warm call: launch-bound when near the device time
                run()
                sync(device)
                rec["host_ms"] = wall_ms(run, device, **(WALL_CLOCK if wall else HOST))
    if wall:     # the implementations ranked by wall clock: each one's best config (by device time) at its wall time
        best = {name: (by_wall_clock(rec), run, cfg) for name, (rec, run, cfg) in best.items()
                if rec["host_ms"] is not None}
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
            "fingerprint": fingerprint(arch, source_hash(op))}


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
