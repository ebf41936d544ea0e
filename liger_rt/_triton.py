"""Triton where it is installed, stand-ins where it is not (macOS, Windows, a CPU-only torch).

Kernel files import ``triton`` and ``tl`` from here.  Without Triton the stand-ins let every kernel be
defined (``@triton.jit`` keeps the Python function, as ``.fn``, for the freshness hash; ``tl.constexpr`` and
other ``tl`` names are placeholders for signatures) but never launched: ``available()`` is False, so every
op's Triton implementation is unavailable and dispatch runs its PyTorch implementation.

    from liger_rt._triton import triton, tl
    MISSING       # "" with Triton, else why not: "ModuleNotFoundError: No module named 'triton'"
"""
from __future__ import annotations

import types

MISSING = ""
try:
    import triton
    import triton.language as tl
except Exception as exc:   # not installed, or an install that cannot import (a broken or mismatched build)
    MISSING = f"{type(exc).__name__}: {exc}"
    triton = tl = None


def available() -> bool:
    """Whether Triton imported: its kernels can run (on a GPU, or on CPU through TRITON_INTERPRET=1)."""
    return not MISSING


def reason() -> str:
    """One line on why the kernels are off, "" when Triton imported."""
    if not MISSING:
        return ""
    what = "not installed" if MISSING.startswith("ModuleNotFoundError") else "installed but failed to import"
    return (f"Triton is {what} ({MISSING}); every op runs its PyTorch implementation. "
            "pip install triton to enable the kernels")


class _NoTritonError(RuntimeError):
    pass


class _Kernel:
    """What ``@triton.jit`` gives without Triton: the function (``.fn``) and a launch that raises."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", __name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def _fail(self, *args, **kwargs):
        raise _NoTritonError(f"liger_rt: cannot launch Triton kernel {self.__qualname__}: {reason()}")

    run = __call__ = _fail

    def __getitem__(self, grid):
        return self._fail


def _jit(fn=None, **options):
    """``@triton.jit`` and ``@triton.jit(do_not_specialize=...)``."""
    return _Kernel(fn) if fn is not None else _Kernel


def _decorator(*args, **kwargs):
    """``@triton.autotune(...)`` and ``@triton.heuristics(...)``: the kernel unchanged."""
    return lambda fn: fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class _Placeholder:
    """A ``tl`` name (``tl.constexpr``, ``tl.float32``, ...) in a signature or at module level."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        return self

    def __repr__(self) -> str:
        return f"<{self._name}: Triton is not available>"


class _Language(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"triton.language.{name}")


if MISSING:
    tl = _Language("triton.language", "Stand-in for triton.language: Triton is not available.")
    triton = types.ModuleType("triton", "Stand-in for triton: Triton is not available.")
    triton.__version__ = ""
    triton.language = tl
    triton.jit = _jit
    triton.autotune = triton.heuristics = _decorator
    triton.Config = lambda *args, **kwargs: (args, kwargs)
    triton.cdiv = _cdiv
    triton.next_power_of_2 = _next_power_of_2
    triton.set_allocator = lambda allocator: None
