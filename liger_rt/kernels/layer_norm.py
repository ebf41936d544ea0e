"""LayerNorm: y = (x - mean) * rstd * w + b over the last dim (the SigLIP2 vision tower's norm).

Shapes: x (..., hidden), weight (hidden,), bias (hidden,) or None -> y (..., hidden) in x.dtype,
like nn.LayerNorm: statistics and the affine in fp32, one rounding at the end.

    y = liger_rt.ops.layer_norm(x, weight, bias, eps=1e-6)   # x (4, 729, 1152) bf16

Kernels mirror rms_norm.py: ROWS rows per program in the forward (1-D tiles when ROWS == 1;
stores mean and rstd, fp32, per row); a persistent backward of min(rows, sm_count *
bwd_progs_per_sm) programs walking rows with the grid's stride, the next row optionally
prefetched while the current one computes, writing fp32 partials of dW and dB (one row per
program each), summed by a column-parallel second kernel.  No atomics.  Under torch.compile the launchers run
inside custom ops (liger_rt::layer_norm_fwd/bwd) dispatched at run time.
PyTorch's own LayerNorm is fast at small hidden sizes; the dispatcher picks `torch` wherever the
tuning DB measured it faster (the torch implementation is registered and timed by sweeps).
Minimum traffic: fwd 2MN, bwd 3MN.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import DTYPES, interpreter_on, next_pow2, triton_available

# One row lives in registers (see rms_norm.py); the backward holds two accumulators here.
MAX_HIDDEN = 32768


# -- reference ------------------------------------------------------------------------------------

def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float = 1e-5) -> torch.Tensor:
    """fp32 LayerNorm cast to x.dtype (what nn.LayerNorm computes for bf16/fp16 inputs)."""
    n = x.shape[-1]
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (n,), w, b, eps).to(x.dtype)


def _layer_norm_torch(x, weight, bias, eps):
    """PyTorch's native LayerNorm (the dispatcher's `torch` implementation, and the reference the
    autotuner validates against).  On CPU its bf16/fp16 backward is off by 2 ulps in dW/dB at 16
    rows (the CUDA kernel accumulates in fp32), so low precision on CPU runs the fp32 reference."""
    same = all(t is None or t.dtype == x.dtype for t in (weight, bias))
    if same and (x.device.type != "cpu" or x.dtype == torch.float32):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return layer_norm_ref(x, weight, bias, eps)


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


@triton.jit(do_not_specialize=["M"])
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, M, N, eps,
                           BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           RNE_BF16: tl.constexpr):
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if ROWS == 1:   # one row per program, 1-D tiles and scalar row statistics
        row = tl.program_id(0).to(tl.int64)
        x = tl.load(X + row * stride_x + o_n, mask=m_n, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(m_n, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(B + o_n, mask=m_n, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + o_n, _to(y, Y.dtype.element_ty, RNE_BF16), mask=m_n)
    else:
        o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        m_m = o_m < M
        mask = m_m[:, None] & m_n[None, :]
        o_m64 = o_m.to(tl.int64)
        x = tl.load(X + o_m64[:, None] * stride_x + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + o_m64[:, None] * stride_y + o_n[None, :], _to(y, Y.dtype.element_ty, RNE_BF16), mask=mask)
        tl.store(MEAN + o_m, mean, mask=m_m)
        tl.store(RSTD + o_m, rstd, mask=m_m)


@triton.jit(do_not_specialize=["M"])
def _layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, stride_dy, stride_x, stride_dx,
                           M, N, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
                           RNE_BF16: tl.constexpr):
    """Persistent, as rms_norm.py: program pid takes rows pid, pid + G, ... (G = grid <= M), 1-D
    row tiles, scalar mean/rstd, fp32 dW/dB accumulators, one partial row each per program."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH:  # register double buffering: the next row's loads fly while this row computes
        p64 = pid.to(tl.int64)
        dy_nx = tl.load(DY + p64 * stride_dy + o_n, mask=m_n, other=0.0)
        x_nx = tl.load(X + p64 * stride_x + o_n, mask=m_n, other=0.0)
    for i in tl.range(0, tl.cdiv(M - pid, G)):
        row = pid + i * G
        r64 = row.to(tl.int64)
        if PREFETCH:
            dy = dy_nx.to(tl.float32)
            x = x_nx.to(tl.float32)
            m_nx = o_n < tl.where(row + G < M, N, 0)   # the next row, if any
            dy_nx = tl.load(DY + (r64 + G) * stride_dy + o_n, mask=m_nx, other=0.0)
            x_nx = tl.load(X + (r64 + G) * stride_x + o_n, mask=m_nx, other=0.0)
        else:
            dy = tl.load(DY + r64 * stride_dy + o_n, mask=m_n, other=0.0).to(tl.float32)
            x = tl.load(X + r64 * stride_x + o_n, mask=m_n, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + r64)
        rstd = tl.load(RSTD + r64)
        xhat = tl.where(m_n, (x - mean) * rstd, 0.0)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)   # L1-resident
        g = dy * w
        c1 = tl.sum(g * xhat, axis=0) / N
        c2 = tl.sum(g, axis=0) / N
        dx = (g - xhat * c1 - c2) * rstd
        tl.store(DX + r64 * stride_dx + o_n, _to(dx, DX.dtype.element_ty, RNE_BF16), mask=m_n)
        acc_w += dy * xhat
        if HAS_BIAS:
            acc_b += dy
    p_off = pid.to(tl.int64) * N
    tl.store(DW_PART + p_off + o_n, acc_w, mask=m_n)
    if HAS_BIAS:
        tl.store(DB_PART + p_off + o_n, acc_b, mask=m_n)


