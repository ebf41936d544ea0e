"""A tiny op for testing the runtime core independently of the real kernels.

y = x * scale (+1 when the config says WRONG, so validation has something to reject).
"""
import torch
import triton
import triton.language as tl

from liger_rt.dispatch import Impl, Op, register
from liger_rt.kernels._common import triton_available


@triton.jit
def _toy_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, WRONG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = x * scale
    if WRONG:
        y = y + 1.0
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


CALLS = {"triton": 0, "torch": 0, "fail": 0}


def toy_ref(x, scale=2.0):
    return (x.float() * scale).to(x.dtype)


def toy_triton(x, config, scale=2.0):
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    block = config.get("BLOCK", 64)
    _toy_kernel[(triton.cdiv(n, block),)](x, y, n, scale, BLOCK=block, WRONG=config.get("WRONG", 0))
    return y


def toy(x):
    d = OP.select(x, rows=x.shape[0], cols=x.shape[1])
    if d.impl == "torch":
        CALLS["torch"] += 1
        return toy_ref(x)
    CALLS["triton"] += 1
    return toy_triton(x, d.config)


def _make_case(dims, dtype, device):
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(dims["rows"], dims["cols"], generator=g).to(device, dtype)}


def _run_triton(case, config):
    if config.get("FAIL"):
        CALLS["fail"] += 1
        raise RuntimeError("out of resources: shared memory (simulated)")
    return [toy_triton(case["x"], config)]


def _run_torch(case, config):
    return [toy_ref(case["x"])]


def _configs(arch, dims, dtype):
    return [{"BLOCK": 32}, {"BLOCK": 64}, {"BLOCK": 64, "WRONG": 1}, {"BLOCK": 128, "FAIL": 1},
            {"BLOCK": 64, "num_warps": 32}, {"BLOCK": 64, "num_stages": 4}]


def _plan(preset, arch, quick):
    return [{"rows": 4, "cols": 40}] if quick else [{"rows": 4, "cols": 40}, {"rows": 16, "cols": 40}]


OP = register(Op(
    name="toy", static=("cols",), dynamic=("rows",),
    impls=[Impl("triton", run=_run_triton, available=triton_available, configs=_configs,
                heuristic=lambda arch, dims, dtype: {"BLOCK": 64}),
           Impl("torch", run=_run_torch)],
    make_case=_make_case, plan=_plan, crossover_axis=lambda d: d["rows"], crossover_axis_name="rows"))
