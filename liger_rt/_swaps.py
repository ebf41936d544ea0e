"""The swap ledger: what ``liger_rt.patch`` replaced, and how a layer forward reaches it.

liger_rt.patch writes here, liger_rt.layers reads here; this module imports nothing from liger_rt.
Swaps on shared objects (a class's ``forward``, a modeling module's function) are ``hold`` / ``release``,
reference-counted by holders (a model type, or ``instance:<id>``); ``bind`` swaps one module instance's
forward.  ``original(module)`` / ``original_function(module)`` answer "what ran before the patch".
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

ORIG_KEY = "_liger_rt_orig_forward"      # module.__dict__ entry: the instance forward a patch replaced
MISSING = object()                       # "the owner had no attribute of its own" (never pickled or copied)


@dataclasses.dataclass
class Swap:
    original: Any                   # what the owner's own __dict__ held, or MISSING
    value: Any                      # what liger_rt put there
    holders: set
    placed: Any = None              # what stands on the owner: value, or a StandIn calling it


class StandIn:
    """Put in place of a callable *object* that a function swaps out: since transformers 5.25 a modeling
    module's ``apply_rotary_pos_emb`` is an nn.Module, which unpickling rebuilds as ``type(<it>)()``.
    Calling a stand-in's class with no arguments builds what it replaced; calling a stand-in calls the
    function."""
    replaced_type: type = object

    def __new__(cls, fn=None):
        return cls.replaced_type() if fn is None else super().__new__(cls)

    def __init__(self, fn):
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self):
        return f"<liger_rt stand-in for {self.replaced_type.__name__}: {self.__wrapped__.__qualname__}>"


@functools.lru_cache(maxsize=None)
def _stand_in_type(kind: type) -> type:
    return type("StandIn", (StandIn,), {"replaced_type": kind})


def _to_place(original, value):
    # value itself, or a StandIn where a function replaces a callable object
    if not isinstance(value, types.FunctionType) or original is MISSING or isinstance(
            original, (types.FunctionType, types.BuiltinFunctionType, type, staticmethod, classmethod)) \
            or not callable(original):
        return value
    return _stand_in_type(type(original))(value)


def function_at(owner, attr: str):
    """``owner.<attr>``, seen through a StandIn: the function liger_rt swapped in, or the original."""
    value = getattr(owner, attr)
    return value.__wrapped__ if isinstance(value, StandIn) else value


# (owner, attribute) -> Swap; owner is a class or a module object
LEDGER: dict[tuple[Any, str], Swap] = {}
SWAPPED = "_liger_rt_swapped"            # set on every function hold() puts in place


def hold(owner, attr: str, value, holder: str, keys: list) -> None:
    """Set ``owner.<attr> = value`` on behalf of ``holder``; the key is appended to ``keys``."""
    key = (owner, attr)
    swap = LEDGER.get(key)
    if swap is None:
        swap = LEDGER[key] = Swap(owner.__dict__.get(attr, MISSING), value, set())
    swap.holders.add(holder)
    if swap.placed is None or swap.value is not value:      # the same object each time: compiled graphs guard on it
        swap.placed = _to_place(swap.original, value)
    swap.value = value
    if isinstance(value, types.FunctionType):
        value.__dict__[SWAPPED] = True
    setattr(owner, attr, swap.placed)
    keys.append(key)


def release(keys: list, holder: str) -> None:
    """Drop ``holder`` from each swap; the original comes back when its last holder is gone."""
    for key in reversed(keys):
        swap = LEDGER.get(key)
        if swap is None:
            continue
        swap.holders.discard(holder)
        if swap.holders:
            continue
        owner, attr = key
        if swap.original is MISSING:
            if attr in owner.__dict__:
                delattr(owner, attr)
        else:
            setattr(owner, attr, swap.original)
        del LEDGER[key]


# -- instance forwards -------------------------------------------------------------------------------

class BoundForward:
    """``types.MethodType(fn, module)`` that pickles and copies (a bound method pickles as
    ``getattr(module, fn.__name__)``), with the replaced forward's signature plus fn's keyword-only extras."""

    def __init__(self, fn, module):
        self.__func__ = fn
        self.__self__ = module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return BoundForward, (self.__func__, self.__self__)

    @property
    def __signature__(self) -> inspect.Signature:
        host = inspect.signature(original(self.__self__))
        return merged_signature(host, inspect.signature(self.__func__), bound=True)

    def __repr__(self):
        return f"<liger_rt forward {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


def merged_signature(host: inspect.Signature, ours: inspect.Signature, bound: bool = False) -> inspect.Signature:
    """``host`` plus the keyword-only parameters with defaults of ``ours`` (less self if ``bound``) that
    it lacks, before its ``**kwargs``."""
    params = list(host.parameters.values())
    names = {p.name for p in params}
    ours_params = list(ours.parameters.values())[1 if bound else 0:]
    extras = [p for p in ours_params if p.kind is p.KEYWORD_ONLY and p.name not in names
              and p.default is not p.empty]
    if not extras:
        return host
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    return host.replace(parameters=params[:at] + extras + params[at:])


def with_signature(fn, sig: inspect.Signature):
    """A copy of function ``fn`` whose ``inspect.signature`` is ``sig`` (``_liger_rt_function``: fn)."""
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__signature__ = sig
    new._liger_rt_function = fn
    return new


def bind(module, fn, attr: str = "forward") -> None:
    """Set ``module.<attr>`` to ``BoundForward(fn, module)``, keeping the instance's own under ORIG_KEY."""
    module.__dict__.pop(ORIG_KEY, None)
    if attr in module.__dict__:
        module.__dict__[ORIG_KEY] = module.__dict__[attr]
    setattr(module, attr, BoundForward(fn, module))


# -- what a layer forward falls back to -------------------------------------------------------------

def class_original(cls: type):
    """``cls.forward`` as it was before any class-level swap (walking the MRO past swaps)."""
    for klass in cls.__mro__:
        if "forward" not in klass.__dict__:
            continue
        value = klass.__dict__["forward"]
        if isinstance(value, types.FunctionType) and not getattr(value, SWAPPED, False):
            # never a swap: no ledger read, which torch.compile would guard on (every patch or
            # unpatch of any model recompiled the graph, and one mid-trace failed its guards)
            return value
        swap = LEDGER.get((klass, "forward"))
        if swap is None:
            return value
        if swap.original is not MISSING:
            return swap.original
    raise AttributeError(f"{cls.__name__} has no original forward")


def original_function(module):
    """The forward a patch replaced on ``module``, as ``fn(module, ...)``: not a bound method, which
    torch.compile rebuilds after a graph break as ``module.forward``, the patched forward again."""
    own = module.__dict__.get(ORIG_KEY)
    if own is None:
        return class_original(type(module))
    func = getattr(own, "__func__", None)
    if func is not None and getattr(own, "__self__", None) is module:
        return func
    return lambda _module, *args, **kwargs: own(*args, **kwargs)


def original(module):
    """The forward a patch replaced, bound to ``module`` (see ``original_function``)."""
    own = module.__dict__.get(ORIG_KEY)
    return own if own is not None else class_original(type(module)).__get__(module, type(module))
