"""benchmarks/report.py on a tiny dataset: it writes docs/perf.md, the README table and the parity cells,
`--check` passes on what it wrote and fails once a figure in the data changes (without matplotlib)."""
from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("kind,name,shape,arm,metric,value,unit,gpu,dtype,method,torch,triton,transformers,liger_rt,"
           "peer_version,commit,date,run_id,notes").split(",")


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", REPO / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                    # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _row(kind, name, shape, arm, metric, value, run="r1", date="2026-01-02", **kw):
    return {**dict.fromkeys(COLUMNS, ""), "kind": kind, "name": name, "shape": shape, "arm": arm, "metric": metric,
            "value": str(value), "gpu": "NVIDIA H200", "dtype": "bf16", "torch": "2.11.0", "triton": "3.6.0",
            "transformers": "5.17.0", "liger_rt": "0.1.0", "date": date, "run_id": run, **kw}


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with two runs of one kernel, one model step, the README and patching.md markers, and a
    parity row whose tests exist; matplotlib hidden, as in CI."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    data = tmp_path / "benchmarks" / "data"
    norm = dict(kind="norms", name="rms_norm.fwdbwd", shape="rows=16384;hidden=4096")
    _write(data / "kernels.csv", [
        _row(**norm, arm="liger_rt", metric="ms", value=0.17, run="r1"),
        _row(**norm, arm="liger_rt", metric="ms", value=0.18, run="r2"),
        _row(**norm, arm="liger_rt", metric="gbps", value=3800, run="r1"),
        _row(**norm, arm="liger_rt", metric="ms", value=0.5, run="r0", date="2026-01-01"),
        _row(**norm, arm="liger_kernel", metric="ms", value=0.25, run="r1", peer_version="0.8.5"),
        _row(kind="norms", name="ceiling", shape="", arm="probe", metric="ceiling_gbps", value=4250, run="r1")])
    step = dict(kind="model", name="qwen3-1.7b+rope", shape="batch=4;seq=2048")
    _write(data / "models.csv", [_row(**step, arm="liger_rt", metric="tok_s", value=45000),
                                 _row(**step, arm="eager", metric="tok_s", value=29000),
                                 _row(**step, arm="liger_rt", metric="peak_gb", value=27.8)])
    (data / "parity.csv").write_text("model_type,cpu_test,gpu_test,gpu_case,gpu,date,result\n"
                                     "qwen3,tests/test_a.py::test_cpu,tests/gpu/test_b.py::test_gpu,"
                                     "qwen3-4b,NVIDIA H200,2026-01-02,passed\n")
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text("def test_cpu():\n    pass\n")
    (tmp_path / "tests" / "gpu" / "test_b.py").write_text("def test_gpu():\n    pass\n")
    (tmp_path / "README.md").write_text("# x\n\n<!-- perf-table:begin (benchmarks/report.py) -->\n"
                                        "<!-- perf-table:end -->\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "patching.md").write_text(
        "<!-- parity:begin (benchmarks/report.py) -->\n| model type | flags | CPU | GPU |\n| --- | --- | --- | --- |\n"
        "| `qwen3` | rms_norm | old | old |\n<!-- parity:end -->\n")
    return tmp_path


def test_written_docs_pass_the_check_and_fail_after_a_value_changes(report, repo, capsys):
    assert report.main(["--root", str(repo), "--check"]) == 1          # nothing written yet
    assert report.main(["--root", str(repo)]) == 0
    assert report.main(["--root", str(repo), "--check"]) == 0
    perf = (repo / "docs" / "perf.md").read_text()
    assert "| rms_norm.fwdbwd | rows=16384;hidden=4096 | bf16 | wall | 0.175 (0.17-0.18, n=2) |" in perf
    assert "0.25 | 1.43x | 3800 GB/s (0.89) |" in perf                   # peer / ours; rate over the ceiling
    assert "liger_kernel 0.8.5" in perf and "AMD Instinct MI300X: no row" in perf
    assert len(perf.splitlines()) <= 400
    readme = (repo / "README.md").read_text()
    assert "| NVIDIA H200 | qwen3-1.7b+rope train step, 4x2048 (tok/s, peak GB) | 45.0k, 27.8 GB | 29.0k |" in readme
    patching = (repo / "docs" / "patching.md").read_text()
    assert ("| `qwen3` | rms_norm | `tests/test_a.py::test_cpu` | passed on NVIDIA H200, 2026-01-02 (qwen3-4b; "
            "`tests/gpu/test_b.py::test_gpu`) |") in patching

    kernels = repo / "benchmarks" / "data" / "kernels.csv"
    kernels.write_text(kernels.read_text().replace(",0.18,", ",0.19,"))
    capsys.readouterr()
    assert report.main(["--root", str(repo), "--check"]) == 1
    assert "docs/perf.md" in capsys.readouterr().out


