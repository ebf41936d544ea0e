"""Sweeps: a plan of cases ([(op, dims, dtype, tag)]) measured and persisted one transaction per case, then
the crossover rows derived from them; in one process (`sweep`) or split across the ranks of a
torch.distributed job (`sweep_sharded`).  `check_arch_matches` refuses to measure for another arch.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from collections import defaultdict
from typing import Callable

import torch

from .. import backend
from ..dtypes import parse_dtype
from ..freshness import source_hash
from ..tuning_db.crossover import derive_crossover
from ..tuning_db.store import fingerprint
from . import tuning
from .timing import error_line


class ArchMismatchError(RuntimeError):
    """A sweep was asked to measure for an arch that is not the hardware present."""


def crossovers(results: list[dict], ops: dict, margin: float = 0.05) -> list[dict]:
    """Crossover rows from tuning results of ops with a crossover axis: per (op, dtype, static
    dims), the best time of each implementation at each measured axis value (averaged over input
    variants), from points of one timing method (the most common one), at least two points.  For an op
    that declares wall_clock the times are each implementation's wall clock per call on a GPU (`tune`:
    method "wall-clock"), so the segments pick torch where torch costs a training step less."""
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
    tuning.persist(op, result, store, origin=origin)
    ops[op.name] = op
    out["results"].append(result)


def _sweep_case(case, target, quick: bool, bar=None) -> tuple[dict | None, dict | None]:
    """(tune's result, None) for one plan case, or (None, the skipped record)."""
    op, dims, dt, tag = case
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(f"{op.name} {','.join(f'{k}={v}' for k, v in dims.items())} {dt} {tag}".strip())
    try:
        return tuning.tune(op, target, parse_dtype(dt), dims, quick=quick, tag=tag), None
    except Exception as exc:
        skipped = {"op": op.name, "dims": dims, "dtype": dt, "tag": tag, "error": error_line(exc, 300)}
    if target.device_type == "cuda":
        torch.cuda.empty_cache()        # once the error, whose frames hold the case's tensors, is gone
    return None, skipped


def _persist_crossovers(results: list[dict], ops: dict, target, store, origin: str) -> list[dict]:
    rows = crossovers(results, ops)
    store.put_rows("crossover", [{**row, "origin": origin, **fingerprint(target.arch, source_hash(ops[row["op"]]))}
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


def check_arch_matches(arch_name: str) -> backend.Arch:
    """The hardware present, when it is `arch_name` (a sweep measures only on the hardware it
    writes for; LIGER_RT_ARCH, a planning switch, does not count); else ArchMismatchError."""
    found = backend.detect_hardware()
    if found.name != arch_name:
        raise ArchMismatchError(f"refusing to measure for --arch {arch_name}: this machine is {found.name} "
                                f"({found.device_name}). Use --dry-run to print the plan, or run on {arch_name} "
                                "hardware.")
    return found
