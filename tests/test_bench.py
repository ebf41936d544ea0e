"""`liger-tune bench`: the harness (CSV, dataset rows, versions, case loop), the model step on tiny presets on CPU,
the CLI's wiring and its one-line errors without a GPU; the repository's benchmark scripts (benchmarks/)."""
from __future__ import annotations

import ast
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import types
import weakref
from importlib import metadata
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bench_scripts import load_script, one_thread  # noqa: F401  (one_thread: autouse)
from liger_rt.registry import REGISTRY
from liger_rt.tools.bench import bench, harness as H, losses, model as M, norms

RUN_COLS = {"kind", "model_type", "preset", "arm", "run_index", "order", "batch", "seq", "steps", "warmup", "dtype",
            "device", "median_step_ms", "tok_per_s", "peak_alloc_GB", "loss_first", "loss_last", "losses",
            "max_loss_diff", "model_TFLOPs", "params_M", "flags", "torch", "gpu", "liger_kernel", "triton"}
SUMMARY_COLS = {"speedup", "mem_ratio", "loss_curves_overlap", "runs", "tok_per_s_spread"}
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _needs_patchers():
    pytest.importorskip("liger_rt.tools.models")


def _read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _torch_references(monkeypatch):
    """Plumbing tests: liger_rt ops take their torch references (no interpreter kernels, fast).  The
    kernel modules are imported first: triton.jit reads TRITON_INTERPRET when a kernel is defined."""
    from liger_rt import dispatch
    REGISTRY.ops()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.reset()


def _no_liger_kernel(monkeypatch):
    monkeypatch.setattr(M.LigerKernelPatch, "supported", staticmethod(lambda mt: (False, "not installed here")))


def _fake_metadata(monkeypatch, **installed):
    real = metadata.version

    def version(dist):
        if dist in installed:
            if installed[dist] is None:
                raise metadata.PackageNotFoundError(dist)
            return installed[dist]
        return real(dist)
    monkeypatch.setattr(metadata, "version", version)


# -- bench model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["qwen3", "lfm2"])
def test_bench_model_cpu_tiny(model_type, tmp_path, monkeypatch):
    _needs_patchers()
    _no_liger_kernel(monkeypatch)
    out = tmp_path / "model.csv"
    res = CliRunner().invoke(bench, ["model", "--model", model_type, "--preset", "tiny", "--steps", "1",
                                     "--warmup", "1", "--batch", "2", "--seq", "12", "--device", "cpu",
                                     "--dtype", "fp32", "--csv", str(out), "--data", str(tmp_path / "data")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    data = _read(tmp_path / "data" / "models.csv")
    assert list(data[0]) == list(H.DATASET_COLUMNS) and {r["kind"] for r in data} == {"model"}
    assert [(r["arm"], r["metric"]) for r in data] == [(a, "tok_s") for a in ("eager", "liger_rt", "liger_rt", "eager")]
    assert {r["shape"] for r in data} == {"batch=2;seq=12"} and len({r["run_id"] for r in data}) == 1
    assert all(r["gpu"] == "cpu" and r["dtype"] == "fp32" and "loss curve overlaps" in r["notes"] for r in data)
    rows = _read(out)
    assert RUN_COLS <= set(rows[0]) and SUMMARY_COLS <= set(rows[0])
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["arm"] for r in runs] == ["baseline", "liger_rt", "liger_rt", "baseline"]
    assert [int(r["run_index"]) for r in runs] == [0, 1, 2, 3]
    assert runs[0]["order"] == "baseline>liger_rt>liger_rt>baseline"
    assert all(r["peak_alloc_GB"] == "n/a" for r in rows)          # CPU: no allocator statistics
    curves = [json.loads(r["losses"]) for r in runs]
    assert all(len(c) == 2 for c in curves)                          # warmup + measured steps
    base = curves[0]
    assert curves[3] == base                                         # same seed, same weights, same batch
    for c in curves[1:3]:                                            # fp32: patched must track baseline
        assert max(abs(a - b) for a, b in zip(c, base)) <= 1e-3 * abs(base[0])
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert set(summ) == {"baseline", "liger_rt"} and summ["liger_rt"]["loss_curves_overlap"] == "True"
    assert "tok/s" in res.output and "n/a" in res.output
    from liger_rt.patch import describe                              # nothing left patched behind it
    from liger_rt.tools.models import build_model
    assert describe(model_type) is None and describe(build_model(f"{model_type}-tiny")) is None


def test_run_model_bench_api_and_liger_kernel_arm_is_isolated(monkeypatch):
    """With a (fake) Liger-Kernel present: six runs, ABCCBA, and its module-level mutations are undone."""
    _needs_patchers()
    _torch_references(monkeypatch)
    from transformers.models.qwen3 import modeling_qwen3
    orig_rope, orig_norm = modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm

    def fake_apply(model):                       # what apply_liger_kernel_to_qwen3 does, numerically neutral
        modeling_qwen3.apply_rotary_pos_emb = lambda *a, **k: orig_rope(*a, **k)
        modeling_qwen3.Qwen3RMSNorm = type("FakeLigerRMSNorm", (orig_norm,), {})
        modeling_qwen3.Qwen3Model.liger_marker = True
        seen.append(model)

    seen = []
    pkg = types.ModuleType("liger_kernel")
    tr = types.ModuleType("liger_kernel.transformers")
    mp = types.ModuleType("liger_kernel.transformers.monkey_patch")
    mp.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen3": fake_apply}
    mp._apply_liger_kernel_to_instance = lambda model: fake_apply(model)
    for name, mod in [("liger_kernel", pkg), ("liger_kernel.transformers", tr),
                      ("liger_kernel.transformers.monkey_patch", mp)]:
        monkeypatch.setitem(sys.modules, name, mod)
    entered = []

    @contextlib.contextmanager
    def arm_context(arm):                        # entered around each run, left before the next
        entered.append(arm)
        yield
        entered.append("/" + arm)

    rows = M.run_model_bench("qwen3", "qwen3-tiny", batch=2, seq=8, steps=1, warmup=1, dtype="fp32",
                             device="cpu", echo=None, arm_context=arm_context)
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["arm"] for r in runs] == ["baseline", "liger_rt", "liger_kernel", "liger_kernel", "liger_rt", "baseline"]
    assert entered == [x for r in runs for x in (r["arm"], "/" + r["arm"])]
    assert len(seen) == 2
    assert modeling_qwen3.apply_rotary_pos_emb is orig_rope and modeling_qwen3.Qwen3RMSNorm is orig_norm
    assert not hasattr(modeling_qwen3.Qwen3Model, "liger_marker")
    assert runs[-1]["losses"] == runs[0]["losses"]
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert summ["liger_kernel"]["runs"] == 2 and summ["baseline"]["speedup"] == 1.0


def test_liger_kernel_arm_failure_is_reported_not_fatal(monkeypatch):
    _needs_patchers()
    _torch_references(monkeypatch)
    monkeypatch.setattr(M.LigerKernelPatch, "supported", staticmethod(lambda mt: (True, "")))

    def boom(self, model):
        raise RuntimeError("peer kernel exploded")
    monkeypatch.setattr(M.LigerKernelPatch, "apply", boom)
    rows = M.run_model_bench("qwen3", "tiny", batch=1, seq=8, steps=1, warmup=0, dtype="fp32", device="cpu",
                             echo=None)
    assert [r["arm"] for r in rows if r["kind"] == "run"] == ["baseline", "liger_rt", "liger_rt", "baseline"]
    assert "peer kernel exploded" in rows[0]["liger_kernel_note"]