def test_check_fails_on_a_parity_test_that_does_not_exist(report, repo, capsys):
    report.main(["--root", str(repo)])
    (repo / "tests" / "test_a.py").write_text("def test_renamed():\n    pass\n")
    assert report.main(["--root", str(repo), "--check"]) == 1
    assert "parity.csv names a missing test: tests/test_a.py::test_cpu" in capsys.readouterr().out


def test_retired_rows_leave_the_current_figure_and_a_mistyped_retirement_fails_the_check(report, repo, capsys):
    """retired.csv takes a run's rows of one arm out of the figures (the other arms and runs stay); a line that
    matches no row fails --check."""
    data = repo / "benchmarks" / "data"
    (data / "retired.csv").write_text("run_id,name,shape,arm,reason\nr2,rms_norm.fwdbwd,,liger_rt,old chunk budget\n")
    assert report.main(["--root", str(repo)]) == 0
    perf = (repo / "docs" / "perf.md").read_text()
    assert "| rms_norm.fwdbwd | rows=16384;hidden=4096 | bf16 | wall | 0.17 |" in perf     # r2's 0.18 is out
    assert "| 0.25 |" in perf                                                                 # the peer stays
    assert report.main(["--root", str(repo), "--check"]) == 0
    (data / "retired.csv").write_text("run_id,name,shape,arm,reason\nr9,,,,typo\n")
    capsys.readouterr()
    assert report.main(["--root", str(repo), "--check"]) == 1
    assert "retired.csv names no row: r9" in capsys.readouterr().out


def test_a_forward_row_gives_way_to_its_forward_and_backward(report, repo):
    """A shape measured forward and backward shows that pass only; a forward measured alone still shows."""
    norm = dict(kind="norms", shape="rows=4096;hidden=2048", arm="liger_rt", metric="ms")
    _write(repo / "benchmarks" / "data" / "kernels.csv",
           [_row(**norm, name="rms_norm.fwd", value=0.031), _row(**norm, name="rms_norm.fwdbwd", value=0.093),
            _row(**dict(norm, shape="rows=8;hidden=2048"), name="rms_norm.fwd", value=0.004)])
    perf = report.perf_md(report.load(repo / "benchmarks" / "data"))[0]
    assert "| rms_norm.fwdbwd | rows=4096;hidden=2048 |" in perf
    assert "| rms_norm.fwd | rows=4096;hidden=2048 |" not in perf
    assert "| rms_norm.fwd | rows=8;hidden=2048 |" in perf


def test_repository_perf_md_is_short(report):
    assert len((REPO / "docs" / "perf.md").read_text().splitlines()) <= 400


