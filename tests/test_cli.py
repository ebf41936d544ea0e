"""liger-tune verbs end to end (real rms_norm op through the interpreter where needed)."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from liger_rt.freshness import source_hash
from liger_rt.registry import REGISTRY
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
    info = json.loads(res.stdout)                 # stdout is JSON alone
    assert info["arch"]["name"] == "cpu"
    assert {"torch", "triton", "transformers", "sqlite-utils", "runtime"} <= set(info["versions"])
    assert info["db"]["user_path"].endswith("tuning.db") and "set" in info["env"]
    assert info["db"]["shipped_health"]["tuning"]["bad"] == 0


def test_doctor_reports_an_unusable_db(tmp_path, monkeypatch):
    bad = tmp_path / "bad.db"
    bad.write_text("garbage" * 500)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(bad))
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 0 and "UNUSABLE" in res.stdout and "not a database" in res.stdout


def test_doctor_shows_bad_env_instead_of_failing(monkeypatch):
    monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "abc")
    monkeypatch.setenv("LIGER_RT_IMPL_RMSNORM", "torch")
    res = CliRunner().invoke(main, ["doctor", "--json"])
    assert res.exit_code == 0 and "Traceback" not in res.output
    snap = json.loads(res.stdout)["env"]
    assert snap["parsed"]["db_timeout"].startswith("error: LIGER_RT_DB_TIMEOUT='abc'")
    assert "LIGER_RT_IMPL_RMS_NORM" in snap["unknown"]["LIGER_RT_IMPL_RMSNORM"]


def test_unknown_arch_and_op_list_the_valid_ones():
    res = CliRunner().invoke(main, ["sweep", "--arch", "h100", "--dry-run"])
    assert res.exit_code != 0 and "hopper" in res.stderr and "mi325x" in res.stderr
    res = CliRunner().invoke(main, ["explain", "rmsnorm", "--shape", "rows=1,hidden=2"])
    assert res.exit_code != 0 and "rms_norm" in res.stderr


ONE_LINE = [
    (["sweep", "--arch", "h100", "--dry-run"], "valid: hopper"),
    (["sweep", "--arch", "cpu", "--op", "rms_norm", "--dtype", "int8", "--dry-run"], "int8"),
    (["sweep", "--arch", "cpu", "--op", "rms_norm", "--shape", "rows=2"], "missing ['hidden']"),
    (["explain", "rms_norm", "--shape", "rows=x,hidden=2"], "'x' is not an integer"),
    (["explain", "rms_norm", "--shape", "rows=0,hidden=2"], "positive"),
    (["explain", "rms_norm", "--shape", "rows=2,hidden=2", "--dtype", "int8"], "int8"),
    (["import", "/no/such/file.jsonl"], "cannot read /no/such/file.jsonl"),
    (["export", "/no/such/dir/x.jsonl", "--shipped"], "cannot write /no/such/dir/x.jsonl"),
    (["export", "-"], "no tuning DB at"),
    (["prune"], "say what to prune"),
    (["prune", "--stale"], "does not exist"),
    (["show", "--arch", "z80"], "unknown arch 'z80'"),
    (["nosuchverb"], "No such command"),
]


@pytest.mark.parametrize("args,fragment", ONE_LINE, ids=[" ".join(a[:2]) + " " + f for a, f in ONE_LINE])
def test_every_failure_is_one_line_on_stderr(args, fragment):
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("liger-tune: error: "), res.stderr
    assert fragment in res.stderr and "Traceback" not in res.stderr


def test_bad_env_is_one_line_and_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("LIGER_RT_DB_TIMEOUT", "nan")
    res = CliRunner().invoke(main, ["show"])
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "LIGER_RT_DB_TIMEOUT='nan'" in res.stderr
    res = CliRunner().invoke(main, ["show", "--debug"])
    assert res.exit_code == 1 and type(res.exception).__name__ == "EnvError"


def test_sweep_refuses_to_measure_on_other_hardware(monkeypatch):
    monkeypatch.setenv("LIGER_RT_ARCH", "hopper")   # a forced profile does not make this an H200
    res = CliRunner().invoke(main, ["sweep", "--arch", "hopper", "--op", "rms_norm", "--quick"])
    assert res.exit_code != 0 and "refusing to measure" in res.output and "cpu" in res.output


def test_dry_run_prints_the_plan_for_any_arch():
    pytest.importorskip("liger_rt.kernels.rms_norm")
    res = CliRunner().invoke(main, ["sweep", "--arch", "mi325x", "--op", "rms_norm", "--model", "qwen3-4b",
                                    "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)                 # JSON alone on stdout; the header went to stderr
    hidden = {p["dims"]["hidden"] for p in plan}
    assert 2560 in hidden and hidden <= {2560, 128}        # decoder norms and the q/k norms (head_dim 128)


def test_explain_says_when_the_crossover_pick_cannot_run_here(monkeypatch):
    monkeypatch.setenv("LIGER_RT_ARCH", "mi325x")     # a CPU forced to mi325x: no grouped MM here
    res = CliRunner().invoke(main, ["explain", "moe_experts", "--dtype", "bf16", "--json", "--shape",
                                    "tokens=4096,experts=32,top_k=4,hidden=2048,intermediate=1792"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["impl"] != "grouped_mm" and "picks grouped_mm" in d["note"] and "not available here" in d["note"]


def test_explain_says_what_a_compiled_trace_takes_under_the_fuse_policy(monkeypatch):
    args = ["explain", "rms_norm", "--shape", "rows=8,hidden=64", "--dtype", "fp32", "--json"]
    assert "under torch.compile: torch" in json.loads(CliRunner().invoke(main, args).stdout)["note"]   # the default
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "kernels")
    assert json.loads(CliRunner().invoke(main, args).stdout)["note"] is None
    monkeypatch.setenv("LIGER_RT_COMPILE_POLICY", "fuse")
    monkeypatch.setenv("LIGER_RT_IMPL_RMS_NORM", "triton")          # the override decides under compile too
    assert json.loads(CliRunner().invoke(main, args).stdout)["note"] is None
    args[1] = "cross_entropy"
    args[3] = "rows=8,vocab=64"
    monkeypatch.delenv("LIGER_RT_IMPL_RMS_NORM")
    assert json.loads(CliRunner().invoke(main, args).stdout)["note"] is None    # not an op the compiler fuses


def test_sweep_then_explain_in_another_process_gets_db(tmp_path, monkeypatch):
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

    # show lists it; export -> import into an empty DB round-trips (in this process: the DB is the test,
    # not the interpreter start-up, which the two runs above already cover)
    def cli(*args, db_path=db):
        monkeypatch.setenv("LIGER_RT_TUNING_DB", db_path)
        return CliRunner().invoke(main, list(args))
    res = cli("show", "--op", "rms_norm", "--json")
    rows = [r for r in json.loads(res.stdout)["tuning"] if r["layer"] == "user"]
    assert len(rows) == 4 and all(r["fresh"] == "yes" and r["method"] == "cpu-wall" for r in rows)
    exp, exp2, other = tmp_path / "export.jsonl", tmp_path / "export2.jsonl", str(tmp_path / "other.db")
    assert cli("export", str(exp)).exit_code == 0
    res = cli("import", str(exp), db_path=other)
    assert res.exit_code == 0 and "merged" in res.stdout, res.output
    assert cli("export", str(exp2), db_path=other).exit_code == 0
    assert sorted(exp.read_text().splitlines()) == sorted(exp2.read_text().splitlines())


def _rms_row(**kw):
    from liger_rt.tuning_db.store import fingerprint
    op = REGISTRY.get("rms_norm")
    row = dict(op="rms_norm", variant="fwdbwd", arch="cpu", dtype="fp32", static_key='{"hidden":64}', impl="torch",
               config={}, median_ms=1.0, method="cpu-wall", config_schema=op.schema_version, origin="sweep",
               bucket='{"rows":8}', **fingerprint("cpu", source_hash(op)))
    row.update(kw)
    return row


def test_prune_stale_lists_and_removes():
    from liger_rt.tuning_db import open_store
    store = open_store()
    store.put_tuning(_rms_row(source_hash="deadbeefdeadbeef"))
    store.put_tuning(_rms_row(bucket='{"rows":16}'))
    store.put_tuning(_rms_row(bucket='{"rows":32}', torch_version="1.0"))     # measured under another torch
    store.put_tuning(_rms_row(bucket='{"rows":64}', arch="hopper", torch_version="1.0"))   # not this machine's arch
    res = CliRunner().invoke(main, ["prune", "--stale", "--dry-run"])
    assert res.exit_code == 0 and "deadbeef" in res.stdout and "torch 1.0" in res.stdout
    assert "2 tuning" in res.stdout
    res = CliRunner().invoke(main, ["prune", "--stale"])
    assert res.exit_code == 0
    assert sorted(r["bucket"] for r in store.all_rows("tuning")) == ['{"rows":16}', '{"rows":64}']


def test_prune_by_op_removes_rows_and_measurements():
    from liger_rt.tuning_db import open_store
    store = open_store()
    store.put_tuning(_rms_row())
    store.put_measurements([{k: v for k, v in _rms_row().items() if k not in ("bucket", "config_schema")}
                            | {"dims": json.dumps({"hidden": 64, "rows": 8}), "ok": 1}])
    res = CliRunner().invoke(main, ["prune", "--op", "rms_norm"])
    assert res.exit_code == 0, res.output
    assert "removed 1 entries and 1 raw measurements" in res.stdout
    assert store.counts() == {"tuning": 0, "measurements": 0, "crossover": 0}


def test_export_arch_with_the_shipped_layer(tmp_path):
    from liger_rt.tuning_db import open_store
    open_store().put_tuning(_rms_row(arch="hopper"))
    res = CliRunner().invoke(main, ["export", "-", "--arch", "hopper"])
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert res.exit_code == 0 and [r["table"] for r in recs] == ["meta", "tuning"]
    res = CliRunner().invoke(main, ["export", "-", "--arch", "hopper", "--shipped"])
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    tables = [r["table"] for r in recs]
    assert tables.count("tuning") > 20 and "crossover" in tables and {r.get("arch") for r in recs[1:]} == {"hopper"}
    # and it imports back, into a DB that then holds them all
    out = tmp_path / "all.jsonl"
    out.write_text(res.stdout)
    res = CliRunner().invoke(main, ["import", str(out), "--db", str(tmp_path / "other.db")])
    assert res.exit_code == 0, res.output
    assert open_store(tmp_path / "other.db").counts()["tuning"] == tables.count("tuning")


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
