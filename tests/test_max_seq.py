"""`liger-tune bench model --max-seq`: the doubling + bisection search against a step that runs out of memory above
a threshold, the probe (optimizer state first, checkpointing that recomputes, the probe process's answer), the CLI
on a tiny model on CPU, its one-line errors, the dataset records; benchmarks/bench_models.py --max-seq and
benchmarks/profile/peak_memory.py's accounting."""
from __future__ import annotations

import csv
import gc
import json
import subprocess
import sys
import types
import weakref

import pytest
import torch
from click.testing import CliRunner

from bench_scripts import load_script, one_thread  # noqa: F401  (one_thread: autouse)
from liger_rt.tools.bench import MAX_SEQ_ARMS, bench, harness as H, max_seq as S, model as M



def _oom_above(threshold: int, calls: list | None = None):
    """A probe that trains at up to `threshold` tokens and runs out of memory above."""
    def probe(seq):
        if calls is not None:
            calls.append(seq)
        if seq > threshold:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {seq} bytes")
        return {"seq": seq, "tok_s": 1000.0 + seq, "step_s": seq / 1000, "peak_gb": seq / 1e3}
    return probe


def _quiet(**kw):
    return dict(echo=None, **kw)


# -- the search -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [4096, 5000, 37_000, 65_535, 100_000, 262_144, 300_001])
@pytest.mark.parametrize("granularity", [1024, 4096])
def test_search_finds_the_threshold_to_the_granularity(threshold, granularity):
    calls = []
    res = S.search_max_seq(_oom_above(threshold, calls), start=4096, max_seq=1 << 22, granularity=granularity,
                           **_quiet())
    assert res.max_seq <= threshold < res.oom_seq and res.oom_seq - res.max_seq <= granularity
    assert res.max_seq % 128 == 0 and res.stop == "granularity" and not res.lower_bound
    assert res.best["seq"] == res.max_seq and res.best["tok_s"] == 1000.0 + res.max_seq
    assert calls == [p["seq"] for p in res.probes] and len(set(calls)) == len(calls)     # no length probed twice
    doubling = [s for s in calls if s <= res.oom_seq and (s & (s - 1)) == 0]
    assert doubling[:2] == [4096, 8192] or threshold < 8192


def test_search_default_granularity_is_a_sixteenth_of_the_bracket():
    res = S.search_max_seq(_oom_above(300_000), start=4096, max_seq=1 << 22, **_quiet())
    assert res.granularity == (524_288 - 262_144) // 16 and res.oom_seq - res.max_seq <= res.granularity
    small = S.search_max_seq(_oom_above(5000), start=4096, max_seq=1 << 22, **_quiet())
    assert small.granularity == S.MIN_GRANULARITY and small.max_seq == 4096 and small.oom_seq == 5120


def test_search_first_probe_out_of_memory_halves_then_bisects():
    calls = []
    res = S.search_max_seq(_oom_above(3000, calls), start=16384, max_seq=1 << 20, granularity=256, **_quiet())
    assert calls[:4] == [16384, 8192, 4096, 2048]
    assert res.max_seq <= 3000 < res.oom_seq and res.oom_seq - res.max_seq <= 256 and res.stop == "granularity"
    none = S.search_max_seq(_oom_above(100), start=4096, max_seq=1 << 20, **_quiet())
    assert none.max_seq == 0 and none.best is None and none.stop == "none fits" and none.oom_seq == 128


def test_search_without_out_of_memory_stops_at_max():
    calls = []
    res = S.search_max_seq(_oom_above(1 << 30, calls), start=1024, max_seq=5000, **_quiet())
    assert calls == [1024, 2048, 4096, 5000]              # the unaligned --max itself is the last probe
    assert res.max_seq == 5000 and res.lower_bound and res.stop == "max" and res.granularity is None
    one = S.search_max_seq(_oom_above(1 << 30), start=64, max_seq=64, **_quiet())
    assert one.max_seq == 64 and len(one.probes) == 1