@pytest.mark.slow
def test_compiled_arms_have_no_graph_break_and_track_baseline(monkeypatch):
    """torch.compile (aot_eager) of the baseline and of a tiny Qwen3 patched with the fused loss, the
    liger_rt ops through the interpreter (their custom ops), under either compile policy: zero graph
    breaks, compile time kept out of the timed steps, loss curves on the baseline's."""
    _needs_patchers()
    import liger_rt.dispatch as S
    taken, real = [], S.compiler_takes
    monkeypatch.setattr(S, "compiler_takes", lambda op: taken.append(real(op)) or taken[-1])
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "fuse")
    rows = M.run_model_bench("qwen3", "tiny", batch=2, seq=8, steps=1, warmup=1, dtype="fp32", device="cpu", layers=1,
                             arms=("baseline", "baseline+compile", "liger_rt+compile+kernels", "liger_rt+compile+fuse"),
                             compile_backend="aot_eager", echo=None)
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["arm"] for r in runs] == ["baseline", "baseline+compile", "liger_rt+compile+kernels",
                                        "liger_rt+compile+fuse", "liger_rt+compile+fuse", "liger_rt+compile+kernels",
                                        "baseline+compile", "baseline"]
    assert [r["compile_policy"] for r in runs[1:7]] == ["fuse", "kernels", "fuse", "fuse", "kernels", "fuse"]
    assert True in taken and False in taken and os.environ["LIGER_RT_COMPILE_POLICY"] == "fuse"  # restored
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert summ["liger_rt+compile+fuse"]["loss_curves_overlap"] and summ["liger_rt+compile+fuse"]["graph_breaks"] == 0
    for r in runs[1:7]:
        assert r["error"] == "" and r["graph_breaks"] == 0 and r["graphs"] >= 1, r
        assert r["compile_s"] > 0 and r["compile_backend"] == "aot_eager" and r["compile_mode"] == "default"
        assert r["tok_per_s"] > 0 and len(r["losses"]) == 2
    assert runs[0]["graph_breaks"] is None and runs[0]["compile_s"] is None
    assert summ["liger_rt+compile+kernels"]["loss_curves_overlap"]
    assert summ["baseline+compile"]["vs_baseline_compile"] == 1.0
    assert summ["liger_rt+compile+kernels"]["graph_breaks"] == 0 and "breaks" in M.format_summary(rows)
    from torch._dynamo.utils import counters                       # the counter the rows read does count breaks

    def f(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()
    M._reset_dynamo()
    torch.compile(f, backend="eager")(torch.ones(3))
    stats = M.compile_stats("baseline+compile")
    assert stats["graph_breaks"] == 1 and stats["graphs"] == 2 and counters["graph_break"]
    M._reset_dynamo()


@pytest.mark.slow
def test_failing_compile_is_a_row_not_the_end_of_the_run(monkeypatch, tmp_path):
    _needs_patchers()
    _torch_references(monkeypatch)
    _no_liger_kernel(monkeypatch)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("inductor fell over")
    rows = M.run_model_bench("qwen3", "tiny", batch=1, seq=8, steps=1, warmup=1, dtype="fp32", device="cpu",
                             compile=True, compile_backend=broken_backend, echo=None)
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["arm"] for r in runs] == ["baseline", "liger_rt", "baseline+compile", "liger_rt+compile", "liger_rt",
                                        "baseline"]                  # a failed arm's repeat is skipped
    for r in runs[2:4]:
        assert "inductor fell over" in r["error"] and r["tok_per_s"] is None
        assert r["compile_backend"] == "broken_backend"
    assert all(r["error"] == "" and r["tok_per_s"] > 0 for r in runs if "compile" not in r["arm"])
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert summ["liger_rt+compile"]["runs"] == 0 and "inductor fell over" in summ["liger_rt+compile"]["error"]
    assert summ["liger_rt"]["loss_curves_overlap"] and summ["liger_rt"]["error"] == ""
    text = M.format_summary(rows)
    assert "baseline+compile FAILED: BackendCompilerFailed" in text and "WARNING" not in text
    path = H.write_csv(rows, tmp_path / "m.csv")
    header = list(_read(path)[0])
    assert header.index("error") > header.index("max_loss_diff") and header.index("graph_breaks") > header.index("mfu")


@pytest.mark.parametrize("args, needle", [
    (["--compile", "--compile-backend", "nope"], "unknown compile backend 'nope'; valid: "),
    (["--compile", "--warmup", "0"], "the compiled arms need --warmup >= 1"),
    (["--compile", "--compile-mode", "max"], "Invalid value for '--compile-mode'"),
    (["--shape", "4x"], "shape '4x': expected BATCHxSEQ"),
])
def test_bench_model_compile_and_shape_arguments(args, needle):
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3", "--device", "cpu", *args])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert M.parse_shapes(["4x2048,1x512", "1X512"]) == [(4, 2048), (1, 512)]


def test_layers_override_cuts_attention_layers():
    p = M.bench_preset("lfm2_moe", "lfm2-8b-a1b", 8, None)
    assert p.layers == 8 and p.attention_layers == (2, 6) and p.name == "lfm2-8b-a1b-8L"
    p = M.bench_preset("lfm2_moe", "lfm2-8b-a1b", 8, (2, 5))
    assert p.attention_layers == (2, 5) and p.dense_layers == 2


