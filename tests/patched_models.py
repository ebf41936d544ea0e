"""Helpers of the patcher tests: twin models, the function a class-level patch installed, the calls of an op.

    base, new = pair("qwen3-tiny")              # same weights; patch `new`, compare the two
    norms = Counter(monkeypatch, "rms_norm")    # every call of liger_rt.ops.rms_norm from now on
"""
import liger_rt.ops
from liger_rt.tools.models import build_model


def pair(preset, **overrides):
    """Two models of a preset (config `overrides` applied to both) with the same random weights."""
    base, new = build_model(preset, **overrides), build_model(preset, **overrides)
    new.load_state_dict(base.state_dict())
    return base, new


def ours(forward):
    """The liger_rt function a class-level patch installed (as a copy with the host's signature)."""
    return getattr(forward, "_liger_rt_function", None)


class Counter:
    """Wraps liger_rt.ops.<name> (the patched layers look it up at call time): `calls` holds each call's
    positional args (`args[1]` of a norm is its weight: which module called it), `kwargs` its keywords."""

    def __init__(self, monkeypatch, name):
        self.fn = getattr(liger_rt.ops, name)
        self.calls, self.kwargs = [], []
        monkeypatch.setattr(liger_rt.ops, name, self)

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        self.kwargs.append(kwargs)
        return self.fn(*args, **kwargs)
