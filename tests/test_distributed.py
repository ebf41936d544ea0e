"""liger_rt under DDP and FSDP2 (fully_shard) on CPU with gloo, 2 processes on 127.0.0.1.

One pair of worker processes per wrapper (this file run as a script) does, in order:
1. parity: tiny Qwen3 and tiny LFM2-MoE from configs (random weights), the unpatched model against
   `liger_rt.patch(model)`, both wrapped, kernels through the Triton interpreter, fp32: loss,
   gradients (gathered whole) and the AdamW update within the parity tool's gates;
2. rank consistency: LIGER_RT_AUTOTUNE=1 over an empty DB in a tmp dir, one training step of a
   wrapped patched Qwen3: rank 0 tunes each case once, rank 1 never, and the digests of every
   memoised decision agree (`check_decisions_agree` all-gathers them).
In step 2 the wrapped `autotune.tuning.tune` makes the fastest Triton config win (on CPU the interpreted
kernels never beat torch, which would leave every decision "torch" and the configs untested).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("qwen3-tiny", "lfm2-moe-tiny")


# -- the worker (one rank) -------------------------------------------------------------------------------

def worker(rank: int, port: str, how: str, out_path: str) -> None:
    from datetime import timedelta
    import torch.distributed as dist
    torch.set_num_threads(1)      # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=120))     # a hang fails the test instead of the run
    import liger_rt
    from liger_rt import autotune, dispatch
    from liger_rt.tools import distributed as D
    from liger_rt.tools.models import build_model
    from liger_rt.tools.parity import format_table, make_inputs
    out: dict = {"rank": rank, "parity": {}}
    for preset in PRESETS:
        base, new = build_model(preset), build_model(preset)
        new.load_state_dict(base.state_dict())
        inputs = make_inputs(base)
        liger_rt.patch(new)
        report = D.compare_wrapped(D.wrap(base, how), D.wrap(new, how), inputs, all_rows=False)
        out["parity"][preset] = {"ok": report["ok"], "table": format_table(report),
                                 "rows": {k: {"value": r[r["gate"]], "tolerance": r["tolerance"], "ok": r["ok"]}
                                          for k, r in report["rows"].items()}}
    out["parity_impls"] = sorted({(d["op"], d["impl"]) for d in D.decisions()})
    # negative control through the same wrap/gather path: the final norm's weight 10% larger
    base, bad = build_model(PRESETS[0]), build_model(PRESETS[0])
    with torch.no_grad():
        bad.model.norm.weight.mul_(1.1)
    report = D.compare_wrapped(D.wrap(base, how), D.wrap(bad, how), inputs=make_inputs(base), all_rows=False)
    out["control"] = {k: r["ok"] for k, r in report["rows"].items()}

    os.environ["LIGER_RT_AUTOTUNE"] = "1"
    dispatch.reset()
    tuned, real = [], autotune.tuning.tune

    def triton_wins(op, target, dtype, dims, **kw):
        tuned.append([op.name, dims])
        result = real(op, target, dtype, dims, **kw)
        best = {k: v for k, v in result["best"].items() if k != "torch"}
        if best:
            result["winner"] = min(best.values(), key=lambda r: r["median_ms"])
        return result
    autotune.tuning.tune = triton_wins
    model = D.wrap(liger_rt.patch(build_model("qwen3-tiny")), how)
    D.train_step(model, make_inputs(build_model("qwen3-tiny")), 1e-3)
    out.update(tuned=tuned, digest=D.decisions_digest(), all_digests=D.check_decisions_agree(),
               decisions=[d.to_dict() for d in dispatch.decisions()])
    Path(out_path).write_text(json.dumps(out, default=str))
    dist.destroy_process_group()


# -- the tests ------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def run(request, tmp_path_factory):
    """Both ranks' JSON results for one wrapper."""
    how = request.param
    tmp = tmp_path_factory.mktemp(how)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_")}
    env.update(TRITON_INTERPRET="1", LIGER_RT_TUNING_DB=str(tmp / "empty" / "tuning.db"),
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, __file__, str(r), port, how, str(tmp / f"rank{r}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"{how} rank failed:\n{log[-3000:]}"
    return how, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], tmp


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_patched_matches_unpatched_under_wrapper(run, preset):
    how, ranks, _ = run
    for res in ranks:
        rep = res["parity"][preset]
        assert set(rep["rows"]) == {"optimisation_loss", "gradients", "adamw_update"}
        assert rep["ok"], f"{how} {preset} rank {res['rank']}:\n{rep['table']}"
    assert ranks[0]["parity"][preset]["rows"] == ranks[1]["parity"][preset]["rows"]
    # the patched model really ran the kernels (a heuristic decision, not the torch reference)
    impls = {op: impl for op, impl in map(tuple, ranks[0]["parity_impls"])}
    expected = {"qwen3-tiny": {"rms_norm", "swiglu"},
                "lfm2-moe-tiny": {"rms_norm", "swiglu", "short_conv", "moe_router", "moe_experts"}}[preset]
    assert {op for op in expected if impls.get(op) == "triton"} == expected, impls


@pytest.mark.slow
def test_a_perturbed_weight_fails_the_gates(run):
    how, ranks, _ = run
    for res in ranks:     # (a first AdamW step is about lr * sign(grad): a scaled gradient moves it alike)
        assert not res["control"]["optimisation_loss"] and not res["control"]["gradients"], how


@pytest.mark.slow
def test_rank0_tunes_once_and_every_rank_decides_alike(run):
    how, ranks, tmp = run
    r0, r1 = ranks
    assert r1["tuned"] == [], f"{how}: rank 1 tuned"
    keys = [json.dumps(t, sort_keys=True) for t in r0["tuned"]]
    assert keys and len(keys) == len(set(keys)), f"{how}: rank 0 tuned {keys}"
    assert r0["digest"] == r1["digest"] and r0["all_digests"] == r1["all_digests"] == [r0["digest"]] * 2
    assert sorted(map(json.dumps, r0["decisions"])) == sorted(map(json.dumps, r1["decisions"]))
    online = [d for d in r0["decisions"] if d["origin"] == "online"]
    assert len(online) == len(keys) and {d["impl"] for d in online} == {"triton"}
    # the nearest-bucket path after an online tune (q_norm rows 64 tuned, k_norm rows 32 found) agrees
    assert any(d["origin"] == "db-nearest" for d in r1["decisions"])
    from liger_rt.tuning_db import open_store
    rows = open_store(tmp / "empty" / "tuning.db").all_rows("tuning")
    assert {r["origin"] for r in rows} == {"online"}
    assert len({(r["op"], r["static_key"], r["bucket"]) for r in rows}) == len(keys)


# -- the digest itself (one process) -------------------------------------------------------------------

def test_digest_covers_op_dims_dtype_impl_config_only():
    from liger_rt import dispatch
    from liger_rt.registry import REGISTRY
    from liger_rt.tools.distributed import DIGEST_FIELDS, decisions, decisions_digest
    empty = decisions_digest()
    op = REGISTRY.get("rms_norm")
    d = dispatch.decision(op, torch.empty(4, 32), rows=4, hidden=32)
    assert decisions() == [{k: d.to_dict()[k] for k in DIGEST_FIELDS}]
    one = decisions_digest()
    assert one != empty
    key = next(iter(dispatch.memo(op)))
    dispatch.memo(op)[key] = dataclass_replace(d, origin="online", reason="another reason")
    assert decisions_digest() == one                 # origin and reason are not decisions
    other = next(c for c in op.candidates_for(op.impl("triton"), dispatch.current_target("cpu").arch,
                                              dict(d.dims), torch.float32) if c != d.config)
    dispatch.memo(op)[key] = dataclass_replace(d, config=other)
    assert decisions_digest() != one
    dispatch.memo(op)[key] = dataclass_replace(d, impl="torch")
    assert decisions_digest() != one
    dispatch.memo(op).clear()
    assert decisions_digest() == empty


def dataclass_replace(obj, **changes):
    import dataclasses
    return dataclasses.replace(obj, **changes)


def test_wrap_names_the_valid_wrappers():
    from liger_rt.tools.distributed import wrap
    with pytest.raises(ValueError, match="valid: ddp, fsdp2"):
        wrap(torch.nn.Linear(2, 2), "fsdp")


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