@pytest.mark.parametrize("args, needle", [
    (["--model", "qwen3", "--preset", "no-such-preset"], "unknown preset 'no-such-preset'; valid presets"),
    (["--model", "gpt2"], "unknown model type 'gpt2'; valid: qwen3"),
    (["--model", "lfm2", "--preset", "qwen3-1.7b"], "is a qwen3 preset, not lfm2"),
    (["--model", "qwen3", "--flags", "rms_norm=maybe"], "value must be 0/1"),
    (["--model", "qwen3", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["--model", "lfm2", "--attention-layers", "1,9", "--layers", "3"], "attention layers [9] outside 0..2"),
    (["--model", "qwen3", "--device", "tpu"], "Invalid value for '--device'"),
    (["--model", "qwen3", "--flags", "no_such_flag=1"], "unknown flag"),
])
def test_bench_model_bad_arguments_are_clear(args, needle):
    res = CliRunner().invoke(bench, ["model", *args, "--device", "cpu", "--steps", "1"] if "--device" not in args
                             else ["model", *args])
    assert res.exit_code != 0
    assert needle in res.output, res.output
    assert not isinstance(res.exception, (AttributeError, KeyError, TypeError)), repr(res.exception)


def test_bench_model_cuda_requested_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3", "--device", "cuda"])
    assert res.exit_code != 0 and "no CUDA/ROCm GPU is available" in res.output


def test_bench_model_needs_a_model_type():
    res = CliRunner().invoke(bench, ["model", "--preset", "qwen3-1.7b"])
    assert res.exit_code == 2 and "Missing option '--model'" in res.output, res.output


def test_model_records_name_the_extra_flags_and_the_compiled_kind():
    """One record per measured run and metric; a failed run has none; kind model_compiled once a compiled arm ran."""
    run = {"kind": "run", "run_index": 0, "steps": 3, "warmup": 1, "layers": 28,
           "flags": "fused_linear_cross_entropy=1,rope=1", "preset": "qwen3-1.7b", "batch": 4, "seq": 2048, "dtype": "bf16", "order": "baseline>liger_rt",
           "config": "", "loss_first": 10.0, "max_loss_diff": 0.0, "tok_per_s": 1000.0, "peak_alloc_GB": 20.0,
           "mfu": 0.4, "compile_s": 12.0, "graph_breaks": 0, "compile_mode": "default", "compile_policy": "fuse",
           "error": ""}
    rows = [{**run, "arm": "baseline"}, {**run, "arm": "liger_rt+compile", "run_index": 1, "max_loss_diff": 1.0},
            {**run, "arm": "liger_kernel", "error": "RuntimeError: no"}]
    recs = M.model_records(rows)
    assert {r["kind"] for r in recs} == {"model_compiled"} and {r["name"] for r in recs} == {"qwen3-1.7b+rope"}
    assert [(r["arm"], r["metric"], r["method"]) for r in recs] == [
        ("eager", "tok_s", "median step"), ("eager", "peak_gb", "max allocated"),
        ("eager", "frac_ceiling", "model FLOPs / bf16 matmul ceiling"),
        *[("liger_rt+torch_compile", m, h) for m, h in (("tok_s", "median step"), ("peak_gb", "max allocated"),
                                                        ("frac_ceiling", "model FLOPs / bf16 matmul ceiling"),
                                                        ("compile_s", "warm-up time beyond steady steps"),
                                                        ("graph_breaks", "dynamo graph_break counter"))]]
    assert all(r["shape"] == {"batch": 4, "seq": 2048} for r in recs)
    assert "loss curve overlaps" in recs[0]["notes"] and "DIFFERS FROM" in recs[-1]["notes"]
    assert "28 layers, 1+3 steps, #2 of order baseline>liger_rt" in recs[-1]["notes"]
    assert M.model_records(rows[:1])[0]["kind"] == "model"


def test_parse_helpers():
    assert M.parse_flags("rms_norm=1, swiglu=off,rope") == {"rms_norm": True, "swiglu": False, "rope": True}
    assert M.parse_config("tie_word_embeddings=true,rope_theta=1e6,name=x") == {
        "tie_word_embeddings": True, "rope_theta": 1e6, "name": "x"}
    with pytest.raises(ValueError):
        M.parse_config("oops")


# -- CSV and versions ------------------------------------------------------------------------------

def test_versions_read_peers_from_package_metadata(monkeypatch):
    _fake_metadata(monkeypatch, **{"liger-kernel": "0.8.5", "transformers": None})
    v = H.versions()
    assert v["liger_kernel"] == "0.8.5" and v["transformers"] == "not installed"
    assert v["torch"] == metadata.version("torch") and v["gpu"] and v["date"]
    assert "?" not in v.values()


def test_write_csv_records_versions(tmp_path, monkeypatch):
    _fake_metadata(monkeypatch, **{"liger-kernel": "0.8.5"})
    path = tmp_path / "norms_cpu.csv"
    first = [{"op": "rms_norm", "case": "rows=8", "impl": "eager", "ms": 1.0, "config": {"a": 1}, "err": None},
             {"op": "rms_norm", "case": "rows=16", "impl": "eager", "ms": 2.0}]
    H.write_csv(first, path)
    rows = _read(path)
    assert [r["liger_kernel"] for r in rows] == ["0.8.5", "0.8.5"] and rows[0]["config"] == '{"a":1}'
    assert rows[0]["err"] == "n/a" and rows[1]["err"] == ""
    H.write_csv([{"op": "rms_norm", "case": "rows=32", "ms": 4.0}], path)        # a new run replaces the file
    assert [r["case"] for r in _read(path)] == ["rows=32"]


def test_dataset_rows_carry_versions_and_append_keeps_one_header(tmp_path, monkeypatch):
    """One row per measurement in DATASET_COLUMNS order: a peer arm's version from package metadata (never "?"),
    the checkout's commit, one run id; appending twice keeps one header; a foreign header is refused."""
    _fake_metadata(monkeypatch, **{"liger-kernel": "0.8.5", "trl": None})
    rec = {"kind": "norms", "name": "rms_norm.fwd", "shape": {"rows": 8, "hidden": 64}, "arm": "liger_kernel",
           "metric": "ms", "value": 0.5, "unit": "ms", "dtype": "bf16", "method": "do_bench", "notes": ""}
    run_id = H.new_run_id()
    rows = H.dataset_rows([rec, {**rec, "arm": "trl"}, {**rec, "arm": "liger_rt"}], run_id)
    assert [list(r) for r in rows] == [list(H.DATASET_COLUMNS)] * 3
    assert rows[0]["shape"] == "rows=8;hidden=64" and rows[0]["peer_version"] == "0.8.5"
    assert rows[1]["peer_version"] == "" and rows[2]["peer_version"] == ""
    assert rows[0]["torch"] == metadata.version("torch") and rows[0]["gpu"] and rows[0]["run_id"] == run_id
    commit, dirty = H.git_commit()
    assert rows[0]["commit"] == commit + ("-dirty" if dirty else "") and "?" not in rows[0].values()
    path = tmp_path / "data" / "kernels.csv"
    H.append_dataset(path, rows[:1])
    H.append_dataset(path, rows[1:])
    text = path.read_text().splitlines()
    assert text[0] == ",".join(H.DATASET_COLUMNS) and len(text) == 4
    assert [r["arm"] for r in _read(path)] == ["liger_kernel", "trl", "liger_rt"]
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header is not the dataset's columns"):
        H.append_dataset(other, rows)
    with pytest.raises(ValueError, match=r"dataset record keys \['gpu'\]"):
        H.dataset_rows([{**rec, "gpu": "x"}], run_id)


# -- kernel cases ----------------------------------------------------------------------------------

def test_counterbalanced_reverses_the_order_every_other_round(monkeypatch):
    import triton.testing
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(fn()) or float(len(calls)))
    times = H.counterbalanced({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, 3, warmup=1, rep=2)
    assert calls == list("abccbaabc")
    assert times == {"a": [1.0, 6.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 4.0, 9.0]}


def test_an_arm_whose_capture_failed_is_not_captured_again(monkeypatch):
    """A failed CUDA-graph capture never gives its memory pool back, so the bench captures a failing arm once per
    process: later cases of that arm keep their wall time with no device time and say why; other arms still try."""
    from liger_rt import autotune
    from liger_rt.autotune import timing
    captured = []

    def graph_ms(fn):
        captured.append(fn)
        if fn is fails:
            raise RuntimeError("operation failed due to a previous error during capture")
        return 0.5

    def fails():
        return None

    def works():
        return None

    monkeypatch.setattr(timing, "do_bench", lambda fn, **kw: 2.0)
    monkeypatch.setattr(autotune, "graph_ms", graph_ms)
    monkeypatch.setattr(autotune, "host_syncs", lambda fn: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(H, "_UNCAPTURABLE", {})
    assert H.time_fn(fails, "cuda", arm=("moe_experts", "liger_kernel")) == (2.0, None, "none: capture failed (RuntimeError)")
    assert H.time_fn(fails, "cuda", arm=("moe_experts", "liger_kernel")) == (
        2.0, None, "none: capture failed earlier (RuntimeError)")
    assert H.time_fn(works, "cuda", arm=("moe_experts", "liger_rt")) == (2.0, 0.5, "cuda-graph")
    assert captured == [fails, works]


def _oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB")


def test_an_arm_that_syncs_with_the_host_is_never_captured(monkeypatch):
    """Liger-Kernel's losses call .item(): their capture would fail and keep its pool, so an arm that makes a
    synchronizing call under the sync debug mode keeps its wall time and is not captured, nor is one whose sync check
    itself fails (an OOM); the allocator's cache is emptied after each, and a later arm is still captured."""
    from liger_rt import autotune
    from liger_rt.autotune import timing
    captured, checked, emptied = [], [], []

    def host_syncs(fn):
        checked.append(fn)
        if fn is oom:
            raise _oom()
        return fn is syncs

    def syncs():
        return None

    def oom():
        return None

    def works():
        return None

    monkeypatch.setattr(timing, "do_bench", lambda fn, **kw: 2.0)
    monkeypatch.setattr(autotune, "graph_ms", lambda fn: captured.append(fn) or 0.5)
    monkeypatch.setattr(autotune, "host_syncs", host_syncs)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(H, "_UNCAPTURABLE", {})
    assert H.time_fn(syncs, "cuda", arm=("cross_entropy", "liger_kernel")) == (
        2.0, None, "none: synchronizes with the host, not captured")
    assert H.time_fn(oom, "cuda", arm=("cross_entropy", "compile")) == (
        2.0, None, "none: sync check failed (OutOfMemoryError)")
    assert H.time_fn(works, "cuda", arm=("cross_entropy", "liger_rt")) == (2.0, 0.5, "cuda-graph")
    assert checked == [syncs, oom, works] and captured == [works] and len(emptied) == 3
    assert H._UNCAPTURABLE == {}                    # nothing failed a capture: nothing holds a pool


def test_release_collects_resets_compiled_caches_and_empties_the_cache_without_raising(monkeypatch):
    calls, lines = [], []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("dynamo.reset"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    box = [torch.ones(4)]
    box.append(box)                                 # a tensor only a collection frees
    ref = weakref.ref(box[0])
    del box
    H.release("cpu", echo=lines.append)
    assert ref() is None and calls == []
    H.release("cuda", compiled=True, echo=lines.append)
    assert calls == ["dynamo.reset", "empty_cache"] and lines == []

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "empty_cache", broken)
    H.release("cuda", echo=lines.append)            # never raises: the next arm reports a broken context
    assert lines == ["  (releasing memory failed: RuntimeError: CUDA error: an illegal memory access was encountered)"]


def test_an_oom_anywhere_in_an_arm_is_its_error_and_the_next_arm_starts_clean(monkeypatch):
    """H100, cross_entropy rows=8192 vocab=151936: an OOM while an arm runs, after its gradients (in its error or
    config) or while its inputs are copied is that arm's rows' error; the arms after it are measured, and nothing a
    failed arm made (its copy of the inputs, kept alive by an output's autograd graph) is alive when the next arm
    copies its inputs."""
    case = losses.build(dict(op="cross_entropy", rows=4, vocab=64), "fp32", "cpu", echo=lambda s: None)
    logits = case.inputs[0]
    made = []                                       # (arm, weak reference to the logits copy it was given)

    def oom_running(z, y):
        made.append(("oom_running", weakref.ref(z)))
        _ = z * 2
        raise _oom()

    def oom_after_grads(z, y):
        made.append(("oom_after_grads", weakref.ref(z)))
        return torch.nn.functional.cross_entropy(z, y)

    def desc():
        raise _oom()

    case.peers |= {"oom_running": H.Arm(oom_running), "oom_after_grads": H.Arm(oom_after_grads, desc),
                   "oom_copying": H.Arm(lambda z, y: torch.nn.functional.cross_entropy(z, y))}
    names = list(H._arms(case, "fp32", False))
    real_clone, alive, released = torch.Tensor.clone, [], []

    def clone(self, *args, **kw):                   # the harness copies the case's logits once per arm
        if self.data_ptr() == logits.data_ptr():
            alive.append([n for n, r in made if r() is not None])
            if len(alive) == names.index("oom_copying") + 1:
                raise _oom()
        return real_clone(self, *args, **kw)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    real_release = H.release
    monkeypatch.setattr(H, "release", lambda *a, **kw: released.append(a) or real_release(*a, **kw))
    lines = []
    rows = H.measure_case(case, dtype="fp32", device="cpu", quick=True, compile_=False, ceilings=None,
                          echo=lines.append)
    by = {r["impl"]: r for r in rows}
    assert list(by) == names and len(alive) == len(names)
    for name in ("oom_running", "oom_after_grads", "oom_copying"):
        assert by[name]["error"].startswith("OutOfMemoryError: CUDA out of memory") and "ms" not in by[name]
        assert any(line.startswith(f"  cross_entropy rows=4,vocab=64,dtype=fp32 {name}: OutOfMemoryError")
                   for line in lines), lines
    for name in ("eager", "liger_rt_inplace", "liger_rt"):
        assert by[name]["ms"] > 0 and by[name]["err_grad"] < 1e-5 and not by[name]["error"], by[name]
    assert alive == [[]] * len(names), alive
    assert len(released) == 1 + len(names)          # after the reference and after every arm


def test_a_reference_that_does_not_fit_leaves_the_arms_timed_without_errors(monkeypatch):
    case = losses.build(dict(op="cross_entropy", rows=4, vocab=64), "fp32", "cpu", echo=lambda s: None)

    def ref(z, y):
        raise _oom()
    case.ref = ref
    lines = []
    rows = H.measure_case(case, dtype="fp32", device="cpu", quick=True, compile_=False, ceilings=None,
                          echo=lines.append)
    by = {r["impl"]: r for r in rows}
    assert by["liger_rt"]["ms"] > 0 and by["liger_rt"]["err_out"] is None and by["liger_rt"]["err_grad"] is None
    assert by["eager"]["ms"] > 0 and not by["eager"]["error"]
    assert lines[0] == ("  cross_entropy rows=4,vocab=64,dtype=fp32 reference: OutOfMemoryError: CUDA out of memory. "
                        "Tried to allocate 2.32 GiB (no errors against it)")


def test_a_case_that_cannot_be_built_is_a_row_and_each_case_is_released_after_its_rounds(monkeypatch):
    """A case whose inputs do not fit is one error row and the run goes on; after every case (all its rounds, which
    share its compiles) torch.compile's caches and the allocator's free blocks are given back."""
    specs = [dict(op="cross_entropy", rows=8192, vocab=151936), dict(op="cross_entropy", rows=4, vocab=64)]
    monkeypatch.setattr(losses, "SPECS", specs)
    real_build, events = losses.build, []

    def build(spec, dtype, device, echo=print):
        if spec["rows"] == 8192:
            raise _oom()
        return real_build(spec, dtype, device, echo)

    def measure_case(case, **kw):
        events.append(f"measure rows={case.spec['rows']}")
        return [{"op": case.op, "case": "rows=4", "impl": "liger_rt", "pass": "fwdbwd", "ms": 1.0, "error": "",
                 "config": "triton {} (heuristic)"}]
    monkeypatch.setattr(losses, "build", build)
    monkeypatch.setattr(H, "measure_case", measure_case)
    monkeypatch.setattr(H, "release", lambda device, compiled=False, echo=print: events.append(
        f"release {device} compiled={compiled}"))
    cases, lines = [], []
    rows = H.run_kernels(["cross_entropy"], dtype="bf16", device="cpu", echo=lines.append, rounds=2,
                         on_case=cases.append)
    assert events == ["release cpu compiled=True", "measure rows=4", "measure rows=4", "release cpu compiled=True"]
    failed = rows[0]
    assert (failed["impl"], failed["pass"], failed["case"]) == ("(case)", "build", "rows=8192,vocab=151936,dtype=bf16")
    assert failed["error"].startswith("OutOfMemoryError: CUDA out of memory") and "round" not in failed
    assert [len(c) for c in cases] == [1, 1, 1] and [r.get("round") for r in rows] == [None, 1, 2]
    assert "  cross_entropy rows=8192,vocab=151936,dtype=bf16: the case could not be built: OutOfMemoryError: " \
           "CUDA out of memory. Tried to allocate 2.32 GiB" in lines


def test_decision_text_writes_nested_configs_as_json():
    """The config column of a dispatched arm: MoE's config nests one launch per GEMM family (H200,
    2026-12-03: `dict(config)` left them objects and every moe_experts arm failed on json.dumps)."""
    from liger_rt import dispatch
    d = dispatch.select("moe_experts", arch="hopper", dtype="bf16", experts=32, top_k=4, hidden=2048,
                        intermediate=1792, tokens=4096)
    impl, rest = H.decision_text(d).split(" ", 1)
    text, origin = rest.rsplit(" ", 1)
    assert impl == d.impl and origin.startswith("(")
    if impl == "triton":
        assert json.loads(text)["wgrad"]["BLOCK_M"] == d.config.wgrad.BLOCK_M
    d = dispatch.select("rms_norm", arch="hopper", dtype="bf16", rows=4096, hidden=4096)
    assert json.loads(H.decision_text(d).split(" ", 1)[1].rsplit(" ", 1)[0]) == dict(d.config)


def test_select_specs():
    plan = H.select_specs([], [], quick=True)
    assert list(plan) == list(H.FAMILIES) and all(s["quick"] for v in plan.values() for s in v)
    assert [s["op"] for s in H.select_specs(["rms_norm"], [], False)["norms"]] == ["rms_norm"] * 4
    assert [s["op"] for s in H.select_specs(["norms"], ["op=layer_norm"], False)["norms"]] == ["layer_norm"] * 4
    moe = H.select_specs(["moe_experts"], ["experts=32", "tokens=512,4096"], False)["moe"]
    assert sorted((s["tokens"], s["routing"]) for s in moe) == [(512, "skewed"), (512, "uniform"), (4096, "skewed"),
                                                                (4096, "uniform")]
    assert {s["op"] for s in H.select_specs(["moe"], [], False)["moe"]} == {"moe_experts", "moe_router"}
    with pytest.raises(ValueError, match=r"unknown benchmark 'rmsnorm'; valid: norms, gated_mlp, losses, lfm2_ops, "
                                         r"moe, rms_norm"):
        H.select_specs(["rmsnorm"], [], False)
    with pytest.raises(ValueError, match=r"--where colour: no such field .*fields: .*hidden"):
        H.select_specs(["norms"], ["colour=red"], False)
    with pytest.raises(ValueError, match="no case matches"):
        H.select_specs(["norms"], ["rows=3"], False)


def test_measure_case_times_every_arm_against_an_fp32_reference():
    """rms_norm through the interpreter (fp32): the forced arm runs under LIGER_RT_IMPL_RMS_NORM=triton,
    every arm's error is taken against LlamaRMSNorm.forward in fp32, a missing peer is no arm."""
    spec = dict(op="rms_norm", rows=4, hidden=32)
    case = norms.build(spec, "fp32", "cpu", echo=lambda s: None)
    case.peers["broken"] = H.Arm(lambda x, w: x.view(3, -1), "a peer that cannot take the shape")
    rows = H.measure_case(case, dtype="fp32", device="cpu", quick=True, compile_=False, ceilings=None,
                          echo=lambda s: None)
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert set(by) == {(a, p) for a in ("eager", "broken", "triton", "liger_rt") for p in ("fwd", "fwdbwd")}
    assert by["broken", "fwd"]["error"].startswith("RuntimeError") and "ms" not in by["broken", "fwd"]
    assert by["triton", "fwd"]["config"].startswith("triton ") and by["triton", "fwd"]["config"].endswith("(env)")
    for impl in ("triton", "liger_rt"):
        r = by[impl, "fwdbwd"]
        assert r["ms"] > 0 and r["err_out"] < 1e-5 and r["err_grad"] < 1e-5 and r["GBps"] > 0
        assert r["ms_method"] == "cpu-wall" and r["dev_ms_method"] == "none: cpu" and r["case"] == "rows=4,hidden=32,dtype=fp32"
    assert by["eager", "fwd"]["vs_eager"] == 1.0 and by["eager", "fwd"]["err_out"] == 0.0
    lines = H.verdicts(rows)
    assert lines[0].startswith("rms_norm rows=4,hidden=32,dtype=fp32 fwd: liger_rt ")
    assert "the best peer (eager)" in lines[0]
    from liger_rt import env
    assert env.impl_override("rms_norm") is None                      # the override is gone after the arm
    recs = H.kernel_records(rows)                                      # the failed peer has none
    assert {r["arm"] for r in recs} == {"eager", "triton", "liger_rt"} and {r["kind"] for r in recs} == {"norms"}
    mine = {(r["name"], r["metric"]): r for r in recs if r["arm"] == "liger_rt"}
    assert set(mine) == {(f"rms_norm.{p}", m) for p in ("fwd", "fwdbwd") for m in ("ms", "gbps")}
    assert mine["rms_norm.fwd", "ms"]["value"] == by["liger_rt", "fwd"]["ms"]
    assert mine["rms_norm.fwd", "gbps"]["unit"] == "GB/s" and mine["rms_norm.fwd", "ms"]["shape"] == "rows=4;hidden=32"
    assert mine["rms_norm.fwd", "ms"]["notes"].startswith("config triton ")


def test_measure_case_reverse_arms_times_the_arms_last_to_first():
    """--reverse-arms: the same arms and results, timed in the opposite order, and the rows say which."""
    spec = dict(op="rms_norm", rows=3, hidden=24)
    runs = {rev: H.measure_case(norms.build(spec, "fp32", "cpu", echo=lambda s: None), dtype="fp32", device="cpu",
                                quick=True, compile_=False, ceilings=None, echo=lambda s: None, reverse_arms=rev)
            for rev in (False, True)}
    order = {rev: list(dict.fromkeys(r["impl"] for r in rows)) for rev, rows in runs.items()}
    assert order[False][0] == "eager" and order[True] == order[False][::-1], order
    assert {r["arm_order"] for r in runs[True]} == {"reversed"} and {r["arm_order"] for r in runs[False]} == {"listed"}
    for rev in (False, True):
        by = {(r["impl"], r["pass"]): r for r in runs[rev]}
        assert by["liger_rt", "fwdbwd"]["err_grad"] < 1e-5 and by["eager", "fwd"]["vs_eager"] == 1.0


def test_run_kernels_writes_the_csv_and_hands_each_case_on(tmp_path, monkeypatch):
    _torch_references(monkeypatch)
    _fake_metadata(monkeypatch, **{"liger-kernel": None})
    monkeypatch.setattr(norms, "SPECS", [dict(op="rms_norm", rows=4, hidden=16, quick=True),
                                         dict(op="layer_norm", rows=4, hidden=16, quick=True)])
    cases = []
    path = tmp_path / "rows.csv"
    rows = H.run_kernels(["norms"], quick=True, dtype="fp32", device="cpu", csv_path=path, echo=lambda s: None,
                         on_case=cases.append)
    csv_rows = _read(path)
    assert len(csv_rows) == len(rows) and {r["op"] for r in csv_rows} == {"rms_norm", "layer_norm"}
    assert [{r["op"] for r in c} for c in cases] == [{"rms_norm"}, {"layer_norm"}] and sum(map(len, cases)) == len(rows)
    assert all(r["liger_kernel"] == "not installed" and r["quick"] == "True" for r in csv_rows)
    ok = [r for r in csv_rows if r["impl"] == "liger_rt"]
    assert ok and all(r["ms_method"] == "cpu-wall" and float(r["ms"]) > 0 for r in ok)
    assert all(r["error"].startswith("RuntimeError: LIGER_RT_IMPL_") for r in csv_rows if r["impl"] == "triton")


def test_run_kernels_rounds_alternate_the_arm_order_and_the_verdict_takes_medians(monkeypatch):
    """--rounds 3: each case measured three times in one process (listed, reversed, listed order), each round handed
    on with its number, the dataset notes naming it, and the verdict on each arm's median, not its last round."""
    _torch_references(monkeypatch)
    _fake_metadata(monkeypatch, **{"liger-kernel": None})
    monkeypatch.setattr(norms, "SPECS", [dict(op="rms_norm", rows=4, hidden=16, quick=True)])
    walls = iter([1.0, 2.0, 9.0, 4.0, 3.0, 5.0, 0.5, 6.0, 7.0] * 9)     # one per (round, arm, pass) in timing order
    monkeypatch.setattr(H, "time_fn", lambda fn, device, quick=False, arm=None: (next(walls), None, "none: cpu"))
    cases, lines = [], []
    rows = H.run_kernels(["rms_norm"], quick=True, dtype="fp32", device="cpu", echo=lines.append, rounds=3,
                         on_case=cases.append)
    assert [{(r["round"], r["rounds"]) for r in c} for c in cases] == [{(1, 3)}, {(2, 3)}, {(3, 3)}]
    orders = [list(dict.fromkeys(r["impl"] for r in c)) for c in cases]
    assert orders[1] == orders[0][::-1] and orders[2] == orders[0], orders
    notes = {r["notes"] for r in H.kernel_records(cases[1]) if r["arm"] == "eager"}
    assert notes == {"arms timed last to first; round 2 of 3"}, notes
    fwd = {impl: sorted(r["ms"] for r in rows if r["impl"] == impl and r["pass"] == "fwd" and r.get("ms"))
           for impl in orders[0]}
    ours = statistics.median(fwd["liger_rt"])
    verdict = next(line for line in lines if line.startswith("rms_norm") and " fwd:" in line)
    assert f"liger_rt {ours:.4g} ms" in verdict, (verdict, fwd)
    assert len(set(fwd["liger_rt"])) == 3                   # the median differs from some round's figure


# -- the CLI ---------------------------------------------------------------------------------------

@NO_GPU
@pytest.mark.parametrize("args", [["kernels", "--quick"], ["ceilings"], ["host"]])
def test_gpu_verbs_without_gpu_are_one_clear_line(args):
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "needs a CUDA/ROCm GPU" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, needle", [
    (["--op", "rmsnorm"], "unknown benchmark 'rmsnorm'; valid: norms, gated_mlp,"),
    (["--where", "tokens"], "expected field=value"),
    (["--op", "norms", "--where", "tokens=512"], "--where tokens: no such field"),
])
def test_bench_kernels_bad_arguments_before_the_gpu_check(args, needle):
    res = CliRunner().invoke(bench, ["kernels", *args])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def _script_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_benchmark_script_is_the_cli():
    """benchmarks/bench_norms.py is `liger-tune bench kernels --op norms ...`: bad arguments are one line."""
    res = subprocess.run([sys.executable, str(BENCHMARKS / "bench_norms.py"), "--where", "colour=red"],
                         capture_output=True, text=True, env=_script_env())
    assert res.returncode == 2 and "--where colour: no such field" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_bench_dispatch_on_cpu(tmp_path):
    res = CliRunner().invoke(bench, ["dispatch", "--calls", "200", "--csv", str(tmp_path / "d.csv"),
                                     "--data", str(tmp_path)])
    assert res.exit_code == 0, res.output
    rows = _read(tmp_path / "d.csv")
    assert [r["what"] for r in rows] == ["select (memo hit)", "floor: x.device.type + dict.get"]
    assert all(float(r["us"]) > 0 and r["liger_rt"] for r in rows)
    data = _read(tmp_path / "host.csv")
    assert [(r["kind"], r["arm"], r["metric"], r["unit"]) for r in data] == [("host", "liger_rt", "host_us", "us"),
                                                                              ("host", "floor", "host_us", "us")]


