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


# -- patched forwards ----------------------------------------------------------------------------------

def dressed(fn, host, sig: inspect.Signature):
    """A copy of function ``fn`` that wears ``host``'s metadata as ``functools.wraps(host)`` gives it
    (``__name__``, ``__qualname__``, ``__doc__``, ``__module__``, ``__dict__``, ``__wrapped__``) and whose
    ``inspect.signature`` is ``sig``; its ``_liger_rt_function`` is ``fn``."""
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    functools.update_wrapper(new, host)
    new.__signature__ = sig
    new._liger_rt_function = fn
    return new


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


def bound_forward(module, fn) -> types.MethodType:
    """``fn`` bound to ``module`` as a plain method, dressed as the forward it replaces (``original(module)``):
    that forward's name, doc and ``__wrapped__``, and its signature plus fn's keyword-only extras."""
    host = original(module)
    sig = merged_signature(inspect.signature(host), inspect.signature(fn), bound=True)
    sig = sig.replace(parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                                  *sig.parameters.values()])
    return types.MethodType(dressed(fn, host, sig), module)


def bind(module, fn, attr: str = "forward") -> None:
    """Set ``module.<attr>`` to ``bound_forward(module, fn)``, keeping the instance's own under ORIG_KEY.
    The entry is re-inserted, so it follows every attribute the module had (pickling: core.InstanceRecord)."""
    module.__dict__.pop(ORIG_KEY, None)
    if (own := module.__dict__.pop(attr, None)) is not None:
        module.__dict__[ORIG_KEY] = own
    module.__dict__[attr] = bound_forward(module, fn)


def BoundForward(fn, module) -> types.MethodType:  # noqa: N802  (the name such pickles hold)
    """What a pickle that holds an instance forward as ``BoundForward(fn, module)`` calls when it loads."""
    return bound_forward(module, fn)


# -- what a layer forward falls back to -------------------------------------------------------------

def class_original(cls: type):
    """``cls.forward`` as it was before any class-level swap (walking the MRO past swaps)."""
    for klass in cls.__mro__:
        if "forward" not in klass.__dict__:
            continue
        value = klass.__dict__["forward"]
        if isinstance(value, types.FunctionType) and not getattr(value, SWAPPED, False):
            # never a swap: no ledger read, which torch.compile would guard on (so that every patch or
            # unpatch of any model would recompile the graph, and one made mid-trace fail its guards)
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
