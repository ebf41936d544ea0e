"""RMSNorm: y = (x * rstd).to(x.dtype) * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps).

Shapes: x (..., hidden), weight (hidden,) -> y (..., hidden) in promote(x.dtype, weight.dtype),
the dtype the Hugging Face module returns.  offset=0 for Llama/Qwen3/LFM2, 1 for Gemma-style
weights stored as w - 1.

    y = liger_rt.ops.rms_norm(x, weight, eps=1e-6)           # x (2, 128, 4096) bf16, weight (4096,)

Casting follows LlamaRMSNorm: statistics in fp32, the normalised x is rounded to the input dtype
*before* the weight multiply (``weight * hidden.to(input_dtype)``).

Kernels
- forward: ROWS rows per program (ROWS > 1 only for small hidden), BLOCK_N = next_pow2(hidden);
  stores rstd (fp32, one per row) for the backward.
- backward: persistent, about sm_count * progs_per_sm programs, each owning a contiguous chunk
  of rows that it walks bwd_ROWS rows at a time, with the next tile's loads in flight while the
  current one computes (bwd_prefetch: register double buffering; or bwd_stages > 1: cp.async
  pipelining by tl.range); dx is written per row, dW is accumulated in fp32 registers and written
  as one fp32 partial row per program, then a second kernel sums the partials and casts to the
  weight dtype.  No atomics.  Minimum traffic: fwd reads x, writes y (2MN); bwd reads dy and x,
  writes dx (3MN).
- under torch.compile the same launchers run inside custom ops (liger_rt::rms_norm_fwd/bwd),
  dispatched at run time, so graphs stay whole (fullgraph, dynamic shapes).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import DTYPES, interpreter_on, next_pow2, triton_available

# One row lives in registers: BLOCK_N 32768 over 1024 threads is 32 fp32 values per thread and
# tensor, the most the backward (dy, x, dW accumulator) holds without spilling.
MAX_HIDDEN = 32768


# -- reference ------------------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """fp32 statistics, normalised x cast to x.dtype, then times (offset + weight), like LlamaRMSNorm."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xn = (xf * rstd).to(x.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    return ((weight.float() + offset) * xn.float()).to(out_dtype)


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
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, M, N, eps, offset,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    mask = m_m[:, None] & m_n[None, :]
    o_m64 = o_m.to(tl.int64)
    x = tl.load(X + o_m64[:, None] * stride_x + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    xn = _to(x * rstd[:, None], X.dtype.element_ty, RNE_BF16).to(tl.float32)
    w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32) + offset
    y = xn * w[None, :]
    tl.store(Y + o_m64[:, None] * stride_y + o_n[None, :], _to(y, Y.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(RSTD + o_m, rstd, mask=m_m)


@triton.jit(do_not_specialize=["M", "rows_per_prog"])
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, M, N, rows_per_prog,
                         offset, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                         PREFETCH: tl.constexpr, RNE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
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
        rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
        xhat = x * rstd[:, None]
        # dW sees the normalised x as the forward multiplied it: rounded to the input dtype
        acc += dy * _to(xhat, X.dtype.element_ty, RNE_BF16).to(tl.float32)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32) + offset   # L1-resident: cheaper than registers
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + o_m64[:, None] * stride_dx + o_n[None, :], _to(dx, DX.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(DW_PART + pid * N + o_n, tl.sum(acc, axis=0), mask=m_n)


@triton.jit
def _rms_norm_dw_kernel(PART, DW, G, N, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, RNE_BF16: tl.constexpr):
    o_n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_n = o_n < N
    acc = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        o_g = g0 + tl.arange(0, BLOCK_G)
        mask = (o_g < G)[:, None] & m_n[None, :]
        acc += tl.load(PART + o_g[:, None] * N + o_n[None, :], mask=mask, other=0.0)
    tl.store(DW + o_n, _to(tl.sum(acc, axis=0), DW.dtype.element_ty, RNE_BF16), mask=m_n)


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


def _check_hidden(n: int) -> None:
    if n > MAX_HIDDEN:
        raise ValueError(f"rms_norm triton kernel supports hidden <= {MAX_HIDDEN}, got {n}; "
                         f"use liger_rt.ops.rms_norm (dispatch picks torch there) or LIGER_RT_IMPL_RMS_NORM=torch")


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, config) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., N) -> (y (..., N), rstd (rows,) fp32)."""
    n = x.shape[-1]
    _check_hidden(n)
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({n},)")
    x2 = _as_rows(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        rows = int(config.get("ROWS", 1))
        _rms_norm_fwd_kernel[(triton.cdiv(m, rows),)](
            x2, weight, y, rstd, x2.stride(0), y.stride(0), m, n, float(eps), float(offset),
            BLOCK_N=next_pow2(n), ROWS=rows, RNE_BF16=interpreter_on(), num_warps=int(config.get("num_warps", 4)))
    return y.view(*x.shape[:-1], n), rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
                 config) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x (..., N), rstd (rows,) -> (dx (..., N) in x.dtype, dW (N,) in weight.dtype)."""
    n = x.shape[-1]
    _check_hidden(n)
    x2, dy2 = _as_rows(x, n), _as_rows(dy, n)
    m = x2.shape[0]
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    rows = int(config.get("bwd_ROWS", 1))
    progs = _sm_count(x.device) * int(config.get("bwd_progs_per_sm", 2))
    rows_per_prog = triton.cdiv(triton.cdiv(m, progs), rows) * rows
    grid = triton.cdiv(m, rows_per_prog)
    part = torch.empty((grid, n), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(grid,)](
        dy2, x2, weight, rstd, dx, part, dy2.stride(0), x2.stride(0), dx.stride(0), m, n, rows_per_prog,
        float(offset), BLOCK_N=next_pow2(n), ROWS=rows, STAGES=int(config.get("bwd_stages", 1)),
        PREFETCH=bool(config.get("bwd_prefetch", 0)), RNE_BF16=interpreter_on(), num_warps=int(config.get("bwd_num_warps", 4)))
    dw = torch.empty(n, dtype=weight.dtype, device=weight.device)
    # >= 2 column programs per SM on a 132-SM part at hidden 4096; the interpreter runs programs
    # one after another, so few wide ones there
    block_r = 128 if x.device.type == "cpu" else (16 if n <= 4096 else 32)
    _rms_norm_dw_kernel[(triton.cdiv(n, block_r),)](part, dw, grid, n, BLOCK_G=4096 // block_r,
                                                   BLOCK_R=block_r, RNE_BF16=interpreter_on(), num_warps=4)
    return dx.view(x.shape), dw


