"""liger_rt: fused Triton training kernels that pick implementation and launch config per backend, dtype and
shape from a persisted tuning database, patched into Hugging Face models.

    import liger_rt
    liger_rt.patch(model)                       # instance-level, weights untouched
    y = liger_rt.ops.rms_norm(x, weight)        # functional, dispatched per call
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {"patch", "unpatch", "patched", "supported_models"}
__all__ = ["__version__", "ops", "dispatch", "backend", "env", *sorted(_LAZY)]


def __getattr__(name: str):
    import importlib
    if name in ("ops", "dispatch", "backend", "env", "autotune", "tuning_db", "layers", "kernels"):
        return importlib.import_module(f"liger_rt.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module("liger_rt.patch"), name)
    raise AttributeError(f"module 'liger_rt' has no attribute {name!r}")
