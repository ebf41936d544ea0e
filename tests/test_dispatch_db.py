"""The decision path, the tuning DB and the autotuner, on the toy op (tests/toy_op.py)."""
import json
import sqlite3
import warnings

import pytest
import torch

import toy_op
from liger_rt import autotune, dispatch, tuning_db
from liger_rt.tuning_db import open_store
from liger_rt.tuning_db.store import dump_jsonl, load_jsonl

OP = toy_op.OP


def _row(**kw):
    base = dict(op="toy", variant="fwdbwd", arch="cpu", device_name="cpu", dtype="fp32",
                static_key=OP.static_key({"cols": 40}), bucket=OP.bucket_key({"rows": 4}), impl="triton",
                config={"BLOCK": 32}, median_ms=1.0, baseline_ms=2.0, source_hash=OP.source_hash,
                config_schema=OP.schema_version, origin="sweep")
    base.update(kw)
    return base


def _fresh_store():
    store = open_store()
    dispatch.reset()
    return store


def test_heuristic_when_db_empty_and_triton_through_interpreter():
    x = torch.randn(4, 40)
    d = OP.select(x, rows=4, cols=40)
    assert (d.impl, d.origin, dict(d.config)) == ("triton", "heuristic", {"BLOCK": 64})
    torch.testing.assert_close(toy_op.toy(x), x * 2)


def test_cpu_without_interpreter_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.reset()
    d = OP.select(torch.randn(4, 40), rows=4, cols=40)
    assert d.impl == "torch"


def test_memo_hit_needs_no_db_or_env(monkeypatch):
    x = torch.randn(4, 40)
    first = OP.select(x, rows=4, cols=40)
    monkeypatch.setattr(tuning_db, "get_store", lambda: (_ for _ in ()).throw(AssertionError("DB touched")))
    monkeypatch.setattr(dispatch.env, "disabled", lambda: (_ for _ in ()).throw(AssertionError("env parsed")))
    assert OP.select(x, rows=4, cols=40) is first


def test_db_exact_then_nearest_bucket_in_log2_space():
    store = _fresh_store()
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 4}), config={"BLOCK": 32}, median_ms=1.0))
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 1024}), config={"BLOCK": 128}, median_ms=1.0))
    store.put_tuning(_row(static_key=OP.static_key({"cols": 41}), bucket=OP.bucket_key({"rows": 64}),
                          config={"BLOCK": 16}))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.origin, d.config["BLOCK"]) == ("db", 32)
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=16, cols=40)      # log2 16 is nearer 4 than 1024
    assert (d.origin, d.config["BLOCK"]) == ("db-nearest", 32)
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=300, cols=40)     # ... and 300 nearer 1024
    assert (d.origin, d.config["BLOCK"]) == ("db-nearest", 128)
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=64, cols=39)      # static dims must match
    assert d.origin == "heuristic"
    d = dispatch.select("toy", dtype="bf16", arch="cpu", rows=4, cols=40)       # dtype must match
    assert d.origin == "heuristic"


def test_db_can_pick_torch_when_it_measured_faster():
    store = _fresh_store()
    store.put_tuning(_row(impl="triton", median_ms=3.0))
    store.put_tuning(_row(impl="torch", config={}, median_ms=1.0))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.impl, d.origin) == ("torch", "db")


def test_stale_entries_are_ignored():
    store = _fresh_store()
    store.put_tuning(_row(source_hash="0123456789abcdef", config={"BLOCK": 16}))
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 64}), config_schema=OP.schema_version + 1))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert d.origin == "heuristic"


def test_upsert_keeps_the_faster_entry_but_replaces_stale_code():
    store = open_store()
    store.put_tuning(_row(median_ms=1.0, config={"BLOCK": 32}))
    store.put_tuning(_row(median_ms=2.0, config={"BLOCK": 64}))
    assert json.loads(store.all_rows("tuning")[0]["config"]) == {"BLOCK": 32}
    store.put_tuning(_row(median_ms=0.5, config={"BLOCK": 16}))
    assert json.loads(store.all_rows("tuning")[0]["config"]) == {"BLOCK": 16}
    store.put_tuning(_row(median_ms=9.0, config={"BLOCK": 8}, source_hash="other"))
    assert store.all_rows("tuning")[0]["source_hash"] == "other"
    assert len(store.all_rows("tuning")) == 1