def test_logprobs_and_host_records():
    """Log-probs rows: one record per round, arm, pass and metric (the report shows their median and spread); host
    rows: one per probe."""
    from liger_rt.tools.bench import host_overhead, logprobs
    rows = [{"tokens": 8, "hidden": 16, "vocab": 67, "impl": impl, "pass": "fwdbwd", "ms": ms, "dev_ms": None,
             "dev_ms_method": "none: cpu", "dtype": "fp32", "temperature": 1.0, "config": "triton {} (heuristic)",
             "round": rnd, "peak_GB": 0.5}
            for impl, times in (("liger_rt", (5.0, 9.0, 1.0)), ("compile", (4.0, 6.0, 20.0)))
            for rnd, ms in enumerate(times)]
    recs = logprobs.logprobs_records([*rows, {**rows[0], "impl": "trl", "ms": None, "error": "skipped"}])
    assert [(r["arm"], r["value"]) for r in recs if r["metric"] == "ms"] == [
        ("liger_rt", 5.0), ("liger_rt", 9.0), ("liger_rt", 1.0), ("torch_compile", 4.0), ("torch_compile", 6.0),
        ("torch_compile", 20.0)]
    assert {r["metric"] for r in recs} == {"ms", "extra_gb"}                      # no device time on CPU
    assert recs[0]["name"] == "fused_linear_logprobs.fwdbwd" and recs[0]["shape"] == {"tokens": 8, "hidden": 16,
                                                                                        "vocab": 67}
    assert recs[0]["method"] == "cpu-wall" and recs[0]["notes"].startswith("round 1 of 3; temperature 1.0")
    assert "round 2 of 3, arms timed last to first" in recs[2]["notes"] and "config triton" in recs[0]["notes"]
    assert "config" not in recs[-1]["notes"]
    one = logprobs.logprobs_records([{**rows[0], "round": 0}])                  # a single round says nothing of it
    assert not one[0]["notes"].startswith("round")
    stub = host_overhead.host_records(host_overhead.cpu_stub(repeats=1, calls=2, echo=lambda s: None))
    assert {r["arm"] for r in stub} == {"liger_rt", "floor"} and {r["metric"] for r in stub} == {"stub_us"}
    assert all(r["kind"] == "host" and r["unit"] == "us" and r["value"] > 0 for r in stub)