def test_longest_sequence_table_and_plot_data(report, repo):
    """Rows of kind max_seq: a "Longest trainable sequence" table, each arm's length with its tok/s and peak, a lower
    bound (no length ran out of memory) marked, liger_rt over eager with and without checkpointing, peers' versions;
    the plot's data beside it."""
    seq = dict(kind="max_seq", name="qwen3-1.7b+rope", shape="batch=1")
    rows = [_row(**seq, arm="eager", metric="max_seq", value=8192, unit="tokens"),
            _row(**seq, arm="eager", metric="oom_seq", value=9216, unit="tokens"),
            _row(**seq, arm="eager", metric="tok_s", value=26300),
            _row(**seq, arm="eager", metric="peak_gb", value=51.3),
            _row(**seq, arm="liger_rt", metric="max_seq", value=32768, run="r1"),
            _row(**seq, arm="liger_rt", metric="max_seq", value=34816, run="r2"),
            _row(**seq, arm="liger_rt", metric="oom_seq", value=36864),
            _row(**seq, arm="liger_rt", metric="oom_seq", value=36864, run="r2"),
            _row(**seq, arm="liger_rt", metric="tok_s", value=23400),
            _row(**seq, arm="liger_rt", metric="peak_gb", value=77.9),
            _row(**seq, arm="liger_rt+ckpt", metric="max_seq", value=262144),       # reached --max: a lower bound
            _row(**seq, arm="liger_rt+ckpt", metric="max_seq", value=131072, run="r0"),  # stopped sooner: left out
            _row(**seq, arm="eager+ckpt", metric="max_seq", value=65536),
            _row(**seq, arm="eager+ckpt", metric="oom_seq", value=69632),
            _row(**seq, arm="liger_kernel", metric="max_seq", value=16384, peer_version="0.8.5"),
            _row(**seq, arm="liger_kernel", metric="oom_seq", value=17408, peer_version="0.8.5"),
            _row(kind="max_seq", name="qwen3-1.7b+rope", shape="batch=1;limit_gib=24", arm="liger_rt",
                 metric="max_seq", value=8704),
            _row(kind="rope", name="rope.fwdbwd", shape="tokens=8", arm="liger_rt", metric="ms", value=0.1)]
    models = repo / "benchmarks" / "data" / "models.csv"
    with models.open() as fh:
        old = list(csv.DictReader(fh))
    _write(models, old + rows)
    assert report.main(["--root", str(repo)]) == 0 and report.main(["--root", str(repo), "--check"]) == 0
    perf = (repo / "docs" / "perf.md").read_text()
    assert "### Longest trainable sequence" in perf and "### rope" in perf          # a kind without a title too
    assert ("| model | shape | liger_rt | liger_rt+ckpt | eager | eager+ckpt | liger_kernel 0.8.5 | liger_rt / eager | "
            "liger_rt+ckpt / eager+ckpt | date |") in perf
    assert ("| qwen3-1.7b+rope | batch 1, bf16 | 33K (32K-34K, n=2), 23.4k tok/s, 77.9 GB | &ge; 256K | "
            "8K, 26.3k tok/s, 51.3 GB | 64K | 16K | 4.12x | &ge; 4.00x | 2026-01-02 |") in perf
    assert ("| qwen3-1.7b+rope | batch 1, capped at 24 GiB, bf16 | &ge; 8.5K | - | - | - | - | - | - | 2026-01-02 |"
            in perf)
    assert "![longest trainable sequence on NVIDIA H200](perf_max_seq_nvidia_h200.png)" in perf
    assert "`max_seq` (longest trainable sequence): no row" not in perf
    readme = (repo / "README.md").read_text()       # the headline: the card's own memory, not an emulated cap
    assert ("| NVIDIA H200 | qwen3-1.7b+rope longest trainable sequence, batch 1 (tokens, tok/s and peak GB there) | "
            "33K (32K-34K, n=2), 23.4k tok/s, 77.9 GB; with activation checkpointing &ge; 256K | "
            "8K, 26.3k tok/s, 51.3 GB | - | 16K | 2026-01-02 |") in readme
    assert "capped" not in readme and readme.count("longest trainable sequence") == 1
    cur = report.current(report.load(repo / "benchmarks" / "data"))
    data = report.max_seq_plot_data(report.by_benchmark(cur, "NVIDIA H200", {"max_seq"}))
    assert data[0] == ["qwen3-1.7b+rope", [["liger_rt", 33792.0, False], ["liger_rt+ckpt", 262144.0, True],
                                           ["eager", 8192.0, False], ["eager+ckpt", 65536.0, False],
                                           ["liger_kernel", 16384.0, False]]]
    assert data[1][0] == "qwen3-1.7b+rope, limit_gib=24"
    assert [report.tokens(v) for v in (32768, 33280, 300)] == ["32K", "32.5K", "300"]


def test_moe_table_counts_the_shapes_liger_rt_leads_every_peer_at(report, repo):
    """The count takes each arm's median, the best peer per shape, and leaves out a shape a peer did not run."""
    moe = dict(kind="moe_experts", name="moe_experts.fwdbwd", metric="ms")
    rows = []
    for shape, ours, eager, lk in (("tokens=512", (1.0, 1.0, 9.0), 1.20, 1.14),      # 1.14x: under the bar
                                   ("tokens=2048", (2.0, 2.1, 1.0), 2.60, 2.50),     # median 2.0: 1.25x
                                   ("tokens=4096", (3.0,), 2.90, 4.00)):             # behind eager
        rows += [_row(**moe, shape=shape, arm="liger_rt", value=v, run=f"r{i}") for i, v in enumerate(ours)]
        rows += [_row(**moe, shape=shape, arm="eager", value=eager),
                 _row(**moe, shape=shape, arm="liger_kernel", value=lk, peer_version="0.8.5")]
    rows.append(_row(**moe, shape="tokens=8192", arm="liger_rt", value=1.0))       # no peer ran: not counted
    _write(repo / "benchmarks" / "data" / "kernels.csv", rows)
    perf = report.perf_md(report.load(repo / "benchmarks" / "data"))[0]
    assert ("at the 3 shapes where every peer (eager, liger_kernel) ran: liger_rt at least 1.15x the best peer "
            "at 1, ahead of it at 2.") in perf