def test_search_ends_on_an_error_a_timeout_or_the_time_limit():
    def broken(seq):
        if seq > 8192:
            raise ValueError("a kernel bug")
        return {"tok_s": 1.0, "step_s": 1.0}
    res = S.search_max_seq(broken, start=4096, max_seq=1 << 20, **_quiet())
    assert res.stop == "error" and res.max_seq == 8192 and res.error == "ValueError: a kernel bug"

    def slow(seq):
        if seq > 4096:
            raise S.ProbeTimeout("ran past 60 s")
        return {"tok_s": 1.0, "step_s": 1.0}
    res = S.search_max_seq(slow, start=4096, max_seq=1 << 20, **_quiet())
    assert res.stop == "time limit" and res.max_seq == 4096 and not res.error          # not a failure
    assert res.probes[-1]["status"] == "timeout" and "60 s" in res.probes[-1]["error"]

    now = [0.0]                                  # a clock: each probe takes 10 s
    def timed(seq):
        now[0] += 10
        return _oom_above(40_000)(seq)
    res = S.search_max_seq(timed, start=4096, max_seq=1 << 20, granularity=1024, time_limit=55,
                           clock=lambda: now[0], **_quiet())
    assert [p["seq"] for p in res.probes] == [4096, 8192, 16384, 32768, 65536, 49152]
    assert res.stop == "time limit" and (res.max_seq, res.oom_seq) == (32768, 49152) and not res.error


def test_search_cleanup_runs_after_the_out_of_memory_error_is_gone():
    """What the failed step held (its frames, through the traceback) is collectable when cleanup runs."""
    held, seen = [], []

    class Activation:
        pass

    def probe(seq):
        act = Activation()
        held.append(weakref.ref(act))
        if seq > 4096:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"tok_s": 1.0, "step_s": 1.0}

    def cleanup():
        gc.collect()
        seen.append((sys.exc_info()[0], held[-1]() is None))
        return "freed"
    lines = []
    S.search_max_seq(probe, start=4096, max_seq=8192, granularity=4096, cleanup=cleanup, echo=lines.append,
                     label="arm")
    assert seen == [(None, True), (None, True)]
    assert lines[1].startswith("  arm") and "8192 tokens: out of memory (CUDA out of memory)" in lines[1]
    assert lines[1].endswith("[4096, 8192)  freed")


def test_search_rejects_bad_bounds():
    with pytest.raises(ValueError, match="start <= max"):
        S.search_max_seq(_oom_above(1), start=4096, max_seq=1024, **_quiet())
    with pytest.raises(ValueError, match="granularity"):
        S.search_max_seq(_oom_above(1), start=1024, max_seq=4096, granularity=0, **_quiet())


def test_is_oom_and_names():
    assert S.is_oom(torch.OutOfMemoryError("x")) and S.is_oom(S.ProbeOOM("x"))
    assert S.is_oom(RuntimeError("CUDA error: out of memory")) and S.is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))
    assert not S.is_oom(RuntimeError("out of resource: shared memory")) and not S.is_oom(ValueError("out of memory"))
    assert [S.arm_dataset_name(a) for a in ("baseline", "baseline+compile", "baseline+ckpt", "liger_rt+ckpt",
                                            "liger_kernel+ckpt", "liger_rt+compile")] == \
        ["eager", "torch_compile", "eager+ckpt", "liger_rt+ckpt", "liger_kernel+ckpt", "liger_rt+torch_compile"]
    assert [S.token_text(n) for n in (32768, 36864, 33280, 1000, None)] == ["32K", "36K", "32.5K", "1000", "-"]
    assert MAX_SEQ_ARMS == S.ARMS
    assert S.parse_arms(None, liger_kernel=False) == ("baseline", "baseline+compile", "liger_rt", "liger_rt+ckpt",
                                                      "baseline+ckpt")
    with pytest.raises(ValueError, match="unknown arm 'nope'; valid: baseline, baseline\\+compile"):
        S.parse_arms("baseline,nope")
    assert M.resolve_model("qwen3", None) == ("qwen3", "tiny")
    assert M.resolve_model("qwen3-8b-18L", None) == ("qwen3", "qwen3-8b-18L")
    assert M.resolve_model("gemma3-4b", "gemma3-4b") == ("gemma3_text", "gemma3-4b")
    with pytest.raises(ValueError, match="is a preset"):
        M.resolve_model("qwen3-1.7b", "qwen3-4b")


