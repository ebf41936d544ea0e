"""Tuning rows per device class, falling back per arch: the class of a device name, lookups (this device, then
another device of the arch, then the heuristic), what "stale" means, `liger-tune explain/show --device` asked on
a CPU machine, the schema-2 -> 3 migration, `doctor`'s coverage line, and the size of the shipped defaults."""
import gzip
import json
import sqlite3
from importlib import resources
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from liger_rt import backend, dispatch
from liger_rt.tools.cli import main
from liger_rt.tuning_db import DB_SCHEMA, open_store, rows
from liger_rt.tuning_db.store import fingerprint, load_jsonl
from liger_rt.registry import REGISTRY
from liger_rt.freshness import source_hash

ROOT = Path(__file__).resolve().parents[1]
RN = REGISTRY.get("rms_norm")
SHAPE = {"rows": 16384, "hidden": 64}      # a shape no shipped row covers


@pytest.mark.parametrize("name,cls", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"), ("AMD Instinct MI300X", "mi300x"),
    ("AMD Instinct MI325X", "mi325x"), ("cpu (Triton interpreter)", "cpu"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("", ""), ("h200", "h200"), ("rtx-4090", "rtx-4090")])
def test_device_class_of_a_name(name, cls):
    assert backend.device_class(name) == cls
    assert backend.device_class(cls) == cls                       # a class is its own class
    assert cls in backend.DEVICE_ARCH or cls in ("l40s", "rtx-4090", "")


def _row(device_name: str, num_warps: int, median_ms: float, **kw) -> dict:
    cfg = dict(RN.config().to_dict(), num_warps=num_warps)
    row = dict(op="rms_norm", variant="fwdbwd", arch="hopper", dtype="bf16", static_key=RN.static_key(SHAPE),
               bucket=RN.bucket_key(SHAPE), impl="triton", config=cfg, median_ms=median_ms, method="cuda-graph",
               config_schema=RN.schema_version, origin="sweep", created=1.0,
               **dict(fingerprint("hopper", source_hash(RN)), device_name=device_name, runtime_version="cuda 12.8",
                      torch_version="2.11.0"))
    row.update(kw)
    return row


@pytest.fixture
def per_device(no_shipped_defaults):
    """Hopper rows of one shape in the user DB: an H100 row (2 warps) and a faster H200 row (4 warps)."""
    with open_store() as store:
        store.put_tuning(_row("NVIDIA H100 80GB HBM3", 2, 1.0))
        store.put_tuning(_row("NVIDIA H200", 4, 0.5))
    dispatch.reset()


