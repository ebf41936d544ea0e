"""SwiGLU: y = silu(gate) * up, the gated activation of Llama/Qwen3/LFM2 MLPs.

Shapes: gate, up (..., cols) -> y (..., cols) in promote(gate.dtype, up.dtype).

    y = liger_rt.ops.swiglu(gate_proj(x), up_proj(x))       # (2, 128, 8192) bf16 each

Casting follows ``act_fn(gate) * up`` in the input dtype: silu is computed in fp32 and rounded to
the gate dtype, then multiplied by up in fp32 and rounded once more.

Kernels are elementwise over (ROWS, BLOCK_N) tiles of a 2-D view with one row stride per tensor,
so the two halves of a fused gate_up projection (``gate_up.chunk(2, -1)``) are read in place.
The backward saves nothing but the inputs and recomputes sigmoid(gate) (cheaper than storing
it): it reads dy, gate, up and writes fresh dgate, dup.  Minimum traffic: fwd 3MN, bwd 5MN.
Under torch.compile the launchers run inside custom ops (liger_rt::swiglu_fwd/bwd) dispatched at
run time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import DTYPES, interpreter_on, next_pow2, triton_available


# -- reference ------------------------------------------------------------------------------------

def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 compute; silu(gate) rounded to gate.dtype before the multiply, as the eager module does."""
    s = F.silu(gate.float()).to(gate.dtype)
    return (s.float() * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What the Hugging Face MLP runs (the dispatcher's `torch` implementation)."""
    return F.silu(gate) * up


# -- Triton kernels -------------------------------------------------------------------------------

@triton.jit
def _to(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 -> dtype.  The interpreter truncates fp32 -> bf16 (triton/runtime/interpreter.py,
    _convert_float without a rounding mode) where the GPU rounds to nearest even; RNE_BF16 (set
    only under the interpreter) rounds explicitly so CPU results match the GPU's bit for bit."""
    if RNE_BF16 and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _tile(M, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Program -> (row offsets, column offsets, mask); column blocks vary fastest (memory order)."""
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(N, BLOCK_N)
    o_m = (pid // n_col_blocks) * ROWS + tl.arange(0, ROWS)
    o_n = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (o_m < M)[:, None] & (o_n < N)[None, :]
    return o_m.to(tl.int64)[:, None], o_n[None, :], mask


@triton.jit(do_not_specialize=["M"])
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, M, N,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    s = _to(g * tl.sigmoid(g), G.dtype.element_ty, RNE_BF16).to(tl.float32)
    tl.store(Y + o_m * stride_y + o_n, _to(s * u, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, M, N,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    dy = tl.load(DY + o_m * stride_dy + o_n, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    s = g * sig
    du = dy * _to(s, G.dtype.element_ty, RNE_BF16).to(tl.float32)
    dg = dy * u * (sig + s * (1.0 - sig))          # silu'(g) = sig * (1 + g * (1 - sig))
    tl.store(DG + o_m * stride_dg + o_n, _to(dg, DG.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(DU + o_m * stride_du + o_n, _to(du, DU.dtype.element_ty, RNE_BF16), mask=mask)


# -- launchers --------------------------------------------------------------------------------------

def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit column stride; a view whenever rows are uniformly strided."""
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _grid(m: int, n: int, config) -> tuple[int, int, int]:
    block_n = min(int(config.get("BLOCK_N", 1024)), next_pow2(n))
    rows = int(config.get("ROWS", 1))
    return block_n, rows, triton.cdiv(m, rows) * triton.cdiv(n, block_n)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.device != up.device:
        raise ValueError(f"swiglu: gate on {gate.device}, up on {up.device}")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, config) -> torch.Tensor:
    """gate, up (..., N) -> y (..., N)."""
    _check(gate, up)
    n = gate.shape[-1]
    g2, u2 = _as_rows(gate, n), _as_rows(up, n)
    m = g2.shape[0]
    y = torch.empty((m, n), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if m > 0 and n > 0:
        block_n, rows, grid = _grid(m, n, config)
        _swiglu_fwd_kernel[(grid,)](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), m, n,
                                    BLOCK_N=block_n, ROWS=rows, RNE_BF16=interpreter_on(),
                                    num_warps=int(config.get("num_warps", 4)))
    return y.view(gate.shape)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, gate, up (..., N) -> (dgate in gate.dtype, dup in up.dtype), fresh contiguous tensors."""
    _check(gate, up)
    n = gate.shape[-1]
    g2, u2, dy2 = _as_rows(gate, n), _as_rows(up, n), _as_rows(dy, n)
    m = g2.shape[0]
    dg = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    du = torch.empty((m, n), dtype=up.dtype, device=up.device)
    if m > 0 and n > 0:
        block_n, rows, grid = _grid(m, n, config)
        _swiglu_bwd_kernel[(grid,)](dy2, g2, u2, dg, du, dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0),
                                    du.stride(0), m, n, BLOCK_N=block_n, ROWS=rows, RNE_BF16=interpreter_on(),
                                    num_warps=int(config.get("bwd_num_warps", 4)))
    return dg.view(gate.shape), du.view(up.shape)


# -- autograd.Function ------------------------------------------------------------------------------

class SwiGLUFunction(torch.autograd.Function):
    """apply(gate, up, config); saves only the inputs."""

    @staticmethod
    def forward(ctx, gate, up, config):
        y = swiglu_fwd(gate, up, config)
        ctx.save_for_backward(gate, up)
        ctx.config = config
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = swiglu_bwd(dy, gate, up, ctx.config)
        return dg, du, None


# -- the torch.compile path: opaque custom ops --------------------------------------------------------
# Under torch.compile the kernels run inside custom ops, dispatched at run time exactly like eager
# calls (so dynamic shapes and env overrides behave the same), and dynamo never traces a launcher.
# Eager calls keep the autograd.Function above: it costs less per call than the op dispatcher.

@torch.library.custom_op("liger_rt::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (rows, cols) -> y."""
    d = OP.select(gate, rows=gate.shape[0], cols=gate.shape[1])
    if d.impl == "torch":
        return _swiglu_torch(gate, up)
    return swiglu_fwd(gate, up, d.config)


@_swiglu_fwd_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("liger_rt::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = OP.select(gate, rows=gate.shape[0], cols=gate.shape[1])
    if d.impl == "torch":   # autograd is off inside an op: the gradients in closed form
        g, u, dyf = gate.float(), up.float(), dy.float()
        sig = torch.sigmoid(g)
        du = dyf * (g * sig).to(gate.dtype).float()
        dg = dyf * u * sig * (1.0 + g * (1.0 - sig))
        return dg.to(gate.dtype), du.to(up.dtype)
    return swiglu_bwd(dy, gate, up, d.config)


@_swiglu_bwd_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_bwd_op(dy, gate, up)


_swiglu_fwd_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# -- functional --------------------------------------------------------------------------------------

def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate, up (..., cols).  Dispatched per call."""
    _check(gate, up)
    if gate.dtype not in DTYPES.values() or up.dtype not in DTYPES.values() or gate.numel() == 0:
        return _swiglu_torch(gate, up)
    n = gate.shape[-1]
    if torch.compiler.is_compiling():
        return _swiglu_fwd_op(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape)
    d = OP.select(gate, rows=gate.numel() // n, cols=n)
    if d.impl == "torch":
        return _swiglu_torch(gate, up)
    return SwiGLUFunction.apply(gate, up, d.config)   # flattens inside: no view nodes in the graph


# -- registration -------------------------------------------------------------------------------------

from ..dispatch import Impl, Op, register  # noqa: E402


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["cols"]
    gate = (2.0 * torch.randn(m, n, generator=g)).to(device, dtype).requires_grad_()
    up = torch.randn(m, n, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return {"gate": gate, "up": up, "dy": dy}


def _run_torch(case, config):
    y = _swiglu_torch(case["gate"], case["up"])
    return [y, *torch.autograd.grad(y, (case["gate"], case["up"]), case["dy"])]


def _run_triton(case, config):
    y = SwiGLUFunction.apply(case["gate"], case["up"], config)
    return [y, *torch.autograd.grad(y, (case["gate"], case["up"]), case["dy"])]


def _warps(elems: int, per_thread: int, arch) -> int:
    return int(min(max(elems // (arch.warp_size * per_thread), 1), arch.max_num_warps))


def _config(arch, cols: int, tile: int, fwd_per_thread: int, bwd_per_thread: int) -> dict:
    block_n = min(tile, next_pow2(cols))
    rows = max(1, tile // block_n)
    return {"BLOCK_N": block_n, "ROWS": rows, "num_warps": _warps(rows * block_n, fwd_per_thread, arch),
            "bwd_num_warps": _warps(rows * block_n, bwd_per_thread, arch)}


def _heuristic(arch, dims, dtype):
    """4096-element tiles, 16 values per thread (two 16-byte vectors of bf16 per tensor): small
    enough that several programs stay resident per SM in the 5-stream backward (~80 registers),
    large enough that the forward streams like Liger-Kernel's 8192x16-warp rows (4.25 TB/s on the
    H200, anchors/h200-anchor.json).  Estimate; sweeps decide."""
    if arch.name == "cpu":
        return _config(arch, dims["cols"], 1024, 8, 8)
    return _config(arch, dims["cols"], 4096, 16, 16)


def _configs(arch, dims, dtype):
    n = dims["cols"]
    if arch.name == "cpu":  # the interpreter ignores warps: cover tiling paths (column blocks, rows)
        narrow = {"BLOCK_N": 32, "ROWS": 8, "num_warps": 1, "bwd_num_warps": 1}
        return [_heuristic(arch, dims, dtype), narrow, _config(arch, n, 4096, 16, 16)]
    shapes = [(4096, 16, 16), (4096, 8, 8), (4096, 16, 8), (2048, 8, 8), (2048, 16, 16), (1024, 8, 8),
              (8192, 16, 16), (8192, 32, 16), (16384, 16, 16)]
    out, seen = [], set()
    for tile, fpt, bpt in shapes:
        c = _config(arch, n, tile, fpt, bpt)
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _plan(preset, arch, quick):
    if arch.name == "cpu":
        cols = (preset.intermediate,) if preset is not None and preset.tiny else (96, 128)
        rows = (8,) if quick else (8, 32)
        return [{"rows": r, "cols": c} for c in cols for r in rows]
    if preset is None:
        cols, tokens = (8192, 12288), ((4096,) if quick else (1024, 4096, 16384))
    else:
        cols, tokens = (preset.intermediate,), (preset.quick_tokens if quick else preset.tokens)
    return [{"rows": t, "cols": c} for c in cols for t in tokens]


OP = register(Op(
    name="swiglu", static=("cols",), dynamic=("rows",),
    impls=[Impl("triton", run=_run_triton, available=triton_available, configs=_configs,
                heuristic=_heuristic),
           Impl("torch", run=_run_torch)],
    make_case=_make_case, plan=_plan))