# -- one probe -----------------------------------------------------------------------------------------------------

def _spec(arm: str, **kw) -> S.ProbeSpec:
    import dataclasses

    from liger_rt.tools.presets import get_preset
    return S.ProbeSpec(model_type="qwen3", preset=dataclasses.asdict(get_preset("qwen3-tiny")), arm=arm,
                       flags=dict(S.DEFAULT_FLAGS) if arm.startswith("liger_rt") else {}, overrides={},
                       dtype="fp32", device="cpu", **kw)


def _torch_references(monkeypatch):
    """liger_rt ops take their torch references (fast plumbing; the kernels have their own tests)."""
    from liger_rt import dispatch
    from liger_rt.registry import REGISTRY
    REGISTRY.ops()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.reset()


def test_prime_optimizer_creates_the_state_and_keeps_the_weights():
    lin = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in lin.parameters()]
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, weight_decay=0.5)
    S.prime_optimizer(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    assert all(p.grad is None and set(opt.state[p]) >= {"exp_avg", "exp_avg_sq"} for p in lin.parameters())
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("arm, calls_per_layer", [("baseline", 1), ("baseline+ckpt", 2), ("liger_rt", 1),
                                                  ("liger_rt+ckpt", 2)])
def test_checkpointed_arms_recompute_each_layer(arm, calls_per_layer, monkeypatch):
    """A +ckpt arm runs each decoder layer's MLP twice per step (forward, then recomputed in the backward), with
    liger_rt's patch too: the checkpointing is real, not bypassed by a patched forward."""
    _torch_references(monkeypatch)
    calls = []
    build = M.build

    def counting_build(*a, **k):
        model = build(*a, **k)
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))   # a recompute stops early
        return model
    monkeypatch.setattr(M, "build", counting_build)
    res = S.run_probe(_spec(arm, warmup_seq=0), 16)
    assert len(calls) == calls_per_layer * 2                      # qwen3-tiny: 2 layers
    assert res["seq"] == 16 and res["tok_s"] > 0 and res["peak_gb"] is None and res["loss"] > 0
    from liger_rt.patch import describe
    assert describe("qwen3") is None                              # the arm's patch undone


def test_probe_process_answers_one_line_and_the_parent_reads_it(monkeypatch, capsys):
    """The probe process prints its result (or its out-of-memory error) as one tagged line; subprocess_probe turns
    it back into the result, ProbeOOM, an error, or ProbeTimeout."""
    import dataclasses
    spec = _spec("baseline")
    job = json.dumps({"spec": dataclasses.asdict(spec), "seq": 32})
    for raised, status in ((torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"), "oom"),
                           (ValueError("bad flag"), "error"), (None, "fits")):
        def fake_probe(spec_, seq, raised=raised):
            assert dataclasses.asdict(spec_) == json.loads(job)["spec"] and seq == 32
            if raised:
                raise raised
            return {"seq": seq, "tok_s": 5.0}
        monkeypatch.setattr(S, "run_probe", fake_probe)
        assert S.probe_main([job]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and out[0].startswith(S.RESULT_TAG)
        assert json.loads(out[0][len(S.RESULT_TAG):])["status"] == status, out[0]
        monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
            stdout="warming up\n" + out[0] + "\n", stderr="", returncode=0))
        if status == "oom":
            with pytest.raises(S.ProbeOOM, match="Tried 2 GiB"):
                S.subprocess_probe(spec, 32)
        elif status == "error":
            with pytest.raises(RuntimeError, match="ValueError: bad flag"):
                S.subprocess_probe(spec, 32)
        else:
            assert S.subprocess_probe(spec, 32) == {"seq": 32, "tok_s": 5.0}

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
        stdout="", stderr="Traceback ...\nSegmentation fault\n", returncode=-11))
    with pytest.raises(RuntimeError, match="exited -11 without a result: Segmentation fault"):
        S.subprocess_probe(spec, 32)

    def too_slow(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])
    monkeypatch.setattr(subprocess, "run", too_slow)
    with pytest.raises(S.ProbeTimeout, match="ran past 7 s"):
        S.subprocess_probe(spec, 32, timeout=7)


