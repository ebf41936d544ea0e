"""Table-driven model patchers: ``patch``, ``unpatch``, ``patched``, ``supported_models``, ``describe``.

    liger_rt.patch(model, fused_linear_cross_entropy=True)   # a loaded model: instance level
    liger_rt.patch("qwen3")                                  # a model type: class level
    with liger_rt.patched(model, swiglu=False): ...

The mechanism is in core.py, the per-family tables in specs.py, the semantics in docs/patching.md.
``liger_rt.patch`` is both this package and the function: importing a subpackage makes it an
attribute of its parent, so this module is made callable and its ``patch`` attribute is the module
itself; ``liger_rt.patch(model)`` and ``from liger_rt.patch import patch`` work whichever import ran
first.  The plain function is ``liger_rt.patch.core.patch``.
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
