"""Fault injection into the tuning DB: crafted rows (configs that cannot launch, or raise when they do),
malformed imports, files that are not ours, old and newer schemas, read-only and unreadable files and
directories, paths that cannot hold a DB, held locks, a writer killed mid-sweep, text with control characters.

Each fault must end in a clear one-line message or a warning and a fallback: never a crash, never a
wrong result, never a write into a file that is not ours.
"""
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import toy_op
import liger_rt.ops
from liger_rt import autotune, backend, dispatch
from liger_rt.freshness import source_hash
from liger_rt.registry import REGISTRY
from liger_rt.tools.cli import main
from liger_rt.tuning_db import DB_SCHEMA, RowError, TuningDBError, open_store
from liger_rt.tuning_db.store import dump_jsonl, fingerprint, load_jsonl

OP = toy_op.OP
HERE = Path(__file__).resolve().parent
SK, BK = OP.static_key({"cols": 40}), OP.bucket_key({"rows": 4})


def _good(**kw) -> dict:
    row = dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=SK, bucket=BK, impl="triton",
               config=json.dumps(toy_op.ToyConfig(BLOCK=32).to_dict()), median_ms=1.0, baseline_ms=2.0, host_ms=1.0,
               method="cpu-wall", config_schema=OP.schema_version, origin="sweep", created=1.0,
               **fingerprint("cpu", source_hash(OP)))
    row.update(kw)
    return row


def _good_cross(**kw) -> dict:
    row = dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=SK, axis_name="rows",
               segments='[[8.0, "triton"], [null, "torch"]]', margin=0.05, method="cpu-wall", origin="sweep",
               created=1.0, **fingerprint("cpu", source_hash(OP)))
    row.update(kw)
    return row


def _raw_insert(path, table: str, row: dict) -> None:
    """Write a row past every check, as another tool or a hand edit could."""
    con = sqlite3.connect(path)
    con.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", list(row.values()))
    con.commit()
    con.close()


def _user_db(tmp_path, monkeypatch, name="user.db") -> Path:
    path = tmp_path / name
    open_store(path).close()
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    dispatch.reset()
    return path


def _select(**dims):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = dispatch.select("toy", dtype="fp32", arch="cpu", **(dims or {"rows": 4, "cols": 40}))
    return d, [str(w.message) for w in caught]


def _digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# -- crafted rows on read: skipped with one warning naming them, the decision falls through -------------

BAD_TUNING = [
    (dict(config="not json"), "config is not JSON"),
    (dict(config="[1, 2]"), "config must be a JSON object"),
    (dict(config="{}"), "missing"),
    (dict(config=json.dumps({**toy_op.ToyConfig().to_dict(), "BLOCK": 3})), "BLOCK=3 is not one of"),
    (dict(config=json.dumps({**toy_op.ToyConfig().to_dict(), "BLOCK": "64"})), "BLOCK must be int"),
    (dict(median_ms="abc"), "median_ms='abc' is not a number"),
    (dict(median_ms=-5.0), "median_ms=-5.0 must be > 0"),
    (dict(median_ms=None), "median_ms is missing"),
    (dict(median_ms=float("inf")), "is not finite"),
    (dict(baseline_ms="x"), "baseline_ms='x' is not a number"),
    (dict(host_ms=-1.0), "host_ms=-1.0 must be >= 0"),
    (dict(bucket='{"rows": 3}'), "not a bucket"),
    (dict(method="stopwatch"), "method='stopwatch' is not one of"),
    (dict(origin="magic"), "origin='magic' is not one of"),
    (dict(sm_count=-1), "sm_count=-1 is out of range"),
]


@pytest.mark.parametrize("change,why", BAD_TUNING, ids=[w for _, w in BAD_TUNING])
def test_bad_tuning_row_is_skipped_with_one_warning(tmp_path, monkeypatch, change, why):
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _good(**change))
    d, caught = _select()
    assert d.origin == "heuristic"
    bad = [m for m in caught if "skipping a bad tuning row" in m]
    assert len(bad) == 1 and why in bad[0] and "toy cpu fp32" in bad[0], caught
    _, again = _select(rows=3, cols=40)                # same row seen again: no second warning
    assert not [m for m in again if "skipping" in m]


def test_bad_row_falls_through_to_the_next_row_and_the_result_is_right(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _good(config=json.dumps({**toy_op.ToyConfig().to_dict(), "BLOCK": 3}), median_ms=0.1))
    _raw_insert(path, "tuning", _good(impl="torch", config="{}", median_ms=0.5))
    d, caught = _select()
    assert (d.impl, d.origin) == ("torch", "db") and any("BLOCK=3" in m for m in caught)
    x = torch.randn(4, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(toy_op.toy(x), x * 2)


def test_crafted_rms_norm_row_never_reaches_the_kernel(tmp_path, monkeypatch):
    """The issue's worst row (ROWS -4, median -5 gave uninitialised memory) is refused on read."""
    path = _user_db(tmp_path, monkeypatch)
    rn = REGISTRY.get("rms_norm")
    cfg = {**rn.config().to_dict(), "ROWS": -4}
    _raw_insert(path, "tuning", _good(op="rms_norm", static_key=rn.static_key({"hidden": 64}),
                                      bucket=rn.bucket_key({"rows": 8}), config=json.dumps(cfg), median_ms=-5.0,
                                      config_schema=rn.schema_version, source_hash=source_hash(rn)))
    dispatch.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = dispatch.select("rms_norm", dtype="fp32", arch="cpu", rows=8, hidden=64)
    assert d.origin == "heuristic" and d.config.ROWS > 0
    assert any("rms_norm cpu fp32" in str(w.message) and "ROWS=-4" in str(w.message) for w in caught)


BAD_SEGMENTS = [
    ("nope", "segments is not JSON"),
    ('{"a": 1}', "must be a JSON list"),
    ("[]", "segments are empty"),
    ('[[8.0, "cuda"], [null, "torch"]]', "'cuda', not an implementation of toy"),
    ('[[8.0, "triton"], [4.0, "torch"], [null, "triton"]]', "bound 4.0 is not a finite number above 8"),
    ('[[8.0, "triton"]]', "the last segment must have the bound null"),
    ('[[null, "triton"], [8.0, "torch"]]', "segment 0 has no bound but is not the last"),
    ('[[8.0]]', "is not a [bound, impl] pair"),
]


@pytest.mark.parametrize("segments,why", BAD_SEGMENTS, ids=[w for _, w in BAD_SEGMENTS])
def test_bad_crossover_row_is_skipped(tmp_path, monkeypatch, segments, why):
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "crossover", _good_cross(segments=segments))
    d, caught = _select(rows=1000, cols=40)
    assert d.origin == "heuristic"
    assert any("skipping a bad crossover row" in m and why in m for m in caught), caught


