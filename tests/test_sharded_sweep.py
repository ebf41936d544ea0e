"""The sharded sweep (`torchrun --nproc-per-node N -m liger_rt.tools.cli sweep ...`) on CPU with gloo.

Two ranks under torchrun sweep a three-case rms_norm plan (uneven: rank 0 takes two cases) into DB A;
one process sweeps the same plan into DB B; the two DBs must hold the same rows.  Timings are pinned
(this file run as a script wraps `liger-tune` with a timer that returns a fixed time per
implementation and config, and 1 ms for torch, so a Triton config wins): the winners, their times
and every raw measurement are then compared exactly, only the creation times differ.  Every other
step is the real one: the plan, validation of each candidate against torch, the gather, persist.

A failing rank (an error outside any case on rank 1; rank 0's DB unusable) stops both ranks with
one line naming it, launched without torchrun (whose agent would kill the survivors: this shows
they do not wait).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["--arch", "cpu", "--op", "rms_norm", "--shape", "rows=4,hidden=32", "--shape", "rows=8,hidden=64",
        "--shape", "rows=2,hidden=16", "--quick", "--dtype", "fp32"]


# -- the wrapped CLI (this file as a script) --------------------------------------------------------------

def pinned_time_fn(fn, device_type, *, quick=False, method=None):
    """A fixed time per (implementation, config): fn is tune's `lambda impl=impl, cfg=cfg: ...`."""
    from liger_rt.tuning_db.rows import config_dict
    impl, cfg = fn.__defaults__
    if impl.name == "torch":
        return 1.0, "cpu-wall"
    return 0.1 + zlib.crc32(json.dumps(config_dict(cfg), sort_keys=True).encode()) % 1000 / 1e4, "cpu-wall"


def wrapped_cli(argv: list[str]) -> None:
    from liger_rt import autotune
    from liger_rt.tools import cli
    autotune.timing.time_fn = pinned_time_fn
    if os.environ.get("FAIL_RANK", "none") == os.environ.get("RANK"):
        def fail(*args, **kwargs):
            raise RuntimeError("simulated failure of this rank")
        autotune.sweeping._sweep_case = fail
    cli.main(argv)


# -- the tests -------------------------------------------------------------------------------------------

def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGER_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
               **extra)
    return env


def _rows(path: Path) -> dict[str, list]:
    from liger_rt.tuning_db import Store
    store = Store(path, layer="user", readonly=True)
    try:
        return {t: sorted(json.dumps({k: v for k, v in r.items() if k != "created"}, sort_keys=True)
                          for r in store.select(t)) for t in ("tuning", "measurements", "crossover")}
    finally:
        store.close()


@pytest.mark.slow
def test_sharded_sweep_writes_the_db_of_a_single_process_sweep(tmp_path):
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              __file__, "sweep", *PLAN, "--db", str(a), "--json"],
                             env=_env(), capture_output=True, text=True, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    single = subprocess.run([sys.executable, __file__, "sweep", *PLAN, "--db", str(b), "--json"],
                            env=_env(), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "split across 2 ranks" in sharded.stderr and "split across" not in single.stderr
    out_a, out_b = json.loads(sharded.stdout), json.loads(single.stdout)     # rank 0 alone printed
    assert [(r["dims"], r["impl"], r["config"], r["ms"]) for r in out_a["results"]] == \
        [(r["dims"], r["impl"], r["config"], r["ms"]) for r in out_b["results"]]
    assert [r["dims"] for r in out_a["results"]] == [{"hidden": 32, "rows": 4}, {"hidden": 64, "rows": 8},
                                                     {"hidden": 16, "rows": 2}]
    assert {r["impl"] for r in out_a["results"]} == {"triton"} and not out_a["skipped"]
    rows_a, rows_b = _rows(a), _rows(b)
    assert rows_a == rows_b
    tuning = [json.loads(r) for r in rows_a["tuning"]]
    meas = [json.loads(r) for r in rows_a["measurements"]]
    assert len(tuning) == 3 * 2 and {r["origin"] for r in tuning} == {"sweep"}     # torch and triton per case
    assert len({(m["dims"], m["impl"], m["config"]) for m in meas}) == len(meas) > 3 * 2
    for row in tuning:      # each winner is one of its case's measured, valid configs (the fastest)
        mine = [m for m in meas if m["static_key"] == row["static_key"] and m["impl"] == row["impl"]
                and json.loads(m["dims"])["rows"] == json.loads(row["bucket"])["rows"] and m["ok"]]
        assert row["config"] in {m["config"] for m in mine}
        assert row["median_ms"] == min(m["median_ms"] for m in mine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["rank 1 fails", "rank 0's DB is a directory"])
def test_a_failing_rank_stops_every_rank_in_one_line(tmp_path, failure):
    db = tmp_path / "sweep.db"
    if failure == "rank 0's DB is a directory":
        db.mkdir()
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, __file__, "sweep", *PLAN, "--db", str(db)],
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, FAIL_RANK="1"
                                       if failure == "rank 1 fails" else ""),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:                 # a rank left waiting for the other fails the test instead of outliving it
        for p in procs:
            if p.poll() is None:
                p.kill()
    failing = "rank 1: RuntimeError: simulated failure of this rank" if failure == "rank 1 fails" else "rank 0: "
    for r, (p, (stdout, stderr)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in stderr.splitlines() if "liger-tune" in ln]
        assert p.returncode == 1, f"rank {r}: {stderr[-2000:]}"
        assert len(lines) == 1 and lines[0].startswith("liger-tune: error: sharded sweep stopped: "), stderr[-2000:]
        assert failing in lines[0] and "(0 of 3 cases persisted)" in lines[0], lines[0]
        assert "Traceback" not in stderr and stdout == ""
    if failure == "rank 1 fails":       # rank 0 opened the DB; nothing was persisted
        assert _rows(db) == {"tuning": [], "measurements": [], "crossover": []}


if __name__ == "__main__":
    wrapped_cli(sys.argv[1:])
