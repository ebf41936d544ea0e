"""The row-norm family (rms_norm.py, layer_norm.py): one launch layout, one config, one tuning space and
the persistent backward both norms run.

Forward (each op's own kernel): ROWS whole rows per program, statistics in fp32.
Backward (here): G = min(rows, sm_count * bwd_progs_per_sm) persistent programs; program p takes rows
p, p + G, ... (neighbours in flight), writes dx and keeps one fp32 partial row of dW (and dB), which a
column-parallel kernel sums into the weight dtype.  No atomics.

    grid = persistent_grid(m, x.device, config.bwd_progs_per_sm)     # e.g. 264 programs on an H200
"""
from __future__ import annotations

import dataclasses

import torch

from .._triton import tl, triton
from ..backend import interpreter_on
from ..config import WARPS, Config, knob, pow2
from ..launch import bind
from ._common import block_problem, next_pow2, sm_count, to_dtype, warps_for

# One row lives in registers: BLOCK_N 32768 over 1024 threads is 32 fp32 values per thread and
# tensor, the most the backward (dy, x, the dW accumulator and LayerNorm's dB one) holds without
# spilling.
MAX_HIDDEN = 32768


def supports(dims: dict, dtype: torch.dtype) -> str | None:
    """The Triton row norms' shape limit (the dispatcher runs torch past it)."""
    too_wide = dims["hidden"] > MAX_HIDDEN
    return f"hidden {dims['hidden']} > {MAX_HIDDEN} (one row per program in registers)" if too_wide else None


def check_hidden(op_name: str, n: int) -> None:
    """A launcher's guard: the one-line error for a row wider than MAX_HIDDEN."""
    if n > MAX_HIDDEN:
        raise ValueError(f"{op_name} triton kernel supports hidden <= {MAX_HIDDEN}, got {n}; use liger_rt.ops."
                         f"{op_name} (dispatch picks torch there) or LIGER_RT_IMPL_{op_name.upper()}=torch")


@dataclasses.dataclass(frozen=True)
class RowNormConfig(Config):
    """Forward: ROWS rows per program. Backward: sm_count * bwd_progs_per_sm persistent programs walking rows
    with the grid's stride, fp32 partial rows summed by a column-parallel kernel."""
    ROWS: int = knob(1, pow2(1, 8192))                # rows per forward program (packed small rows)
    num_warps: int = knob(4, WARPS)                   # forward
    bwd_num_warps: int = knob(4, WARPS)
    bwd_progs_per_sm: int = knob(2, (1, 2, 3, 4, 6, 8, 12, 16))   # persistent backward programs
    bwd_prefetch: int = knob(1, (0, 1))               # next row's loads in flight (register double buffer)


def norm_launchable(config, dims, arch, dtype) -> str | None:
    """Why a row norm's `config` cannot launch at `dims` (None: it can): the forward's (ROWS, padded hidden) block
    within Triton's largest (the backward walks one row at a time)."""
    return block_problem(forward=config.ROWS * next_pow2(dims["hidden"]))


# -- heuristics and the tuning space --------------------------------------------------------------------