def test_doctor_counts_bad_rows_and_prune_invalid_removes_them(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _good())
    _raw_insert(path, "tuning", _good(bucket=OP.bucket_key({"rows": 8}), median_ms=-1.0))
    _raw_insert(path, "tuning", _good(bucket=OP.bucket_key({"rows": 16}), impl="cuda"))
    _raw_insert(path, "tuning", _good(op="nosuchop"))
    _raw_insert(path, "crossover", _good_cross(margin=2.0))
    res = CliRunner().invoke(main, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    db = json.loads(res.stdout)["db"]
    assert db["user_health"]["tuning"] == {"ok": 1, "stale": 0, "bad": 3}
    assert db["user_health"]["crossover"]["bad"] == 1
    assert any("unknown op 'nosuchop'" in b for b in db["user_bad"])
    res = CliRunner().invoke(main, ["prune", "--invalid"])
    assert res.exit_code == 0, res.output
    assert "removed 4 entries" in res.stdout
    assert len(open_store(path).all_rows("tuning")) == 1


# -- import: validated, all or nothing, the first bad line named --------------------------------------

def _line(table="tuning", **kw) -> str:
    row = _good(**kw) if table == "tuning" else _good_cross(**kw) if table == "crossover" else kw
    return json.dumps({"table": table, **row})


BAD_LINES = [
    ("[1, 2]", "not a liger_rt export record"),
    ('"a string"', "not a liger_rt export record"),
    ('{"table": "tuning", ', "not JSON"),
    (_line(median_ms={"a": 1}), "median_ms={'a': 1} is not a number"),
    (_line(sm_count=2 ** 64), "sm_count=18446744073709551616 is out of range"),
    (_line(median_ms=-1.0), "must be > 0"),
    (_line(median_ms="0.1"), "is not a number"),
    (_line().replace('"median_ms": 1.0', '"median_ms": NaN'), "is not finite"),
    (_line().replace('"median_ms": 1.0', '"median_ms": Infinity'), "is not finite"),
    (_line(op="nope"), "unknown op 'nope'"),
    (_line(arch="z80"), "arch='z80' is not one of"),
    (_line(config="not json"), "config is not JSON"),
    (_line(impl="cuda"), "impl='cuda' is not one of"),
    (_line(colour="red"), "unknown field(s) colour"),
    (_line("crossover", segments=[[8.0, "cuda"], [None, "torch"]]), "not an implementation of toy"),
    (_line("bogus"), "unknown table 'bogus'"),
    (_line("meta", db_schema=99), "newer than this liger_rt"),
    (_line("meta", db_schema="two"), "'two' is not a schema number"),
]


@pytest.mark.parametrize("bad,why", BAD_LINES, ids=[w for _, w in BAD_LINES])
def test_import_is_all_or_nothing_and_names_the_first_bad_line(tmp_path, bad, why):
    store = open_store(tmp_path / "x.db")
    lines = [_line(), _line(impl="torch", config="{}"), bad, _line(bucket=OP.bucket_key({"rows": 8}))]
    with pytest.raises(TuningDBError) as info:
        load_jsonl(store, lines)
    assert str(info.value).startswith("line 3: ") and why in str(info.value), str(info.value)
    assert store.counts() == {"tuning": 0, "measurements": 0, "crossover": 0}


def test_cli_import_of_a_bad_file_is_one_line_and_changes_nothing(tmp_path):
    db = tmp_path / "x.db"
    good = tmp_path / "good.jsonl"
    good.write_text(_line() + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(impl="torch", config="{}") + "\n" + _line(arch="z80") + "\n")
    assert CliRunner().invoke(main, ["import", str(good), "--db", str(db)]).exit_code == 0
    before = open_store(db).all_rows("tuning")
    res = CliRunner().invoke(main, ["import", str(bad), "--db", str(db)])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "line 2" in res.stderr and "z80" in res.stderr
    assert "nothing imported" in res.stderr and "Traceback" not in res.stderr
    assert open_store(db).all_rows("tuning") == before


# -- files that are not ours: unusable, reported, never written -----------------------------------------

def _garbage(p):
    p.write_bytes(b"this is not an sqlite file at all" * 100)


def _empty(p):
    p.write_bytes(b"")


def _foreign(p):
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE invoices (id INTEGER, amount REAL)")
    con.execute("INSERT INTO invoices VALUES (1, 2.5)")
    con.commit()
    con.close()


def _wrong_columns(p):
    con = sqlite3.connect(p)
    for t in ("tuning", "measurements", "crossover"):
        con.execute(f"CREATE TABLE {t} (a TEXT, b TEXT)")
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('db_schema', '2')")
    con.commit()
    con.close()


def _schema(value):
    def make(p):
        open_store(p).close()
        con = sqlite3.connect(p)
        con.execute("UPDATE meta SET value = ? WHERE key = 'db_schema'", [value])
        con.commit()
        con.close()
    return make


def _truncated(p):
    store = open_store(p)
    for i in range(200):
        store.put_tuning(_good(bucket=OP.bucket_key({"rows": 2 ** (i % 30)}), static_key=OP.static_key({"cols": i + 1}),
                               created=None))
    store.close()
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])


