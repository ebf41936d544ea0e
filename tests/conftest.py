"""Test setup: kernels run through the Triton interpreter on CPU unless a GPU is present.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is decorated), hence at the top of conftest.  Every test gets a private tuning DB.  GPU tests
(``-m gpu``) state the memory they need (``gpu_mem``, tests/gpu_sizing.py), skip on a smaller card,
and fail if they leave memory allocated.  They run with the CUDA allocator's expandable segments
(unless PYTORCH_CUDA_ALLOC_CONF says otherwise): a small tensor that outlives a test, such as a cuBLAS
workspace, then pins a page and not the whole segment a model's weights were carved from, so the memory a
test frees goes back to the card and the next test's model fits.
"""
import os

import pytest

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # read at CUDA's first allocation
import torch  # noqa: E402

import gpu_sizing

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_mem(gib): GiB of GPU memory the test needs; skipped on a smaller card")


def _guarded(item) -> bool:
    return "gpu" in item.keywords and torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """GPU tests only: skip on a card smaller than the test's gpu_mem; fail the test if the memory it
    allocated is not free again after it (gpu_sizing.guard)."""
    if _guarded(request.node):
        yield from gpu_sizing.guard(request.node)
    else:
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep a GPU test's exception (its body's or a fixture's) for _gpu_memory, which clears its frames:
    they hold the test's tensors."""
    if call.when != "teardown" and call.excinfo is not None and _guarded(item):
        item.stash[gpu_sizing.CALL_EXCEPTION] = call.excinfo.value


_SETUP_S: dict[str, float] = {}


def pytest_report_teststatus(report, config):
    """On a GPU machine a test's verbose outcome names its seconds (setup and call), so that a log cut by a time
    limit still says where the time went."""
    if not torch.cuda.is_available() or report.when not in ("setup", "call") or hasattr(report, "wasxfail"):
        return None
    if report.when == "setup":
        _SETUP_S[report.nodeid] = report.duration
        return None
    secs = f"({_SETUP_S.pop(report.nodeid, 0.0) + report.duration:.1f} s)"
    if report.passed:
        return "passed", ".", f"PASSED {secs}"
    return ("failed", "F", f"FAILED {secs}") if report.failed else None


@pytest.fixture(autouse=True)
def _private_db(tmp_path, monkeypatch):
    """Each test sees an empty user DB and fresh dispatch memos; no LIGER_* leaks in."""
    for key in list(os.environ):
        if key.startswith("LIGER_"):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LIGER_RT_TUNING_DB", str(tmp_path / "tuning.db"))
    from liger_rt import dispatch
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if missing := gpu_sizing.unstated(items):
        raise pytest.UsageError(f"tests/gpu tests without @pytest.mark.gpu_mem(gib=...): {', '.join(missing)}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_shipped_defaults(monkeypatch):
    """Hide the shipped tuning defaults (tests of the heuristic and crossover paths in isolation)."""
    from liger_rt import dispatch
    from liger_rt.tuning_db import store
    monkeypatch.setattr(store, "_DEFAULTS", store.Store(None, layer="shipped"))
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture
def fallback(monkeypatch):
    """Every op on its torch reference (LIGER_RT_DISABLE=1)."""
    monkeypatch.setenv("LIGER_RT_DISABLE", "1")
    from liger_rt import dispatch
    dispatch.reset()