# -- autograd.Function ------------------------------------------------------------------------------

class RMSNormFunction(torch.autograd.Function):
    """apply(x, weight, eps, offset, config); x (rows, hidden) or any leading shape."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, config):
        x2 = _as_rows(x, x.shape[-1])
        y, rstd = rms_norm_fwd(x2, weight, eps, offset, config)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset, ctx.config, ctx.x_shape = offset, config, x.shape
        return y.view(*x.shape[:-1], x.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x2, weight, rstd, ctx.offset, ctx.config)
        return dx.view(ctx.x_shape), dw, None, None, None


# -- the torch.compile path: opaque custom ops --------------------------------------------------------
# Under torch.compile the kernels run inside custom ops, dispatched at run time exactly like eager
# calls (so dynamic shapes and env overrides behave the same), and dynamo never traces a launcher.
# Eager calls keep the autograd.Function above: it costs less per call than the op dispatcher.

@torch.library.custom_op("liger_rt::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, hidden) -> (y, rstd)."""
    d = OP.select(x, rows=x.shape[0], hidden=x.shape[1])
    if d.impl == "torch":
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        return rms_norm_ref(x, weight, eps, offset), rstd
    return rms_norm_fwd(x, weight, eps, offset, d.config)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, offset):
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty((x.shape[0],), dtype=torch.float32))