UNUSABLE = [
    (_garbage, "not a database"),
    (_empty, "an empty file"),
    (_foreign, "another program (tables invoices)"),
    (_wrong_columns, "table tuning lacks columns"),
    (_schema("two"), "db_schema 'two' is not a schema number"),
    (_schema("99"), "newer than this liger_rt"),
    (_schema("0"), "is not a liger_rt schema"),
    (_truncated, "malformed"),
]


@pytest.mark.parametrize("make,why", UNUSABLE, ids=[w for _, w in UNUSABLE])
def test_unusable_file_is_reported_and_never_touched(tmp_path, monkeypatch, make, why):
    path = tmp_path / "theirs.db"
    make(path)
    digest = _digest(path)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    dispatch.reset()
    d, caught = _select()
    assert d.origin == "heuristic" and any("tuning DB" in m for m in caught), caught
    res = CliRunner().invoke(main, ["doctor", "--json"])
    assert res.exit_code == 0
    assert why in json.loads(res.stdout)["db"]["user_error"]
    if make is not _empty:             # a writer refuses it too (an empty file it may initialise)
        res = CliRunner().invoke(main, ["import", os.devnull])
        assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert _digest(path) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]  # no journal, no -wal, no -shm


def test_reading_never_changes_the_journal_mode_or_creates_a_file(tmp_path, monkeypatch):
    path = tmp_path / "ours.db"
    open_store(path).close()
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    con.close()
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    dispatch.reset()
    _select()
    CliRunner().invoke(main, ["show", "--json"])
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    missing = tmp_path / "sub" / "none.db"
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(missing))
    dispatch.reset()
    _select()
    CliRunner().invoke(main, ["doctor"])
    assert not missing.parent.exists()


# -- schemas: old ones migrate (or read as they are), newer ones are refused ---------------------------------

V1 = {
    "tuning": "op TEXT, variant TEXT, arch TEXT, device_name TEXT, dtype TEXT, static_key TEXT, bucket TEXT, impl TEXT, "
              "config TEXT, median_ms FLOAT, baseline_ms FLOAT, source_hash TEXT, config_schema INTEGER, "
              "triton_version TEXT, torch_version TEXT, origin TEXT, created FLOAT, "
              "PRIMARY KEY (op, variant, arch, dtype, static_key, bucket, impl)",
    "measurements": "op TEXT, variant TEXT, arch TEXT, device_name TEXT, dtype TEXT, static_key TEXT, dims TEXT, "
                    "axis FLOAT, tag TEXT, impl TEXT, config TEXT, median_ms FLOAT, ok INTEGER, error TEXT, "
                    "source_hash TEXT, created FLOAT",
    "crossover": "op TEXT, variant TEXT, arch TEXT, dtype TEXT, static_key TEXT, axis_name TEXT, segments TEXT, "
                 "margin FLOAT, origin TEXT, source_hash TEXT, created FLOAT, "
                 "PRIMARY KEY (op, variant, arch, dtype, static_key)",
}


def _v1_db(path):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('db_schema', '1')")
    for table, cols in V1.items():
        con.execute(f"CREATE TABLE {table} ({cols})")
    con.commit()
    con.close()
    row = {k: v for k, v in _good().items() if k not in ("method", "host_ms", "sm_count", "runtime_version")}
    _raw_insert(path, "tuning", row)
    meas = dict(op="toy", variant="fwdbwd", arch="cpu", device_name="cpu", dtype="fp32", static_key=SK,
                dims=json.dumps({"cols": 40, "rows": 4}), axis=4.0, tag="", impl="torch", config="{}", median_ms=1.0,
                ok=1, error="", source_hash=source_hash(OP), created=5.0)
    _raw_insert(path, "measurements", meas)
    _raw_insert(path, "measurements", meas)          # schema 1 let a double import duplicate it


def test_schema1_db_is_read_as_is_and_migrated_when_written(tmp_path, monkeypatch):
    path = tmp_path / "v1.db"
    _v1_db(path)
    digest = _digest(path)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    dispatch.reset()
    d, _ = _select()
    assert d.origin == "stale" and "unrecorded" in d.reason and "STALE" in d.reason
    assert _digest(path) == digest
    store = open_store(path)                         # a writer migrates
    assert store.db.execute("SELECT value FROM meta").fetchone()[0] == str(DB_SCHEMA)
    (row,) = store.all_rows("tuning")
    assert (row["method"], row["sm_count"], row["host_ms"]) == ("unrecorded", 0, None)
    assert len(store.all_rows("measurements")) == 1
    store.close()
    open_store(path).close()                         # migrating twice is a no-op


# -- permissions and locks ----------------------------------------------------------------------------------

def _one_line_error(res, *fragments):
    assert res.exit_code != 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("liger-tune: error: "), res.stderr
    for f in fragments:
        assert f in res.stderr, res.stderr


def test_read_only_file_and_directory(tmp_path, monkeypatch):
    from liger_rt.tuning_db import store as store_mod
    path = tmp_path / "ro.db"
    open_store(path).close()
    denied = {str(path), str(tmp_path / "locked")}
    real = os.access
    monkeypatch.setattr(store_mod.os, "access", lambda p, mode: not (str(p) in denied and mode & os.W_OK)
                        and real(p, mode))     # readable, not writable
    args = ["sweep", "--arch", "cpu", "--op", "rms_norm", "--shape", "rows=2,hidden=8", "--dtype", "fp32"]
    _one_line_error(CliRunner().invoke(main, [*args, "--db", str(path)]), "is read-only")
    (tmp_path / "locked").mkdir()
    _one_line_error(CliRunner().invoke(main, [*args, "--db", str(tmp_path / "locked" / "new.db")]), "is not writable")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_file_by_permissions(tmp_path):
    path = tmp_path / "ro.db"
    open_store(path).close()
    path.chmod(0o444)
    res = CliRunner().invoke(main, ["import", os.devnull, "--db", str(path)])
    _one_line_error(res, "read-only")


