"""Inputs and checks shared by the SwiGLU and GeGLU test files (the same gate/up layout)."""
import torch

from liger_rt import backend
from liger_rt.autograd import call_impl
from liger_rt.numerics import assert_close


def inputs(shape, dtype, seed=0):
    """gate (spread 3: both tails and the knee of the activation), up and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(*shape, generator=g) * 3.0).to(dtype)
    up = torch.randn(*shape, generator=g).to(dtype)
    dy = torch.randn(*shape, generator=g).to(dtype)
    return gate, up, dy


def fwd_bwd(fn, gate, up, dy):
    """[y, dgate, dup] of fn(gate, up) under upstream gradient dy."""
    gate, up = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    y = fn(gate, up)
    return [y, *torch.autograd.grad(y, (gate, up), dy)]


def check_reference_and_fp64(op, reference, exact, dtype):
    """The op's Triton pair at the cpu heuristic, on (3, 5, 100) inputs, against its torch reference (the
    eager module's casting) and against the fp64 formula `exact(gate, up, dy)` on the same values, each within
    the dtype's tolerance."""
    gate, up, dy = inputs((3, 5, 100), dtype)
    outs = fwd_bwd(triton(op, cpu_heuristic(op, 100)), gate, up, dy)
    check(outs, fwd_bwd(reference, gate, up, dy), dtype, f"{dtype} vs ref")
    check(outs, exact(gate, up, dy), dtype, f"{dtype} vs fp64")


def check(outs, refs, dtype, what=""):
    for o, r, name in zip(outs, refs, ("y", "dgate", "dup")):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert_close(o, r, dtype, name=f"{what} {name}")


def triton(op, config):
    """fn(gate, up) through the op's Triton pair with `config` (no dispatch)."""
    return lambda g, u: call_impl(op, "triton", config, g, u)


def cpu_heuristic(op, cols):
    return op.heuristic(backend.profile("cpu"), {"rows": 1, "cols": cols}, torch.float32)
