"""Test setup: kernels run through the Triton interpreter on CPU unless a GPU is present.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is decorated), hence at the top of conftest.  Every test gets a private tuning DB.
"""
import os

import pytest

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the H200: pytest -m gpu)")
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