def test_trl_arm_runs_where_trl_imports_but_its_trainer_utils_do_not(monkeypatch):
    """A GPU image with trl's wheel carried alone: trl.trainer.utils fails on a missing dependency (an ImportError
    too); benchmarks/bench_logprobs.py stands in for its one name and the trl arm is timed, not skipped."""
    pytest.importorskip("trl.kernels")
    script = load_script("bench_logprobs.py")
    from liger_rt.tools.bench import logprobs
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)     # its stand-in is gone after the test
    for name in [m for m in sys.modules if m == "trl.trainer" or m.startswith("trl.trainer.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pandas", None)        # import of pandas halted: ModuleNotFoundError
    script.stand_in_for_trl_utils()
    assert getattr(sys.modules["trl.trainer.utils"], "STAND_IN", False)
    arm = logprobs.trl_arm(echo=lambda *_: None)
    assert arm is not None and "stood in" in arm.desc
    x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    t = torch.tensor([0, 3, -100, 10, 5, -100])
    lp, ent = arm(x, w, t)
    ref_lp, ref_ent = logprobs.materialised(x, w, t)
    torch.testing.assert_close(lp.double(), ref_lp.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.double(), rtol=1e-5, atol=1e-5)


def test_script_data_folder_defaults_and_opt_out(monkeypatch):
    """A repository script appends under its data folder unless told --data DIR or --no-data."""
    import liger_rt.tools.bench as B
    seen = []
    monkeypatch.setattr(B.bench.commands["dispatch"], "main", lambda args, prog_name: seen.append(args))
    for argv in (["--calls", "5"], ["--no-data"], ["--data", "/x"], ["--data=/y"]):
        monkeypatch.setattr(sys, "argv", ["bench_host.py", *argv])
        B.script(["dispatch"], "/repo/benchmarks/data")
    assert seen == [["--calls", "5", "--data", "/repo/benchmarks/data"], [], ["--data", "/x"], ["--data=/y"]]


def _private_uses(path: Path) -> list[str]:
    """`liger_rt` names a file uses that are private: a module path or an imported name or an attribute of an
    imported liger_rt object with a leading underscore (dunders aside)."""
    tree, bad = ast.parse(path.read_text()), []
    bound = set()

    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "liger_rt":
                    bad += [a.name] if any(map(private, a.name.split("."))) else []
                    bound.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "liger_rt":
            bad += [node.module] if any(map(private, node.module.split("."))) else []
            bad += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
            bound |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                bad.append(f"{ast.unparse(node)} (line {node.lineno})")
    return bad


def test_bench_models_runs_resolve_and_fit_the_card():
    """Every model run of benchmarks/bench_models.py builds its preset; groups expand; the batch is halved until the
    run's measured peak fits 90% of the card."""
    bm = load_script("bench_models.py")
    assert bm.run_names([]) == bm.GROUPS["default"] and bm.run_names(["qwen3,families"])[:2] == ["qwen3", "gemma3"]
    with pytest.raises(SystemExit, match="unknown run 'nope'"):
        bm.run_names(["nope"])
    for name in bm.RUNS:
        preset, flags, overrides = bm.run_setup(name)
        assert preset.layers >= 1 and flags["fused_linear_cross_entropy"] is True
    assert bm.run_setup("lfm2moe")[0].name == "lfm2-8b-a1b-8L" and bm.run_setup("qwen3rope")[1]["rope"] is True
    assert bm.fitted_batch("lfm2-a1b", 4, 85.5) == 2 and bm.fitted_batch("lfm2-a1b", 4, 150.0) == 4
    assert bm.fitted_batch("qwen3", 4, 85.5) == 4 and bm.fitted_batch("gemma3", 2, 85.5) == 2


def test_benchmarks_use_no_private_liger_rt_name(tmp_path):
    files = sorted(BENCHMARKS.rglob("*.py"))
    assert files
    assert {str(f.relative_to(ROOT)): _private_uses(f) for f in files if _private_uses(f)} == {}
    planted = tmp_path / "planted.py"                          # the check itself finds each kind of use
    planted.write_text("from liger_rt.kernels import _common\nfrom liger_rt.kernels._common import x\n"
                       "import liger_rt\nfrom liger_rt import dispatch as d\nliger_rt._swaps\nd._REGISTRY\n"
                       "liger_rt.__version__\n")
    assert len(_private_uses(planted)) == 4


def test_every_benchmark_script_answers_help(capsys, monkeypatch):
    """`--help` of every script in benchmarks/ and benchmarks/profile/, run as __main__ in this process: exit 0 and
    a usage line, no GPU needed (what a script sets in the environment or sys.path at import is put back)."""
    import runpy
    files = sorted([*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("profile/*.py")])
    bad = {}
    for f in files:
        with monkeypatch.context() as m:
            m.setattr(sys, "argv", [str(f), "--help"])
            m.setattr(sys, "path", list(sys.path))
            m.setattr(os, "environ", os.environ.copy())
            try:
                runpy.run_path(str(f), run_name="__main__")
                code = "no exit"
            except SystemExit as exc:
                code = exc.code
        out = capsys.readouterr().out
        if code not in (0, None) or "usage" not in out.lower():
            bad[f.name] = (code, out[-300:])
    assert not bad, bad


# -- on the GPU (pytest -m gpu) -------------------------------------------------------------------

@pytest.mark.gpu
def test_measure_ceilings_gpu():
    c = H.measure_ceilings(quick=True)
    assert c["copy_GBps"] > 100 and c["bf16_matmul_TFLOPs"] > 10


@pytest.mark.gpu
def test_run_kernels_gpu_device_time():
    rows = H.run_kernels(["rms_norm"], where=["rows=16384"], quick=True, echo=lambda s: None)
    ours = [r for r in rows if r["impl"] == "liger_rt"]
    assert ours and all(r["dev_ms_method"] == "cuda-graph" and r["dev_ms"] > 0 and r["frac_ceiling"] for r in ours)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3", "lfm2_moe"])
def test_bench_model_cuda_tiny(model_type):
    _needs_patchers()
    rows = M.run_model_bench(model_type, "tiny", batch=2, seq=64, steps=2, warmup=1, dtype="bf16", device="cuda",
                             echo=None)
    runs = [r for r in rows if r["kind"] == "run"]
    assert runs[0]["arm"] == runs[-1]["arm"] == "baseline" and len(runs) in (4, 6)
    assert all(isinstance(r["peak_alloc_GB"], float) and r["peak_alloc_GB"] > 0 for r in rows)
    assert all(r["mfu"] is not None for r in runs)
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert summ["liger_rt"]["loss_curves_overlap"], summ["liger_rt"]["loss_rel_diff"]


def test_source_version_marks_a_tree_that_differs_from_its_head(monkeypatch):
    """The liger_rt column of a CSV: version+commit, and `.dirty` where liger_rt/ differs from HEAD
    (the H200's copy of a working tree carried an older HEAD under newer files)."""
    import subprocess
    import types

    from liger_rt.tools.bench import harness

    def fake(dirty):
        def run(cmd, **kw):
            if "rev-parse" in cmd:
                return types.SimpleNamespace(stdout="abc1234\n", returncode=0)
            return types.SimpleNamespace(stdout="", returncode=1 if dirty else 0)
        return run
    monkeypatch.setattr(subprocess, "run", fake(True))
    assert harness.source_version().endswith("+abc1234.dirty")
    monkeypatch.setattr(subprocess, "run", fake(False))
    assert harness.source_version().endswith("+abc1234")


def test_bench_model_arms_option(tmp_path, monkeypatch):
    """--arms runs just those arms (a peer alone in its process, under its own switches), and
    names the valid ones when an arm is unknown or baseline is missing."""
    _needs_patchers()
    _no_liger_kernel(monkeypatch)
    for args, needle in ((["--model", "qwen3", "--arms", "bogus"], "unknown arm 'bogus'; valid: baseline, liger_rt"),
                         (["--model", "qwen3", "--arms", "liger_rt"], "the arms must include baseline"),
                         (["--model", "qwen3", "--arms", "baseline,bogus"], "unknown arm 'bogus'")):
        res = CliRunner().invoke(bench, ["model", "--device", "cpu", *args])
        assert res.exit_code != 0 and needle in res.output, res.output
    out = tmp_path / "model.csv"
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3", "--preset", "tiny", "--steps", "1", "--warmup", "1",
                                     "--batch", "1", "--seq", "8", "--device", "cpu", "--dtype", "fp32",
                                     "--arms", "baseline", "--csv", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert [r["arm"] for r in _read(out) if r["kind"] == "run"] == ["baseline", "baseline"]


def test_profile_memory_finds_what_is_live_at_the_peak(tmp_path):
    """benchmarks/profile/step_memory.py's replay of allocator events: the peak is where the live bytes are
    largest (a block counts until its free completes), charged to the innermost liger_rt/transformers
    frame, else the innermost outside torch."""
    pm = load_script("profile/step_memory.py")

    def frames(*files):
        return [{"filename": f, "line": i + 1, "name": f"f{i}"} for i, f in enumerate(files)]
    ours = frames("/x/torch/nn/functional.py", "/x/liger_rt/kernels/fused_linear_cross_entropy.py", "/w/train.py")
    user = frames("/x/torch/autograd/graph.py", "/w/train.py")
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 50, "frames": user},
        {"action": "free_requested", "addr": 1, "size": 100},            # still in use by a stream
        {"action": "alloc", "addr": 3, "size": 30, "frames": user},       # the peak: 180 live
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 3, "size": 30},
        {"action": "alloc", "addr": 4, "size": 120, "frames": frames("/x/torch/_tensor.py")},   # 170: below
    ]
    peak, groups = pm.peak_live_set(events)
    assert peak == 180
    assert groups == {"kernels/fused_linear_cross_entropy.py:2 f1": 100, "w/train.py:2 f1": 80}
    assert pm._where(frames("/x/torch/_tensor.py")) == "(torch internals) _tensor.py:1 f0"
    assert pm.peak_live_set.blocks == {"kernels/fused_linear_cross_entropy.py:2 f1": 1, "w/train.py:2 f1": 2}
    assert pm.peak_live_set.at == 3
    generated = tmp_path / "torchinductor_root" / "ab" / "cabc.py"              # inductor's output code
    generated.parent.mkdir(parents=True)
    generated.write_text("def call(args):\n    buf0 = empty_strided_cuda((4, 2048), (2048, 1), torch.float32)\n"
                         "    buf17 = empty_strided_cuda((4, 2048), (2048, 1), torch.float32)\n")
    where = [pm._where([{"filename": str(generated), "line": line, "name": "call"}]) for line in (2, 3)]
    assert where[0] == where[1] == "ab/cabc.py call  buf = empty_strided_cuda((4, 2048), (2048, 1), torch.float32)"


