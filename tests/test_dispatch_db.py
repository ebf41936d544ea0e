"""The decision path, the tuning DB and the autotuner, on the toy op (tests/toy_op.py)."""
import json
import warnings

import pytest
import torch

import toy_op
from liger_rt import autotune, dispatch, tuning_db
from liger_rt.freshness import source_hash
from liger_rt.registry import REGISTRY
from liger_rt.tuning_db import open_store
from liger_rt.tuning_db.crossover import crossover_pick, derive_crossover
from liger_rt.tuning_db.store import dump_jsonl, fingerprint, load_jsonl

OP = toy_op.OP


def cfg(**kw) -> dict:
    return toy_op.ToyConfig(**kw).to_dict()


def _row(**kw):
    """A tuning row as a sweep on this machine would write it (this process's fingerprint)."""
    base = dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=OP.static_key({"cols": 40}),
                bucket=OP.bucket_key({"rows": 4}), impl="triton", config=cfg(BLOCK=32), median_ms=1.0,
                baseline_ms=2.0, method="cpu-wall", config_schema=OP.schema_version, origin="sweep",
                **fingerprint("cpu", source_hash(OP)))
    base.update(kw)
    return base


def _fresh_store():
    store = open_store()
    dispatch.reset()
    return store


def test_heuristic_when_db_empty_and_triton_through_interpreter():
    x = torch.randn(4, 40)
    d = dispatch.decision(OP, x, rows=4, cols=40)
    assert (d.impl, d.origin, d.config.BLOCK) == ("triton", "heuristic", 64)
    torch.testing.assert_close(toy_op.toy(x), x * 2)


def test_cpu_without_interpreter_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.reset()
    d = dispatch.decision(OP, torch.randn(4, 40), rows=4, cols=40)
    assert d.impl == "torch"


def test_memo_hit_needs_no_db_or_env(monkeypatch):
    x = torch.randn(4, 40)
    first = dispatch.decision(OP, x, rows=4, cols=40)
    monkeypatch.setattr(tuning_db, "get_store", lambda: (_ for _ in ()).throw(AssertionError("DB touched")))
    monkeypatch.setattr(dispatch.env, "disabled", lambda: (_ for _ in ()).throw(AssertionError("env parsed")))
    assert dispatch.decision(OP, x, rows=4, cols=40) is first


def test_db_exact_then_nearest_bucket_in_log2_space():
    store = _fresh_store()
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 4}), config=cfg(BLOCK=32)))
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 1024}), config=cfg(BLOCK=128)))
    store.put_tuning(_row(static_key=OP.static_key({"cols": 41}), bucket=OP.bucket_key({"rows": 64}),
                          config=cfg(BLOCK=16)))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.origin, d.config.BLOCK) == ("db", 32) and "cpu-wall" in d.reason and "STALE" not in d.reason
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=16, cols=40)      # log2 16 is nearer 4 than 1024
    assert (d.origin, d.config.BLOCK) == ("db-nearest", 32)
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=300, cols=40)     # ... and 300 nearer 1024
    assert (d.origin, d.config.BLOCK) == ("db-nearest", 128)
    assert dispatch.select("toy", dtype="fp32", arch="cpu", rows=64, cols=39).origin == "heuristic"   # static dims
    assert dispatch.select("toy", dtype="bf16", arch="cpu", rows=4, cols=40).origin == "heuristic"    # dtype


def test_only_configs_from_a_db_row_carry_a_launch_fallback(monkeypatch):
    """What call() runs when a launch raises: the heuristic config instead of a DB row's (see test_db_faults)."""
    store = _fresh_store()
    store.put_tuning(_row(config=cfg(BLOCK=32)))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert d.origin == "db" and d.launch_fallback.config() == OP.heuristic(d.launch_fallback.target.arch, d.dims,
                                                                          torch.float32)
    assert d.launch_fallback.row["config"] == json.dumps(cfg(BLOCK=32), sort_keys=True)
    assert "fallback" not in d.to_dict() and "fallback" not in repr(d)
    assert dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=39).launch_fallback is None   # heuristic
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "triton")                  # forced: the config is still the DB row's
    assert dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40).launch_fallback is not None
    store.put_tuning(_row(impl="torch", config={}, median_ms=0.1))
    monkeypatch.delenv("LIGER_RT_IMPL_TOY")
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.impl, d.launch_fallback) == ("torch", None)              # torch has no launch config


