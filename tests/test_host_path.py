"""The eager host path of an op call, on CPU with the Triton launches stubbed:
after the first call a forward+backward reads no environment variable, queries no tuning DB and
recomputes no launch constant; the stub sees the launches; the lean paths keep torch's semantics."""
import os

import pytest
import torch

from liger_rt import backend, dispatch, env, launch, ops, tuning_db
from liger_rt.kernels import layer_norm as ln
from liger_rt.kernels import rms_norm as rn
from liger_rt.kernels import rope as rp
from liger_rt.kernels import row_norm
from liger_rt.kernels import swiglu as sw
from liger_rt.registry import REGISTRY
from liger_rt.tools.bench.host_overhead import StubbedLaunches, cpu_stub


class _CountingEnviron(dict):
    """os.environ's stand-in: every read is counted (get, [], in, iteration)."""

    def __init__(self, data):
        super().__init__(data)
        self.reads = []

    def get(self, key, default=None):
        self.reads.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.reads.append(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.reads.append(key)
        return super().__contains__(key)

    def __iter__(self):
        self.reads.append("<iter>")
        return super().__iter__()

    def items(self):
        self.reads.append("<items>")
        return super().items()


@pytest.fixture
def triton_path(monkeypatch):
    """The Triton implementation on CPU tensors (the interpreter's availability; no kernel runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LIGER_RT_IMPL_RMS_NORM", "triton")
    monkeypatch.setenv("LIGER_RT_IMPL_LAYER_NORM", "triton")
    monkeypatch.setenv("LIGER_RT_IMPL_SWIGLU", "triton")
    monkeypatch.setenv("LIGER_RT_IMPL_ROPE", "triton")
    dispatch.reset()


def _count_slow_path(monkeypatch) -> dict:
    """Count the DB opens, decisions, arch detections, env checks and environment reads."""
    calls = {"get_store": 0, "decide": 0, "detect": 0, "env.check": 0}

    def counted(name, real):
        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return wrapper
    monkeypatch.setattr(tuning_db, "get_store", counted("get_store", tuning_db.get_store))
    monkeypatch.setattr(dispatch, "decide", counted("decide", dispatch.decide))
    monkeypatch.setattr(backend, "detect", counted("detect", backend.detect))
    monkeypatch.setattr(env, "check", counted("env.check", env.check))
    environ = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    calls["environ"] = environ.reads
    return calls


def _fwd_bwd_call(name):
    """(a forward+backward through the functional, the kernel modules, launches per call)."""
    if name in ("rms_norm", "layer_norm"):
        x, w, dy = torch.randn(2, 3, 64, requires_grad=True), torch.randn(64, requires_grad=True), torch.randn(2, 3, 64)
        fwd = (lambda: ops.rms_norm(x, w)) if name == "rms_norm" else (lambda: ops.layer_norm(x, w, None))
        return (lambda: torch.autograd.grad(fwd(), (x, w), dy)), (rn, ln, row_norm), 3   # forward, backward, dW sum
    if name == "swiglu":
        g, u = torch.randn(2, 3, 64, requires_grad=True), torch.randn(2, 3, 64, requires_grad=True)
        dy = torch.randn(2, 3, 64)
        return (lambda: torch.autograd.grad(ops.swiglu(g, u), (g, u), dy)), (sw,), 2
    q = torch.randn(2, 5, 4, 16).transpose(1, 2).requires_grad_()      # HF's views of (B, S, H, D)
    k = torch.randn(2, 5, 2, 16).transpose(1, 2).requires_grad_()
    cos, sin, dq, dk = torch.randn(1, 5, 16), torch.randn(1, 5, 16), torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    return (lambda: torch.autograd.grad(ops.rope(q, k, cos, sin), (q, k), (dq, dk))), (rp,), 2


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "swiglu", "rope"])
def test_memo_hit_reads_no_env_and_no_db(triton_path, monkeypatch, name):
    call, modules, per_call = _fwd_bwd_call(name)
    with StubbedLaunches(*modules) as stub:
        call()                                            # the miss: decision and launch constants
        assert stub.launches == per_call                  # the Triton path
        op = REGISTRY.get(name)
        assert [d.impl for d in dispatch.memo(op).values()] == ["triton"]
        memos = [*launch._LAUNCH_MEMOS, rp._layout_memo]      # rope's layout check: memoised per shapes
        memo_misses = [m.cache_info().misses for m in memos]
        calls = _count_slow_path(monkeypatch)
        for _ in range(3):
            call()
        assert stub.launches == 4 * per_call
        assert [m.cache_info().misses for m in memos] == memo_misses
    reads = calls.pop("environ")
    assert calls == {"get_store": 0, "decide": 0, "detect": 0, "env.check": 0}
    assert [k for k in reads if "LIGER" in str(k) or "TRITON" in str(k) or k.startswith("<")] == []


def test_a_new_shape_decides_and_reset_clears_the_launch_constants(triton_path, monkeypatch):
    """The counters above can fire: a new bucket decides (env, DB), and dispatch.reset() forgets
    the launch constants along with the decisions."""
    x, w = torch.randn(4, 64), torch.randn(64)
    with StubbedLaunches(rn):
        ops.rms_norm(x, w)
        calls = _count_slow_path(monkeypatch)
        ops.rms_norm(torch.randn(40, 64), w)
        assert calls["decide"] == 1 and calls["get_store"] >= 1 and calls["environ"]
        assert rn._fwd_launch.cache_info().currsize == 2
        dispatch.reset()
        assert rn._fwd_launch.cache_info().currsize == 0
        ops.rms_norm(x, w)
        assert calls["decide"] == 2 and rn._fwd_launch.cache_info().currsize == 1
    assert rn._fwd_launch.cache_info().currsize == 0       # the stub's bound runs are not kept


def test_second_differentiation_still_refused(triton_path):
    """Under create_graph the backward is once_differentiable, as it was: the kernels' gradient
    is not differentiable, and differentiating it raises instead of returning zeros."""
    x = torch.randn(3, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    dy = torch.randn(3, 32, requires_grad=True)
    dx, = torch.autograd.grad(ops.rms_norm(x, w), x, dy, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


def test_kernel_function_under_functorch_is_refused_as_before(triton_path):
    """Under a functorch transform the call goes through Function.apply itself, which refuses a
    Function without setup_context: the same error as before the direct C entry."""
    x, w = torch.randn(3, 32), torch.randn(32)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: ops.rms_norm(t, w).sum())(x)


def test_cpu_stub_probe_rows():
    rows = cpu_stub(repeats=1, calls=3, echo=lambda s: None)
    assert [r["what"] for r in rows] == [f"ops.{op} fwd{bwd}" for op in ("rms_norm", "swiglu", "rope")
                                         for bwd in ("", "+bwd (autograd.grad)")] + \
        ["floor: identity Function fwd+bwd", "floor: eager x*2 fwd+bwd"]
    assert all(r["us"] > 0 and "CPU stub" in r["method"] for r in rows)
    assert not any(k in os.environ for k in ("LIGER_RT_IMPL_RMS_NORM", "LIGER_RT_IMPL_SWIGLU", "LIGER_RT_IMPL_ROPE"))