def test_env_overrides(monkeypatch):
    store = _fresh_store()
    store.put_tuning(_row())
    x = torch.randn(4, 40)
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "torch")
    dispatch.reset()
    d = OP.select(x, rows=4, cols=40)
    assert (d.impl, d.origin) == ("torch", "env")
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "triton")
    dispatch.reset()
    d = OP.select(x, rows=4, cols=40)
    assert (d.impl, d.origin, d.config["BLOCK"]) == ("triton", "env", 32)   # config still from the DB
    monkeypatch.setenv("LIGER_RT_DISABLE", "1")
    dispatch.reset()
    assert OP.select(x, rows=4, cols=40).impl == "torch"


def test_forcing_an_impl_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "triton")
    dispatch.reset()
    with pytest.raises(RuntimeError, match="LIGER_RT_IMPL_TOY=triton.*available: torch"):
        OP.select(torch.randn(4, 40), rows=4, cols=40)


def test_unknown_op_and_arch_and_dims_list_valid_ones():
    with pytest.raises(ValueError, match="valid ops: rms_norm, swiglu"):
        dispatch.get_op("rmsnorm")
    with pytest.raises(ValueError, match="valid arches: hopper"):
        dispatch.select("toy", arch="h100", rows=1, cols=2)
    with pytest.raises(ValueError, match="takes dims cols,rows"):
        dispatch.select("toy", arch="cpu", rows=1, hidden=2)


def test_arch_pruner_drops_configs_over_warps_stages_and_smem():
    hopper, amd = dispatch.backend.profile("hopper"), dispatch.backend.profile("mi325x")
    cfgs = [{"num_warps": 32}, {"num_warps": 16}, {"num_warps": 8, "num_stages": 3}, {"num_warps": 8, "num_stages": 2},
            {"num_warps": 8, "num_stages": 2}]
    assert dispatch.prune_configs(cfgs, hopper) == cfgs[:4]
    assert dispatch.prune_configs(cfgs, amd) == [{"num_warps": 16}, {"num_warps": 8, "num_stages": 2}]
    impl = dispatch.Impl("x", run=None, smem=lambda c, d, t: c["B"] * 1024)
    big = [{"B": 32}, {"B": 100}, {"B": 200}]
    assert dispatch.prune_configs(big, amd, impl, {}, torch.bfloat16) == [{"B": 32}]
    assert dispatch.prune_configs(big, hopper, impl, {}, torch.bfloat16) == big


def test_autotune_validates_skips_failures_and_persists():
    target = dispatch.current_target("cpu")
    result = autotune.tune(OP, target, torch.float32, {"rows": 4, "cols": 40}, quick=True)
    by_cfg = {json.dumps(m["config"], sort_keys=True): m for m in result["measurements"]}
    assert by_cfg['{"BLOCK": 64, "WRONG": 1}']["error"].startswith("wrong result")
    assert "out of resources" in by_cfg['{"BLOCK": 128, "FAIL": 1}']["error"]
    assert '{"BLOCK": 64, "num_warps": 32}' not in by_cfg          # pruned: cpu profile allows 4 warps
    assert result["winner"]["config"].get("WRONG") is None
    assert set(result["best"]) == {"triton", "torch"} and result["baseline_ms"] > 0
    store = open_store()
    assert autotune.persist(OP, result, store) == 2
    assert len(store.all_rows("measurements")) == len(result["measurements"])
    dispatch.reset()
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert d.origin == "db" and d.impl == result["winner"]["impl"]


def test_online_autotune_on_miss_persists(monkeypatch):
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "1")
    dispatch.reset()
    d = OP.select(torch.randn(4, 40), rows=4, cols=40)
    assert d.origin == "online"
    rows = open_store().all_rows("tuning")
    assert {r["origin"] for r in rows} == {"online"} and len(rows) == 2
    dispatch.reset()
    monkeypatch.delenv("LIGER_RT_AUTOTUNE")
    assert OP.select(torch.randn(4, 40), rows=4, cols=40).origin == "db"


def test_export_import_round_trip(tmp_path):
    store = open_store()
    store.put_tuning(_row())
    store.put_tuning(_row(impl="torch", config={}, median_ms=2.0))
    store.put_crossover(dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=OP.static_key({"cols": 40}),
                             axis_name="rows", segments=[[8.0, "triton"], [None, "torch"]], margin=0.05,
                             origin="sweep", source_hash=OP.source_hash))
    store.put_measurements([dict(op="toy", arch="cpu", dtype="fp32", impl="torch", median_ms=2.0, ok=1, dims="{}")])
    lines = list(dump_jsonl(store))
    other = open_store(tmp_path / "empty.db")
    counts = load_jsonl(other, lines)
    assert counts == {"tuning": 2, "crossover": 1, "measurements": 1}
    assert sorted(dump_jsonl(other)) == sorted(lines)