def test_profile_moe_splits_device_time_by_gemm_family():
    """benchmarks/profile/moe_gemms.py: each MoE GEMM family's device time per step and its TFLOP/s (its share of
    the 18 * S * H * I FLOPs); both weight-gradient kernels count as one family, the rest as other."""
    from types import SimpleNamespace as E
    pm = load_script("profile/moe_gemms.py")
    assert sum(pm.FAMILIES.values()) == 18
    events = [E(key="_moe_up_fwd_kernel", device_time_total=8000.0), E(key="_moe_down_kernel", device_time_total=12000.0),
              E(key="_moe_up_bwd_kernel", device_time_total=4000.0), E(key="_moe_wgrad_kernel", device_time_total=2000.0),
              E(key="_moe_wgrad_desc_kernel", device_time_total=10000.0), E(key="elementwise", device_time_total=1000.0)]
    rates = {name: (ms, rate) for name, ms, rate in pm.family_rates(events, steps=2, shi=10**12)}
    assert rates["_moe_up_fwd_kernel"] == (4.0, 1000.0)            # 4e12 FLOPs in 4 ms
    assert rates["_moe_wgrad"] == (6.0, 1000.0) and rates["_moe_down_kernel"] == (6.0, 1000.0)
    assert rates["other"][0] == 0.5
    # up_bwd_split: dy @ down runs in the down kernel (8 units), the SwiGLU backward is its own family (no FLOPs)
    assert sum(pm.SPLIT.values()) == 18
    events[1] = E(key="_moe_down_kernel", device_time_total=16000.0)
    events[2] = E(key="_moe_swiglu_bwd_kernel", device_time_total=800.0)
    rates = {name: (ms, rate) for name, ms, rate in pm.family_rates(events, steps=2, shi=10**12, families=pm.SPLIT)}
    assert rates["_moe_down_kernel"] == (8.0, 1000.0) and rates["_moe_swiglu_bwd_kernel"][0] == 0.4
    assert rates["_moe_up_bwd_kernel"][0] == 0.0 and rates["other"][0] == 0.5


