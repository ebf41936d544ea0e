"""Table-driven model patchers: ``patch``, ``unpatch``, ``patched``, ``supported_models``, ``describe``.

    liger_rt.patch(model, fused_linear_cross_entropy=True)   # a loaded model: instance level
    liger_rt.patch("qwen3")                                  # a model type: class level

The mechanism is in core.py, the tables in specs.py.  ``liger_rt.patch`` is both this package and the
function: this module is callable, and its ``patch`` attribute is the module itself, so
``liger_rt.patch(model)`` and ``from liger_rt.patch import patch`` work whichever import ran first.
"""
from __future__ import annotations

import sys
import types

from .._swaps import original  # noqa: F401  (liger_rt.patch.original)
from . import core
from .core import PatchWarning, describe, patched, supported_models, unpatch

__all__ = ["patch", "unpatch", "patched", "supported_models", "describe", "PatchWarning"]


class _CallableModule(types.ModuleType):
    def __call__(self, target, **layers):
        return core.patch(target, **layers)

    __call__.__doc__ = core.patch.__doc__


sys.modules[__name__].__class__ = _CallableModule
patch = sys.modules[__name__]
