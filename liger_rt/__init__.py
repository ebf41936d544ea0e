"""liger_rt: fused Triton training kernels that pick implementation and launch config per backend, dtype and
shape from a persisted tuning database, patched into Hugging Face models.

    import liger_rt
    liger_rt.patch(model)                       # instance-level, weights untouched
    y = liger_rt.ops.rms_norm(x, weight)        # functional, dispatched per call
"""
from __future__ import annotations

__version__ = "0.1.0"

# the patchers, as plain functions: liger_rt.patch is the function (liger_rt/patch/__init__.py says why it
# is imported here, and why that costs no import time)
from .patch import patch, patched, supported_models, unpatch

__all__ = ["__version__", "ops", "dispatch", "backend", "env", "patch", "patched", "supported_models", "unpatch"]


def __getattr__(name: str):
    import importlib
    if name in ("ops", "dispatch", "backend", "env", "autotune", "tuning_db", "layers", "kernels"):
        return importlib.import_module(f"liger_rt.{name}")
    raise AttributeError(f"module 'liger_rt' has no attribute {name!r}")