def test_crossover_derivation_with_hysteresis():
    pts = [(8, {"a": 1.0, "b": 2.0}), (32, {"a": 1.0, "b": 0.97}),   # b wins by 3% < margin: a stays
           (128, {"a": 1.0, "b": 0.8}), (512, {"a": 1.0, "b": 0.7})]
    seg = dispatch.derive_crossover(pts, margin=0.05)
    assert seg == [[64.0, "a"], [None, "b"]]
    assert dispatch.crossover_pick(seg, 63.9) == "a" and dispatch.crossover_pick(seg, 64.0) == "b"
    assert dispatch.derive_crossover(pts, margin=0.35) == [[None, "a"]]
    # non-monotone: a, then b, then a again
    seg = dispatch.derive_crossover([(1, {"a": 1, "b": 2}), (4, {"a": 2, "b": 1}), (16, {"a": 1, "b": 2})])
    assert [s[1] for s in seg] == ["a", "b", "a"]


def test_crossover_drives_dispatch_between_db_buckets():
    store = _fresh_store()
    store.put_crossover(dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=OP.static_key({"cols": 40}),
                             axis_name="rows", segments=[[100.0, "triton"], [None, "torch"]], margin=0.05,
                             origin="sweep", source_hash=OP.source_hash))
    lo = dispatch.select("toy", dtype="fp32", arch="cpu", rows=10, cols=40)
    hi = dispatch.select("toy", dtype="fp32", arch="cpu", rows=1000, cols=40)
    assert (lo.impl, lo.origin, hi.impl, hi.origin) == ("triton", "crossover", "torch", "crossover")
    assert "rows=1000" in hi.reason


def test_garbage_db_file_warns_and_uses_defaults(tmp_path, monkeypatch):
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not an sqlite file at all" * 100)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    dispatch.reset()
    with pytest.warns(RuntimeWarning, match="ignoring the tuning DB"):
        d = OP.select(torch.randn(4, 40), rows=4, cols=40)
    assert d.origin == "heuristic"
    assert tuning_db.get_store().user_error


def test_foreign_sqlite_and_newer_schema_fall_back(tmp_path, monkeypatch):
    foreign = tmp_path / "foreign.db"
    sqlite3.connect(foreign).execute("CREATE TABLE invoices (id INTEGER)").connection.commit()
    newer = tmp_path / "newer.db"
    store = open_store(newer)
    store.db.execute("UPDATE meta SET value = '99' WHERE key = 'db_schema'")
    store.close()
    for path, msg in ((foreign, "another program"), (newer, "newer than this liger_rt")):
        monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
        dispatch.reset()
        with pytest.warns(RuntimeWarning, match=msg):
            assert dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40).origin == "heuristic"


def test_locked_db_falls_back_after_timeout(tmp_path, monkeypatch):
    path = tmp_path / "locked.db"
    store = open_store(path)
    store.put_tuning(_row())
    store.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode=DELETE")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "0.2")
    dispatch.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    holder.execute("ROLLBACK")
    assert d.origin == "heuristic"
    assert any("tuning DB" in str(w.message) for w in caught)


def test_validation_tolerates_ulp_outliers_but_not_wrong_elements():
    from liger_rt.kernels._common import validation_report
    torch.manual_seed(0)
    ref = torch.randn(4096, 64) * 50
    out = ref.to(torch.bfloat16)
    near = out.clone().float()
    near.view(-1)[:20] += 3 * (near.view(-1)[:20].abs() * 2 ** -8 + 0.05)   # 20 elements 3 ulps out
    assert validation_report(near.to(torch.bfloat16), ref, torch.bfloat16) is None
    wrong = out.clone()
    wrong[17] = 0                                                              # one row dropped
    assert "worst element" in validation_report(wrong, ref, torch.bfloat16)
    off = (ref * 1.03).to(torch.bfloat16)                                     # everything 3% off
    assert validation_report(off, ref, torch.bfloat16) is not None


def test_shipped_hopper_defaults_are_fresh_and_used(monkeypatch):
    """The rows measured on the H200 match this code (else every Hopper user silently loses them)."""
    from liger_rt.tuning_db.store import _fresh, shipped_defaults
    rows = shipped_defaults().all_rows("tuning", "arch = ?", ["hopper"])
    assert len(rows) >= 20
    stale = [(r["op"], r["static_key"]) for r in rows if not _fresh(r, dispatch.get_op(r["op"]))]
    assert not stale, f"shipped rows measured on other kernel code: {stale}; re-sweep on the H200"
    d = dispatch.select("rms_norm", dtype="bf16", arch="hopper", rows=4096, hidden=4096)
    assert (d.origin, d.impl) == ("db", "triton") and "shipped" in d.reason
