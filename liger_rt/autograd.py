"""Running one implementation of an op in eager mode: a Triton pair through one generic autograd Function
(:class:`KernelFunction`), a native one as it is.

    y = call_impl(OP, "triton", config, x, weight, 1e-6, 0.0)     # bypasses the decision (tests, benchmarks)
    outs_and_grads = run_case(OP, OP.impl("triton"), case, config)  # the autotuner's run of a candidate
"""
from __future__ import annotations

import torch

from .op import Case, Impl, Op


class KernelFunction(torch.autograd.Function):
    """Eager autograd for any Triton pair: apply(impl, config, *args)."""

    @staticmethod
    def forward(ctx, impl, config, *args):
        outs, saved = impl.forward(config, *args)
        keep = impl.keep
        if keep is None:
            ctx.save_for_backward(*[a if isinstance(a, torch.Tensor) else None for a in args], *saved)
        else:
            ctx.save_for_backward(*[kept(a, i, keep) if isinstance(a, torch.Tensor) else None
                                    for i, a in enumerate(args)], *saved)
        ctx.impl, ctx.config, ctx.n = impl, config, len(args)
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


def apply_kernel(impl: Impl, config, *args):
    """KernelFunction.apply(impl, config, *args) through the C entry, skipping the Python wrapper's
    per-call work (~1.5 us); under functorch transforms, the wrapper itself."""
    if torch._C._are_functorch_transforms_active():
        return KernelFunction.apply(impl, config, *args)
    return _function_apply(impl, config, *[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])


def _kernel_backward(ctx, *grads):
    saved = ctx.saved_tensors
    n = ctx.n
    args = tuple([c if t is None else t for t, c in zip(saved[:n], ctx.scalars)])
    dargs = ctx.impl.backward(ctx.config, args, saved[n:], ctx.needs_input_grad[2:], *grads)
    return (None, None, *dargs)


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
    return apply_kernel(the_impl, op.parse_config(config, impl), *args)


def run_case(op: Op, impl: Impl, case: Case, config) -> list[torch.Tensor]:
    """Outputs and input gradients of one implementation on a tuning case (autotune, tests)."""
    outs = call_impl(op, impl.name, config, *case.args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    inputs = [a for a in case.args if isinstance(a, torch.Tensor) and a.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, case.grads) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                allow_unused=True, materialize_grads=True) if inputs and pairs else ()
    return [*outs, *grads]
