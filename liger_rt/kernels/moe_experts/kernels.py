"""moe_experts' Triton kernels and their launchers: routing (a stable sort of the slots by expert, tile schedules),
the routed GEMMs (up with the SwiGLU epilogue, down/dX, the up backward, the weight gradients), the Op's forward
and backward, and the Triton implementation they make (``TRITON``, which the package registers).  The op, its
shapes and its data flow: the package docstring (liger_rt/kernels/moe_experts/__init__.py).

    (y,), saved = TRITON.forward(config, x, gate_up_proj, down_proj, top_k_index, top_k_weights, True)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..._triton import tl, triton
from ...backend import interpreter_on
from ...op import Impl
from .._common import triton_available

if TYPE_CHECKING:
    from .configs import Gemm


# ================================================================================ Triton kernels
@triton.jit
def _tile_swizzle(pid, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles walk the column tiles together (L2 reuse of A and B)."""
    width = GROUP_M * n_tiles_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = min(n_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["n_tiles_m"])
def _moe_up_fwd_kernel(
    perm_ptr, tile_ptr, bounds_ptr, n_tiles_m, x_ptr, w_ptr, gu_ptr, h_ptr, H, I, TOP_K, STORE_GU: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_DESC: tl.constexpr = False):
    """h[r, n] = silu(x[tok_r] . Wg[e, n]) * (x[tok_r] . Wu[e, n]) over the rows r of one expert tile. W_DESC: gate|up
    rows through a tensor descriptor (TMA; zero-filled past H, gate rows past I read up rows the store masks)."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_swizzle(pid, n_tiles_m, n_tiles_n, GROUP_M)
    e = tl.load(tile_ptr + pid_m)
    if e < 0:
        return
    row0 = tl.load(tile_ptr + n_tiles_m + pid_m)
    row_end = tl.load(bounds_ptr + e + 1)
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < row_end
    # rows past the expert's end read token 0 (in bounds) and are masked at the store
    slot = tl.load(perm_ptr + o_m, mask=m_m, other=0)
    tok = (slot // TOP_K).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_nw = o_n % I
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + tok[:, None] * H + o_k[None, :]
    p_wg = w_ptr + e.to(tl.int64) * (2 * I * H) + o_nw[None, :].to(tl.int64) * H + o_k[:, None]
    p_wu = p_wg + I * H
    if W_DESC:
        w_desc = tl.make_tensor_descriptor(w_ptr + e.to(tl.int64) * (2 * I * H), shape=[2 * I, H], strides=[H, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    b_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if W_DESC:
            a = tl.load(p_x) if EVEN_K else tl.load(p_x, mask=(o_k < H - k * BLOCK_K)[None, :], other=0.0)
            wg = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            wu = w_desc.load([I + pid_n * BLOCK_N, k * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(p_x)
            wg = tl.load(p_wg)
            wu = tl.load(p_wu)
        else:
            m_k = o_k < H - k * BLOCK_K
            a = tl.load(p_x, mask=m_k[None, :], other=0.0)
            wg = tl.load(p_wg, mask=m_k[:, None], other=0.0)
            wu = tl.load(p_wu, mask=m_k[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        b_g = tl.dot(a, wg, b_g, input_precision=PRECISION)
        b_u = tl.dot(a, wu, b_u, input_precision=PRECISION)
        p_x += BLOCK_K
        p_wg += BLOCK_K
        p_wu += BLOCK_K
    o_r = o_m.to(tl.int64)
    m_o = m_m[:, None] & (o_n < I)[None, :]
    if STORE_GU:
        p_gu = gu_ptr + o_r[:, None] * (2 * I) + o_n[None, :]
        tl.store(p_gu, b_g.to(gu_ptr.dtype.element_ty), mask=m_o)
        tl.store(p_gu + I, b_u.to(gu_ptr.dtype.element_ty), mask=m_o)
    b_h = b_g * tl.sigmoid(b_g) * b_u
    tl.store(h_ptr + o_r[:, None] * I + o_n[None, :], b_h.to(h_ptr.dtype.element_ty), mask=m_o)


@triton.jit(do_not_specialize=["n_tiles_m"])
def _moe_down_kernel(
    perm_ptr, tile_ptr, bounds_ptr, n_tiles_m, a_ptr, w_ptr, out_ptr, scale_ptr, N, KD, stride_we, stride_wk, stride_wn,
    HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DESC: tl.constexpr = False, W_T: tl.constexpr = False, OUT_SORTED: tl.constexpr = False):
    """out[slot_r, n] = (scale[slot_r] *) sum_k a[r, k] * W[e, k, n], a sorted, out in slot (or sorted) order. Forward:
    a = h, W[e] = down[e]^T; dX: a = dgu, W = gate_up[e]; up_bwd_split: a = sorted dy, W = down[e], out = g sorted.
    DESC: both operands through tensor descriptors (TMA), zero-filled past their bounds (W[e] n-major where W_T)."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_swizzle(pid, n_tiles_m, n_tiles_n, GROUP_M)
    e = tl.load(tile_ptr + pid_m)
    if e < 0:
        return
    row0 = tl.load(tile_ptr + n_tiles_m + pid_m)
    row_end = tl.load(bounds_ptr + e + 1)
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < row_end
    o_ma = tl.minimum(o_m, row_end - 1).to(tl.int64)  # in-bounds rows for unmasked loads
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_nw = o_n % N
    o_k = tl.arange(0, BLOCK_K)
    p_a = a_ptr + o_ma[:, None] * KD + o_k[None, :]
    p_w = w_ptr + e.to(tl.int64) * stride_we + o_k[:, None] * stride_wk + o_nw[None, :].to(tl.int64) * stride_wn
    if DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[row_end, KD], strides=[KD, 1], block_shape=[BLOCK_M, BLOCK_K])
        if W_T:
            w_desc = tl.make_tensor_descriptor(w_ptr + e.to(tl.int64) * stride_we, shape=[N, KD],
                                               strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr + e.to(tl.int64) * stride_we, shape=[KD, N],
                                               strides=[stride_wk, 1], block_shape=[BLOCK_K, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(KD, BLOCK_K)):
        if DESC:
            a = a_desc.load([row0, k * BLOCK_K])
            if W_T:
                w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                w = w_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(p_a)
            w = tl.load(p_w)
        else:
            m_k = o_k < KD - k * BLOCK_K
            a = tl.load(p_a, mask=m_k[None, :], other=0.0)
            w = tl.load(p_w, mask=m_k[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        p_a += BLOCK_K
        p_w += BLOCK_K * stride_wk
    if OUT_SORTED:
        row = o_m.to(tl.int64)
    else:
        slot = tl.load(perm_ptr + o_m, mask=m_m, other=0)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + slot, mask=m_m, other=0.0).to(tl.float32)[:, None]
        row = slot.to(tl.int64)
    p_o = out_ptr + row[:, None] * N + o_n[None, :]
    tl.store(p_o, acc.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & (o_n < N)[None, :])


@triton.jit(do_not_specialize=["n_tiles_m"])
def _moe_up_bwd_kernel(
    perm_ptr, tile_ptr, bounds_ptr, n_tiles_m, dy_ptr, w_ptr, gu_ptr, h_ptr, scale_ptr, dgu_ptr, dwp_ptr, hw_ptr, H, I,
    TOP_K, NEED_DW: tl.constexpr, STORE_HW: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_DESC: tl.constexpr = False):
    """g = dy[tok_r] @ down[e] in fp32; dw partials <g, h>; dgate|dup through SwiGLU of w * g. STORE_HW writes hw =
    w * h from registers, so the dW_down GEMM streams both operands straight into shared memory (no scaled loads)."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_swizzle(pid, n_tiles_m, n_tiles_n, GROUP_M)
    e = tl.load(tile_ptr + pid_m)
    if e < 0:
        return
    row0 = tl.load(tile_ptr + n_tiles_m + pid_m)
    row_end = tl.load(bounds_ptr + e + 1)
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < row_end
    slot = tl.load(perm_ptr + o_m, mask=m_m, other=0)
    tok = (slot // TOP_K).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_nw = o_n % I
    o_k = tl.arange(0, BLOCK_K)
    p_a = dy_ptr + tok[:, None] * H + o_k[None, :]
    p_w = w_ptr + e.to(tl.int64) * H * I + o_k[:, None].to(tl.int64) * I + o_nw[None, :]
    if W_DESC:
        w_desc = tl.make_tensor_descriptor(w_ptr + e.to(tl.int64) * H * I, shape=[H, I], strides=[I, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if W_DESC:
            a = tl.load(p_a) if EVEN_K else tl.load(p_a, mask=(o_k < H - k * BLOCK_K)[None, :], other=0.0)
            w = w_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(p_a)
            w = tl.load(p_w)
        else:
            m_k = o_k < H - k * BLOCK_K
            a = tl.load(p_a, mask=m_k[None, :], other=0.0)
            w = tl.load(p_w, mask=m_k[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        p_a += BLOCK_K
        p_w += BLOCK_K * I
    o_r = o_m.to(tl.int64)
    m_o = m_m[:, None] & (o_n < I)[None, :]
    b_w = tl.load(scale_ptr + slot, mask=m_m, other=0.0).to(tl.float32)
    if NEED_DW or STORE_HW:
        b_h = tl.load(h_ptr + o_r[:, None] * I + o_n[None, :], mask=m_o, other=0.0).to(tl.float32)
        if NEED_DW:
            tl.store(dwp_ptr + slot.to(tl.int64) * n_tiles_n + pid_n, tl.sum(acc * b_h, axis=1), mask=m_m)
        if STORE_HW:
            tl.store(hw_ptr + o_r[:, None] * I + o_n[None, :], (b_h * b_w[:, None]).to(hw_ptr.dtype.element_ty),
                     mask=m_o)
    b_dh = acc * b_w[:, None]
    p_gu = gu_ptr + o_r[:, None] * (2 * I) + o_n[None, :]
    b_g = tl.load(p_gu, mask=m_o, other=0.0).to(tl.float32)
    b_u = tl.load(p_gu + I, mask=m_o, other=0.0).to(tl.float32)
    b_sig = tl.sigmoid(b_g)
    b_dg = b_dh * b_u * b_sig * (1.0 + b_g * (1.0 - b_sig))
    b_du = b_dh * b_g * b_sig
    p_dgu = dgu_ptr + o_r[:, None] * (2 * I) + o_n[None, :]
    tl.store(p_dgu, b_dg.to(dgu_ptr.dtype.element_ty), mask=m_o)
    tl.store(p_dgu + I, b_du.to(dgu_ptr.dtype.element_ty), mask=m_o)


@triton.jit
def _moe_swiglu_bwd_kernel(g_ptr, perm_ptr, gu_ptr, h_ptr, scale_ptr, dgu_ptr, dw_ptr, hw_ptr, S, I,
                           NEED_DW: tl.constexpr, STORE_HW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """_moe_up_bwd_kernel's epilogue alone (up_bwd_split) over BLOCK_R sorted rows of g = dy[tok_r] @ down[e]
    (rounded to the inputs' dtype, as torch's dy @ down would be). hw may be g's buffer (read before written)."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < S
    slot = tl.load(perm_ptr + o_r, mask=m_r, other=0)
    b_w = tl.load(scale_ptr + slot, mask=m_r, other=0.0).to(tl.float32)
    r = o_r.to(tl.int64)[:, None]
    dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I)
        m = m_r[:, None] & (o_i < I)[None, :]
        b_gr = tl.load(g_ptr + r * I + o_i[None, :], mask=m, other=0.0).to(tl.float32)
        if NEED_DW or STORE_HW:
            b_h = tl.load(h_ptr + r * I + o_i[None, :], mask=m, other=0.0).to(tl.float32)
            if NEED_DW:
                dw += tl.sum(b_gr * b_h, axis=1)
            if STORE_HW:
                tl.store(hw_ptr + r * I + o_i[None, :], (b_h * b_w[:, None]).to(hw_ptr.dtype.element_ty), mask=m)
        b_dh = b_gr * b_w[:, None]
        p_gu = gu_ptr + r * (2 * I) + o_i[None, :]
        b_g = tl.load(p_gu, mask=m, other=0.0).to(tl.float32)
        b_u = tl.load(p_gu + I, mask=m, other=0.0).to(tl.float32)
        b_sig = tl.sigmoid(b_g)
        p_dgu = dgu_ptr + r * (2 * I) + o_i[None, :]
        tl.store(p_dgu, (b_dh * b_u * b_sig * (1.0 + b_g * (1.0 - b_sig))).to(dgu_ptr.dtype.element_ty), mask=m)
        tl.store(p_dgu + I, (b_dh * b_g * b_sig).to(dgu_ptr.dtype.element_ty), mask=m)
    if NEED_DW:
        tl.store(dw_ptr + slot, dw, mask=m_r)


@triton.jit
def _moe_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, perm_ptr, bounds_ptr, M, N, lda, ldb, TOP_K, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[e, m, n] = sum over the rows r of expert e of A[r, m] * B[r, n] (fp32 accumulator); row r of A is
    a[tok_r] when A_GATHER else a[r] (sorted), likewise B. dW_gate_up: A = dgu, B = x; dW_down: A = dy, B = hw."""
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    per_e = n_tiles_m * n_tiles_n
    e = pid // per_e
    pid_m, pid_n = _tile_swizzle(pid % per_e, n_tiles_m, n_tiles_n, GROUP_M)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_mw = o_m % M
    o_nw = o_n % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        o_r = r0 + tl.arange(0, BLOCK_K)
        m_r = o_r < end
        if A_GATHER or B_GATHER:
            slot = tl.load(perm_ptr + o_r, mask=m_r, other=0)
        if A_GATHER:
            row_a = (slot // TOP_K).to(tl.int64)
        else:
            row_a = o_r.to(tl.int64)
        if B_GATHER:
            row_b = (slot // TOP_K).to(tl.int64)
        else:
            row_b = o_r.to(tl.int64)
        a = tl.load(a_ptr + row_a[None, :] * lda + o_mw[:, None], mask=m_r[None, :], other=0.0)
        b = tl.load(b_ptr + row_b[:, None] * ldb + o_nw[None, :], mask=m_r[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    p_o = out_ptr + e.to(tl.int64) * M * N + o_m[:, None].to(tl.int64) * N + o_n[None, :]
    tl.store(p_o, acc.to(out_ptr.dtype.element_ty), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


@triton.jit
def _moe_wgrad_desc_kernel(
    a_ptr, b_ptr, out_ptr, bounds_ptr, M, N, lda, ldb, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """_moe_wgrad_kernel on sorted operands, one TMA descriptor per expert: its bound ends the ragged K loop."""
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    per_e = n_tiles_m * n_tiles_n
    e = pid // per_e
    pid_m, pid_n = _tile_swizzle(pid % per_e, n_tiles_m, n_tiles_n, GROUP_M)
    start = tl.load(bounds_ptr + e)
    rows = tl.load(bounds_ptr + e + 1) - start
    a_desc = tl.make_tensor_descriptor(a_ptr + start.to(tl.int64) * lda, shape=[rows, M], strides=[lda, 1],
                                       block_shape=[BLOCK_K, BLOCK_M])
    b_desc = tl.make_tensor_descriptor(b_ptr + start.to(tl.int64) * ldb, shape=[rows, N], strides=[ldb, 1],
                                       block_shape=[BLOCK_K, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_K):
        a = a_desc.load([r0, pid_m * BLOCK_M]).T
        b = b_desc.load([r0, pid_n * BLOCK_N])
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_o = out_ptr + e.to(tl.int64) * M * N + o_m[:, None].to(tl.int64) * N + o_n[None, :]
    tl.store(p_o, acc.to(out_ptr.dtype.element_ty), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


@triton.jit(do_not_specialize=["n_tiles"])
def _moe_tiles_kernel(bounds_ptr, meta_ptr, n_tiles, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """Tile schedule: for tile t the expert owning it (-1 past the last tile) and its first sorted row."""
    o_e = tl.arange(0, E_PAD)
    m_e = o_e < E
    start = tl.load(bounds_ptr + o_e, mask=m_e, other=0)
    end = tl.load(bounds_ptr + o_e + 1, mask=m_e, other=0)
    ntiles = (end - start + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(ntiles, axis=0)
    tile_start = tile_end - ntiles
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hit = (tile_start[None, :] <= t[:, None]) & (t[:, None] < tile_end[None, :]) & m_e[None, :]
    e = tl.max(tl.where(hit, o_e[None, :], -1), axis=1)
    row = tl.sum(tl.where(hit, start[None, :] + (t[:, None] - tile_start[None, :]) * BLOCK_M, 0), axis=1)
    m_t = t < n_tiles
    tl.store(meta_ptr + t, e, mask=m_t)
    tl.store(meta_ptr + n_tiles + t, row, mask=m_t)



# ================================================================================ launchers
def _n_tiles(S, E, block_m: int):
    """Tiles a routed GEMM launches: sum_e ceil(c_e / BM) <= (S + E * (BM - 1)) // BM, known without a sync."""
    return torch.sym_max(1, torch.sym_min(S, (S + E * (block_m - 1)) // block_m))


class _Routing:
    """Slots sorted by expert: perm (sorted row -> slot), bounds (E+1 row offsets), top_k, tiles per BLOCK_M (lazy)."""

    def __init__(self, perm: torch.Tensor, bounds: torch.Tensor, top_k: int, tiles: dict | None = None):
        self.perm, self.bounds, self.K = perm, bounds, top_k
        self.S, self.E = perm.numel(), bounds.numel() - 1
        self._tiles = tiles or {}

    @classmethod
    def sort(cls, top_k_index: torch.Tensor, experts: int) -> "_Routing":
        flat = top_k_index.reshape(-1)
        sorted_e, perm = torch.sort(flat, stable=True)
        bounds = torch.searchsorted(sorted_e, torch.arange(experts + 1, device=flat.device))
        # every id in [0, E) <=> the first expert starts at row 0 and the last ends at S (no host sync)
        torch._assert_async((bounds[0] == 0) & (bounds[experts] == flat.numel()),
                            f"moe_experts: top_k_index holds ids outside [0, {experts})")
        return cls(perm.to(torch.int32), bounds.to(torch.int32), top_k_index.shape[-1])

    def tiles(self, block_m: int) -> tuple[torch.Tensor, int]:
        """(2, n) int32: row 0 the expert of each BLOCK_M tile (-1 past the last), row 1 its first row."""
        hit = self._tiles.get(block_m)
        if hit is None:
            n = _n_tiles(self.S, self.E, block_m)
            meta = torch.empty(2, n, device=self.perm.device, dtype=torch.int32)
            _moe_tiles_kernel[(triton.cdiv(n, 128),)](self.bounds, meta, n, self.E, BLOCK_M=block_m,
                                                       E_PAD=triton.next_power_of_2(self.E), BLOCK_T=128, num_warps=4)
            hit = self._tiles[block_m] = (meta, n)
        return hit


def _dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    interp = device.type == "cpu" or interpreter_on()
    dot_fp32 = dtype == torch.float32 or (interp and dtype == torch.bfloat16)
    # fp32 inputs get exact fp32 products (tf32 would miss the fp32 tolerance); 16-bit inputs ignore it
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return dot_fp32, precision


def _gemm_opts(c: Gemm, a: torch.Tensor) -> dict:
    """Launch options of one GEMM family's config; `a` (the A operand) sets the dot's precision."""
    dot_fp32, precision = _dot_flags(a.dtype, a.device)
    return dict(DOT_FP32=dot_fp32, PRECISION=precision, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
                GROUP_M=c.GROUP_M, num_warps=c.num_warps, num_stages=c.num_stages)


def _launch(kernel, route: _Routing, c: Gemm, n_cols: int, a: torch.Tensor, *args, **flags) -> None:
    """A routed GEMM over route's BLOCK_M row tiles and n_cols columns; `a` is the A operand (its columns reduced)."""
    meta, n_m = route.tiles(c.BLOCK_M)
    kernel[(n_m * triton.cdiv(n_cols, c.BLOCK_N),)](
        route.perm, meta, route.bounds, n_m, a, *args, EVEN_K=a.shape[1] % c.BLOCK_K == 0, **flags, **_gemm_opts(c, a))


def _descriptors_ok(*ts: torch.Tensor) -> bool:
    """Tensor descriptors (TMA): a Triton with them, CUDA sm90+ or the interpreter, 16-byte aligned rows (any row)."""
    if not (hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")):
        return False
    if not all(t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in ts):
        return False
    return interpreter_on() or ts[0].device.type == "cpu" or (
        ts[0].is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(ts[0].device)[0] >= 9)


def _tma(on, *ts: torch.Tensor) -> bool:
    """Read these operands through tensor descriptors? (`on` and _descriptors_ok; sets Triton's scratch allocator)"""
    if not (on and _descriptors_ok(*[t.view(-1, t.shape[-1]) for t in ts])):
        return False
    triton.set_allocator(lambda size, alignment, stream, d=ts[0].device: torch.empty(size, device=d, dtype=torch.int8))
    return True


def _wgrad(a, b, out, route: _Routing, c: Gemm, *, a_gather: bool, b_gather: bool, desc: bool = False) -> None:
    """out (E, M, N) <- per expert sum over its rows of A[r]^T B[r]; `desc`: both sorted, through descriptors."""
    E, M, N = out.shape
    if _tma(desc and not (a_gather or b_gather), a, b):
        _moe_wgrad_desc_kernel[(E * triton.cdiv(M, c.BLOCK_M) * triton.cdiv(N, c.BLOCK_N),)](
            a, b, out, route.bounds, M, N, a.stride(0), b.stride(0), **_gemm_opts(c, a))
        return
    _moe_wgrad_kernel[(E * triton.cdiv(M, c.BLOCK_M) * triton.cdiv(N, c.BLOCK_N),)](
        a, b, out, route.perm, route.bounds, M, N, a.shape[1], b.shape[1], route.K,
        A_GATHER=a_gather, B_GATHER=b_gather, **_gemm_opts(c, a))


def _sum_k(slots: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """(T*K, H) slot rows -> (T, H): a contiguous sum over k, accumulated in fp32 by torch."""
    H = slots.shape[1]
    return slots.view(T, K, H).sum(1) if K > 1 else slots.view(T, H)


def _forward(config, x, gate_up_proj, down_proj, top_k_index, top_k_weights, save):
    """x (T, H) -> y (T, H); saved: gate|up (S, 2I) (empty unless `save`), h (S, I), perm, bounds, down tiles."""
    x, gate_up_proj, down_proj = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    T, H = x.shape
    I = down_proj.shape[2]
    route = _Routing.sort(top_k_index, gate_up_proj.shape[0])
    h = x.new_empty(route.S, I)
    gu = x.new_empty(route.S, 2 * I) if save else x.new_empty(0)
    _launch(_moe_up_fwd_kernel, route, config.up, I, x, gate_up_proj, gu if save else h, h, H, I, route.K,
            STORE_GU=save, W_DESC=_tma(config.up_desc, gate_up_proj))
    y_slot = x.new_empty(route.S, H)
    # W[e, k=i, n=h] = down[e, h, i]
    _launch(_moe_down_kernel, route, config.down, H, h, down_proj, y_slot, top_k_weights.contiguous().view(-1),
            H, I, H * I, 1, I, HAS_SCALE=True, DESC=_tma(config.down_desc, h, down_proj), W_T=True)
    meta = route.tiles(config.down.BLOCK_M)[0]
    return (_sum_k(y_slot, T, route.K),), (gu, h, route.perm, route.bounds, meta)


def _backward(config, args, saved, needs, dy):
    """dy (T, H) -> (dx, dgate_up, ddown, None, dweights, None), each None where not needed."""
    x, gate_up_proj, down_proj, top_k_index, top_k_weights, _ = args
    gu, h, perm, bounds, meta = saved
    if gu.numel() == 0:
        raise RuntimeError("moe_experts: this forward ran with save=False and kept nothing for a backward")
    x, gate_up_proj, down_proj, dy = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous(), dy.contiguous()
    need_dx, need_dgu, need_ddown, _, need_dw = needs[:5]     # eager: one per arg; the custom op: per tensor
    T, H = x.shape
    I = down_proj.shape[2]
    route = _Routing(perm, bounds, top_k_index.shape[-1], {config.down.BLOCK_M: (meta, meta.shape[1])})
    S, K = route.S, route.K
    split = config.up_bwd_split
    dgu = x.new_empty(S, 2 * I)
    dwp = x.new_empty(S, 1 if split else triton.cdiv(I, config.up_bwd.BLOCK_N), dtype=torch.float32) if need_dw else dgu
    hw = x.new_empty(S, I) if need_ddown else dgu
    scale = top_k_weights.contiguous().view(-1)
    # wgrad_sorted / up_bwd_split: x and dy copied into sorted order first (S x H each), so the GEMMs reading them
    # load plain strided tiles (or descriptors) instead of rows whose addresses come from a load in the same iteration
    tok = route.perm.long() // K if split or (config.wgrad_sorted and (need_dgu or need_ddown)) else None
    dy_s = dy.index_select(0, tok) if split or (tok is not None and need_ddown) else None
    if split:   # g = dy @ down[e] through the down/dX launch (sorted rows in and out), then the SwiGLU backward
        g = hw if need_ddown else x.new_empty(S, I)
        _launch(_moe_down_kernel, route, config.down, I, dy_s, down_proj, g, scale, I, H, H * I, I, 1,
                HAS_SCALE=False, OUT_SORTED=True, DESC=_tma(config.down_desc, dy_s, down_proj))
        block_i = min(512, triton.next_power_of_2(I))
        _moe_swiglu_bwd_kernel[(triton.cdiv(S, 4096 // block_i),)](
            g, route.perm, gu, h, scale, dgu, dwp, hw, S, I, NEED_DW=need_dw, STORE_HW=need_ddown,
            BLOCK_R=4096 // block_i, BLOCK_I=block_i, num_warps=4)
        del g
    else:
        _launch(_moe_up_bwd_kernel, route, config.up_bwd, I, dy, down_proj, gu, h, scale, dgu, dwp, hw, H, I, K,
                NEED_DW=need_dw, STORE_HW=need_ddown, W_DESC=_tma(config.up_desc, down_proj))
    # buffers go once their last reader has run (the first MoE layer's backward runs beside nearly every activation,
    # so its transients add to the step's peak): dW_down first (frees hw, sorted dy), then dX, then dW_gate_up
    dx = dgate_up = ddown = dw = None
    if need_dw:
        dw = dwp.sum(1).view(T, K).to(top_k_weights.dtype)
    del dwp
    if need_ddown:
        ddown = torch.empty_like(down_proj)
        if not config.wgrad_sorted:
            _wgrad(dy, hw, ddown, route, config.wgrad, a_gather=True, b_gather=False)
        else:
            _wgrad(dy_s, hw, ddown, route, config.wgrad, a_gather=False, b_gather=False, desc=config.wgrad_sorted == 2)
    del hw, dy_s
    if need_dx:
        dx_slot = x.new_empty(S, H)
        # W[e, k=j, n=h] = gate_up[e, j, h]
        _launch(_moe_down_kernel, route, config.down, H, dgu, gate_up_proj, dx_slot, dgu, H, 2 * I, 2 * I * H, H, 1,
                HAS_SCALE=False, DESC=_tma(config.down_desc, dgu, gate_up_proj))
        dx = _sum_k(dx_slot, T, K)
        del dx_slot
    if need_dgu:
        dgate_up = torch.empty_like(gate_up_proj)
        if not config.wgrad_sorted:
            _wgrad(dgu, x, dgate_up, route, config.wgrad, a_gather=False, b_gather=True)
        else:
            _wgrad(dgu, x.index_select(0, tok), dgate_up, route, config.wgrad, a_gather=False, b_gather=False,
                   desc=config.wgrad_sorted == 2)
    return dx, dgate_up, ddown, None, dw, None


def fake(config, x, gate_up_proj, down_proj, top_k_index, top_k_weights, save):
    E, I2, _ = gate_up_proj.shape
    S = top_k_index.numel()
    i32 = torch.int32
    return ((x.new_empty(x.shape),),
            (x.new_empty(S, I2) if save else x.new_empty(0), x.new_empty(S, I2 // 2), x.new_empty(S, dtype=i32),
             x.new_empty(E + 1, dtype=i32), x.new_empty(2, _n_tiles(S, E, config.down.BLOCK_M), dtype=i32)))


def supports(dims: dict, dtype: torch.dtype) -> str | None:
    if dims["hidden"] < 1 or dims["intermediate"] < 1 or dims["experts"] < 1 or dims["top_k"] < 1:
        return "moe_experts needs hidden, intermediate, experts and top_k >= 1"
    return None


TRITON = Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=supports)
