"""A new op in one short file: the worked example of docs/adding_an_op.md.

y = x * scale (+1 when the config says WRONG, so validation has something to reject).  Declaring
the spec at the bottom is all it takes: dispatch, the tuning DB and its row validation, sweeps,
`explain` and the torch.compile custom ops come from the runtime (a real op also adds its module to
`liger_rt.registry.OP_MODULES`, the one registry line; tests register this one by importing it).
"""
import dataclasses

import torch
import triton
import triton.language as tl

from liger_rt.config import WARPS, Config, knob, pow2
from liger_rt.dispatch import call, register
from liger_rt.kernels._common import triton_available
from liger_rt.op import Case, Impl, Op, check_dtype

CALLS = {"triton": 0, "torch": 0, "fail": 0}


# -- reference ------------------------------------------------------------------------------------

def toy_ref(x, scale=2.0):
    CALLS["torch"] += 1
    return (x.float() * scale).to(x.dtype)


# -- Triton kernel and launchers ---------------------------------------------------------------------

@triton.jit
def _toy_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, WRONG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = x * scale
    if WRONG:
        y = y + 1.0
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def toy_triton(x, config, scale=2.0):
    if config.FAIL:
        CALLS["fail"] += 1
        raise RuntimeError("out of resources: shared memory (simulated)")
    CALLS["triton"] += 1
    x = x.contiguous()
    y = torch.empty_like(x)
    _toy_kernel[(triton.cdiv(x.numel(), config.BLOCK),)](x, y, x.numel(), scale, BLOCK=config.BLOCK,
                                                        WRONG=config.WRONG, num_warps=config.num_warps)
    return y


def _forward(config, x, scale):
    return (toy_triton(x, config, scale),), ()


def _backward(config, args, saved, needs, dy):
    return dy * args[1], None


# -- the spec -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToyConfig(Config):
    BLOCK: int = knob(64, pow2(16, 1024))
    num_warps: int = knob(4, WARPS)
    num_stages: int = knob(1, (1, 2, 3, 4))
    WRONG: int = knob(0, (0, 1))        # test hooks: a config that computes wrong / fails to launch
    FAIL: int = knob(0, (0, 1))


def toy(x):
    return call(OP, x, 2.0)


def _dims(x, scale):
    check_dtype("toy", "x", x, OP.accepted_dtypes)
    if x.dim() != 2:
        raise ValueError(f"toy takes x (rows, cols), got shape {tuple(x.shape)}")
    return {"rows": x.shape[0], "cols": x.shape[1]}


def _configs(arch, dims, dtype):
    return [ToyConfig(BLOCK=32), ToyConfig(BLOCK=64), ToyConfig(BLOCK=64, WRONG=1), ToyConfig(BLOCK=128, FAIL=1),
            ToyConfig(num_warps=32), ToyConfig(num_stages=4)]


def _make_case(dims, dtype, device):
    g = torch.Generator().manual_seed(1)
    return Case(args=(torch.randn(dims["rows"], dims["cols"], generator=g).to(device, dtype), 2.0), grads=(None,))


def _plan(preset, arch, quick):
    return [{"rows": 4, "cols": 40}] if quick else [{"rows": 4, "cols": 40}, {"rows": 16, "cols": 40}]


OP = register(Op(
    name="toy", static=("cols",), dynamic=("rows",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available),
           Impl("torch", fn=toy_ref)],
    config=ToyConfig, candidates=_configs, heuristic=lambda arch, dims, dtype: ToyConfig(),
    schema="Tensor x, float scale", fake=lambda config, x, scale: ((x.new_empty(x.shape),), ()),
    make_case=_make_case, plan=_plan, crossover_axis=lambda d: d["rows"], crossover_axis_name="rows"))