def test_sqlite_refusing_a_write_is_one_clear_error(tmp_path):
    path = tmp_path / "x.db"
    store = open_store(path)
    store.conn.close()
    store.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    with pytest.raises(TuningDBError, match="is read-only"):
        store.put_tuning(_good())


def test_held_write_lock_gives_a_clear_error_and_reads_go_on(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    store = open_store(path)
    store.put_tuning(_good())
    store.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")               # another process mid-write
    try:
        monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "0.2")
        good = tmp_path / "good.jsonl"
        good.write_text(_line(bucket=OP.bucket_key({"rows": 8})) + "\n")
        _one_line_error(CliRunner().invoke(main, ["import", str(good)]), "locked by another process",
                        "LIGER_RT_DB_TIMEOUT")
        dispatch.reset()
        d, _ = _select()
        assert d.origin == "db"                      # WAL: readers are not blocked by a writer
    finally:
        holder.execute("ROLLBACK")


def test_exclusive_lock_on_read_falls_back_after_the_timeout(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    store = open_store(path)
    store.put_tuning(_good())
    store.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode=DELETE")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "0.2")
    dispatch.reset()
    try:
        d, caught = _select()
    finally:
        holder.execute("ROLLBACK")
    assert d.origin == "heuristic" and any("tuning DB" in m for m in caught)


# -- transactions --------------------------------------------------------------------------------------------

def test_a_case_is_persisted_whole_or_not_at_all(tmp_path):
    store = open_store(tmp_path / "x.db")
    result = autotune.tune(OP, dispatch.current_target("cpu"), torch.float32, {"rows": 4, "cols": 40}, quick=True,
                           impls=["torch"])
    result["measurements"].append({**result["measurements"][0], "median_ms": float("nan")})   # a bad one, last
    with pytest.raises(RowError, match="not finite"):
        autotune.persist(OP, result, store)
    assert store.counts() == {"tuning": 0, "measurements": 0, "crossover": 0}


KILLED = textwrap.dedent("""
    import sys, time
    import torch
    import toy_op
    from liger_rt import autotune, dispatch
    from liger_rt.freshness import source_hash
    from liger_rt.tuning_db import open_store
    from liger_rt.tuning_db.store import fingerprint
    op = toy_op.OP

    def fake_tune(op, target, dtype, dims, quick=False, tag="", **kw):   # quick synthetic results, many rows
        meas = [dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=op.static_key(dims),
                     dims=__import__("json").dumps(dims, sort_keys=True), axis=float(dims["rows"]), tag="",
                     impl="triton", config=toy_op.ToyConfig(BLOCK=2 ** (4 + i % 6), num_warps=1 + i % 2).to_dict(),
                     median_ms=1.0 + i, ok=1, error="", method="cpu-wall") for i in range(PER_CASE)]
        best = {"triton": {**meas[0], "host_ms": 1.0}, "torch": {**meas[0], "impl": "torch", "config": {}, "host_ms": 1.0}}
        return {"op": "toy", "dims": dims, "dtype": "fp32", "arch": "cpu", "tag": "", "winner": best["triton"],
                "best": best, "configs": {}, "baseline_ms": 1.0, "measurements": meas, "unavailable": {},
                "fingerprint": fingerprint(target.arch, source_hash(op))}

    autotune.tuning.tune = fake_tune
    store = open_store(sys.argv[1])
    plan = [(op, {"rows": r, "cols": c}, "fp32", "") for c in range(1, 400) for r in (1, 2, 4, 8)]
    print("start", flush=True)
    autotune.sweep(plan, dispatch.current_target("cpu"), store)
""")


@pytest.mark.slow
def test_kill_9_mid_sweep_leaves_whole_cases(tmp_path):
    path = tmp_path / "killed.db"
    per_case = 60
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED.replace("PER_CASE", str(per_case)), str(path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "start", proc.stderr.read()
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.3)
        try:
            if sqlite3.connect(f"file:{path}?mode=ro", uri=True).execute("SELECT count(*) FROM tuning").fetchone()[0] >= 20:
                break
        except sqlite3.Error:
            pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    store = open_store(path)
    assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    cases = {(r["static_key"], r["bucket"]) for r in store.all_rows("tuning")}
    assert len(cases) >= 10
    per = {}
    for m in store.all_rows("measurements"):
        dims = json.loads(m["dims"])
        key = (m["static_key"], OP.bucket_key(dims))
        per[key] = per.get(key, 0) + 1
    assert set(per) == cases and set(per.values()) == {per_case}
    for key in cases:
        assert len(store.all_rows("tuning", "static_key = ? AND bucket = ?", list(key))) == 2


# -- places a user can point the DB at: read without writing, or one clear line ------------------------------

@contextlib.contextmanager
def _unwritable(path: Path):
    """`path` (a file or directory) really unwritable for this process: chmod for a user, chattr +i for root
    (which file modes do not stop)."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(mode & ~0o222)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root, and chattr +i does not work here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _wal_db(path: Path) -> None:
    store = open_store(path)          # a writer: WAL; closing it removes -wal and -shm
    store.put_tuning(_good())
    store.close()
    assert path.read_bytes()[18:20] == b"\x02\x02"           # the header says WAL
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.parametrize("what", ["directory", "file"])
def test_read_only_db_is_read_and_nothing_is_written(tmp_path, monkeypatch, what):
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "team.db"
    _wal_db(path)
    digest = _digest(path)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    with _unwritable(folder if what == "directory" else path):
        try:
            dispatch.reset()
            d, caught = _select()
            assert (d.origin, d.config.BLOCK) == ("db", 32) and not [m for m in caught if "tuning DB" in m], caught
            for args in (["show", "--json"], ["export", "-"], ["doctor", "--json"]):
                res = CliRunner().invoke(main, args)
                assert res.exit_code == 0 and res.stderr == "", (args, res.output)
            assert json.loads(CliRunner().invoke(main, ["doctor", "--json"]).stdout)["db"]["user_schema"] == DB_SCHEMA
            good = tmp_path / "good.jsonl"
            good.write_text(_line(bucket=OP.bucket_key({"rows": 8})) + "\n")
            _one_line_error(CliRunner().invoke(main, ["import", str(good)]),
                            "is not writable" if what == "directory" else "is read-only")
        finally:
            dispatch.reset()                  # closes the reader before the directory is writable again
        assert sorted(p.name for p in folder.iterdir()) == ["team.db"]     # no -wal, no -shm, no journal
        assert _digest(path) == digest


def _fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    os.mkfifo(tmp_path / "pipe.db")
    return tmp_path / "pipe.db"


BAD_PATHS = [
    (lambda tmp: tmp, "is a directory"),
    (_fifo, "is a named pipe"),
    (lambda tmp: Path(os.devnull), "is a character device"),
    (lambda tmp: tmp / ("x" * 300 + ".db"), "name too long"),
    (lambda tmp: tmp / ("d" * 200) / ("d" * 200) / ("d" * 200) / ("x" * 200) / ("y" * 200) / "t.db", None),
    (lambda tmp: (tmp / "file").write_text("") or tmp / "file" / "t.db", "a directory in its path is a file"),
]


@pytest.mark.parametrize("make,why", BAD_PATHS, ids=["directory", "named pipe", "device", "long name",
                                                      "long path", "under a file"])
def test_a_path_that_cannot_hold_a_db_is_one_line_and_ops_fall_back(tmp_path, monkeypatch, make, why):
    path = make(tmp_path)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    done, unblocked = threading.Event(), threading.Event()

    def watchdog():          # a reader blocked opening the pipe would wait forever: give it a writer, say so
        if not done.wait(60) and path.is_fifo():
            unblocked.set()
            with open(path, "wb") as pipe:
                pipe.write(b"not a database")

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        dispatch.reset()
        d, caught = _select()
        warned = [m for m in caught if "ignoring the tuning DB" in m]
        if why is not None or warned:       # a long path that still fits is a DB that does not exist yet
            assert d.origin == "heuristic" and len(warned) == 1 and "\n" not in warned[0], caught
            assert why is None or why in warned[0].lower(), warned
            assert len(warned[0]) < 400, warned[0]
        x = torch.randn(4, 40)
        torch.testing.assert_close(toy_op.toy(x), x * 2)
        res = CliRunner().invoke(main, ["doctor", "--json"])
        assert res.exit_code == 0 and (why is None or why in json.loads(res.stdout)["db"]["user_error"].lower())
        for verb in (["show"], ["export", "-"], ["import", os.devnull], ["prune", "--stale"]):
            res = CliRunner().invoke(main, [*verb, "--db", str(path)])
            if why is not None or verb[0] in ("export", "prune", "import"):
                _one_line_error(res, *([why] if why and verb[0] != "import" else []))
    finally:
        done.set()
        dispatch.reset()
    assert not unblocked.is_set(), "opening the DB path blocked"


# -- imports: idempotent whatever optional field a record lacks ----------------------------------------------

_OPTIONAL = {"tuning": ("created", "baseline_ms", "host_ms", "method", "origin", "variant", "device", "device_name",
                        "sm_count", "torch_version", "triton_version", "runtime_version", "source_hash"),
             "crossover": ("created", "axis_name", "method", "origin", "variant", "device", "device_name", "sm_count",
                           "torch_version", "triton_version", "runtime_version", "source_hash"),
             "measurements": ("created", "axis", "tag", "error", "method", "origin", "variant", "device",
                              "device_name", "sm_count", "torch_version", "triton_version", "runtime_version",
                              "source_hash")}


def _meas(**kw) -> dict:
    row = dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=SK,
               dims=json.dumps({"cols": 40, "rows": 4}), axis=4.0, tag="", impl="triton", config=json.dumps(toy_op.ToyConfig(BLOCK=32).to_dict()), median_ms=1.0,
               ok=1, error="", method="cpu-wall", origin="sweep", created=1.0, **fingerprint("cpu", source_hash(OP)))
    row.update(kw)
    return row


def test_import_three_times_leaves_the_same_rows_whatever_field_is_absent(tmp_path):
    makers = {"tuning": _good, "crossover": _good_cross, "measurements": _meas}
    lines = []
    for table, make in makers.items():
        # one record per optional field absent, and one per that field null, each its own key
        for i, (col, null) in enumerate([("", False)] + [(c, n) for c in _OPTIONAL[table] for n in (False, True)]):
            rec = {k: v for k, v in make(static_key=OP.static_key({"cols": 100 + i})).items() if k != col}
            if null:
                rec[col] = None
            if table == "measurements":
                rec["dims"] = json.dumps({"cols": 100 + i, "rows": 4})
            lines.append(json.dumps({"table": table, **rec}))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    db = tmp_path / "x.db"
    dumps = []
    for _ in range(3):
        res = CliRunner().invoke(main, ["import", str(path), "--db", str(db)])
        assert res.exit_code == 0, res.output
        with open_store(db) as store:
            counts = store.counts()
            dumps.append(sorted(dump_jsonl(store)))
    assert counts == {t: 1 + 2 * len(_OPTIONAL[t]) for t in makers}
    assert dumps[0] == dumps[1] == dumps[2]


# -- text from a DB reaches the terminal escaped ---------------------------------------------------------------

_EVIL = "\x1b[2J\x1b]0;owned\x07\nFORGED: all rows ok\r\u202e"


def test_control_characters_from_a_db_are_printed_escaped(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    rn = REGISTRY.get("rms_norm")
    row = dict(_good(), op="rms_norm", static_key=rn.static_key({"hidden": 64}), bucket=rn.bucket_key({"rows": 8}),
               impl="torch", config="{}", config_schema=rn.schema_version, torch_version="2.0" + _EVIL,
               device_name="cpu" + _EVIL, runtime_version=_EVIL, source_hash="f" * 16 + _EVIL)
    _raw_insert(path, "tuning", row)                                   # stale: another torch, another kernel
    _raw_insert(path, "tuning", dict(row, bucket=rn.bucket_key({"rows": 16}), impl="cuda" + _EVIL))   # bad
    _raw_insert(path, "measurements", {k: v for k, v in _meas(error=_EVIL, tag=_EVIL).items()})       # bad tag
    for args in (["show"], ["show", "--op", "rms_norm", "--device", "cpu"], ["doctor"],
                 ["prune", "--stale", "--dry-run"], ["explain", "rms_norm", "--arch", "cpu", "--dtype", "fp32", "--shape", "rows=8,hidden=64"]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, (args, res.output)
        out = res.stdout + res.stderr
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u202e" not in out, (args, out)
        assert not any(line.startswith("FORGED") for line in out.splitlines()), (args, out)
    assert "\\x1b[2J" in CliRunner().invoke(main, ["show", "--op", "rms_norm"]).stdout
    res = CliRunner().invoke(main, ["show", "--json"])                  # JSON escapes on its own
    assert "\x1b" not in res.stdout and json.loads(res.stdout)["tuning"]
    res = CliRunner().invoke(main, ["export", str(tmp_path / "out.jsonl")])     # its human lines, on stderr
    assert res.exit_code == 0 and "left out 2 invalid rows" in res.stderr, res.stderr
    assert "\x1b" not in res.stderr and "\r" not in res.stderr and "\nFORGED" not in res.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = dispatch.select("rms_norm", dtype="fp32", arch="cpu", rows=8, hidden=64)
    assert d.origin == "stale" and d.reason.isprintable(), d.reason        # what LIGER_RT_LOG=decisions prints


# -- launchability: a config that validates but cannot launch is a bad row ---------------------------------------

def test_a_row_that_cannot_launch_is_refused_at_import_and_skipped_at_lookup(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    too_wide = json.dumps(toy_op.ToyConfig(BLOCK=32, num_warps=32).to_dict())   # declared, but cpu runs 4 warps
    with pytest.raises(TuningDBError, match=r"line 1: .*cannot launch for cols=40, rows=4 on cpu: num_warps 32 > 4"):
        load_jsonl(open_store(tmp_path / "other.db"), [_line(config=too_wide)])
    _raw_insert(path, "tuning", _good(config=too_wide, median_ms=0.01))
    d, caught = _select()
    assert d.origin == "heuristic" and d.config.num_warps <= 4
    assert any("skipping a bad tuning row" in m and "cannot launch" in m for m in caught), caught
    x = torch.randn(4, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(toy_op.toy(x), x * 2)
    db = json.loads(CliRunner().invoke(main, ["doctor", "--json"]).stdout)["db"]
    assert db["user_health"]["tuning"]["bad"] == 1 and "cannot launch" in db["user_bad"][0]
    assert "BAD" in CliRunner().invoke(main, ["show"]).stdout


def test_the_ops_launchable_hook_judges_every_row_it_sees(tmp_path, monkeypatch):
    """op.launchable(config, dims, arch, dtype) -> None or a reason: import, lookup (at the call's dims, so a
    nearer bucket's config too), doctor and show apply it."""
    seen = []

    def launchable(config, dims, arch, dtype):
        seen.append((dims["rows"], arch.name, dtype))
        return f"BLOCK {config.BLOCK} over {dims['rows']} rows needs a bigger grid" if dims["rows"] > 8 else None

    monkeypatch.setattr(OP, "launchable", launchable, raising=False)
    path = _user_db(tmp_path, monkeypatch)
    with pytest.raises(TuningDBError, match="BLOCK 32 over 16 rows needs a bigger grid"):
        load_jsonl(open_store(tmp_path / "other.db"), [_line(bucket=OP.bucket_key({"rows": 16}))])
    _raw_insert(path, "tuning", _good())                       # the rows=4 bucket: launches up to 8 rows
    assert _select(rows=4, cols=40)[0].origin == "db"
    d, caught = _select(rows=32, cols=40)                      # nearest bucket rows=4, but 32 rows cannot launch
    assert d.origin == "heuristic" and any("cannot launch for cols=40, rows=32" in m for m in caught), caught
    assert (4, "cpu", torch.float32) in seen
    monkeypatch.setattr(OP, "launchable", lambda *a: "never", raising=False)
    dispatch.reset()
    assert json.loads(CliRunner().invoke(main, ["doctor", "--json"]).stdout)["db"]["user_health"]["tuning"]["bad"] == 1
    assert "BAD" in CliRunner().invoke(main, ["show"]).stdout


# -- launchability of the real ops: every block within Triton's largest, every grid within its limits -------------

def _op_row(name: str, dims: dict, **knobs) -> dict:
    """A fresh tuning row of op `name` at `dims` (cpu, fp32) whose triton config is the default one with `knobs`."""
    op = REGISTRY.get(name)
    return _good(op=name, variant=op.variant, static_key=op.static_key(dims), bucket=op.bucket_key(dims),
                 config=json.dumps({**op.config().to_dict(), **knobs}), config_schema=op.schema_version,
                 source_hash=source_hash(op), median_ms=0.01)


# every knob inside its declared choices, every launch past 2**20 elements in one block (unchecked, each fails every call)
TOO_BIG = [
    ("swiglu", {"rows": 4, "cols": 128}, dict(BLOCK_N=16384, ROWS=16384), "tile block holds 2097152"),
    ("geglu", {"rows": 4, "cols": 16384}, dict(BLOCK_N=16384, ROWS=16384), "tile block holds 268435456"),
    ("rms_norm", {"rows": 4, "hidden": 256}, dict(ROWS=8192), "forward block holds 2097152"),
    ("rms_norm", {"rows": 4, "hidden": 8192}, dict(bwd_rows=256), "backward block holds 2097152"),
    ("layer_norm", {"rows": 4, "hidden": 256}, dict(ROWS=8192), "forward block holds 2097152"),
    ("moe_router", {"tokens": 4, "experts": 256, "top_k": 2}, dict(BLOCK_T=8192, num_warps=4), "tile block holds 2097152"),
]


@pytest.mark.parametrize("name,dims,knobs,why", TOO_BIG, ids=[f"{n}-{w.split()[0]}" for n, _, _, w in TOO_BIG])
def test_a_block_past_tritons_largest_is_refused_at_import_and_bad_everywhere(tmp_path, monkeypatch, name, dims,
                                                                              knobs, why):
    row = _op_row(name, dims, **knobs)
    with pytest.raises(TuningDBError, match=f"cannot launch .* on cpu: its {why} elements, more than Triton's"):
        load_jsonl(open_store(tmp_path / "other.db"), [json.dumps({"table": "tuning", **row})])
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", row)                                       # past the import check
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = dispatch.select(name, dtype="fp32", arch="cpu", **dims)
    assert d.origin == "heuristic" and any("cannot launch" in str(m.message) and why in str(m.message)
                                           for m in caught), caught
    for arch in ("hopper", "mi325x"):                                      # the limit holds on every arch
        assert why in REGISTRY.get(name).launchable(REGISTRY.get(name).parse_config(row["config"]), dims,
                                                    backend.profile(arch), torch.bfloat16)
    db = json.loads(CliRunner().invoke(main, ["doctor", "--json"]).stdout)["db"]
    assert db["user_health"]["tuning"]["bad"] == 1 and why in db["user_bad"][0]
    assert "BAD" in CliRunner().invoke(main, ["show", "--op", name]).stdout


def test_the_block_limit_is_tritons():
    import triton.language.core as tlc
    from liger_rt.kernels._common import MAX_BLOCK_NUMEL
    assert MAX_BLOCK_NUMEL == tlc.TRITON_MAX_TENSOR_NUMEL


def test_short_conv_grid_and_shapes_an_implementation_refuses_are_bad_rows():
    from liger_rt.tuning_db import rows as R
    sc = REGISTRY.get("short_conv")
    cfg = sc.config().replace(BLOCK_H=16)
    wide = {"batch": 1, "seq": 8, "hidden": 16 * 65536, "kernel": 3}
    assert "second axis, more than 65535" in R.launch_problem(sc, "triton", cfg, wide, backend.profile("hopper"), "bf16")
    assert R.launch_problem(sc, "triton", cfg.replace(BLOCK_H=1024, BWD_BLOCK_H=512), wide, backend.profile("hopper"),
                            "bf16") is None
    rn = REGISTRY.get("rms_norm")
    with pytest.raises(RowError, match="triton does not take this shape: hidden 65536 > 32768"):
        R.check("tuning", _op_row("rms_norm", {"rows": 4, "hidden": 65536}))
    R.check("tuning", dict(_op_row("rms_norm", {"rows": 4, "hidden": 65536}), impl="torch", config="{}"))
    assert rn.candidates_for(rn.impl("triton"), backend.profile("cpu"), {"rows": 4, "hidden": 256}, torch.float32)


@pytest.mark.parametrize("name,dims,knobs", [
    ("swiglu", {"rows": 4, "cols": 128}, dict(BLOCK_N=16384, ROWS=16384)),
    ("rms_norm", {"rows": 1, "hidden": 8192}, dict(bwd_rows=256)),          # the forward launches, the backward not
], ids=["swiglu-forward", "rms_norm-backward"])
def test_a_row_that_fails_at_launch_costs_one_warning_and_the_result_is_the_reference(tmp_path, monkeypatch, name,
                                                                                      dims, knobs):
    """Without the op's launchable hook the crafted row is used, and its launch raises: the call falls back to the
    heuristic config, warns once naming op, shape, row and error, and returns the reference's values and gradients."""
    op = REGISTRY.get(name)
    monkeypatch.setattr(op, "launchable", None)
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _op_row(name, dims, **knobs))
    case = op.new_case(dims, torch.float32, "cpu")
    args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in case.args]
    assert dispatch.select(name, dtype="fp32", arch="cpu", **dims).origin == "db"
    fn = getattr(liger_rt.ops, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
        out.backward(case.grads[0])
        fn(*args).backward(case.grads[0])                                 # a second call: no second warning
    failed = [str(m.message) for m in caught if "raised at launch" in str(m.message)]
    assert len(failed) == 1 and "\n" not in failed[0], caught
    assert all(s in failed[0] for s in (name, f"{op.static_key(dims)} {op.bucket_key(dims)} triton", "exceeds triton"))
    refs = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in case.args]
    ref = op.reference(*refs)
    ref.backward(case.grads[0])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, r in zip(args, refs):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            torch.testing.assert_close(a.grad, 2 * r.grad, rtol=1e-4, atol=1e-4)   # two backward passes
    x = args[0]
    assert dispatch.decision(op, x, **op.dims(*args)).origin == "heuristic"    # the row is skipped now