@pytest.mark.slow
def test_isolated_probes_run_in_fresh_processes_on_cpu(monkeypatch):
    _torch_references(monkeypatch)
    rows = S.run_max_seq("qwen3", "tiny", arms="baseline", start=16, max_seq=32, isolate=True, device="cpu",
                         dtype="fp32", echo=None)
    assert rows[0]["isolate"] and rows[0]["max_seq"] == 32 and rows[0]["n_probes"] == 2 and not rows[0]["error"]


# -- the CLI -------------------------------------------------------------------------------------------------------

def _read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_cli_max_seq_tiny_cpu_prints_and_writes_rows(tmp_path, monkeypatch):
    _torch_references(monkeypatch)
    monkeypatch.setattr(M.LigerKernelPatch, "supported", staticmethod(lambda mt: (False, "not installed here")))
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3-tiny", "--max-seq", "--device", "cpu", "--dtype",
                                     "fp32", "--start", "16", "--max", "48", "--arms",
                                     "baseline,liger_rt,liger_rt+ckpt,liger_kernel", "--csv", str(tmp_path / "m.csv"),
                                     "--data", str(tmp_path / "data")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = res.output
    assert "probes in this process" in out and "Liger-Kernel arms skipped: not installed here" in out
    assert out.count(" tokens: fits ") == 9                         # 16, 32, 48 per arm, one line each
    assert "liger_rt+ckpt: 48 (48 tokens" in out and "reached --max" in out
    assert "liger_rt: 1.00x the baseline's longest sequence (at least)" in out
    rows = _read(tmp_path / "m.csv")
    assert [r["arm"] for r in rows] == ["baseline", "liger_rt", "liger_rt+ckpt"]
    assert all(r["max_seq"] == "48" and r["lower_bound"] == "True" and r["stop"] == "max" for r in rows)
    data = _read(tmp_path / "data" / "models.csv")
    assert list(data[0]) == list(H.DATASET_COLUMNS) and {r["kind"] for r in data} == {"max_seq"}
    assert [(r["arm"], r["metric"]) for r in data] == [(a, m) for a in ("eager", "liger_rt", "liger_rt+ckpt")
                                                      for m in ("max_seq", "tok_s")]   # no peak on CPU, no OOM
    assert {r["name"] for r in data} == {"qwen3-tiny+rope"} and {r["shape"] for r in data} == {"batch=1"}
    assert len({r["run_id"] for r in data}) == 1 and all(r["gpu"] == "cpu" for r in data)
    assert all(r["value"] == "48" and r["unit"] == "tokens" for r in data if r["metric"] == "max_seq")