def test_db_can_pick_torch_when_it_measured_faster():
    store = _fresh_store()
    store.put_tuning(_row(impl="triton", median_ms=3.0))
    store.put_tuning(_row(impl="torch", config={}, median_ms=1.0))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.impl, d.origin) == ("torch", "db")


def test_rows_of_different_methods_are_never_compared():
    store = _fresh_store()
    store.put_tuning(_row(impl="torch", config={}, median_ms=0.5, method="unrecorded"))   # "faster", other method
    store.put_tuning(_row(impl="triton", median_ms=1.0, method="cpu-wall"))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.impl, d.config.BLOCK) == ("triton", 32) and "cpu-wall" in d.reason


def test_exact_fingerprint_preferred_then_stale_rows_used_and_said():
    store = _fresh_store()
    store.put_tuning(_row(config=cfg(BLOCK=16), median_ms=0.1, torch_version="1.0", source_hash="0123456789abcdef"))
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.config.BLOCK, d.origin) == (16, "stale")
    assert "STALE" in d.reason and "torch 1.0" in d.reason and "kernel 0123456789abcdef" in d.reason
    # a row measured here wins over the stale one, though slower; another config schema is never used
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 64}), config=cfg(BLOCK=32), median_ms=5.0))
    store.put_tuning(_row(bucket=OP.bucket_key({"rows": 8}), config=cfg(BLOCK=128),
                          config_schema=OP.schema_version + 1))
    dispatch.reset()
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert (d.config.BLOCK, d.origin) == (32, "db-nearest") and "STALE" not in d.reason


def test_upsert_keeps_the_faster_comparable_entry_and_replaces_any_other():
    store = open_store()
    store.put_tuning(_row(median_ms=1.0, config=cfg(BLOCK=32)))
    store.put_tuning(_row(median_ms=2.0, config=cfg(BLOCK=64)))
    assert json.loads(store.all_rows("tuning")[0]["config"])["BLOCK"] == 32
    store.put_tuning(_row(median_ms=0.5, config=cfg(BLOCK=16)))
    assert json.loads(store.all_rows("tuning")[0]["config"])["BLOCK"] == 16
    for change in (dict(source_hash="other"), dict(torch_version="9.9"), dict(sm_count=7), dict(method="do_bench")):
        store.put_tuning(_row(median_ms=9.0, config=cfg(BLOCK=256), **change))      # slower, but re-measured
        row = store.all_rows("tuning")[0]
        assert (row["median_ms"], {k: row[k] for k in change}) == (9.0, change)
    assert len(store.all_rows("tuning")) == 1


def test_env_overrides(monkeypatch):
    store = _fresh_store()
    store.put_tuning(_row())
    x = torch.randn(4, 40)
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "torch")
    dispatch.reset()
    d = dispatch.decision(OP, x, rows=4, cols=40)
    assert (d.impl, d.origin) == ("torch", "env")
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "triton")
    dispatch.reset()
    d = dispatch.decision(OP, x, rows=4, cols=40)
    assert (d.impl, d.origin, d.config.BLOCK) == ("triton", "env", 32)   # config still from the DB
    monkeypatch.setenv("LIGER_RT_DISABLE", "1")
    dispatch.reset()
    assert dispatch.decision(OP, x, rows=4, cols=40).impl == "torch"