@torch.library.custom_op("liger_rt::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, eps: float,
                     offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    d = OP.select(x, rows=x.shape[0], hidden=x.shape[1])
    if d.impl == "torch":   # autograd is off inside an op: the reference's gradients in closed form
        xhat = x.float() * rstd[:, None]
        dw = (dy.float() * xhat.to(x.dtype).float()).sum(0).to(weight.dtype)
        g = dy.float() * (weight.float() + offset)
        dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None]
        return dx.to(x.dtype), dw
    return rms_norm_bwd(dy, x, weight, rstd, offset, d.config)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, eps, offset):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd_op(dy, x, weight, rstd, ctx.eps, ctx.offset)
    return dx, dw, None, None


_rms_norm_fwd_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


# -- functional --------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim; x (..., hidden), weight (hidden,).  Dispatched per call."""
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"rms_norm: weight must have shape ({n},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if x.dtype not in DTYPES.values() or x.numel() == 0:
        return rms_norm_ref(x, weight, eps, offset)
    x2 = x.reshape(-1, n)
    if torch.compiler.is_compiling():
        y, _ = _rms_norm_fwd_op(x2, weight, float(eps), float(offset))
        return y.view(*x.shape[:-1], n)
    d = OP.select(x2, rows=x2.shape[0], hidden=n)
    if d.impl == "torch":
        return rms_norm_ref(x, weight, eps, offset)
    y = RMSNormFunction.apply(x2, weight, eps, offset, d.config)
    return y.view(*x.shape[:-1], n)


# -- registration -------------------------------------------------------------------------------------

from ..dispatch import Impl, Op, register  # noqa: E402


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["hidden"]
    x = torch.randn(m, n, generator=g).to(device, dtype).requires_grad_()
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return {"x": x, "w": w, "dy": dy}


def _run_torch(case, config):
    y = rms_norm_ref(case["x"], case["w"])
    return [y, *torch.autograd.grad(y, (case["x"], case["w"]), case["dy"])]


def _run_triton(case, config):
    y = RMSNormFunction.apply(case["x"], case["w"], 1e-6, 0.0, config)
    return [y, *torch.autograd.grad(y, (case["x"], case["w"]), case["dy"])]


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
    """Forward: Liger-Kernel 0.8.5's warp table (8 values per thread up to 2048, 16 above), which
    runs at 3.77-3.85 TB/s on the H200 (anchors/h200-anchor.json).  Backward: 4096-element row
    tiles at 16 values per thread, the next tile prefetched into registers while this one
    computes, two persistent programs per SM: four tiles, 64 KB of loads, in flight per SM
    (Triton 3.9 sm_90 ptxas: 80 registers at hidden 4096, no spills, so even three 8-warp programs
    fit; two leave headroom for other compilers).  Not yet measured on a GPU: sweeps decide."""
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
           _bwd(arch, e, 1, 16, 3),                          # 80 registers fit three 8-warp programs
           _bwd(arch, e, 1, 16, 2, prefetch=0),              # no overlap within a program
           _bwd(arch, e, 1, 16, 2, stages=2, prefetch=0),    # cp.async pipelining by tl.range
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
    if arch.name == "cpu":
        hidden = (preset.hidden,) if preset is not None and preset.tiny else (64, 128)
        rows = (8,) if quick else (8, 32)
        return [{"rows": r, "hidden": h} for h in hidden for r in rows]
    if preset is None:
        hidden, tokens = (2048, 4096), ((4096,) if quick else (1024, 4096, 16384, 65536))
    else:
        hidden, tokens = (preset.hidden,), (preset.quick_tokens if quick else preset.tokens)
    return [{"rows": t, "hidden": h} for h in hidden for t in tokens]


OP = register(Op(
    name="rms_norm", static=("hidden",), dynamic=("rows",),
    impls=[Impl("triton", run=_run_triton, available=triton_available, configs=_configs,
                heuristic=_heuristic, supports=_supports, smem=_smem),
           Impl("torch", run=_run_torch)],
    make_case=_make_case, plan=_plan, reduce_len=lambda d: d["rows"]))
