"""Table-driven model patchers: ``patch``, ``unpatch``, ``patched``, ``supported_models``, ``describe``.

    liger_rt.patch(model, fused_linear_cross_entropy=True)   # a loaded model: instance level
    liger_rt.patch("qwen3")                                  # a model type: class level
    liger_rt.patch.describe(model)                           # or: from liger_rt.patch import describe

The mechanism is in core.py, the tables in specs.py.  liger_rt/__init__.py imports this package when
liger_rt is imported and binds ``liger_rt.patch`` to the function ``patch`` below, so the name stays the
function whatever is imported later (a package attribute is set only when its module first loads);
``describe``, ``original`` and ``PatchWarning`` are attributes of that function too.  This module is
light: each function imports core (which imports torch) on first call, so ``import liger_rt`` stays fast.
"""
from __future__ import annotations

from .warning import PatchWarning

__all__ = ["patch", "unpatch", "patched", "supported_models", "describe", "original", "PatchWarning"]


def patch(target, **layers):
    """Patch a loaded model (instance level, returns it) or a model type (class level, returns None).

        liger_rt.patch(model, fused_linear_cross_entropy=True)  # SFT: loss without logits
        liger_rt.patch("lfm2", short_conv=False)                # classes, before building models

    ``layers`` are the family's flags (booleans); an unknown flag or model type raises listing the valid ones.
    """
    from . import core      # import time: core imports torch
    return core.patch(target, **layers)


def unpatch(target):
    """Undo ``patch(target)`` (a no-op where nothing is patched); returns a model, None for a model type."""
    from . import core      # import time: core imports torch
    return core.unpatch(target)


def patched(target, **layers):
    """A context manager: ``target`` patched inside the with-block, back as it was on exit.

        with liger_rt.patched(model, swiglu=False): ...
    """
    from . import core      # import time: core imports torch
    return core.patched(target, **layers)


def supported_models() -> list[str]:
    """The model types ``patch`` takes: the validated allowlist, less families this transformers lacks."""
    from . import core      # import time: core imports torch
    return core.supported_models()


def describe(target) -> dict | None:
    """What is patched on a model or model type: level, flags in force, modules per flag (None: nothing)."""
    from . import core      # import time: core imports torch
    return core.describe(target)


def original(module):
    """The forward a patch replaced on ``module``, bound to it."""
    from .. import _swaps   # import time: _swaps imports inspect and dataclasses
    return _swaps.original(module)


patch.describe, patch.original, patch.PatchWarning = describe, original, PatchWarning