def test_bad_env_raises_on_db_hits_too(monkeypatch):
    """The decision path validates every variable, not only the ones it needs."""
    store = _fresh_store()
    store.put_tuning(_row())
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "maybe")
    with pytest.raises(dispatch.env.EnvError, match="LIGER_RT_AUTOTUNE='maybe'"):
        dispatch.decision(OP, torch.randn(4, 40), rows=4, cols=40)
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "0")
    monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "nan")
    with pytest.raises(dispatch.env.EnvError, match="LIGER_RT_DB_TIMEOUT"):
        dispatch.decision(OP, torch.randn(4, 40), rows=4, cols=40)


def test_forcing_an_impl_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("LIGER_RT_IMPL_TOY", "triton")
    dispatch.reset()
    with pytest.raises(RuntimeError, match="LIGER_RT_IMPL_TOY=triton.*available: torch"):
        dispatch.decision(OP, torch.randn(4, 40), rows=4, cols=40)


def test_unknown_op_and_arch_and_dims_list_valid_ones():
    with pytest.raises(ValueError, match="valid ops: rms_norm, swiglu"):
        REGISTRY.get("rmsnorm")
    with pytest.raises(ValueError, match="valid arches: hopper"):
        dispatch.select("toy", arch="h100", rows=1, cols=2)
    with pytest.raises(ValueError, match="takes dims cols,rows"):
        dispatch.select("toy", arch="cpu", rows=1, hidden=2)


def test_autotune_validates_skips_failures_times_one_way_and_persists():
    target = dispatch.current_target("cpu")
    result = autotune.tune(OP, target, torch.float32, {"rows": 4, "cols": 40}, quick=True)
    by_cfg = {(m["config"].get("BLOCK"), m["config"].get("WRONG"), m["config"].get("FAIL")): m
              for m in result["measurements"] if m["impl"] == "triton"}
    assert by_cfg[(64, 1, 0)]["error"].startswith("wrong result")
    assert "out of resources" in by_cfg[(128, 0, 1)]["error"]
    assert all(m["config"]["num_warps"] <= 4 for m in result["measurements"] if m["impl"] == "triton")   # pruned
    assert result["winner"]["config"].get("WRONG", 0) == 0
    assert set(result["best"]) == {"triton", "torch"} and result["baseline_ms"] > 0
    assert {m["method"] for m in result["measurements"]} == {"cpu-wall"}
    assert all(r["host_ms"] > 0 for r in result["best"].values())
    store = open_store()
    assert autotune.persist(OP, result, store, origin="sweep") == 2
    rows = store.all_rows("tuning")
    assert {(r["method"], r["origin"], r["torch_version"], r["sm_count"]) for r in rows} == {
        ("cpu-wall", "sweep", torch.__version__, 2)}
    assert len(store.all_rows("measurements")) == len(result["measurements"])
    dispatch.reset()
    d = dispatch.select("toy", dtype="fp32", arch="cpu", rows=4, cols=40)
    assert d.origin == "db" and d.impl == result["winner"]["impl"]


def test_sweep_measures_every_impl_and_derives_its_own_crossover():
    target = dispatch.current_target("cpu")
    store = open_store()
    plan = [(OP, {"rows": r, "cols": 40}, "fp32", "") for r in (2, 64)]
    out = autotune.sweep(plan, target, store, quick=True)
    assert [sorted(r["best"]) for r in out["results"]] == [["torch", "triton"]] * 2
    (cross,) = out["crossovers"]
    assert cross["method"] == "cpu-wall" and cross["segments"][-1][0] is None
    row = store.crossover_row("toy", "fwdbwd", "cpu", "fp32", OP.static_key({"cols": 40}))
    assert (row["origin"], row["method"], row["torch_version"]) == ("sweep", "cpu-wall", torch.__version__)