@triton.jit
def _layer_norm_dwdb_kernel(PW, PB, DW, DB, G, N, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                            HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_n = o_n < N
    acc_w = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        o_g = g0 + tl.arange(0, BLOCK_G)
        mask = (o_g < G)[:, None] & m_n[None, :]
        acc_w += tl.load(PW + o_g[:, None] * N + o_n[None, :], mask=mask, other=0.0)
        if HAS_BIAS:
            acc_b += tl.load(PB + o_g[:, None] * N + o_n[None, :], mask=mask, other=0.0)
    tl.store(DW + o_n, _to(tl.sum(acc_w, axis=0), DW.dtype.element_ty, RNE_BF16), mask=m_n)
    if HAS_BIAS:
        tl.store(DB + o_n, _to(tl.sum(acc_b, axis=0), DB.dtype.element_ty, RNE_BF16), mask=m_n)


# -- launchers --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _sm_count(device: torch.device) -> int:
    """SMs/CUs of the device; 2 under the interpreter (its programs run one after another)."""
    if device.type == "cpu":
        return 2
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit column stride; a view whenever rows are uniformly strided."""
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    n = x.shape[-1]
    if n > MAX_HIDDEN:
        raise ValueError(f"layer_norm triton kernel supports hidden <= {MAX_HIDDEN}, got {n}; "
                         f"use liger_rt.ops.layer_norm (dispatch picks torch there) or LIGER_RT_IMPL_LAYER_NORM=torch")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != n):
            raise ValueError(f"layer_norm: {name} must have shape ({n},) for x of shape {tuple(x.shape)}, "
                             f"got {tuple(t.shape)}")
    return n


def _bwd_grid(m: int, device: torch.device, config) -> int:
    """Persistent backward programs: sm_count * bwd_progs_per_sm, never more than the rows."""
    return max(1, min(m, _sm_count(device) * int(config.get("bwd_progs_per_sm", 4))))


def _dw_tile(n: int, device: torch.device) -> tuple[int, int]:
    """(columns, partial rows) per tile of the dW/dB partial-sum kernel (see rms_norm.py): 32
    contiguous columns x 64 partial rows on a GPU; few wide programs under the interpreter."""
    if device.type == "cpu":
        return 128, 16
    return 32, 64


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., N) -> (y (..., N) in x.dtype, mean (rows,), rstd (rows,) fp32)."""
    n = _check(x, weight, bias)
    x2 = _as_rows(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        rows = int(config.get("ROWS", 1))
        _layer_norm_fwd_kernel[(triton.cdiv(m, rows),)](
            x2, weight, bias if bias is not None else weight, y, mean, rstd, x2.stride(0), y.stride(0), m, n,
            float(eps), BLOCK_N=next_pow2(n), ROWS=rows, HAS_BIAS=bias is not None, RNE_BF16=interpreter_on(),
            num_warps=int(config.get("num_warps", 4)))
    return y.view(x.shape), mean, rstd


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   mean: torch.Tensor, rstd: torch.Tensor, config):
    """-> (dx (..., N) in x.dtype, dW (N,) in weight.dtype, dB (N,) in bias.dtype or None)."""
    n = _check(x, weight, bias)
    x2, dy2 = _as_rows(x, n), _as_rows(dy, n)
    m = x2.shape[0]
    has_bias = bias is not None
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return dx.view(x.shape), torch.zeros_like(weight), (torch.zeros_like(bias) if has_bias else None)
    grid = _bwd_grid(m, x.device, config)
    part = torch.empty((2 if has_bias else 1, grid, n), dtype=torch.float32, device=x.device)
    part_b = part[1] if has_bias else part[0]
    _layer_norm_bwd_kernel[(grid,)](
        dy2, x2, weight, mean, rstd, dx, part[0], part_b, dy2.stride(0), x2.stride(0), dx.stride(0), m, n,
        BLOCK_N=next_pow2(n), PREFETCH=bool(config.get("bwd_prefetch", 0)), HAS_BIAS=has_bias,
        RNE_BF16=interpreter_on(), num_warps=int(config.get("bwd_num_warps", 4)))
    dw = torch.empty(n, dtype=weight.dtype, device=weight.device)
    db = torch.empty(n, dtype=bias.dtype, device=bias.device) if has_bias else None
    block_r, block_g = _dw_tile(n, x.device)
    _layer_norm_dwdb_kernel[(triton.cdiv(n, block_r),)](
        part[0], part_b, dw, db if has_bias else dw, grid, n, BLOCK_G=block_g, BLOCK_R=block_r,
        HAS_BIAS=has_bias, RNE_BF16=interpreter_on(), num_warps=4)
    return dx.view(x.shape), dw, db


# -- autograd.Function ------------------------------------------------------------------------------

class LayerNormFunction(torch.autograd.Function):
    """apply(x, weight, bias, eps, config); bias may be None."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, config):
        x2 = _as_rows(x, x.shape[-1])
        y, mean, rstd = layer_norm_fwd(x2, weight, bias, eps, config)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.config, ctx.x_shape = config, x.shape
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_bwd(dy, x2, weight, bias, mean, rstd, ctx.config)
        return dx.view(ctx.x_shape), dw, db, None, None


# -- the torch.compile path: opaque custom ops --------------------------------------------------------
# Under torch.compile the kernels run inside custom ops, dispatched at run time exactly like eager
# calls (so dynamic shapes, env overrides and DB picks of torch behave the same), and dynamo never
# traces a launcher.  Eager calls keep the autograd.Function above: it costs less per call.

@torch.library.custom_op("liger_rt::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, hidden) -> (y, mean, rstd)."""
    d = OP.select(x, rows=x.shape[0], hidden=x.shape[1])
    if d.impl == "torch":
        xf = x.float()
        mean = xf.mean(-1)
        rstd = torch.rsqrt((xf - mean[:, None]).pow(2).mean(-1) + eps)
        return _layer_norm_torch(x, weight, bias, eps), mean, rstd
    return layer_norm_fwd(x, weight, bias, eps, d.config)


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, eps):
    stat = x.new_empty((x.shape[0],), dtype=torch.float32)
    return x.new_empty(x.shape), stat, torch.empty_like(stat)


