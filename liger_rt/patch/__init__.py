"""Table-driven model patchers: ``patch``, ``unpatch``, ``patched``, ``supported_models``.

    import liger_rt
    liger_rt.patch(model)                          # a loaded model: instance level, weights untouched
    liger_rt.patch(model, fused_linear_cross_entropy=True)
    liger_rt.patch("qwen3")                        # a model type: class level, before building models
    liger_rt.unpatch(model)
    with liger_rt.patched(model, swiglu=False): ...
    liger_rt.supported_models()                    # ['qwen3', 'llama', 'lfm2', 'lfm2_moe', 'lfm2_vl', ...]

The mechanism is in core.py, the per-family tables in specs.py, the semantics in docs/patching.md.

``liger_rt.patch`` is both this package and the function: once the package is imported the
attribute ``liger_rt.patch`` is the module, so the module itself is callable and calling it is
``patch(...)``.
"""
from __future__ import annotations

import sys
import types

from .core import PatchWarning, describe, original, patch, patched, supported_models, unpatch

__all__ = ["patch", "unpatch", "patched", "supported_models", "describe", "PatchWarning"]


class _CallableModule(types.ModuleType):
    def __call__(self, target, **layers):
        return patch(target, **layers)


sys.modules[__name__].__class__ = _CallableModule
