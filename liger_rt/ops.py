"""Functional kernels: autograd-aware, dispatched per call (arch, dtype and shape pick the
implementation and config).  Each name imports its kernel module on first use."""
from __future__ import annotations

import importlib

_FUNCTIONS = {
    "rms_norm": "rms_norm",
    "swiglu": "swiglu",
    "layer_norm": "layer_norm",
    "short_conv": "short_conv",
    "moe_router": "moe_router",
    "moe_experts": "moe_experts",
    "cross_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
    "rope": "rope",
}
__all__ = list(_FUNCTIONS)


def __getattr__(name: str):
    if name in _FUNCTIONS:
        mod = importlib.import_module(f"liger_rt.kernels.{_FUNCTIONS[name]}")
        fn = getattr(mod, name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"liger_rt.ops has no {name!r}; ops: {', '.join(_FUNCTIONS)}")


def __dir__():
    return __all__
