"""The torch.compile form of an op's Triton pair: generated ``torch.library`` ops and the autograd
Function that joins them under dynamo.

For an op with a ``schema`` ("Tensor x, Tensor weight, float eps"), :func:`traced_function` defines

    liger_rt::<op>_fwd(args..., str _config) -> Tensor[]        (outputs, then saved)
    liger_rt::<op>_bwd(Tensor?[] _fwd_tensors, Tensor[] _fwd_saved, Tensor?[] _out_grads,
                       <scalar args>, bool[] _needs, str _config) -> Tensor[]

with fake implementations from the op's ``fake``/``bwd_fake``, once per op (at registration: dynamo
cannot trace a registration).  ``_config`` is the decision as JSON ({"impl": ..., "config": ...}), baked
into the graph at trace time by the dispatcher.
"""
from __future__ import annotations

import functools
import json
import threading

import torch

from .autograd import kept
from .op import Op
from .registry import REGISTRY

_LIB = torch.library.Library("liger_rt", "FRAGMENT")     # the namespace of every generated op
_FUNCTIONS: dict = {}                                    # op -> its TracedFunction
_LOCK = threading.Lock()


def traced_function(op: Op) -> type[torch.autograd.Function]:
    """The autograd.Function whose ``apply(config_json, keep, traced_backward, *args)`` returns the op's
    outputs through the generated ops (defining them on the first call)."""
    fn = _FUNCTIONS.get(op)
    if fn is None:
        with _LOCK:
            if op not in _FUNCTIONS:
                _FUNCTIONS[op] = _build(op)
            fn = _FUNCTIONS[op]
    return fn


def schema_args(schema: str) -> list[tuple[str, str]]:
    """[(type, name)] of a schema's args: "Tensor x, float eps" -> [("Tensor", "x"), ("float", "eps")]."""
    return [tuple(a.strip().rsplit(" ", 1)) for a in schema.split(",") if a.strip()]


def _build(op: Op) -> type[torch.autograd.Function]:
    """Plain ``Library`` ops: a ``torch.library.custom_op`` costs ~6 us more per call in a compiled graph
    (docs/architecture.md)."""
    spec = schema_args(op.schema)
    is_tensor = [t.startswith("Tensor") for t, _ in spec]
    scalars = [(t, n) for t, n in spec if not t.startswith("Tensor")]

    def fwd(*a):
        *args, config_json = a
        impl, cfg = _parse_decision(op.name, config_json)
        outs, saved = impl.forward(cfg, *args)
        return _unaliased([*outs, *saved], args)

    def fwd_fake(*a):
        *args, config_json = a
        outs, saved = op.fake(_parse_decision(op.name, config_json)[1], *args)
        return [*outs, *saved]

    # the op's own scalar names sit beside these: prefixed so that none can clash (fused_linear_
    # cross_entropy has an `int grads`; a duplicate name broke inductor's lowering on the H200)
    bwd_schema = ", ".join(["Tensor?[] _fwd_tensors", "Tensor[] _fwd_saved", "Tensor?[] _out_grads",
                            *(f"{t} {n}" for t, n in scalars), "bool[] _needs", "str _config"])

    def rebuild(tensors, scalar_values):
        it_t, it_s = iter(tensors), iter(scalar_values)
        return tuple(next(it_t) if flag else next(it_s) for flag in is_tensor)

    def bwd(tensors, saved, grads, *rest):
        *scalar_values, needs, config_json = rest
        impl, cfg = _parse_decision(op.name, config_json)
        args = rebuild(tensors, scalar_values)
        per_arg = rebuild(map(bool, needs), [False] * len(scalars))     # one flag per arg, as in eager mode
        dargs = [g for g, flag in zip(impl.backward(cfg, args, tuple(saved), per_arg, *grads), is_tensor) if flag]
        like = next(t for t in tensors if t is not None)
        return _unaliased([g.to(t.dtype) if g is not None and need and t is not None else like.new_empty(0)
                           for g, t, need in zip(dargs, tensors, needs)], tensors)

    def bwd_fake(tensors, saved, grads, *rest):
        needs = rest[-2]
        like = next(t for t in tensors if t is not None)
        return [t.new_empty(t.shape) if need and t is not None else like.new_empty(0)
                for t, need in zip(tensors, needs)]

    for half, schema, kernel, fake in (("fwd", f"({op.schema}, str _config)", fwd, fwd_fake),
                                       ("bwd", f"({bwd_schema})", bwd, op.bwd_fake or bwd_fake)):
        _LIB.define(f"{op.name}_{half}{schema} -> Tensor[]")
        _LIB.impl(f"{op.name}_{half}", kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"liger_rt::{op.name}_{half}", fake, lib=_LIB)
    fwd_op = getattr(torch.ops.liger_rt, f"{op.name}_fwd").default
    bwd_op = getattr(torch.ops.liger_rt, f"{op.name}_bwd").default
    n_out = op.outputs

    class TracedFunction(torch.autograd.Function):
        """apply(config_json, keep, traced_backward, *args): the op's outputs (`keep`, `traced_backward`:
        the implementation's); traced by dynamo, never run eagerly."""

        @staticmethod
        def forward(ctx, config_json, keep, traced_backward, *args):
            out = fwd_op(*args, config_json)
            tensors = [kept(a, i, keep) for i, (a, flag) in enumerate(zip(args, is_tensor)) if flag]
            ctx.save_for_backward(*tensors, *out[n_out:])
            ctx.n_tensors = len(tensors)
            ctx.scalars = [a for a, flag in zip(args, is_tensor) if not flag]
            ctx.config_json, ctx.traced_backward = config_json, traced_backward
            return tuple(out[:n_out])

        @staticmethod
        def backward(ctx, *grads):
            saved = ctx.saved_tensors
            tensors, extra = list(saved[:ctx.n_tensors]), list(saved[ctx.n_tensors:])
            if ctx.traced_backward is not None:
                dargs = ctx.traced_backward(rebuild(tensors, ctx.scalars), tuple(extra), ctx.needs_input_grad[3:],
                                            *grads)
                if dargs is not None:
                    return (None, None, None, *dargs)
            needs = [bool(n) for n, flag in zip(ctx.needs_input_grad[3:], is_tensor) if flag]
            out = bwd_op(tensors, extra, list(grads), *ctx.scalars, needs, ctx.config_json)
            dargs = rebuild(out, [None] * len(ctx.scalars))
            return (None, None, None, *(g if g is not None and g.numel() else None for g in dargs))

    return TracedFunction


def _unaliased(results: list, inputs) -> list:
    """A custom op's results with none aliasing an input or an earlier result (torch.library's rule: inductor
    may reuse one result's buffer while another still reads it): each such result cloned.  An eager
    launcher may return one tensor twice (an output it also saves, one gradient for two addends)."""
    out: list = []
    for r in results:
        out.append(r.clone() if any(r is t for t in (*inputs, *out)) else r)
    return out


@functools.lru_cache(maxsize=256)
def _parse_decision(op_name: str, config_json: str):
    op = REGISTRY.get(op_name)
    data = json.loads(config_json)
    return op.impl(data["impl"]), op.parse_config(data["config"], data["impl"])