# -- a config from the DB that raises at launch: the heuristic's runs instead, once warned --------------------------

def _calls() -> dict:
    toy_op.CALLS.update(triton=0, torch=0, fail=0)
    return toy_op.CALLS


def test_launch_failure_of_a_db_row_falls_back_warns_once_and_skips_the_row(tmp_path, monkeypatch):
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _good(config=json.dumps(toy_op.ToyConfig(BLOCK=32, FAIL=1).to_dict())))
    calls = _calls()
    x = torch.randn(4, 40, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = toy_op.toy(x)
        y.backward(torch.ones_like(y))
        toy_op.toy(torch.randn(3, 40))                                    # the same bucket: decided without the row
    torch.testing.assert_close(y, x.detach() * 2)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    failed = [str(m.message) for m in caught if "raised at launch" in str(m.message)]
    assert len(failed) == 1 and len(caught) == 1, [str(m.message) for m in caught]
    for part in ("toy cols=40,rows=4 (cpu, fp32)", 'user DB row toy cpu fp32 {"cols":40} {"rows":4} triton',
                 "RuntimeError: out of resources: shared memory (simulated)", "cpu heuristic config"):
        assert part in failed[0], failed[0]
    assert calls == {"triton": 2, "torch": 0, "fail": 1}
    assert _select()[0].origin == "heuristic"
    dispatch.reset()                                                      # re-reads the DB: the row is tried again
    assert _select()[0].origin == "db"


def test_only_configs_from_the_db_are_retried_and_a_second_failure_propagates(tmp_path, monkeypatch):
    calls = _calls()
    failing = toy_op.ToyConfig(FAIL=1)
    monkeypatch.setattr(OP, "heuristic", lambda arch, dims, dtype: failing)
    x = torch.randn(4, 40)
    with pytest.raises(RuntimeError, match="simulated"):                  # a heuristic config: never retried
        toy_op.toy(x)
    assert calls["fail"] == 1
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "triton")                     # forced, with no DB row: the heuristic's
    dispatch.reset()
    with pytest.raises(RuntimeError, match="simulated"):
        toy_op.toy(x)
    assert calls["fail"] == 2
    monkeypatch.delenv("LIGER_RT_IMPL_TOY")
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _good(config=json.dumps(toy_op.ToyConfig(BLOCK=32, FAIL=1).to_dict())))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="simulated"):              # the DB's and then the heuristic's
            toy_op.toy(x)
    assert calls["fail"] == 4 and not [m for m in caught if "raised at launch" in str(m.message)]
    assert _select()[0].origin == "db"                                    # a failure of every config: not the row's