def test_profile_host_cpu_floor_runs_and_restores_the_interpreter(capsys):
    """benchmarks/profile/host_layers.py without a GPU: both probes print, and the interpreter's run is put back."""
    from triton.runtime.interpreter import InterpretedFunction
    ph = load_script("profile/host_layers.py")
    run = InterpretedFunction.run
    ph.cpu_floor(calls=20)
    assert InterpretedFunction.run is run
    out = capsys.readouterr().out
    assert "floor fwd+bwd" in out and "ops.rms_norm fwd+bwd, launches stubbed" in out


def test_profile_model_gaps_charge_idle_to_the_launching_host_ops(capsys):
    """benchmarks/profile/step_time.py --gaps: an idle gap on the device is charged to the innermost CPU ops
    around the launch of the kernel after it, "host late" when that launch came after the device went idle;
    overlapping kernels leave no gap, and a gap ended by an early launch (a dependency) is not host late."""
    import json
    pm = load_script("profile/step_time.py")

    def x(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                **({"args": {"correlation": corr}} if corr is not None else {})}
    events = [x("cpu_op", "step", 0, 1000), x("cpu_op", "aten::mm", 100, 50),
              x("cuda_runtime", "cudaLaunchKernel", 110, 5, 1), x("kernel", "k_mm", 120, 100, 1),
              x("cuda_runtime", "cudaLaunchKernel", 130, 5, 2), x("kernel", "k_overlap", 150, 20, 2),
              x("cpu_op", "liger_rt::rms_norm", 300, 40),
              x("cuda_runtime", "cuLaunchKernelEx", 320, 5, 3), x("kernel", "k_norm", 330, 20, 3),   # 110 us, late
              x("cuda_runtime", "cudaLaunchKernel", 345, 5, 4), x("kernel", "k_dep", 400, 10, 4)]   # 50 us, not late

    class Prof:
        def export_chrome_trace(self, file):
            Path(file).write_text(json.dumps({"traceEvents": events}))
    pm.print_gaps(Prof(), steps=1, rows=5)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device idle between kernels: 0.16 ms per step (0.11 ms with the host late)")
    assert out[2].split() == ["0.110", "1", "yes", "step", ">", "liger_rt::rms_norm", "->", "k_norm"]
    assert out[3].split() == ["0.050", "1", "no", "step", "->", "k_dep"]
    assert len(out) == 4