def test_online_autotune_on_miss_persists(monkeypatch):
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "1")
    dispatch.reset()
    d = dispatch.decision(OP, torch.randn(4, 40), rows=4, cols=40)
    assert d.origin == "online"
    rows = open_store().all_rows("tuning")
    assert {r["origin"] for r in rows} == {"online"} and len(rows) == 2
    dispatch.reset()
    monkeypatch.delenv("LIGER_RT_AUTOTUNE")
    assert dispatch.decision(OP, torch.randn(4, 40), rows=4, cols=40).origin == "db"


def _crossover_row(**kw):
    base = dict(op="toy", variant="fwdbwd", arch="cpu", dtype="fp32", static_key=OP.static_key({"cols": 40}),
                axis_name="rows", segments=[[8.0, "triton"], [None, "torch"]], margin=0.05, origin="sweep",
                method="cpu-wall", **fingerprint("cpu", source_hash(OP)))
    base.update(kw)
    return base


def test_export_import_round_trip_and_idempotent(tmp_path):
    store = open_store()
    store.put_tuning(_row())
    store.put_tuning(_row(impl="torch", config={}, median_ms=2.0))
    store.put_crossover(_crossover_row())
    store.put_measurements([dict(op="toy", arch="cpu", dtype="fp32", static_key=OP.static_key({"cols": 40}),
                                 impl="torch", config={}, median_ms=2.0, ok=1, method="cpu-wall",
                                 dims=json.dumps({"cols": 40, "rows": 4}))])
    lines = list(dump_jsonl(store))
    assert json.loads(lines[0]) == {"table": "meta", "db_schema": tuning_db.DB_SCHEMA}
    other = open_store(tmp_path / "empty.db")
    assert load_jsonl(other, lines) == {"tuning": 2, "crossover": 1, "measurements": 1}
    assert load_jsonl(other, lines) == {"tuning": 2, "crossover": 1, "measurements": 1}   # again: no change
    assert other.counts() == {"tuning": 2, "crossover": 1, "measurements": 1}
    assert sorted(dump_jsonl(other)) == sorted(lines)


def test_crossover_derivation_with_hysteresis():
    pts = [(8, {"a": 1.0, "b": 2.0}), (32, {"a": 1.0, "b": 0.97}),   # b wins by 3% < margin: a stays
           (128, {"a": 1.0, "b": 0.8}), (512, {"a": 1.0, "b": 0.7})]
    seg = derive_crossover(pts, margin=0.05)
    assert seg == [[64.0, "a"], [None, "b"]]
    assert crossover_pick(seg, 63.9) == "a" and crossover_pick(seg, 64.0) == "b"
    assert crossover_pick([[64.0, "a"], [128.0, "b"]], 500.0) == "b"    # past every bound: the last segment
    assert derive_crossover(pts, margin=0.35) == [[None, "a"]]
    # non-monotone: a, then b, then a again
    seg = derive_crossover([(1, {"a": 1, "b": 2}), (4, {"a": 2, "b": 1}), (16, {"a": 1, "b": 2})])
    assert [s[1] for s in seg] == ["a", "b", "a"]


def test_crossover_drives_dispatch_between_db_buckets():
    store = _fresh_store()
    store.put_crossover(_crossover_row(segments=[[100.0, "triton"], [None, "torch"]]))
    lo = dispatch.select("toy", dtype="fp32", arch="cpu", rows=10, cols=40)
    hi = dispatch.select("toy", dtype="fp32", arch="cpu", rows=1000, cols=40)
    assert (lo.impl, lo.origin, hi.impl, hi.origin) == ("triton", "crossover", "torch", "crossover")
    assert "rows=1000" in hi.reason and "cpu-wall" in hi.reason


def test_validation_tolerates_ulp_outliers_but_not_wrong_elements():
    from liger_rt.numerics import validation_report
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


