"""LayerNorm: y = (x - mean) * rstd * w + b over the last dim (the SigLIP2 vision tower's norm).

Shapes: x (..., hidden), weight (hidden,), bias (hidden,) or None -> y (..., hidden) in x.dtype,
like nn.LayerNorm: statistics and the affine in fp32, one rounding at the end.

    y = liger_rt.ops.layer_norm(x, weight, bias, eps=1e-6)   # x (4, 729, 1152) bf16

Kernels mirror rms_norm.py: ROWS rows per program in the forward (which stores mean and rstd,
fp32, per row); a persistent backward of about sm_count * progs_per_sm programs, the next row
tile prefetched while the current one computes, writing fp32 partials of dW and dB (one row per
program each), summed by a second kernel.  No atomics.  Under torch.compile the launchers run
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
    o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
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


@triton.jit(do_not_specialize=["M", "rows_per_prog"])
def _layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, stride_dy, stride_x, stride_dx,
                           M, N, rows_per_prog, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                           STAGES: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
                           RNE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    acc_w = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if PREFETCH:  # register double buffering: the next tile's loads fly while this tile computes
        o_first = (row_start + tl.arange(0, ROWS)).to(tl.int64)
        m_nx = (o_first < row_end)[:, None] & m_n[None, :]
        dy_nx = tl.load(DY + o_first[:, None] * stride_dy + o_n[None, :], mask=m_nx, other=0.0)
        x_nx = tl.load(X + o_first[:, None] * stride_x + o_n[None, :], mask=m_nx, other=0.0)
    for r0 in tl.range(row_start, row_end, ROWS, num_stages=STAGES):
        o_m = r0 + tl.arange(0, ROWS)
        m_m = o_m < row_end
        mask = m_m[:, None] & m_n[None, :]
        o_m64 = o_m.to(tl.int64)
        if PREFETCH:
            dy = dy_nx.to(tl.float32)
            x = x_nx.to(tl.float32)
            m_nx = (o_m + ROWS < row_end)[:, None] & m_n[None, :]
            dy_nx = tl.load(DY + (o_m64 + ROWS)[:, None] * stride_dy + o_n[None, :], mask=m_nx, other=0.0)
            x_nx = tl.load(X + (o_m64 + ROWS)[:, None] * stride_x + o_n[None, :], mask=m_nx, other=0.0)
        else:
            dy = tl.load(DY + o_m64[:, None] * stride_dy + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + o_m64[:, None] * stride_x + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + o_m, mask=m_m, other=0.0)
        rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)   # L1-resident: cheaper than 16 registers
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DX + o_m64[:, None] * stride_dx + o_n[None, :], _to(dx, DX.dtype.element_ty, RNE_BF16), mask=mask)
        acc_w += dy * xhat
        if HAS_BIAS:
            acc_b += dy
    tl.store(DW_PART + pid * N + o_n, tl.sum(acc_w, axis=0), mask=m_n)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + o_n, tl.sum(acc_b, axis=0), mask=m_n)


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
    rows = int(config.get("bwd_ROWS", 1))
    progs = _sm_count(x.device) * int(config.get("bwd_progs_per_sm", 2))
    rows_per_prog = triton.cdiv(triton.cdiv(m, progs), rows) * rows
    grid = triton.cdiv(m, rows_per_prog)
    part = torch.empty((2 if has_bias else 1, grid, n), dtype=torch.float32, device=x.device)
    part_b = part[1] if has_bias else part[0]
    _layer_norm_bwd_kernel[(grid,)](
        dy2, x2, weight, mean, rstd, dx, part[0], part_b, dy2.stride(0), x2.stride(0), dx.stride(0), m, n,
        rows_per_prog, BLOCK_N=next_pow2(n), ROWS=rows, STAGES=int(config.get("bwd_stages", 1)),
        PREFETCH=bool(config.get("bwd_prefetch", 0)), HAS_BIAS=has_bias, RNE_BF16=interpreter_on(), num_warps=int(config.get("bwd_num_warps", 4)))
    dw = torch.empty(n, dtype=weight.dtype, device=weight.device)
    db = torch.empty(n, dtype=bias.dtype, device=bias.device) if has_bias else None
    # >= 2 column programs per SM on a 132-SM part at hidden 4096; few wide ones in the interpreter
    block_r = 128 if x.device.type == "cpu" else (16 if n <= 4096 else 32)
    _layer_norm_dwdb_kernel[(triton.cdiv(n, block_r),)](
        part[0], part_b, dw, db if has_bias else dw, grid, n, BLOCK_G=4096 // block_r, BLOCK_R=block_r,
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
    x2 = x.reshape(-1, n)
    if torch.compiler.is_compiling():
        return _layer_norm_fwd_op(x2, weight, bias, float(eps))[0].view(x.shape)
    d = OP.select(x2, rows=x2.shape[0], hidden=n)
    if d.impl == "torch":
        return _layer_norm_torch(x, weight, bias, eps)
    return LayerNormFunction.apply(x2, weight, bias, eps, d.config).view(x.shape)


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


def _bwd(arch, block_n: int, row_mult: int, per_thread: int, progs: int, stages: int = 1, prefetch: int = 1) -> dict:
    rows = max(1, 4096 // block_n) * row_mult
    return {"bwd_num_warps": _warps(rows * block_n, per_thread, arch), "bwd_ROWS": rows,
            "bwd_progs_per_sm": progs, "bwd_stages": stages, "bwd_prefetch": prefetch}


def _heuristic(arch, dims, dtype):
    """As rms_norm.py: Liger-Kernel's forward warp table (8 values per thread up to 2048, 16
    above); a backward of 4096-element row tiles at 16 values per thread, two persistent programs
    per SM, the next tile prefetched into registers.  Not yet measured on a GPU: sweeps decide,
    and pick torch where it is faster."""
    e = next_pow2(dims["hidden"])
    if arch.name == "cpu":
        return {**_fwd(arch, e, 2048, 8), **_bwd(arch, e, 1, 16, 2)}
    return {**_fwd(arch, e, 2048, 8 if e <= 2048 else 16), **_bwd(arch, e, 1, 16, 2)}


def _configs(arch, dims, dtype):
    e = next_pow2(dims["hidden"])
    base = _heuristic(arch, dims, dtype)
    fwd_h = {k: base[k] for k in ("num_warps", "ROWS")}
    if arch.name == "cpu":  # the interpreter ignores warps: cover the code paths, not the space
        return [base, {**fwd_h, **_bwd(arch, e, 2, 16, 1, stages=2, prefetch=0)},
                {**_fwd(arch, e, 8192, 16), **_bwd(arch, e, 1, 8, 4, prefetch=0)}]
    bwd = [_bwd(arch, e, 1, 16, 2),                          # register prefetch (the heuristic)
           _bwd(arch, e, 1, 16, 2, prefetch=0),              # no overlap within a program
           _bwd(arch, e, 1, 16, 2, stages=2, prefetch=0),    # cp.async pipelining by tl.range
           _bwd(arch, e, 1, 16, 2, stages=3, prefetch=0),
           _bwd(arch, e, 1, 8, 2),                           # half the registers, twice the warps
           _bwd(arch, e, 2, 16, 1)]                          # one fat program per SM
    fwd_alt = [_fwd(arch, e, 2048, 16), _fwd(arch, e, 2048, 8), _fwd(arch, e, 8192, 16)]
    out = [{**fwd_h, **b} for b in bwd] + [{**f, **bwd[0]} for f in fwd_alt]
    seen, uniq = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if c["bwd_stages"] > arch.max_num_stages:   # HIP: <= 2 stages (dispatch prunes only num_stages)
            continue
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def _smem(config, dims, dtype) -> int:
    """Pipelined backward stages keep bwd_stages tiles of dy and x in shared memory."""
    e = next_pow2(dims["hidden"])
    el = torch.empty((), dtype=dtype).element_size() if dtype is not None else 2
    stages = int(config.get("bwd_stages", 1))
    tiles = stages * int(config.get("bwd_ROWS", 1)) * e * 2 * el if stages > 1 else 0
    return tiles + 4096  # row-reduction scratch


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
    make_case=_make_case, plan=_plan, reduce_len=lambda d: d["rows"]))