def test_a_shape_measured_again_under_a_fuller_key_gives_way(report, repo):
    """An older row whose shape fields are a subset of a later row's (routing named since) shows no more; a
    shape that was not measured again, and a later row under a smaller key, still show."""
    moe = dict(kind="moe_experts", name="moe_experts.fwdbwd", arm="liger_rt", metric="ms")
    _write(repo / "benchmarks" / "data" / "kernels.csv", [
        _row(**moe, shape="tokens=512;experts=32", value=1.0, date="2026-01-01"),
        _row(**moe, shape="tokens=512;experts=32;routing=skewed", value=1.1, date="2026-01-02"),
        _row(**moe, shape="tokens=8192;experts=32", value=4.0, date="2026-01-01"),
        _row(**moe, shape="tokens=16384;experts=32;routing=skewed", value=9.0, date="2026-01-01"),
        _row(**moe, shape="tokens=16384;experts=32", value=8.0, date="2026-01-02")])
    perf = report.perf_md(report.load(repo / "benchmarks" / "data"))[0]
    assert "| tokens=512;experts=32 |" not in perf and "| tokens=512;experts=32;routing=skewed |" in perf
    assert "| tokens=8192;experts=32 |" in perf
    assert "| tokens=16384;experts=32 |" in perf and "| tokens=16384;experts=32;routing=skewed |" in perf


def test_a_row_that_is_the_median_of_rounds_shows_their_spread(report):
    """A log-probs row written as the median of its run's rounds carries their range in its notes: the cell shows
    it as a spread over n rounds (only for ms, whose range it is); several rows pool as usual."""
    lp = dict(kind="logprobs", name="fused_linear_logprobs.fwdbwd", shape="tokens=8192;hidden=2048;vocab=65536")
    note = "median of 3 rounds (ms 16.12..16.27, arm order reversed every other round); temperature 1.0"
    rows = [_row(**lp, arm="liger_rt", metric="ms", value=16.21, notes=note),
            _row(**lp, arm="liger_rt", metric="dev_ms", value=16.27, notes=note),
            _row(**lp, arm="eager", metric="ms", value=171.3, notes=note.replace("3 rounds", "1 rounds")),
            _row(**lp, arm="torch_compile", metric="ms", value=13.4, run="a", notes="round 1 of 2"),
            _row(**lp, arm="torch_compile", metric="ms", value=13.6, run="a", notes="round 2 of 2")]
    cur = report.current(rows)
    cell = {k[5:]: f.cell(report.sig) for k, f in cur.items()}
    assert cell[("liger_rt", "ms")] == "16.21 (16.12-16.27, n=3)"
    assert cell[("liger_rt", "dev_ms")] == "16.27" and cell[("eager", "ms")] == "171.3"
    assert cell[("torch_compile", "ms")] == "13.5 (13.4-13.6, n=2)"


def test_compiled_ratio_takes_the_later_measured_default_policy_arm(report, repo):
    """Both compiled liger_rt arms run the default policy: the ratio over torch_compile takes the one measured
    last (an older +fuse figure left in the row must not decide it), +fuse where both share a date."""
    step = dict(kind="model_compiled", name="qwen3-1.7b+rope", shape="batch=4;seq=2048", metric="tok_s")
    rows = [_row(**step, arm="liger_rt+torch_compile+fuse", value=44000, date="2026-01-01", run="old"),
            _row(**step, arm="liger_rt+torch_compile", value=46000, run="new"),
            _row(**step, arm="torch_compile", value=40000, run="new")]
    _write(repo / "benchmarks" / "data" / "models.csv", rows)
    perf = report.perf_md(report.load(repo / "benchmarks" / "data"))[0]
    assert "| 1.150x |" in perf
    rows[0]["date"] = "2026-01-02"
    _write(repo / "benchmarks" / "data" / "models.csv", rows)
    assert "| 1.100x |" in report.perf_md(report.load(repo / "benchmarks" / "data"))[0]