def norm_fwd(arch, *, block_n: int, tile: int, per_thread: int) -> dict:
    """Forward knobs: tile // block_n rows per program, `per_thread` values per thread."""
    rows = max(1, tile // block_n)
    return {"num_warps": warps_for(rows * block_n, per_thread, arch), "ROWS": rows}


def norm_bwd(arch, *, block_n: int, per_thread: int, progs: int, prefetch: int) -> dict:
    """Backward knobs: at least 4 warps (arch permitting), `progs` programs per SM, `prefetch` 1 keeps the next
    row's loads in flight."""
    return {"bwd_num_warps": max(min(4, arch.max_num_warps), warps_for(block_n, per_thread, arch)),
            "bwd_progs_per_sm": progs, "bwd_prefetch": prefetch}


# The GPU backward ladder around a heuristic.  At 4096 columns on Triton 3.9 sm_90, 16 values per thread is
# 8 warps: rms_norm takes 98 registers with prefetch (2 programs resident per SM), 71 without (3 resident);
# layer_norm 127 with or without.
BWD_LADDER = (
    dict(per_thread=8, progs=2, prefetch=1),
    dict(per_thread=8, progs=4, prefetch=1),
    dict(per_thread=8, progs=4, prefetch=0),     # occupancy instead of prefetch
    dict(per_thread=8, progs=8, prefetch=0),
    dict(per_thread=16, progs=2, prefetch=1),
    dict(per_thread=16, progs=3, prefetch=0),
    dict(per_thread=16, progs=8, prefetch=0),
    dict(per_thread=16, progs=16, prefetch=0),   # many short programs (8 rows each at 16384 x 4096)
    dict(per_thread=32, progs=8, prefetch=0),    # 4 warps at 4096
)


def norm_candidates(arch, hidden: int, base: RowNormConfig) -> list[RowNormConfig]:
    """A row norm's tuning space around its heuristic `base` (first), at most 12 configs."""
    e = next_pow2(hidden)
    if arch.name == "cpu":  # the interpreter ignores warps: cover the code paths, not the space
        return [base, base.replace(**norm_bwd(arch, block_n=e, per_thread=16, progs=1, prefetch=0)),
                base.replace(**norm_fwd(arch, block_n=e, tile=8192, per_thread=16),
                             **norm_bwd(arch, block_n=e, per_thread=8, progs=3, prefetch=0))]
    bwd = [norm_bwd(arch, block_n=e, **step) for step in BWD_LADDER]
    fwd = [norm_fwd(arch, block_n=e, tile=min(e, 2048), per_thread=8) if e > 2048        # 16 warps a row at 4096
           else norm_fwd(arch, block_n=e, tile=2048, per_thread=16),
           norm_fwd(arch, block_n=e, tile=min(e, 2048), per_thread=32),                # 4 warps a row at 4096
           norm_fwd(arch, block_n=e, tile=8192, per_thread=16)]                        # packed rows
    return list(dict.fromkeys([base] + [base.replace(**b) for b in bwd] + [base.replace(**f) for f in fwd]))[:12]


# -- the forward's packed rows -----------------------------------------------------------------------------

@triton.jit
def load_row_block(X, stride_x, M, o_n, m_n, ROWS: tl.constexpr):
    """A forward program's ROWS rows of X (unit column stride) as fp32 (ROWS, BLOCK_N), masked past M rows and N
    columns: (x, row offsets, the same as int64, row mask, element mask)."""
    o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_m = o_m < M
    mask = m_m[:, None] & m_n[None, :]
    o_m64 = o_m.to(tl.int64)
    x = tl.load(X + o_m64[:, None] * stride_x + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, o_m, o_m64, m_m, mask


@triton.jit
def rms_norm_store_row(x, XP, W, Y, RSTD, row, stride_y, o_n, m_n, N, eps, offset, RNE_BF16: tl.constexpr):
    """One fp32 row x (the values of XP's dtype): stores rstd and y = round(x * rstd) * (offset + w), the
    normalised row rounded to XP's dtype as the forward multiplies it."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    xn = to_dtype(x * rstd, XP.dtype.element_ty, RNE_BF16).to(tl.float32)
    w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32) + offset
    tl.store(Y + row * stride_y + o_n, to_dtype(xn * w, Y.dtype.element_ty, RNE_BF16), mask=m_n)


@triton.jit
def rms_norm_store_rows(x, XP, W, Y, RSTD, o_m, o_m64, m_m, mask, stride_y, o_n, m_n, N, eps, offset,
                        RNE_BF16: tl.constexpr):
    """rms_norm_store_row on a (ROWS, BLOCK_N) block of fp32 rows (load_row_block's offsets and masks)."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    xn = to_dtype(x * rstd[:, None], XP.dtype.element_ty, RNE_BF16).to(tl.float32)
    w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32) + offset
    y = xn * w[None, :]
    tl.store(Y + o_m64[:, None] * stride_y + o_n[None, :], to_dtype(y, Y.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(RSTD + o_m, rstd, mask=m_m)


# -- the persistent backward ------------------------------------------------------------------------------

def persistent_grid(m: int, device: torch.device, progs_per_sm: int) -> int:
    """Persistent programs: sm_count * progs_per_sm, never more than the rows."""
    return max(1, min(m, sm_count(device) * progs_per_sm))


def partial_sum_tile(device: torch.device) -> tuple[int, int]:
    """(columns, partial rows) per tile of the column-parallel sum of (G, N) fp32 partials: 32 columns (128 bytes
    per partial row) by 64 rows, 16 fp32 per thread at 4 warps; on the (serial) interpreter, few wide tiles."""
    return (128, 16) if device.type == "cpu" else (32, 64)


@triton.jit(do_not_specialize=["M"])
def row_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, DS, stride_dy, stride_x, stride_dx, stride_ds, M,
                        N, offset, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, CENTERED: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_DS: tl.constexpr, RNE_BF16: tl.constexpr):
    """dx rows and this program's fp32 partial dW (dB) row; program pid takes rows pid, pid + G, ... (G = grid <= M).

    RMSNorm (CENTERED off): xhat = x * rstd, y = round(xhat) * (offset + w); dW sees xhat rounded to x's dtype, as
    the forward multiplied it; dx = (g - xhat * mean(g * xhat)) * rstd with g = dy * (offset + w).
    LayerNorm (CENTERED): xhat = (x - mean) * rstd, y = xhat * w (+ b); dx = (g - xhat * mean(g * xhat) - mean(g))
    * rstd with g = dy * w; dB = sum dy (HAS_BIAS).  HAS_DS: x = a + b was an output too (fused_add_rms_norm.py)
    and DS its gradient, added to dx (the gradient of both addends).  MEAN, DB_PART, DS and offset may be None
    where they do not apply.
    """
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
        if HAS_DS:
            ds_nx = tl.load(DS + p64 * stride_ds + o_n, mask=m_n, other=0.0)
    for i in tl.range(0, tl.cdiv(M - pid, G)):
        row = pid + i * G
        r64 = row.to(tl.int64)
        if PREFETCH:
            dy = dy_nx.to(tl.float32)
            x = x_nx.to(tl.float32)
            m_nx = o_n < tl.where(row + G < M, N, 0)   # the next row, if any
            dy_nx = tl.load(DY + (r64 + G) * stride_dy + o_n, mask=m_nx, other=0.0)
            x_nx = tl.load(X + (r64 + G) * stride_x + o_n, mask=m_nx, other=0.0)
            if HAS_DS:
                ds = ds_nx.to(tl.float32)
                ds_nx = tl.load(DS + (r64 + G) * stride_ds + o_n, mask=m_nx, other=0.0)
        else:
            dy = tl.load(DY + r64 * stride_dy + o_n, mask=m_n, other=0.0).to(tl.float32)
            x = tl.load(X + r64 * stride_x + o_n, mask=m_n, other=0.0).to(tl.float32)
            if HAS_DS:
                ds = tl.load(DS + r64 * stride_ds + o_n, mask=m_n, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r64)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)   # L1-resident
        if CENTERED:
            xhat = tl.where(m_n, (x - tl.load(MEAN + r64)) * rstd, 0.0)
            g = dy * w
            c1 = tl.sum(g * xhat, axis=0) / N
            c2 = tl.sum(g, axis=0) / N
            dx = (g - xhat * c1 - c2) * rstd
            acc_w += dy * xhat
            if HAS_BIAS:
                acc_b += dy
        else:
            xhat = x * rstd
            acc_w += dy * to_dtype(xhat, X.dtype.element_ty, RNE_BF16).to(tl.float32)
            g = dy * (w + offset)
            c = tl.sum(g * xhat, axis=0) / N
            dx = (g - xhat * c) * rstd
        if HAS_DS:
            dx += ds
        tl.store(DX + r64 * stride_dx + o_n, to_dtype(dx, DX.dtype.element_ty, RNE_BF16), mask=m_n)
    p_off = pid.to(tl.int64) * N
    tl.store(DW_PART + p_off + o_n, acc_w, mask=m_n)
    if HAS_BIAS:
        tl.store(DB_PART + p_off + o_n, acc_b, mask=m_n)


@triton.jit
def row_norm_partial_sum_kernel(PW, PB, DW, DB, G, N, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                                HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr):
    """Column-parallel sums of the (G, N) fp32 partials of dW (and dB), BLOCK_R columns per program (coalesced
    rows), stored in DW's (DB's) dtype.  PB and DB may be None without HAS_BIAS."""
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
    tl.store(DW + o_n, to_dtype(tl.sum(acc_w, axis=0), DW.dtype.element_ty, RNE_BF16), mask=m_n)
    if HAS_BIAS:
        tl.store(DB + o_n, to_dtype(tl.sum(acc_b, axis=0), DB.dtype.element_ty, RNE_BF16), mask=m_n)


def bind_persistent_bwd(config: RowNormConfig, m: int, n: int, device: torch.device, *, centered: bool,
                        has_bias: bool = False, has_ds: bool = False):
    """(programs, the persistent backward kernel bound for them) at m rows of n on `device`."""
    grid = persistent_grid(m, device, config.bwd_progs_per_sm)
    return grid, bind(row_norm_bwd_kernel, (grid,), BLOCK_N=next_pow2(n), PREFETCH=bool(config.bwd_prefetch),
                      CENTERED=centered, HAS_BIAS=has_bias, HAS_DS=has_ds, RNE_BF16=interpreter_on(),
                      num_warps=config.bwd_num_warps)


def bind_partial_sum(n: int, device: torch.device, *, has_bias: bool = False):
    """The dW (dB) sum of fp32 partial rows of n, bound: sum(PW, PB, DW, DB, G, N)."""
    block_r, block_g = partial_sum_tile(device)
    return bind(row_norm_partial_sum_kernel, (triton.cdiv(n, block_r),), BLOCK_G=block_g, BLOCK_R=block_r,
                HAS_BIAS=has_bias, RNE_BF16=interpreter_on(), num_warps=4)