def test_shipped_defaults_load_valid_and_say_what_they_are():
    """Every shipped row passes validation and says how it was measured; crossovers say which tool
    made them (the hopper one: the sweep, which measured every implementation)."""
    from liger_rt.tuning_db.store import classify, shipped_defaults
    shipped = shipped_defaults()
    for table in ("tuning", "crossover", "measurements"):
        bad = [(r["op"], why) for r in shipped.select(table) for status, why in [classify(table, r)] if status == "bad"]
        assert not bad, bad
    rows = shipped.select("tuning", "arch = ?", ["hopper"])
    assert len(rows) >= 20 and {r["origin"] for r in rows} == {"sweep"}
    # GPU timers only; the wall-clock ones are the ops whose host cost decides (the router)
    assert {r["method"] for r in rows} <= {"cuda-graph", "do_bench", "wall-clock"}
    assert all(r["device_name"] for r in rows)
    crossovers = {r["arch"]: r for r in shipped.select("crossover")}
    assert crossovers["hopper"]["origin"] == "sweep" and crossovers["hopper"]["method"]
    assert crossovers["mi325x"]["origin"] == "published"
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a shipped row never warns
        d = dispatch.select("rms_norm", dtype="bf16", arch="hopper", rows=4096, hidden=4096)
    # the hopper planning profile is an H100: its own shipped row, measured by the sweep's CUDA-graph timer
    assert d.origin == "db" and "shipped" in d.reason and "on h100" in d.reason and "cuda-graph" in d.reason


def test_host_syncing_candidates_are_timed_without_a_capture(monkeypatch):
    """autotune.host_syncs: a fn that trips torch's sync debug mode is reported (timed by do_bench,
    never captured); other errors are not swallowed; the mode is restored either way."""
    from liger_rt import autotune
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def syncs():
        raise RuntimeError("called a synchronizing CUDA operation")

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert autotune.host_syncs(syncs) is True and autotune.host_syncs(lambda: None) is False
    with pytest.raises(RuntimeError, match="illegal memory access"):
        autotune.host_syncs(broken)
    assert modes == ["error", 0] * 3


def test_every_shipped_hopper_row_is_fresh_for_this_code():
    """The shipped rows were swept from the current kernels (a kernel edit that
    changes a launch stales them: re-sweep on the H200, `liger-tune export`, replace the file)."""
    from liger_rt.tuning_db.store import shipped_defaults
    shipped = shipped_defaults()
    rows = shipped.select("tuning", "arch = ?", ["hopper"]) + shipped.select("crossover", "arch = ?", ["hopper"])
    stale = sorted({r["op"] for r in rows if r["source_hash"] != source_hash(REGISTRY.get(r["op"]))})
    assert not stale, f"shipped hopper rows stale for: {stale}"
    for r in shipped.select("tuning", "arch = ?", ["hopper"]):
        REGISTRY.get(r["op"]).parse_config(r["config"], r["impl"])   # raises on a row the spec refuses


def test_sweep_skips_a_case_whose_torch_reference_does_not_fit_and_goes_on(monkeypatch):
    """An out-of-memory in the reference is one skipped case naming the figures; the next case is tuned."""
    from liger_rt.autotune import tuning
    real = tuning.run_case

    def run_case(op, impl, case, cfg):
        if impl.name == "torch" and case.args[0].shape[0] == 64:      # the larger case's reference
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.09 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 22.86 GiB is free. Including ...")
        return real(op, impl, case, cfg)
    monkeypatch.setattr(tuning, "run_case", run_case)
    plan = [(OP, {"rows": r, "cols": 40}, "fp32", "") for r in (64, 2)]
    out = autotune.sweep(plan, dispatch.current_target("cpu"), open_store(), quick=True)
    (skipped,) = out["skipped"]
    assert skipped["dims"] == {"rows": 64, "cols": 40}
    assert skipped["error"] == ("ReferenceTooLarge: the torch reference that validates the candidates does not fit "
                                "this device's memory (it asked for 37.09 GiB, 22.86 GiB was free): no row for this "
                                "shape, dispatch serves it as an untuned one")
    assert [r["dims"] for r in out["results"]] == [{"rows": 2, "cols": 40}]
