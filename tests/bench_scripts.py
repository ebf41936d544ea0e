"""What the benchmark tests share: loading a repository script (benchmarks/) as a module, and one CPU thread."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(relpath: str):
    """benchmarks/<relpath> as a module (registered while it runs: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, BENCHMARKS / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    return mod


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared CPU: more threads only add spin-waiting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