def _explain(*args):
    res = CliRunner().invoke(main, ["explain", "rms_norm", "--shape", "rows=16384,hidden=64", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_explain_per_device_on_a_cpu_machine(per_device):
    h100, h200, gh200 = (_explain("--device", d) for d in ("h100", "h200", "gh200"))
    assert (h100["origin"], h100["device"], h100["config"]["num_warps"]) == ("db", "h100", 2)
    assert (h200["origin"], h200["device"], h200["config"]["num_warps"]) == ("db", "h200", 4)
    # no GH200 row: the fastest row of another hopper device, and the origin says whose
    assert (gh200["origin"], gh200["device"], gh200["config"]["num_warps"]) == ("arch:h200", "gh200", 4)
    assert "no gh200 row" in gh200["reason"]
    for d, device, name in ((h100, "h100", "NVIDIA H100 80GB HBM3"), (h200, "h200", "NVIDIA H200"),
                            (gh200, "h200", "NVIDIA H200")):
        row = d["row"]      # the row it used: device class, timing method, fingerprint
        assert (row["device"], row["device_name"], row["method"], row["layer"]) == (device, name, "cuda-graph", "user")
        assert row["torch_version"] == "2.11.0" and row["runtime_version"] == "cuda 12.8" and not row["stale"]
        assert row["source_hash"] == source_hash(RN)
    # a full device name works as well as its class; the arch is implied, or checked when given
    assert _explain("--device", "NVIDIA H100 80GB HBM3", "--arch", "hopper")["config"]["num_warps"] == 2
    res = CliRunner().invoke(main, ["explain", "rms_norm", "--shape", "rows=8,hidden=64", "--device", "h100",
                                    "--arch", "mi325x"])
    assert res.exit_code == 2 and "h100 is a hopper device" in res.stderr
    res = CliRunner().invoke(main, ["explain", "rms_norm", "--shape", "rows=8,hidden=64", "--device", "rtx-4090"])
    assert res.exit_code == 2 and "say its arch with --arch" in res.stderr
    text = CliRunner().invoke(main, ["explain", "rms_norm", "--shape", "rows=16384,hidden=64", "--device", "gh200"])
    assert "rms_norm on hopper (gh200)" in text.stdout and "origin  arch:h200" in text.stdout
    assert "user DB, sweep, cuda-graph on h200 (NVIDIA H200, 132 SMs)" in text.stdout


def test_another_device_tier_answers_from_one_device(no_shipped_defaults):
    """Rows of two other hopper devices: the fastest row's device answers, and its own torch row is the baseline the
    reason quotes (never another device's)."""
    with open_store() as store:
        for name, triton_ms, torch_ms in (("NVIDIA H100 80GB HBM3", 1.0, 0.9), ("NVIDIA H200", 0.5, 0.7)):
            store.put_tuning(_row(name, 4 if "H200" in name else 2, triton_ms))
            store.put_tuning(_row(name, 0, torch_ms, impl="torch", config={}))
    dispatch.reset()
    gh200 = _explain("--device", "gh200")
    assert (gh200["impl"], gh200["origin"], gh200["config"]["num_warps"]) == ("triton", "arch:h200", 4)
    assert "0.5 ms, torch 0.7 ms" in gh200["reason"], gh200["reason"]


def test_this_device_wins_over_a_faster_sibling_and_stale_means_code_or_software(per_device):
    target = dispatch.target_for_arch("hopper")                       # planning: the reference part, an H100
    assert backend.device_class(target.arch.device_name) == "h100"
    d = dispatch.decide(RN, target, torch.bfloat16, SHAPE)
    assert (d.origin, d.config.num_warps) == ("db", 2)                 # slower than the H200 row, but measured here
    with open_store() as store:                                        # the H100 row re-measured on other code
        store.put_tuning(_row("NVIDIA H100 80GB HBM3", 8, 9.0, source_hash="0123456789abcdef"))
    dispatch.reset()
    d = _explain("--device", "h100")
    # a fresh row of another device ranks above a stale row of this one
    assert (d["origin"], d["config"]["num_warps"]) == ("arch:h200", 4)
    with open_store() as store:
        store.put_tuning(_row("NVIDIA H200", 4, 0.5, source_hash="0123456789abcdef"))
    dispatch.reset()
    d = _explain("--device", "h100")
    assert d["origin"] == "stale" and "kernel 0123456789abcdef" in d["reason"] and d["row"]["device"] == "h100"
    # another device is never a reason to call a row stale
    res = CliRunner().invoke(main, ["show", "--device", "h200", "--json"])
    (row,) = json.loads(res.stdout)["tuning"]
    assert row["device"] == "h200" and row["fresh"] == "STALE" and "device" not in row["why"]


def test_software_versions_stale_rows_of_this_machine_only(no_shipped_defaults):
    """On the machine's own arch the torch/Triton/runtime versions count; for an arch not present here (its
    machine's software unknown) only the kernel hash does.  Neither judges the device."""
    cpu = dict(_row("another cpu", 2, 1.0), arch="cpu", dtype="fp32", method="cpu-wall",
               **{k: v for k, v in fingerprint("cpu", source_hash(RN)).items() if k != "device_name"})
    with open_store() as store:
        store.put_tuning(cpu)
    dispatch.reset()
    d = dispatch.select("rms_norm", dtype="fp32", arch="cpu", **SHAPE)
    assert d.origin == "arch:another-cpu" and "STALE" not in d.reason
    with open_store() as store:
        store.put_tuning(dict(cpu, torch_version="1.0"))
    dispatch.reset()
    d = dispatch.select("rms_norm", dtype="fp32", arch="cpu", **SHAPE)
    assert d.origin == "stale" and "torch 1.0" in d.reason


def test_crossovers_per_device(no_shipped_defaults):
    moe = REGISTRY.get("moe_experts")
    dims = dict(tokens=4096, experts=32, top_k=4, hidden=2048, intermediate=1792)

    def cross(device_name, segments):
        return dict(op="moe_experts", arch="hopper", dtype="bf16", static_key=moe.static_key(dims),
                    axis_name="rows_per_expert", segments=segments, margin=0.05, method="do_bench", origin="sweep",
                    **dict(fingerprint("hopper", source_hash(moe)), device_name=device_name))
    with open_store() as store:
        store.put_crossover(cross("NVIDIA H200", [[100.0, "triton"], [None, "torch"]]))
    dispatch.reset()
    res = CliRunner().invoke(main, ["explain", "moe_experts", "--device", "h100", "--json", "--shape",
                                    ",".join(f"{k}={v}" for k, v in dims.items())])
    d = json.loads(res.stdout)
    assert (d["impl"], d["origin"]) == ("torch", "arch:h200") and d["crossover_row"]["device"] == "h200"
    with open_store() as store:
        store.put_crossover(cross("NVIDIA H100 80GB HBM3", [[1000.0, "triton"], [None, "torch"]]))
    dispatch.reset()
    d = dispatch.decide(moe, dispatch.target_for_arch("hopper"), torch.bfloat16, dims)
    assert (d.impl, d.origin) == ("triton", "crossover") and "on h100" in d.reason


def test_show_filters_by_device(per_device):
    res = CliRunner().invoke(main, ["show", "--op", "rms_norm", "--device", "NVIDIA H100 80GB HBM3", "--json"])
    assert [r["device"] for r in json.loads(res.stdout)["tuning"]] == ["h100"]
    text = CliRunner().invoke(main, ["show", "--op", "rms_norm"]).stdout
    assert "device" in text.splitlines()[0] and " h100 " in text and " h200 " in text


def _schema2_db(path: Path) -> None:
    """A DB as the schema-2 code left it: no device column, keys without it."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('db_schema', '2')")
    for table, pk in (("tuning", rows.TUNING_PK), ("crossover", rows.CROSSOVER_PK), ("measurements", None)):
        sql_type = {str: "TEXT", float: "REAL", int: "INTEGER"}
        cols = ", ".join(f"{c} {sql_type[t]}" for c, t in rows.COLUMNS[table].items() if c != "device")
        keys = f", PRIMARY KEY ({', '.join(c for c in pk if c != 'device')})" if pk else ""
        con.execute(f"CREATE TABLE {table} ({cols}{keys})")
    row = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in _row("NVIDIA H200", 4, 0.5).items()}
    con.execute(f"INSERT INTO tuning ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", list(row.values()))
    con.commit()
    con.close()


def test_schema2_db_is_read_as_is_and_migrates_to_device_keys(tmp_path, monkeypatch, no_shipped_defaults):
    path = tmp_path / "v2.db"
    _schema2_db(path)
    before = path.read_bytes()
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(path))
    dispatch.reset()
    assert _explain("--device", "h200")["origin"] == "db"           # the device class derived from the name
    assert path.read_bytes() == before
    with open_store(path) as store:
        assert store.db.execute("SELECT value FROM meta").fetchone()[0] == str(DB_SCHEMA) == "3"
        assert store.db["tuning"].pks == list(rows.TUNING_PK)
        assert [r["device"] for r in store.all_rows("tuning")] == ["h200"]
        store.put_tuning(_row("NVIDIA H100 80GB HBM3", 2, 1.0))      # the same key on another device: a second row
        assert sorted(r["device"] for r in store.all_rows("tuning")) == ["h100", "h200"]
    dispatch.reset()
    assert _explain("--device", "h100")["config"]["num_warps"] == 2


def test_a_device_that_contradicts_its_name_is_refused(tmp_path):
    line = json.dumps({"table": "tuning", **_row("NVIDIA H200", 4, 0.5, device="h100")})
    with pytest.raises(Exception, match="device='h100' but device_name='NVIDIA H200' is a h200"):
        load_jsonl(open_store(tmp_path / "x.db"), [line])
    line = json.dumps({"table": "tuning", **_row("", 4, 0.5, device="H 100!")})
    with pytest.raises(Exception, match="is not a device class"):
        load_jsonl(open_store(tmp_path / "x.db"), [line])


def test_doctor_counts_a_models_shapes_with_rows_for_this_device(no_shipped_defaults):
    res = CliRunner().invoke(main, ["doctor", "--json"])
    cov = json.loads(res.stdout)["coverage"]
    assert (cov["model"], cov["device"], cov["covered"]) == ("qwen3-1.7b", "cpu", 0) and cov["shapes"] > 5
    assert cov["command"] == "liger-tune sweep --arch cpu --model qwen3-1.7b"
    row = dict(_row("cpu (Triton interpreter)", 2, 1.0), arch="cpu", static_key=RN.static_key({"hidden": 64}),
               bucket=RN.bucket_key({"rows": 8}), config=RN.config().to_dict() | {"num_warps": 2}, method="cpu-wall",
               **{k: v for k, v in fingerprint("cpu", source_hash(RN)).items() if k != "device_name"})
    with open_store() as store:
        store.put_tuning(row)
    dispatch.reset()
    res = CliRunner().invoke(main, ["doctor"])
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("coverage"))
    assert line == (f"coverage     1 of {cov['shapes']} qwen3-1.7b shapes (bf16) have rows for cpu; "
                    "the rest: liger-tune sweep --arch cpu --model qwen3-1.7b"), line
    res = CliRunner().invoke(main, ["doctor", "--model", "nosuch", "--json"])
    assert res.exit_code == 0 and "unknown preset 'nosuch'" in json.loads(res.stdout)["coverage"]["error"]


def test_doctor_counts_the_coverage_of_another_device_from_a_cpu_machine(no_shipped_defaults):
    """`doctor --device h100` on a CPU machine counts the model's Hopper shapes that have rows of the H100: a row
    of the H100 counts there and not for the H200 or the GH200 (a fallback is not coverage)."""
    from liger_rt.tools.presets import get_preset
    hopper = dispatch.target_for_arch("hopper").arch
    dims = RN.check_dims(RN.plan(get_preset("qwen3-1.7b"), hopper, False)[0])

    def coverage(*args):
        res = CliRunner().invoke(main, ["doctor", "--json", *args])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["coverage"]
    before = coverage("--device", "h100")
    assert (before["device"], before["covered"], before["command"]) == (
        "h100", 0, "liger-tune sweep --arch hopper --model qwen3-1.7b") and before["shapes"] > 5
    with open_store() as store:
        store.put_tuning(_row("NVIDIA H100 80GB HBM3", 4, 0.5, static_key=RN.static_key(dims),
                              bucket=RN.bucket_key(dims)))
    dispatch.reset()
    assert coverage("--device", "h100")["covered"] == 1
    assert coverage("--device", "NVIDIA H100 80GB HBM3", "--arch", "hopper")["covered"] == 1
    assert [coverage("--device", d)["covered"] for d in ("h200", "gh200")] == [0, 0]
    assert coverage()["device"] == "cpu"                     # without --device: this machine
    res = CliRunner().invoke(main, ["doctor", "--device", "h100", "--arch", "ampere"])
    assert res.exit_code == 2 and "h100 is a hopper device, not ampere" in res.output
    assert "Traceback" not in res.output


def test_the_defaults_ship_winners_and_the_measurements_ship_beside_the_benchmarks(tmp_path):
    folder = resources.files("liger_rt.tuning_db") / "defaults"
    files = [p for p in folder.iterdir() if p.name.endswith(".jsonl")]
    assert sum(len(p.read_bytes()) for p in files) < 150 * 1024
    tables = {json.loads(line)["table"] for p in files for line in p.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    assert tables == {"meta", "tuning", "crossover"}
    raw = ROOT / "benchmarks" / "data" / "sweeps" / "hopper_measurements.jsonl.gz"
    assert raw.stat().st_size < 256 * 1024
    res = CliRunner().invoke(main, ["import", str(raw), "--db", str(tmp_path / "raw.db")])
    assert res.exit_code == 0, res.output
    with gzip.open(raw, "rt") as f:
        counts = load_jsonl(open_store(tmp_path / "raw.db"), f.read().splitlines())
    assert counts["measurements"] > 1000 and counts["tuning"] == counts["crossover"] == 0


def test_export_winners_of_one_device(per_device):
    with open_store() as store:
        store.put_measurements(dict(op="rms_norm", arch="hopper", dtype="bf16", static_key=RN.static_key(SHAPE),
                                    dims=json.dumps(SHAPE), impl="torch", config={}, median_ms=2.0, ok=1,
                                    method="cuda-graph", **fingerprint("hopper", source_hash(RN))))
    res = CliRunner().invoke(main, ["export", "-", "--device", "h200", "--winners"])
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert res.exit_code == 0 and [(r["table"], r.get("device")) for r in recs] == [("meta", None), ("tuning", "h200")]
    res = CliRunner().invoke(main, ["export", "-", "--device", "h100"])
    assert sorted(json.loads(line)["table"] for line in res.stdout.splitlines()) == ["measurements", "meta", "tuning"]


# -- first use on an untuned device ----------------------------------------------------------------------------

def _first_use_arches() -> list:
    """Every arch profile, the generic ones (an unknown GPU) and parts a profile serves with the device's own
    limits: Ampere/Ada consumer and workstation cards (sm86/sm89: 99 KiB of shared memory per block), a GH200."""
    parts = (("NVIDIA GeForce RTX 4090", (8, 9), 128), ("NVIDIA L40S", (8, 9), 142), ("NVIDIA A10", (8, 6), 72),
             ("NVIDIA GeForce RTX 3090", (8, 6), 82), ("NVIDIA GH200 480GB", (9, 0), 132))
    return ([backend.profile(name) for name in backend.ARCH_NAMES]
            + [backend.generic_profile(name) for name in rows.GENERIC_ARCHES]
            + [backend.arch_from_properties(name, capability=cap, sm_count=sms) for name, cap, sms in parts])


def test_heuristic_configs_launch_on_every_arch_profile():
    """What the first call on an untuned device runs: the heuristic (and pinned) config of every op, at every
    shape its sweep plans or a model preset uses, fits that arch's warps, pipeline stages and shared memory
    (rows.launch_problem, the check a DB row passes).  The register file (64K 32-bit registers per SM, 255 per
    thread) is the same on every NVIDIA profile here; the ops bound their tiles per program for it
    (tests/test_op_contract.py, TILE_BOUNDS)."""
    from liger_rt.dtypes import dtype_name
    from liger_rt.registry import OP_MODULES
    from liger_rt.tools.presets import PRESETS
    presets = [p for p in PRESETS.values() if not p.tiny]
    arches = _first_use_arches()
    assert {a.smem_bytes for a in arches if a.capability in ("sm86", "sm89")} == {101376}
    checked = 0
    for arch in arches:
        for name in OP_MODULES:
            op = REGISTRY.get(name)
            plans = [*op.plan(None, arch, True), *op.plan(None, arch, False), *(d for p in presets
                                                                                for d in op.plan(p, arch, False))]
            for dims in {json.dumps(op.check_dims(d), sort_keys=True): op.check_dims(d) for d in plans}.values():
                for dtype in (torch.bfloat16, torch.float32):
                    for impl in (i for i in op.impls if i.tuned and (i.supports is None or i.supports(dims, dtype)
                                                                     is None)):
                        fixed = [op.heuristic(arch, dims, dtype)] + ([op.pinned(arch, dims, dtype)] if op.pinned
                                                                     else [])
                        for cfg in fixed:
                            why = rows.launch_problem(op, impl.name, cfg, dims, arch, dtype_name(dtype))
                            assert why is None, (arch.name, arch.device_name, name, dims, dtype, cfg, why)
                            checked += 1
    assert checked > 5000


@pytest.mark.parametrize("arch", backend.ARCH_NAMES)
def test_the_first_call_on_an_untuned_device_runs_the_heuristic_and_never_tunes(arch, monkeypatch,
                                                                               no_shipped_defaults):
    """LIGER_RT_ARCH forces each profile on CPU (the kernels through the interpreter): with no row for the device,
    the first call takes the arch's heuristic config, measures nothing, and computes what the reference does."""
    from liger_rt import autotune, ops

    def no_tuning(*args, **kwargs):
        raise AssertionError("a call tuned without LIGER_RT_AUTOTUNE=1")
    monkeypatch.setattr(autotune.tuning, "tune", no_tuning)
    monkeypatch.setenv("LIGER_RT_ARCH", arch)
    dispatch.reset()
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = ops.rms_norm(x, w, eps=1e-6)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    rx, rw = torch.autograd.grad(ref.sum(), (x64, w64))
    for got, want in ((y, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-4)
    (d,) = [d for d in dispatch.decisions() if d.op == "rms_norm"]
    assert (d.arch, d.impl, d.origin) == (arch, "triton", "heuristic"), d
    assert d.config == RN.heuristic(backend.profile(arch), dict(d.dims), torch.float32)


def test_online_tuning_says_so_once_per_op(monkeypatch, no_shipped_defaults):
    """LIGER_RT_AUTOTUNE=1: a miss is tuned inside the call, never silently: one warning per op names the op, the
    shape and the device, then each new shape is tuned without repeating it."""
    from liger_rt import ops
    from liger_rt.autotune import online
    monkeypatch.setattr(online, "_ANNOUNCED", set())
    monkeypatch.setenv("LIGER_RT_AUTOTUNE", "1")
    monkeypatch.setenv("LIGER_RT_ARCH", "ampere")
    dispatch.reset()
    with pytest.warns(RuntimeWarning) as caught:
        for hidden in (64, 32):
            ops.rms_norm(torch.randn(8, hidden), torch.randn(hidden))
    said = [str(w.message) for w in caught if "tuning" in str(w.message)]
    assert said == ["liger_rt: tuning rms_norm now (fp32 hidden=64,rows=8 has no row for a100; LIGER_RT_AUTOTUNE=1): "
                    "each new shape of it is measured once, inside its first call, and saved to the user DB"], said
    assert {d.origin for d in dispatch.decisions() if d.op == "rms_norm"} == {"online"}


def test_doctor_says_where_the_rest_is_swept(monkeypatch, no_shipped_defaults):
    """The coverage line names the sweep that fills the rest; under LIGER_RT_ARCH for another arch it says where
    that sweep must run, and on an unknown GPU that there is none."""
    monkeypatch.setenv("LIGER_RT_ARCH", "ampere")
    dispatch.reset()
    line = next(ln for ln in CliRunner().invoke(main, ["doctor"]).stdout.splitlines() if ln.startswith("coverage"))
    assert line.endswith("have rows for a100; the rest: liger-tune sweep --arch ampere --model qwen3-1.7b (it "
                         "measures on ampere hardware only; this machine is cpu)"), line
    monkeypatch.delenv("LIGER_RT_ARCH")
    with pytest.warns(RuntimeWarning, match="unknown GPU"):
        rtx = backend.arch_from_properties("NVIDIA GeForce RTX 5090", capability=(12, 0), sm_count=170)
    monkeypatch.setattr(backend, "detect", lambda device=None: rtx)
    res = CliRunner().invoke(main, ["doctor", "--json"])
    cov = json.loads(res.stdout)["coverage"]
    assert (cov["device"], cov["covered"], cov["command"]) == ("rtx-5090", 0, None) and cov["shapes"] > 5
    line = next(ln for ln in CliRunner().invoke(main, ["doctor"]).stdout.splitlines() if ln.startswith("coverage"))
    assert line == (f"coverage     0 of {cov['shapes']} qwen3-1.7b shapes (bf16) have rows for rtx-5090; an unknown "
                    "GPU runs the generic-nvidia heuristics and has no sweep (profiled arches: "
                    f"{', '.join(backend.ARCH_NAMES)})"), line
