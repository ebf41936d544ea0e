"""Online tuning (LIGER_RT_AUTOTUNE=1): a dispatch miss tunes the case now and persists the winner.  Never
silently: the first miss of each op warns that it is being tuned (a pause of seconds inside that call)."""
from __future__ import annotations

import sys
import warnings

from .. import backend, tuning_db
from ..dtypes import dtype_name
from . import tuning

_ANNOUNCED: set[str] = set()      # ops whose online tuning this process has warned about


def _announce(op, target, dtype, dims) -> None:
    if op.name in _ANNOUNCED:
        return
    _ANNOUNCED.add(op.name)
    device = backend.device_class(target.arch.device_name) or target.arch.name
    shape = ",".join(f"{k}={v}" for k, v in dims.items())
    warnings.warn(f"liger_rt: tuning {op.name} now ({dtype_name(dtype)} {shape} has no row for {device}; "
                  "LIGER_RT_AUTOTUNE=1): each new shape of it is measured once, inside its first call, and saved "
                  "to the user DB", RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the first frame outside liger_rt (the call that missed), for the warning."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("liger_rt"):
        frame, level = frame.f_back, level + 1
    return level


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
        _announce(op, target, dtype, dims)
        try:
            result = tuning.tune(op, target, dtype, dims, quick=True)
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
                tuning.persist(op, result, store, origin="online")
        except Exception as exc:
            warnings.warn(f"liger_rt: could not persist the tuned {op.name} config ({exc})", RuntimeWarning)
    if world > 1:
        dist.barrier()
    tuning_db.reset()
    return decision
