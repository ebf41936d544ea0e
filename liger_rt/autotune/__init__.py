"""Benchmark candidate configs safely and persist the winners (docs/cli.md, "sweep").

Every candidate is validated against the torch reference before it is timed, so a config that computes
wrong can never win; a case is timed by one method (`time_fn`), never two compared; a candidate that
fails to compile or runs out of resources or memory is recorded and skipped.

    timing     time_fn / graph_ms / measure: device milliseconds of a call (CUDA graphs, do_bench, CPU wall)
    tuning     tune: validate and time every candidate of one case; persist: write its rows
    sweeping   sweep / sweep_sharded: a plan of cases, then the crossovers derived from them
    online     tune_online: LIGER_RT_AUTOTUNE=1 on a dispatch miss (rank 0 tunes, every rank agrees)

Each module calls the others through their module (``tuning.tune``), so a test replaces a function in
one place (``monkeypatch.setattr(autotune.tuning, "tune", ...)``).
"""
from __future__ import annotations

from .online import tune_online
from .sweeping import (ArchMismatchError, ShardedSweepError, check_arch_matches, crossovers, sweep,
                       sweep_sharded)
from .timing import error_line, graph_ms, host_syncs, measure, time_fn
from .tuning import persist, tune, unavailable

__all__ = ["ArchMismatchError", "ShardedSweepError", "check_arch_matches", "crossovers", "error_line", "graph_ms",
           "host_syncs", "measure", "persist", "sweep", "sweep_sharded", "time_fn", "tune", "tune_online",
           "unavailable"]