@pytest.mark.parametrize("args, needle", [
    (["--seq", "512"], "--max-seq searches the length: leave out --seq/--shape"),
    (["--shape", "1x512"], "leave out --seq/--shape"),
    (["--warmup", "2"], "leave out --warmup"),
    (["--compile"], "names its compiled arms in --arms"),
    (["--start", "4096", "--max", "1024"], "need 2 <= --start <= --max"),
    (["--arms", "baseline,bogus"], "unknown arm 'bogus'; valid: baseline, baseline+compile"),
    (["--limit-gib", "24"], "--limit-gib needs a GPU"),
    (["--time-limit", "0"], "--time-limit must be > 0"),
    (["--flags", "bogus_flag=1"], "bogus_flag"),
    (["--preset", "qwen3-4b"], "--model qwen3-tiny is a preset; --preset qwen3-4b names another"),
])
def test_cli_max_seq_errors_are_one_line(args, needle):
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3-tiny", "--max-seq", "--device", "cpu", *args])
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1 and needle in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cli_max_seq_cuda_without_gpu_is_one_line():
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3-1.7b", "--max-seq", "--device", "cuda"])
    assert res.exit_code == 2 and "no CUDA/ROCm GPU is available here" in res.output


def test_an_arm_that_fails_is_a_row_and_a_one_line_exit(monkeypatch):
    def failing(spec, seq):
        if spec.arm == "liger_rt":
            raise ValueError("kernel bug")
        return {"seq": seq, "tok_s": 10.0, "step_s": 0.1, "peak_gb": None}
    monkeypatch.setattr(S, "run_probe", failing)
    res = CliRunner().invoke(bench, ["model", "--model", "qwen3", "--max-seq", "--device", "cpu", "--start", "16",
                                     "--max", "32", "--arms", "baseline,liger_rt"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "Error: 1 arm(s) failed: liger_rt: ValueError: kernel bug" in res.output
    assert "baseline" in res.output and "liger_rt FAILED: ValueError: kernel bug" in res.output


# -- records --------------------------------------------------------------------------------------------------------

def _row(arm, max_seq, oom_seq, **kw):
    return {"kind": "max_seq", "arm": arm, "model_type": "qwen3", "preset": "qwen3-1.7b", "layers": 28, "batch": 1,
            "dtype": "bf16", "device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "gpu_GiB": 79.1, "limit_gib": None,
            "start": 4096, "max": 1 << 20, "isolate": True, "steps": 1,
            "flags": "fused_linear_cross_entropy=1,rope=1", "config": "", "liger_kernel_note": "",
            "alloc_conf": "", "max_seq": max_seq, "oom_seq": oom_seq, "lower_bound": oom_seq is None,
            "tok_per_s": 23400.0, "step_s": 1.4, "peak_alloc_GB": 77.9, "peak_reserved_GB": 79.0,
            "granularity": 2048, "stop": "granularity" if oom_seq else "max", "n_probes": 9, "probes": [],
            "seconds": 120.0, "error": "", **kw}


def test_max_seq_records(monkeypatch):
    rows = [_row("baseline", 8192, 9216), _row("liger_rt+ckpt", 262144, None), _row("liger_kernel+ckpt", 65536, 67584),
            _row("liger_rt", 0, 4096), _row("baseline+compile", 0, None, error="RuntimeError: boom"),
            _row("liger_rt", 32768, 34816, limit_gib=24.0)]
    recs = S.max_seq_records(rows)
    assert {r["name"] for r in recs} == {"qwen3-1.7b+rope"}
    by = {(r["arm"], r["metric"], r["shape"].get("limit_gib") if isinstance(r["shape"], dict) else None): r["value"]
          for r in recs}
    assert by[("eager", "max_seq", None)] == 8192 and by[("eager", "oom_seq", None)] == 9216
    assert ("liger_rt+ckpt", "oom_seq", None) not in by and by[("liger_rt+ckpt", "max_seq", None)] == 262144
    assert by[("liger_rt", "max_seq", "24")] == 32768 and ("liger_rt", "max_seq", None) not in by   # none fit
    assert not any(r["arm"] == "torch_compile" for r in recs)                                       # failed arm
    _fake = {"liger-kernel": "0.8.5"}
    monkeypatch.setattr(H, "dist_version", lambda d: _fake.get(d))
    data = H.dataset_rows(recs, "run1")
    assert {r["peer_version"] for r in data if r["arm"] == "liger_kernel+ckpt"} == {"0.8.5"}
    assert {r["peer_version"] for r in data if r["arm"] != "liger_kernel+ckpt"} == {""}
    assert {r["shape"] for r in data} == {"batch=1", "batch=1;limit_gib=24"}
    assert "doubling from 4096 then bisection to 2048 tokens, a fresh process per probe" in \
        {r["method"] for r in data if r["metric"] == "max_seq"}


def test_max_seq_records_name_a_recomputed_swiglu(monkeypatch):
    """LIGER_RT_RECOMPUTE_SWIGLU=1 changes what liger_rt keeps: its rows must not pool with the default's."""
    assert {r["name"] for r in S.max_seq_records([_row("liger_rt", 36864, 38912, recompute_swiglu=True)])} \
        == {"qwen3-1.7b+rope+recompute_swiglu"}
    monkeypatch.setenv("LIGER_RT_RECOMPUTE_SWIGLU", "1")
    monkeypatch.setattr(S, "run_probe", lambda spec, seq: {"seq": seq, "tok_s": 10.0, "step_s": 0.1, "peak_gb": None})
    lines = []
    rows = S.run_max_seq("qwen3", "qwen3-tiny", arms=("baseline",), device="cpu", start=16, max_seq=32,
                         echo=lines.append)
    assert rows[0]["recompute_swiglu"] is True and any("LIGER_RT_RECOMPUTE_SWIGLU=1" in ln for ln in lines)
    assert S.max_seq_records(rows)[0]["name"] == "qwen3-tiny+rope+recompute_swiglu"


def test_format_max_seq_compares_with_the_baseline():
    text = S.format_max_seq([_row("baseline", 8192, 9216), _row("liger_rt", 32768, 34816),
                             _row("liger_rt+ckpt", 262144, None)])
    assert "liger_rt: 4.00x the baseline's longest sequence" in text
    assert "liger_rt+ckpt: 32.00x the baseline's longest sequence (at least)" in text
    assert S.summary_text(_row("liger_rt", 32768, 34816)).startswith("32K (32768 tokens, 23.4k tok/s, 77.9 GB peak)")


# -- scripts -------------------------------------------------------------------------------------------------------

def test_bench_models_max_seq_runs_resolve():
    bm = load_script("bench_models.py")
    for name, run in bm.MAX_SEQ_RUNS.items():
        p = M.bench_preset(run["model_type"], run["preset"])
        assert p.layers >= 1 and not p.tiny, name
    assert M.bench_preset("qwen3", bm.MAX_SEQ_RUNS["qwen3-8b"]["preset"]).layers == 18


def test_peak_memory_accounts_the_peak_by_category():
    """benchmarks/profile/peak_memory.py: the blocks live at the step's peak, charged to gradients, saved
    activations (by module type; an address reused after its saved tensor was freed is not one), the fused loss's
    chunk, or the frame that allocated them."""
    pm = load_script("profile/peak_memory.py")
    loss = [{"filename": "/x/liger_rt/kernels/fused_linear_cross_entropy.py", "line": 9, "name": "fwd"}]
    other = [{"filename": "/x/torch/autograd/graph.py", "line": 1, "name": "run"}]
    events = [
        {"action": "alloc", "addr": 10, "size": 400, "frames": other},       # 1: a saved MLP activation
        {"action": "alloc", "addr": 20, "size": 100, "frames": other},       # 2: a saved norm input
        {"action": "free_completed", "addr": 20, "size": 100},
        {"action": "alloc", "addr": 20, "size": 100, "frames": other},       # 3: a temporary at the same address
        {"action": "alloc", "addr": 30, "size": 50, "frames": loss},         # 4: the loss chunk
        {"action": "alloc", "addr": 40, "size": 70, "frames": other},        # 5: a gradient (live to the end)
        {"action": "free_completed", "addr": 20, "size": 100},
        {"action": "alloc", "addr": 50, "size": 5, "frames": other},         # after the peak
    ]
    b = pm.peak_breakdown(events, grads={40}, saved=[(10, 1, "Qwen3MLP"), (20, 2, "Qwen3RMSNorm")])
    assert (b.peak, b.at, b.allocs_at) == (620, 5, 5)
    assert b.bytes == {"saved activations: Qwen3MLP": 400, "other: (torch internals) graph.py:run": 100,
                       "loss (fused linear cross-entropy)": 50, "gradients": 70}
    by_address = pm.peak_breakdown(events, grads={40}, saved={10: "Qwen3MLP", 20: "Qwen3RMSNorm"})
    assert by_address.bytes["saved activations: Qwen3RMSNorm"] == 100 and by_address.blocks["gradients"] == 1
    assert pm._frame([{"filename": "/x/transformers/models/qwen3/modeling_qwen3.py", "line": 7, "name": "f"}]) == \
        "qwen3/modeling_qwen3.py:7 f"


@pytest.mark.parametrize("arm", ["baseline", "liger_rt", "liger_rt+ckpt"])
def test_peak_memory_saved_tensor_hook_names_the_module_types(arm, monkeypatch):
    """peak_memory.py's saved-tensor hook on CPU: every tensor kept for the backward that is no parameter, under the
    module type that saved it; the step's loss and gradients are those of a step without the hooks."""
    _torch_references(monkeypatch)
    pm = load_script("profile/peak_memory.py")
    model, step_model, opt, undo = S.build_arm(_spec(arm))
    ids = M.random_ids(model, 1, 16, 0, "cpu")
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    try:
        saved, fwd_allocs, loss = pm.saved_by_module(
            model, lambda: step_model(input_ids=ids, labels=ids, use_cache=False).loss, "cpu", lambda: 0)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        plain = step_model(input_ids=ids, labels=ids, use_cache=False).loss
        plain.backward()
        assert torch.equal(loss, plain) and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    finally:
        undo()
    modules = {m for _, m, _ in saved.values()}
    assert saved and fwd_allocs == 0 and all(size > 0 for _, _, size in saved.values())
    assert "Qwen3MLP" in modules or "Linear" in modules or "Qwen3DecoderLayer" in modules, modules
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not params & set(saved)
    assert hooks == [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]   # ours removed


def test_peak_memory_census_counts_the_bytes_a_layer_saves_per_token(capsys):
    """--census on CPU: per token and layer, the MLP keeps gate and up (2 x intermediate fp32 values) and the
    attention at least q, k, v and its output, whatever the length; liger_rt's layers save less than the baseline's
    (no HF RMSNorm intermediates, no separate SiLU output), and its loss saves no logits."""
    import argparse

    from liger_rt.tools.presets import get_preset
    pm = load_script("profile/peak_memory.py")
    p = get_preset("qwen3-tiny")

    def run(arm, seq):
        args = argparse.Namespace(model="qwen3", preset="qwen3-tiny", layers=1, flags=None, arm=arm, seq=seq, at=1024)
        return pm.census(args)
    ours, ours_long, base = run("liger_rt", 16), run("liger_rt", 32), run("baseline", 16)
    assert ours["layer"] == pytest.approx(ours_long["layer"]) and ours["layer"]
    mlp = next(v for m, v in ours["layer"].items() if m.endswith("MLP"))
    assert mlp == 2 * p.intermediate * 4
    attention = next(v for m, v in ours["layer"].items() if m.endswith("Attention"))
    assert attention >= 4 * (p.heads + 2 * p.kv_heads + p.heads) * p.head_dim // 2
    assert sum(ours["layer"].values()) < sum(base["layer"].values())
    assert base["outside"] - ours["outside"] >= p.vocab * 4          # the fp32 logits per token
    assert ours["per_token"] == pytest.approx(sum(ours["layer"].values()) * p.layers + ours["outside"])
    assert "B per token and layer" in capsys.readouterr().out