def test_a_backward_that_raises_reruns_forward_and_backward_with_the_heuristic(tmp_path, monkeypatch):
    """The saved tensors belong to the config the forward ran, so the fallback runs the forward again first."""
    impl = OP.impl("triton")
    forward, backward = impl.forward, impl.backward

    def saving_forward(config, *args):
        outs, _ = forward(config, *args)
        return outs, (torch.tensor([config.BLOCK]),)

    def picky_backward(config, args, saved, needs, dy):
        if config.BLOCK == 32:
            raise RuntimeError("out of resources: registers (simulated, backward)" + _EVIL)
        assert int(saved[0]) == config.BLOCK, "saved tensors of another config"
        return backward(config, args, (), needs, dy)

    monkeypatch.setattr(impl, "forward", saving_forward)
    monkeypatch.setattr(impl, "backward", picky_backward)
    path = _user_db(tmp_path, monkeypatch)
    _raw_insert(path, "tuning", _good())                                   # BLOCK 32: the forward launches
    x = torch.randn(4, 40, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = toy_op.toy(x)
        y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    (failed,) = [str(m.message) for m in caught if "raised at launch" in str(m.message)]
    assert "simulated, backward" in failed and "\x1b" not in failed and "\n" not in failed, failed
    dispatch.reset()                                  # where the backward keeps stand-ins, it cannot: the error stands
    monkeypatch.setattr(impl, "keep", (1,))
    y = toy_op.toy(torch.randn(4, 40, requires_grad=True))
    with pytest.raises(RuntimeError, match="simulated, backward"):
        y.sum().backward()


# -- DB paths: unreadable, a WAL it cannot read, an empty --db ------------------------------------------------------

def test_an_unreadable_file_is_one_line_and_ops_fall_back(tmp_path, monkeypatch):
    from liger_rt.tuning_db import store as store_mod
    path = _user_db(tmp_path, monkeypatch)
    real = os.access
    monkeypatch.setattr(store_mod.os, "access", lambda p, mode: not (str(p) == str(path) and mode & os.R_OK)
                        and real(p, mode))
    dispatch.reset()
    d, caught = _select()
    warned = [m for m in caught if "ignoring the tuning DB" in m]
    assert d.origin == "heuristic" and len(warned) == 1 and "cannot be read (permission denied)" in warned[0]
    for verb in (["export", "-"], ["prune", "--stale"], ["import", os.devnull], ["show", "--db", str(path)]):
        _one_line_error(CliRunner().invoke(main, verb), "cannot be read (permission denied)")
    assert "cannot be read" in json.loads(CliRunner().invoke(main, ["doctor", "--json"]).stdout)["db"]["user_error"]


def test_a_wal_it_cannot_read_is_said_and_nothing_is_written(tmp_path, monkeypatch):
    """A writer killed mid-session leaves committed rows in -wal; without a -shm and with a read-only directory,
    SQLite can only read the main file: say that the last writes are not seen, create nothing."""
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "team.db"
    _wal_db(path)
    killed = textwrap.dedent(f"""
        import os, sqlite3, signal
        con = sqlite3.connect({str(path)!r})
        con.execute("PRAGMA wal_autocheckpoint = 0")
        con.execute("UPDATE tuning SET median_ms = 0.5")
        con.commit()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    subprocess.run([sys.executable, "-c", killed])
    (folder / "team.db-shm").unlink()
    assert (folder / "team.db-wal").stat().st_size > 0
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    with _unwritable(folder):
        try:
            dispatch.reset()
            d, caught = _select()
            assert d.origin == "db" and any("without its last writes" in m for m in caught), caught
            res = CliRunner().invoke(main, ["show", "--json"])
            assert res.exit_code == 0 and "without its last writes" in res.stderr
        finally:
            dispatch.reset()
    assert sorted(p.name for p in folder.iterdir()) == ["team.db", "team.db-wal"]


@pytest.mark.parametrize("verb", [["show"], ["export", "-"], ["import", os.devnull], ["prune", "--stale"],
                                  ["sweep", "--arch", "cpu", "--op", "toy", "--shape", "rows=2,cols=8"]])
def test_an_empty_db_option_is_an_error_not_the_default_db(tmp_path, verb):
    res = CliRunner().invoke(main, [*verb, "--db", ""])
    _one_line_error(res, "--db is empty")
    assert not (tmp_path / "tuning.db").exists()


def test_show_of_a_db_that_does_not_exist_is_an_error(tmp_path):
    _one_line_error(CliRunner().invoke(main, ["show", "--db", str(tmp_path / "none.db")]), "no tuning DB at")
    assert CliRunner().invoke(main, ["show"]).exit_code == 0          # no user DB yet: the shipped defaults
    assert not (tmp_path / "none.db").exists()
