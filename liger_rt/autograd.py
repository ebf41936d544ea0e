"""Running one implementation of an op in eager mode: a Triton pair through one generic autograd Function
(:class:`KernelFunction`), a native one as it is.

    y = call_impl(OP, "triton", config, x, weight, 1e-6, 0.0)     # bypasses the decision (tests, benchmarks)
    outs_and_grads = run_case(OP, OP.impl("triton"), case, config)  # the autotuner's run of a candidate

A config read from the tuning DB comes with a fallback (:class:`Fallback`, the dispatcher's): when a launch with
it raises, the forward (or the backward) runs again with the fallback's config, and only then is the row reported
as failed; when that config raises too, or is the same, the error propagates (a bad input fails with any config).
"""
from __future__ import annotations

from typing import Protocol

import torch

from .config import Config
from .op import Case, Impl, Op


class Fallback(Protocol):
    """What to run when a launch with a config from the tuning DB raises."""

    def config(self) -> Config:
        """The config to run instead (the arch's heuristic one)."""

    def failed(self, exc: BaseException) -> None:
        """The fallback config ran where the DB's raised `exc`: report the row (once) and stop using it."""


class KernelFunction(torch.autograd.Function):
    """Eager autograd for any Triton pair: apply(impl, config, fallback, *args); `fallback` None for a config that
    did not come from the tuning DB."""

    @staticmethod
    def forward(ctx, impl, config, fallback, *args):
        try:
            outs, saved = impl.forward(config, *args)
        except Exception as exc:
            if fallback is None:
                raise
            config = _fallback_config(fallback, config, exc)
            outs, saved = impl.forward(config, *args)
            fallback.failed(exc)
            fallback = None          # the backward runs this config: nothing left to fall back to
        keep = impl.keep
        if keep is None:
            ctx.save_for_backward(*[a if isinstance(a, torch.Tensor) else None for a in args], *saved)
        else:
            ctx.save_for_backward(*[kept(a, i, keep) if isinstance(a, torch.Tensor) else None
                                    for i, a in enumerate(args)], *saved)
        ctx.impl, ctx.config, ctx.fallback, ctx.n = impl, config, fallback, len(args)
        ctx.scalars = tuple([None if isinstance(a, torch.Tensor) else a for a in args])
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # the launchers are not differentiable: under create_graph (grad mode on in the backward)
        # once_differentiable makes a second differentiation raise; otherwise its wrapper (a no_grad
        # block and a grad-mode check, ~8 us of host time) would only return the outputs as they are
        if torch.is_grad_enabled():
            return _kernel_backward_once(ctx, *grads)
        return _kernel_backward(ctx, *grads)


_function_apply = super(torch.autograd.Function, KernelFunction).apply     # the C entry of Function.apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def apply_kernel(impl: Impl, config, fallback: Fallback | None, *args):
    """KernelFunction.apply(impl, config, fallback, *args) through the C entry, skipping the Python wrapper's
    per-call work (~1.5 us); under functorch transforms, the wrapper itself."""
    if torch._C._are_functorch_transforms_active():
        return KernelFunction.apply(impl, config, fallback, *args)
    return _function_apply(impl, config, fallback,
                           *[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])


def _kernel_backward(ctx, *grads):
    saved = ctx.saved_tensors
    n = ctx.n
    args = tuple([c if t is None else t for t, c in zip(saved[:n], ctx.scalars)])
    try:
        dargs = ctx.impl.backward(ctx.config, args, saved[n:], ctx.needs_input_grad[3:], *grads)
    except Exception as exc:
        if ctx.fallback is None:
            raise
        dargs = _backward_fallback(ctx, args, saved[n:], grads, exc)
    return (None, None, None, *dargs)


def _fallback_config(fallback: Fallback, config, exc: Exception):
    """The config to run instead of `config`, whose launch raised `exc`; `exc` again when it is the same one."""
    instead = fallback.config()
    if instead == config:
        raise exc
    return instead


def _backward_fallback(ctx, args, saved, grads, exc: Exception):
    """The backward with the fallback config.  The forward's saved tensors belong to the config it ran (a tile
    layout), so the forward runs again with the fallback config first; where some args were kept as shape-only
    stand-ins (Impl.keep) it cannot, and the error stands."""
    impl = ctx.impl
    config = _fallback_config(ctx.fallback, ctx.config, exc)
    if saved:
        if impl.keep is not None:
            raise exc
        with torch.no_grad():
            _, saved = impl.forward(config, *args)
    dargs = impl.backward(config, args, saved, ctx.needs_input_grad[3:], *grads)
    ctx.fallback.failed(exc)
    return dargs


_kernel_backward_once = torch.autograd.function.once_differentiable(_kernel_backward)


def kept(t, index: int, keep):
    """The arg itself if the backward reads it, else a stand-in with its shape, dtype and device
    (one element, expanded) so the activation it holds can be freed."""
    if t is None or keep is None or index in keep:
        return t
    return t.new_empty(()).expand(t.shape)


def call_impl(op: Op, impl: str, config, *args):
    """Run one implementation of `op` with a given config (a Config or its dict), bypassing the decision."""
    the_impl = op.impl(impl)
    if the_impl.fn is not None:
        return the_impl.fn(*args)
    return apply_kernel(the_impl, op.parse_config(config, impl), None, *args)


def run_case(op: Op, impl: Impl, case: Case, config) -> list[torch.Tensor]:
    """Outputs and input gradients of one implementation on a tuning case (autotune, tests)."""
    outs = call_impl(op, impl.name, config, *case.args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    inputs = [a for a in case.args if isinstance(a, torch.Tensor) and a.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, case.grads) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                allow_unused=True, materialize_grads=True) if inputs and pairs else ()
    return [*outs, *grads]