@torch.library.custom_op("liger_rt::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx, dW, dB); dB is empty when there is no bias."""
    d = OP.select(x, rows=x.shape[0], hidden=x.shape[1])
    if d.impl == "torch":   # autograd is off inside an op: the gradients in closed form
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        dyf = dy.float()
        g = dyf * weight.float()
        dx = (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None]
        dw = (dyf * xhat).sum(0).to(weight.dtype)
        db = dyf.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
        return dx.to(x.dtype), dw, db
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd, d.config)
    return dx, dw, db if db is not None else weight.new_empty(0)


@_layer_norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), \
        (bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0))


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.has_bias = bias is not None


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd_op(dy, x, weight, bias, mean, rstd)
    return dx, dw, (db if ctx.has_bias else None), None


_layer_norm_fwd_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


# -- functional --------------------------------------------------------------------------------------

def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim; x (..., hidden), weight/bias (hidden,).  Dispatched per call;
    weight=None (no affine) runs PyTorch's LayerNorm."""
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != n):
            raise ValueError(f"layer_norm: {name} must have shape ({n},) for x of shape {tuple(x.shape)}, "
                             f"got {tuple(t.shape)}")
    if weight is None or x.dtype not in DTYPES.values() or x.numel() == 0:
        return _layer_norm_torch(x, weight, bias, eps)
    if torch.compiler.is_compiling():
        return _layer_norm_fwd_op(x.reshape(-1, n), weight, bias, float(eps))[0].view(x.shape)
    d = OP.select(x, rows=x.numel() // n, hidden=n)
    if d.impl == "torch":
        return _layer_norm_torch(x, weight, bias, eps)
    return LayerNormFunction.apply(x, weight, bias, eps, d.config)   # flattens inside: no view nodes


# -- registration -------------------------------------------------------------------------------------

from ..dispatch import Impl, Op, register  # noqa: E402


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["hidden"]
    x = (0.5 + torch.randn(m, n, generator=g)).to(device, dtype).requires_grad_()   # nonzero mean
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return {"x": x, "w": w, "b": b, "dy": dy}


def _run_torch(case, config):
    y = _layer_norm_torch(case["x"], case["w"], case["b"], 1e-5)
    return [y, *torch.autograd.grad(y, (case["x"], case["w"], case["b"]), case["dy"])]


def _run_triton(case, config):
    y = LayerNormFunction.apply(case["x"], case["w"], case["b"], 1e-5, config)
    return [y, *torch.autograd.grad(y, (case["x"], case["w"], case["b"]), case["dy"])]


def _warps(elems: int, per_thread: int, arch) -> int:
    return int(min(max(elems // (arch.warp_size * per_thread), 1), arch.max_num_warps))


def _fwd(arch, block_n: int, tile: int, per_thread: int) -> dict:
    rows = max(1, tile // block_n)
    return {"num_warps": _warps(rows * block_n, per_thread, arch), "ROWS": rows}


def _bwd(arch, block_n: int, per_thread: int, progs: int, prefetch: int) -> dict:
    return {"bwd_num_warps": max(min(4, arch.max_num_warps), _warps(block_n, per_thread, arch)),
            "bwd_progs_per_sm": progs, "bwd_prefetch": prefetch}


def _heuristic(arch, dims, dtype):
    """As rms_norm.py.  Forward: one row per program from hidden 2048 up (1-D tiles), 8 values
    per thread up to 2048 and 16 above; small rows pack 2048 elements per program.  Backward: 2
    persistent programs per SM walking rows with the grid's stride, 8 values per thread (16
    warps at 4096); the next row prefetched into registers up to hidden 2048 only: LayerNorm's
    backward holds two accumulators, and with prefetch a 16-warp program at 4096 takes 82
    registers on Triton 3.9 sm_90 (one resident per SM), without it 64 (two resident).
    fp32 dW/dB partials (2 * sm_count rows each) summed by a column-parallel kernel.
    Not measured on a GPU yet: `liger-tune sweep` decides among _configs, and picks torch
    where PyTorch's LayerNorm is faster (small hidden)."""
    e = next_pow2(dims["hidden"])
    return {**_fwd(arch, e, 2048, 8 if e <= 2048 else 16), **_bwd(arch, e, 8, 2, 1 if e <= 2048 else 0)}


def _configs(arch, dims, dtype):
    e = next_pow2(dims["hidden"])
    base = _heuristic(arch, dims, dtype)
    fwd_h = {k: base[k] for k in ("num_warps", "ROWS")}
    if arch.name == "cpu":  # the interpreter ignores warps: cover the code paths, not the space
        return [base, {**fwd_h, **_bwd(arch, e, 16, 1, 0)},
                {**_fwd(arch, e, 8192, 16), **_bwd(arch, e, 8, 3, 0)}]
    bwd = [{k: base[k] for k in base if k.startswith("bwd_")},   # the heuristic
           _bwd(arch, e, 8, 2, 1),
           _bwd(arch, e, 8, 4, 1),
           _bwd(arch, e, 8, 4, 0),      # occupancy instead of prefetch
           _bwd(arch, e, 8, 8, 0),
           _bwd(arch, e, 16, 2, 1),     # 8 warps at 4096: 127 registers with or without prefetch
           _bwd(arch, e, 16, 3, 0),
           _bwd(arch, e, 16, 8, 0),
           _bwd(arch, e, 16, 16, 0),    # many short programs (8 rows each at 16384 x 4096)
           _bwd(arch, e, 32, 8, 0)]     # 4 warps at 4096
    fwd_alt = [_fwd(arch, e, min(e, 2048), 8) if e > 2048 else _fwd(arch, e, 2048, 16),  # 16 warps/row at 4096
               _fwd(arch, e, min(e, 2048), 32),                                           # 4 warps/row at 4096
               _fwd(arch, e, 8192, 16)]                                                   # packed rows
    out = [{**fwd_h, **b} for b in bwd] + [{**f, **bwd[0]} for f in fwd_alt]
    seen, uniq = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq[:12]   # the heuristic first


def _smem(config, dims, dtype) -> int:
    """Row reductions only: a few KB of scratch (no pipelined shared-memory tiles)."""
    return 4096


def _supports(dims, dtype):
    if dims["hidden"] > MAX_HIDDEN:
        return f"hidden {dims['hidden']} > {MAX_HIDDEN} (one row per program in registers)"
    return None


def _plan(preset, arch, quick):
    vision = preset is not None and preset.model_type == "lfm2_vl" and preset.vision_hidden
    if arch.name == "cpu":
        if preset is not None and preset.tiny:
            hidden = (preset.vision_hidden if vision else preset.hidden,)
        else:
            hidden = (64, 128)
        rows = (8,) if quick else (8, 32)
        return [{"rows": r, "hidden": h} for h in hidden for r in rows]
    if preset is None:
        # SigLIP2 (1152) and two LLM widths
        hidden, tokens = (1152, 2048, 4096), ((4096,) if quick else (1024, 4096, 16384, 65536))
    else:
        hidden = (preset.vision_hidden if vision else preset.hidden,)
        tokens = preset.quick_tokens if quick else preset.tokens
    return [{"rows": t, "hidden": h} for h in hidden for t in tokens]


OP = register(Op(
    name="layer_norm", static=("hidden",), dynamic=("rows",),
    impls=[Impl("triton", run=_run_triton, available=triton_available, configs=_configs,
                heuristic=_heuristic, supports=_supports, smem=_smem),
           Impl("torch", run=_run_torch)],
    make_case=_make_case, plan=_plan, reduce_len=lambda d: d["rows"],
    schema_version=2))   # 2: grid-strided backward; bwd_ROWS and bwd_stages are gone
