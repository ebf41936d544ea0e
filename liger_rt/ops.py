"""Functional kernels: autograd-aware, dispatched per call (arch, dtype and shape pick the
implementation and config).  Each name imports its kernel module on first use; the names are the
op registry's (`dispatch.OP_MODULES`)."""
from __future__ import annotations

import importlib

from .dispatch import OP_MODULES

__all__ = list(OP_MODULES)


def __getattr__(name: str):
    if name in OP_MODULES:
        fn = getattr(importlib.import_module(f"liger_rt.kernels.{OP_MODULES[name]}"), name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"liger_rt.ops has no {name!r}; ops: {', '.join(OP_MODULES)}")


def __dir__():
    return __all__
