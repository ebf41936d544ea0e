"""liger-tune verbs end to end (real rms_norm op through the interpreter where needed)."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from liger_rt.tools.cli import main


def _run(*args, env_extra=None):
    env = {**os.environ, "TRITON_INTERPRET": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "liger_rt.tools.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_help_lists_every_verb():
    out = CliRunner().invoke(main, ["--help"]).output
    for verb in ("doctor", "sweep", "show", "explain", "export", "import", "prune"):
        assert f"  {verb} " in out


def test_doctor_json_has_the_fields():
    res = CliRunner().invoke(main, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["arch"]["name"] == "cpu"
    assert {"torch", "triton", "transformers", "sqlite-utils"} <= set(info["versions"])
    assert info["db"]["user_path"].endswith("tuning.db") and "set" in info["env"]


def test_doctor_reports_an_unusable_db(tmp_path, monkeypatch):
    bad = tmp_path / "bad.db"
    bad.write_text("garbage" * 500)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(bad))
    res = CliRunner().invoke(main, ["doctor", "--json"])
    assert res.exit_code == 0
    assert json.loads(res.output[res.output.index("{"):])["db"]["user_error"]


def test_unknown_arch_and_op_list_the_valid_ones():
    res = CliRunner().invoke(main, ["sweep", "--arch", "h100", "--dry-run"])
    assert res.exit_code != 0 and "hopper" in res.output and "mi325x" in res.output
    res = CliRunner().invoke(main, ["explain", "rmsnorm", "--shape", "rows=1,hidden=2"])
    assert res.exit_code != 0 and "rms_norm" in res.output


def test_sweep_refuses_to_measure_on_other_hardware(monkeypatch):
    monkeypatch.setenv("LIGER_RT_ARCH", "hopper")   # a forced profile does not make this an H200
    res = CliRunner().invoke(main, ["sweep", "--arch", "hopper", "--op", "rms_norm", "--quick"])
    assert res.exit_code != 0 and "refusing to measure" in res.output and "cpu" in res.output


def test_dry_run_prints_the_plan_for_any_arch():
    pytest.importorskip("liger_rt.kernels.rms_norm")
    res = CliRunner().invoke(main, ["sweep", "--arch", "mi325x", "--op", "rms_norm", "--model", "qwen3-4b",
                                    "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output[res.output.index("["):])
    hidden = {p["dims"]["hidden"] for p in plan}
    assert 2560 in hidden and hidden <= {2560, 128}        # decoder norms and the q/k norms (head_dim 128)


def test_sweep_then_explain_in_another_process_gets_db(tmp_path):
    pytest.importorskip("liger_rt.kernels.rms_norm")
    db = str(tmp_path / "cli.db")
    env = {"LIGER_RT_TUNING_DB": db}
    res = _run("sweep", "--arch", "cpu", "--op", "rms_norm", "--shape", "rows=8,hidden=64", "--shape",
               "rows=3,hidden=32", "--dtype", "fp32", "--quick", "--json", env_extra=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert [r["dims"] for r in out["results"]] == [{"rows": 8, "hidden": 64}, {"rows": 3, "hidden": 32}]
    assert out["results"][0]["impl"] in ("triton", "torch") and out["results"][0]["ms"] > 0
    res = _run("explain", "rms_norm", "--shape", "rows=8,hidden=64", "--dtype", "fp32", "--arch", "cpu", "--json",
               env_extra=env)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(res.stdout)
    assert d["origin"] == "db" and d["impl"] == out["results"][0]["impl"]
    # show lists it; export -> import into an empty DB round-trips
    res = _run("show", "--op", "rms_norm", "--json", env_extra=env)
    rows = [r for r in json.loads(res.stdout)["tuning"] if r["layer"] == "user"]
    assert len(rows) == 4 and all(r["fresh"] == "yes" and r["method"] == "cpu-wall" for r in rows)
    exp = tmp_path / "export.jsonl"
    assert _run("export", str(exp), env_extra=env).returncode == 0
    other = {"LIGER_RT_TUNING_DB": str(tmp_path / "other.db")}
    res = _run("import", str(exp), env_extra=other)
    assert res.returncode == 0 and "merged" in res.stdout
    exp2 = tmp_path / "export2.jsonl"
    _run("export", str(exp2), env_extra=other)
    assert sorted(exp.read_text().splitlines()) == sorted(exp2.read_text().splitlines())


def test_prune_stale_lists_and_removes(tmp_path, monkeypatch):
    pytest.importorskip("liger_rt.kernels.rms_norm")
    from liger_rt.tuning_db import open_store
    store = open_store()
    from liger_rt import dispatch
    base = dict(op="rms_norm", variant="fwdbwd", arch="cpu", dtype="fp32", static_key='{"hidden":64}', impl="torch",
                config={}, median_ms=1.0, config_schema=dispatch.get_op("rms_norm").schema_version)
    store.put_tuning({**base, "bucket": '{"rows":8}', "source_hash": "deadbeefdeadbeef"})
    store.put_tuning({**base, "bucket": '{"rows":16}', "source_hash": dispatch.get_op("rms_norm").source_hash})
    res = CliRunner().invoke(main, ["prune", "--stale", "--dry-run"])
    assert res.exit_code == 0 and "deadbeef" in res.output and "1 tuning" in res.output
    res = CliRunner().invoke(main, ["prune", "--stale"])
    assert res.exit_code == 0
    assert [r["bucket"] for r in store.all_rows("tuning")] == ['{"rows":16}']
    res = CliRunner().invoke(main, ["prune"])
    assert res.exit_code != 0 and "--stale" in res.output


def test_console_sweep_turns_the_interpreter_on_itself(tmp_path):
    """As the README runs it: no TRITON_INTERPRET in the environment, triton candidates must run."""
    pytest.importorskip("liger_rt.kernels.rms_norm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LIGER_RT_TUNING_DB"] = str(tmp_path / "console.db")
    res = subprocess.run([sys.executable, "-m", "liger_rt.tools.cli", "sweep", "--arch", "cpu", "--op", "rms_norm",
                          "--shape", "rows=4,hidden=64", "--dtype", "fp32", "--quick", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)["results"][0]
    assert out["failed"] == 0
