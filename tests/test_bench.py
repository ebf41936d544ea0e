"""`liger-tune bench`: the model step on tiny presets on CPU, kernel-bench plumbing, clear errors."""
from __future__ import annotations

import csv
import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from liger_rt.tools import bench as B
from liger_rt.tools.bench import bench

RUN_COLS = {"kind", "model_type", "preset", "arm", "run_index", "order", "batch", "seq", "steps", "warmup", "dtype",
            "device", "median_step_ms", "tok_per_s", "peak_alloc_GB", "loss_first", "loss_last", "losses",
            "max_loss_diff", "model_TFLOPs", "params_M", "flags", "torch", "gpu"}
SUMMARY_COLS = {"speedup", "mem_ratio", "loss_curves_overlap", "runs", "tok_per_s_spread"}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared CPU: more threads only add spin-waiting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _needs_patchers():
    pytest.importorskip("liger_rt.tools.models")
    import liger_rt.patch as P
    if not hasattr(P, "patch"):
        pytest.skip("liger_rt.patch has no patch() yet")


def _read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _torch_references(monkeypatch):
    """Plumbing tests: liger_rt ops take their torch references (no interpreter kernels, fast)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from liger_rt import dispatch
    dispatch.reset()


def _no_liger_kernel(monkeypatch):
    monkeypatch.setattr(B._LigerKernelPatch, "supported", staticmethod(lambda mt: (False, "not installed here")))


# -- bench model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["qwen3", "lfm2"])
def test_bench_model_cpu_tiny(model_type, tmp_path, monkeypatch):
    _needs_patchers()
    _no_liger_kernel(monkeypatch)
    out = tmp_path / "model.csv"
    res = CliRunner().invoke(bench, ["model", "--model", model_type, "--preset", "tiny", "--steps", "1",
                                     "--warmup", "1", "--batch", "2", "--seq", "12", "--device", "cpu",
                                     "--dtype", "fp32", "--csv", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
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
    import liger_rt.patch as P                                       # nothing left patched behind it
    from liger_rt.tools.models import build_model
    assert P.describe(model_type) is None and P.describe(build_model(f"{model_type}-tiny")) is None


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
    rows = B.run_model_bench("qwen3", "qwen3-tiny", batch=2, seq=8, steps=1, warmup=1, dtype="fp32",
                             device="cpu", echo=None)
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["arm"] for r in runs] == ["baseline", "liger_rt", "liger_kernel", "liger_kernel", "liger_rt", "baseline"]
    assert len(seen) == 2
    assert modeling_qwen3.apply_rotary_pos_emb is orig_rope and modeling_qwen3.Qwen3RMSNorm is orig_norm
    assert not hasattr(modeling_qwen3.Qwen3Model, "liger_marker")
    assert runs[-1]["losses"] == runs[0]["losses"]
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert summ["liger_kernel"]["runs"] == 2 and summ["baseline"]["speedup"] == 1.0


def test_liger_kernel_arm_failure_is_reported_not_fatal(monkeypatch):
    _needs_patchers()
    _torch_references(monkeypatch)
    monkeypatch.setattr(B._LigerKernelPatch, "supported", staticmethod(lambda mt: (True, "")))

    def boom(self, model):
        raise RuntimeError("peer kernel exploded")
    monkeypatch.setattr(B._LigerKernelPatch, "apply", boom)
    rows = B.run_model_bench("qwen3", "tiny", batch=1, seq=8, steps=1, warmup=0, dtype="fp32", device="cpu",
                             echo=None)
    assert [r["arm"] for r in rows if r["kind"] == "run"] == ["baseline", "liger_rt", "liger_rt", "baseline"]
    assert "peer kernel exploded" in rows[0]["liger_kernel_note"]


def test_layers_override_cuts_attention_layers():
    p = B._bench_preset("lfm2_moe", "lfm2-8b-a1b", 8, None)
    assert p.layers == 8 and p.attention_layers == (2, 6) and p.name == "lfm2-8b-a1b-8L"
    p = B._bench_preset("lfm2_moe", "lfm2-8b-a1b", 8, (2, 5))
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


def test_bench_model_plot_without_matplotlib_is_clear(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)             # import fails as if not installed
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3", "--device", "cpu", "--plot", str(tmp_path / "p.png")])
    assert res.exit_code != 0 and "pip install matplotlib" in res.output


def test_plot_model_rows(tmp_path):
    pytest.importorskip("matplotlib")
    common = dict(model_type="qwen3", preset="qwen3-tiny", warmup=1)
    runs = [dict(common, kind="run", arm=a, run_index=i, losses=[5.0, 4.9, 4.8], peak_alloc_GB=None)
            for i, a in enumerate(["baseline", "liger_rt", "liger_rt", "baseline"])]
    summ = [dict(common, kind="summary", arm=a, tok_per_s=t, peak_alloc_GB=None, max_loss_diff=0.0)
            for a, t in [("baseline", 100.0), ("liger_rt", 130.0)]]
    path = B.plot_model_rows(runs + summ, tmp_path / "p.png")
    assert path.stat().st_size > 1000


# -- bench kernels --------------------------------------------------------------------------------

def test_bench_kernels_without_gpu_exits_nonzero():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = CliRunner().invoke(bench, ["kernels", "--quick"])
    assert res.exit_code != 0
    assert "needs a CUDA/ROCm GPU" in res.output and "Traceback" not in res.output
    assert isinstance(res.exception, SystemExit)


def test_normalize_kernel_rows_against_measured_ceilings():
    """Wide rows (bench_lfm2_ops.py layout) and long rows (bench_losses.py layout) -> one long table."""
    conv = dict(op="short_conv", dtype="bfloat16", batch="8", seq="4096", hidden="2048", kernel="3",
                peak_gb="0.2", anchor_eager_fwdbwd="3.278", target_speedup="4.0", torch="2.11", gpu="NVIDIA H200")
    rows = [
        {**conv, "impl": "eager", "fwd_ms": "0.1", "fwd_GBps": "2000", "fwdbwd_ms": "0.5", "fwdbwd_GBps": "1000",
         "fwd_frac_ceiling": "0.47", "relerr_vs_eager": "0", "config": "", "speedup_vs_eager": "1.0"},
        {**conv, "impl": "liger_rt", "fwd_ms": "0.05", "fwd_GBps": "4000", "fwdbwd_ms": "0.25",
         "fwdbwd_GBps": "2000", "fwd_frac_ceiling": "0.94", "relerr_vs_eager": "0.001",
         "config": "triton {'BLOCK_T': 64} (heuristic)", "speedup_vs_eager": "2.0"},
        {"kind": "flce", "shape": "BT8192_H2048_V65536", "impl": "eager", "dtype": "bf16", "ms": "20",
         "peak_extra_GB": "3.0", "TFLOPs": "300", "frac_ceiling": "0.4", "target_ms": "10.4", "target_GB": "0.5"},
        {"kind": "flce", "shape": "BT8192_H2048_V65536", "impl": "liger_rt", "dtype": "bf16", "ms": "10",
         "peak_extra_GB": "0.4", "TFLOPs": "600", "frac_ceiling": "0.8", "target_ms": "10.4", "target_GB": "0.5",
         "meets_target": "True", "origin": "heuristic"},
        {"kind": "flce", "shape": "BT8192_H2048_V65536", "impl": "liger_kernel", "dtype": "bf16",
         "error": "ImportError: no liger"},
        {"shape": "BT8192_H2048_V65536", "chunk": "1024", "ms": "11", "TFLOPs": "550"},   # a tuning table row
    ]
    ceil = {"copy_GBps": 4000.0, "bf16_matmul_TFLOPs": 750.0}
    out = B.normalize_kernel_rows(rows, "mixed", ceil)
    assert [(r["op"], r["impl"], r["pass"]) for r in out] == [
        ("short_conv", "eager", "fwd"), ("short_conv", "eager", "fwdbwd"),
        ("short_conv", "liger_rt", "fwd"), ("short_conv", "liger_rt", "fwdbwd"),
        ("fused_linear_cross_entropy", "eager", ""), ("fused_linear_cross_entropy", "liger_rt", ""),
        ("fused_linear_cross_entropy", "liger_kernel", "")]
    ours = out[2]
    assert ours["case"] == "dtype=bfloat16,batch=8,seq=4096,hidden=2048,kernel=3" == out[0]["case"]
    assert ours["ceiling"] == "copy" and ours["frac_ceiling"] == pytest.approx(1.0)     # 4000 / 4000 measured
    assert ours["vs_baseline"] == pytest.approx(2.0) and ours["peak_GB"] == 0.2 and "BLOCK_T" in ours["config"]
    flce = out[5]
    assert flce["case"] == "shape=BT8192_H2048_V65536,dtype=bf16"
    assert flce["ceiling"] == "matmul" and flce["frac_ceiling"] == pytest.approx(0.8)
    assert flce["vs_baseline"] == pytest.approx(2.0) and flce["peak_GB"] == 0.4 and flce["ms"] == 10.0
    assert out[6]["error"].startswith("ImportError") and out[6]["ms"] is None


def test_normalize_moe_rows_compare_with_hf_grouped_mm():
    """bench_moe_experts.py layout: per-case routing statistics stay out of the label."""
    point = dict(op="moe_experts", dtype="bf16", experts="32", top_k="4", hidden="2048", intermediate="1792",
                 tokens="512", routing="uniform", rows_per_expert="64.0")
    rows = [{**point, "impl": "hf_grouped_mm", "max_rows_expert": "80", "empty_experts": "0", "fwd_ms": "1.0",
             "fwd_TFLOPs": "100", "fwdbwd_ms": "3.0", "fwdbwd_TFLOPs": "100", "peak_gb": "", "error": ""},
            {**point, "impl": "triton", "max_rows_expert": "80", "empty_experts": "0", "fwd_ms": "0.5",
             "fwd_TFLOPs": "200", "fwdbwd_ms": "2.0", "fwdbwd_TFLOPs": "150", "peak_gb": "", "error": "",
             "config": "{'BLOCK_M': 64}"},
            {**point, "impl": "liger_kernel", "fwd_ms": "", "fwdbwd_ms": "", "error": "RuntimeError: shape"}]
    out = B.normalize_kernel_rows(rows, "moe_experts", {"copy_GBps": 4000.0, "bf16_matmul_TFLOPs": 750.0})
    assert out[0]["case"] == "dtype=bf16,experts=32,top_k=4,hidden=2048,intermediate=1792,tokens=512,routing=uniform"
    tri = {r["pass"]: r for r in out if r["impl"] == "triton"}
    assert tri["fwdbwd"]["vs_baseline"] == pytest.approx(1.5) and tri["fwdbwd"]["frac_ceiling"] == pytest.approx(0.2)
    assert tri["fwd"]["case"] == out[0]["case"] and tri["fwd"]["peak_GB"] is None
    assert out[-1]["impl"] == "liger_kernel" and out[-1]["error"] == "RuntimeError: shape"


def test_kernel_scripts_resolution_and_run(tmp_path, monkeypatch):
    bdir = tmp_path / "benchmarks"
    bdir.mkdir()
    (bdir / "_harness.py").write_text("")
    (bdir / "bench_model.py").write_text("raise SystemExit('the model bench is not a kernel bench')")
    (bdir / "bench_norms.py").write_text(
        "import os, sys  # ap.add_argument('--op', action='append')\n"
        "quick = '--quick' in sys.argv\n"
        "print('timing rms_norm', 'quick' if quick else 'full', sys.argv[2:])\n"
        "open(os.path.join(os.environ['OUT'], 'norms.csv'), 'w').write(\n"
        "    'op,impl,rows,fwd_ms,fwd_GBps\\nrms_norm,eager,4096,0.2,1000\\nlayer_norm,eager,4096,0.2,900\\n')\n")
    assert B.find_benchmarks_dir(str(bdir)) == bdir
    scripts = B.available_scripts(bdir)
    assert list(scripts) == ["norms"]
    assert B.resolve_scripts([], scripts) == (["norms"], {"norms": set()})
    assert B.resolve_scripts(["rms_norm"], scripts) == (["norms"], {"norms": {"rms_norm"}})
    with pytest.raises(ValueError, match=r"no benchmark script for op 'moe_experts' .*bench_moe_experts.py"):
        B.resolve_scripts(["moe_experts"], scripts)
    with pytest.raises(ValueError, match=r"unknown op 'rmsnorm2'; valid --op values: norms, "):
        B.resolve_scripts(["rmsnorm2"], scripts)
    lines = []
    monkeypatch.delenv("OUT", raising=False)
    rc, csvs, _ = B.run_kernel_script(scripts["norms"], quick=True, ops={"rms_norm"}, echo=lines.append)
    assert rc == 0 and [p.name for p in csvs] == ["norms.csv"]
    assert "[norms] timing rms_norm quick ['--op', 'rms_norm']" in lines
    rows = B.normalize_kernel_rows(B.read_csv_rows(csvs[0]), "norms", None)
    kept = [r for r in rows if B._op_matches(r["op"], {"rms_norm"})]
    assert [r["op"] for r in kept] == ["rms_norm"]


def test_parse_helpers():
    assert B.parse_flags("rms_norm=1, swiglu=off,rope") == {"rms_norm": True, "swiglu": False, "rope": True}
    assert B.parse_config("tie_word_embeddings=true,rope_theta=1e6,name=x") == {
        "tie_word_embeddings": True, "rope_theta": 1e6, "name": "x"}
    with pytest.raises(ValueError):
        B.parse_config("oops")


# -- on the GPU (pytest -m gpu) -------------------------------------------------------------------

@pytest.mark.gpu
def test_measure_ceilings_gpu():
    c = B.measure_ceilings("cuda", quick=True)
    assert c["copy_GBps"] > 100 and c["bf16_matmul_TFLOPs"] > 10


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3", "lfm2_moe"])
def test_bench_model_cuda_tiny(model_type):
    _needs_patchers()
    rows = B.run_model_bench(model_type, "tiny", batch=2, seq=64, steps=2, warmup=1, dtype="bf16", device="cuda",
                             echo=None)
    runs = [r for r in rows if r["kind"] == "run"]
    assert runs[0]["arm"] == runs[-1]["arm"] == "baseline" and len(runs) in (4, 6)
    assert all(isinstance(r["peak_alloc_GB"], float) and r["peak_alloc_GB"] > 0 for r in rows)
    assert all(r["mfu"] is not None for r in runs)
    summ = {r["arm"]: r for r in rows if r["kind"] == "summary"}
    assert summ["liger_rt"]["loss_curves_overlap"], summ["liger_rt"]["loss_rel_diff"]