def test_bench_models_tags_a_run_setting_in_the_row_names():
    """--recompute-swiglu rows keep apart from the default rows of the same preset and flags in models.csv."""
    bm = load_script("bench_models.py")
    rows = [{"name": "qwen3-1.7b+rope", "arm": "liger_rt"}, {"name": "qwen3-1.7b+rope", "arm": "baseline"}]
    assert [r["name"] for r in bm.tagged(rows, "+recompute_swiglu")] == ["qwen3-1.7b+rope+recompute_swiglu"] * 2
    assert bm.tagged(rows, "") == rows and rows[0]["name"] == "qwen3-1.7b+rope"


@pytest.mark.parametrize("tokens", [1, 127, 128, 1000, 8192, 8193])
@pytest.mark.parametrize("chunk", [128, 384, 896, 1024])
def test_profile_flce_equal_spans_cover_the_tokens_in_equal_grain_chunks(chunk, tokens):
    """benchmarks/profile/flce_chunks.py's equal chunks: contiguous, all tokens once, as few chunks as chunks of
    `chunk` rows, none longer than `chunk`, all but the last a multiple of the grain, sizes within one grain."""
    spans = load_script("profile/flce_chunks.py").equal_spans(chunk, tokens)
    assert spans[0][0] == 0 and spans[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [e - s for s, e in spans]
    assert len(spans) == -(-tokens // chunk) and max(sizes) <= chunk
    assert all(n % 128 == 0 for n in sizes[:-1]) and max(sizes[:-1] or [0]) - min(sizes[:-1] or [0]) <= 128


@pytest.mark.parametrize("name", ["b12", "c12k"])
def test_profile_flce_loop_variants_match_fp64_and_are_put_back(name):
    """The equal-chunk and split-K dX variants of the fused loss's loop (interpreter, fp32) against an fp64
    reference, loss and both gradients; the kernel module's loop helpers are its own again afterwards."""
    from liger_rt import backend
    from liger_rt.autograd import call_impl
    from liger_rt.kernels import fused_linear_cross_entropy as flce
    fc = load_script("profile/flce_chunks.py")
    op = REGISTRY.get("fused_linear_cross_entropy")
    g = torch.Generator().manual_seed(7)
    t, h, v = 37, 16, 30
    x = torch.randn(t, h, generator=g, requires_grad=True)
    w = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, v, (t,), generator=g)
    cfg = op.default_config("triton", backend.detect(), {"tokens": t, "hidden": h, "vocab": v}, torch.float32)
    before = flce.chunk_spans, flce.chunk_grads
    seen = []
    spans = fc.equal_spans
    fc.equal_spans = lambda c, n: seen.append(spans(c, n, grain=4)) or seen[-1]
    grads, calls = fc.GRADS.get(name[-1]), []
    spy = None if grads is None else (lambda *a, **k: calls.append(1) or grads(*a, **k))
    with fc.variant(balanced=name.startswith("b"), grads=spy):
        loss = call_impl(op, "triton", cfg.replace(chunk=12), x, w, y, None, -100, "mean", 0.0, 0.0, None, None, 3,
                         True)
        gx, gw = torch.autograd.grad(loss, (x, w))
    assert (flce.chunk_spans, flce.chunk_grads) == before
    assert [[e - s for s, e in sp] for sp in seen] == ([[12, 12, 8, 5]] if name.startswith("b") else [])
    assert len(calls) == (0 if grads is None else 4)      # the variant's dX ran for each chunk
    xd, wd = (p.detach().double().requires_grad_() for p in (x, w))
    ref = torch.nn.functional.cross_entropy(xd @ wd.t(), y)
    rx, rw = torch.autograd.grad(ref, (xd, wd))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx.double(), rx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-4, atol=1e-6)


def test_profile_flce_budget_step_settings_move_the_chunk_per_arm_and_are_put_back():
    """benchmarks/profile/flce_budget_step.py: while an arm runs, its budget moves the fused loss's heuristic chunk
    (and `chunk=N` replaces it); other arms and the code after the run see the shipped budget and decisions."""
    from liger_rt import backend, dispatch
    from liger_rt.kernels import fused_linear_cross_entropy as flce
    fb = load_script("profile/flce_budget_step.py")
    dims = dict(tokens=4096, hidden=64, vocab=256)

    def chunk():
        arch = backend.detect().name
        return dispatch.select("fused_linear_cross_entropy", dtype="fp32", arch=arch, **dims).config.chunk

    shipped, shipped_budget = chunk(), dict(flce.LOGITS_BUDGET)
    settings = {"A": fb.parse_setting("budget=1"), "B": fb.parse_setting("chunk=24"), "C": fb.parse_setting("shipped")}
    got = {}
    with fb.Settings(settings) as s:
        for arm in ("A", "B", "C", "baseline"):
            with s.arm(arm):
                got[arm] = chunk()
        between = chunk()
    rows = (1 << 20) // (256 * 4)
    assert shipped < rows and got == {"A": rows, "B": 24, "C": shipped, "baseline": shipped} and between == shipped
    assert dispatch.decide is s.original_decide
    assert flce.LOGITS_BUDGET == shipped_budget and chunk() == shipped
    assert any("chunk=24" in d for d in s.decisions)
    for bad in ("budget=0", "chunk=x", "size=3", "budget"):
        with pytest.raises(ValueError, match="expected budget=MiB"):
            fb.parse_setting(bad)
