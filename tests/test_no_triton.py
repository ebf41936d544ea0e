"""Without Triton (macOS, Windows, a CPU-only torch) liger_rt still works: every op runs its PyTorch
implementation, a patched model trains with one warning that says why, timing (the autotuner's clock) works, and
`liger-tune doctor` says so.

One subprocess hides Triton (``sys.modules["triton"] = None``: ``import triton`` raises ModuleNotFoundError,
as where it is not installed) and runs the checks in SCRIPT, which prints its findings as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import contextlib, io, json, runpy, sys, warnings
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch
import torch.nn.functional as F
import liger_rt
from liger_rt import _triton, backend, dispatch, ops
from liger_rt.autograd import run_case
from liger_rt.registry import REGISTRY
from liger_rt.tools.models import build_model

out = {"reason": _triton.reason(), "ops": {}, "public": {}}


def clone(args):
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


def err(got, want):
    return max([float((g.detach().double() - w.detach().double()).abs().max()) for g, w in zip(got, want)
                if isinstance(g, torch.Tensor) and g.is_floating_point() and g.numel()] or [0.0])


# every op of the registry through the functionals' body (dispatch.call) against its torch implementation
torch.manual_seed(0)
for op in REGISTRY.ops():
    dims = op.check_dims(op.plan(None, backend.profile("cpu"), True)[0])
    case = op.make_case(dims, torch.float32, "cpu")
    args = clone(case.args)
    outs = dispatch.call(op, *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, case.grads) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True,
                                materialize_grads=True)
    want = run_case(op, op.impl("torch"), type(case)(clone(case.args), case.grads), None)
    out["ops"][op.name] = {"err": err([*outs, *grads], want), "n": len(want)}
out["impls"] = {d.op: d.impl for d in dispatch.decisions()}

# a few public functionals against formulas
x, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True)
y = ops.rms_norm(x, w, eps=1e-6)
y.sum().backward()
x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
ref = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2
ref.sum().backward()
out["public"]["rms_norm"] = err([y, x.grad, w.grad], [ref, x2.grad, w2.grad])
g, u = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
out["public"]["swiglu"] = err([ops.swiglu(g, u)], [F.silu(g) * u])
logits, target = torch.randn(6, 32), torch.randint(0, 32, (6,))
out["public"]["cross_entropy"] = err([ops.cross_entropy(logits, target)], [F.cross_entropy(logits, target)])

# a patched tiny qwen3's training step: one warning about Triton
model = build_model("qwen3-tiny")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    liger_rt.patch(model)
    liger_rt.patch(model)                        # a second patch does not repeat it
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
out["warnings"] = [str(c.message) for c in caught if "Triton" in str(c.message)]
out["loss"] = float(loss.detach())
out["grads"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
out["patched"] = sum((liger_rt.patch.describe(model) or {}).get("patched", {}).values())
out["model_impls"] = sorted({d.impl for d in dispatch.decisions()})

# timing: the CPU clock, and on a GPU do_bench's recipe on torch's CUDA events (no triton.testing)
from liger_rt.autotune import timing
ms, method = timing.time_fn(lambda: torch.ones(64).sum(), "cpu", quick=True)
timing.event_bench = lambda fn, warmup, rep: fn() or 0.25      # the CUDA clock, on this CPU-only machine
out["timing"] = {"cpu": [ms, method], "do_bench": timing.do_bench(lambda: None, warmup=1, rep=2),
                 "triton_loaded": "triton.testing" in sys.modules and sys.modules["triton.testing"] is not None}

# liger-tune doctor, as `python -m liger_rt.tools.cli doctor` runs it
for argv, key in ((["doctor"], "doctor"), (["doctor", "--json"], "doctor_json")):
    sys.argv, buf, code = ["liger-tune", *argv], io.StringIO(), None
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_module("liger_rt.tools.cli", run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    out[key] = {"code": code, "stdout": buf.getvalue()}
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("LIGER_")}
    env["LIGER_RT_TUNING_DB"] = str(tmp_path_factory.mktemp("db") / "tuning.db")     # not the user's DB
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def test_the_reason_names_the_missing_module(found):
    assert found["reason"].startswith("Triton is not installed (ModuleNotFoundError")
    assert "pip install triton" in found["reason"]


def test_every_op_runs_its_torch_implementation(found):
    from liger_rt.registry import OP_MODULES       # the package's ops (this process may hold the tests' toy op too)
    assert set(found["ops"]) == set(OP_MODULES)
    assert "triton" not in found["impls"].values() and set(found["impls"]) == set(OP_MODULES)
    for name, r in found["ops"].items():
        assert r["n"] > 0 and r["err"] <= 1e-5, (name, r)
    for name, e in found["public"].items():
        assert e <= 1e-5, (name, e)


def test_a_patched_model_trains_with_one_warning(found):
    assert len(found["warnings"]) == 1, found["warnings"]
    assert found["warnings"][0].startswith("liger_rt: Triton is not installed")
    assert found["patched"] > 0 and found["grads"] and found["loss"] == found["loss"]
    assert "triton" not in found["model_impls"]


def test_timing_works_without_triton(found):
    ms, method = found["timing"]["cpu"]
    assert method == "cpu-wall" and ms > 0
    assert found["timing"]["do_bench"] == 0.25 and not found["timing"]["triton_loaded"]


@pytest.mark.gpu
def test_event_bench_agrees_with_triton_do_bench():
    """The torch-event do_bench (what a CUDA machine without Triton times with) against triton's own."""
    import torch
    import triton.testing

    from liger_rt.autotune import timing
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    fn = (lambda: a @ a)
    ours = timing.event_bench(fn, warmup=25, rep=100)
    theirs = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    assert abs(ours - theirs) <= 0.15 * theirs, (ours, theirs)


def test_doctor_says_the_kernels_are_off(found):
    text = found["doctor"]
    assert text["code"] in (0, None), text
    lines = [x for x in text["stdout"].splitlines() if x.startswith("triton ")]
    assert len(lines) == 1 and "kernels OFF: Triton is not installed" in lines[0], text["stdout"]
    info = json.loads(found["doctor_json"]["stdout"])
    assert info["triton"]["available"] is False and "not installed" in info["triton"]["reason"]
    assert not [o for o in info["ops"] if "cannot be loaded" in o]
