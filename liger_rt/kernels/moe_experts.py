"""MoE experts (SwiGLU experts of a sparse MoE block), transformers v5 layout.

    y = liger_rt.ops.moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights)

x (tokens, hidden); gate_up_proj (experts, 2*intermediate, hidden) with the gate in the FIRST
half (HF: ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``); down_proj (experts,
hidden, intermediate); top_k_index (tokens, k) integer expert ids in [0, experts);
top_k_weights (tokens, k). Returns (tokens, hidden):

    y[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = idx[t, j]

Three implementations on one Op:
- ``triton``: the fused path below (forward and backward in Triton, routing metadata in torch).
- ``grouped_mm``: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` (CUDA, bf16).
- ``torch``: the loop-over-experts reference in fp32 (tests, parity, the fallback).

Design of the fused path (S = tokens * k routed slots, slot s = t * k + j):
1. routing metadata (no host sync): a stable torch sort of the S slots by expert gives
   ``perm`` (sorted row -> slot) and ``bounds`` (E+1 row offsets per expert, searchsorted); a
   per-BLOCK_M tile schedule (tile -> expert, first row) comes from one small Triton launch.
   GEMM grids are launched for an upper bound of tiles; tiles past the real count return at once.
2. up GEMM: rows of x are gathered by token *inside the A-operand loads* (no permuted copy of
   x); two accumulators (gate columns n and up columns I+n of the same expert) share every A
   tile; the epilogue applies SwiGLU and stores h (S, I) in the input dtype, in sorted order,
   plus the pre-activations gate|up (S, 2I) when a backward will need them (storing them costs
   3*S*I*2 bytes of traffic; recomputing them would cost another 2/3 of the forward's flops).
3. down GEMM: h (contiguous, sorted) @ down[e]^T; the epilogue scales each row by its routing
   weight in fp32 and scatters it to its slot row of a (S, hidden) buffer in the input dtype.
4. the top-k reduction y[t] = sum_j y_slot[t*k + j] is a contiguous (T, k, H) sum that
   accumulates in fp32. We chose this over atomics into an fp32 (T, H) buffer: it is
   deterministic, needs no fp32 temporary and no memset, and costs 2*S*H*2 bytes of traffic
   (~0.13 ms at T=16384 on an H200, under 2% of the fused fwd+bwd). There is no (S, hidden)
   fp32 temporary anywhere.
Backward (dy (T, H)):
5. ``_moe_up_bwd_kernel``: g = dy[token] (gathered in the loads) @ down[e] -> (S, I) in fp32;
   its epilogue forms d top_k_weights partials <g, h> (= <dy[t], down_out[t, j]>, one fp32
   partial per I-tile, summed in torch: deterministic), dh = w * g, and dgate/dup through
   SwiGLU from the saved pre-activations, stored as dgu (S, 2I) in the input dtype.
6. dX: dgu @ gate_up[e] with the same down-GEMM kernel, scattered to slot rows in the input
   dtype, then summed over k like step 4 (no atomics).
7. dW: one grouped "weight-gradient" kernel per weight, an fp32 accumulator per (expert,
   tile) looping over that expert's rows: dW_gate_up[e] = dgu_e^T @ x[tokens_e] (x gathered),
   dW_down[e] = dy[tokens_e]^T @ hw_e (dy gathered; hw = w * h written by step 5, so neither
   operand needs a register pass). Experts with no rows get zeros.
Every GEMM is ``tl.dot`` with fp32 accumulation. ``DOT_FP32`` (constexpr) upcasts loaded tiles
to fp32 for fp32 inputs and for bf16 under the Triton interpreter, whose bf16 arithmetic is
wrong (NOTES.md); on a GPU bf16/fp16 tiles feed the tensor cores directly.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import backend
from ..dispatch import Impl, Op, register
from ._common import interpreter_on, triton_available

__all__ = ["moe_experts", "moe_experts_ref", "moe_experts_grouped_mm", "MoEExpertsFunction",
           "moe_experts_fwd", "moe_experts_bwd", "OP"]


# ================================================================================ reference
def moe_experts_ref(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The HF eager experts loop computed in fp32; returns x.dtype. Also the ``torch`` impl.

    >>> y = moe_experts_ref(x, gate_up_proj, down_proj, top_k_index, top_k_weights)  # (T, H)
    """
    T, H = x.shape
    E = gate_up_proj.shape[0]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    idx = top_k_index.long()
    for e in range(E):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        gate, up = (xf[tok] @ gate_up_proj[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down_proj[e].float().t()
        out = out.index_add(0, tok, y * top_k_weights[tok, pos, None].float())
    return out.to(x.dtype)


# ================================================================================ grouped MM
def _grouped_mm_fn():
    """torch.nn.functional.grouped_mm (torch >= 2.10) or torch._grouped_mm (2.8, 2.9), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def moe_experts_grouped_mm(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Sort slots by expert, two grouped GEMMs, weighted top-k sum (torch autograd backward).

    Alignment rules of the grouped GEMM (CUTLASS on sm90): bf16 operands, int32 cumulative
    end offsets per expert, 16-byte aligned rows (hidden and intermediate multiples of 8);
    the weights are passed as column-major views ``W.transpose(-2, -1)`` (no copy).
    """
    gmm = _grouped_mm_fn()
    if gmm is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has neither torch.nn.functional.grouped_mm nor "
                           "torch._grouped_mm; use the triton or torch implementation of moe_experts")
    T, H = x.shape
    K = top_k_index.shape[1]
    E = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    sorted_e, perm = torch.sort(flat, stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(E, device=x.device), right=True).to(torch.int32)
    xs = x.index_select(0, perm // K)
    gate, up = gmm(xs, gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = gmm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offs)
    y = y * top_k_weights.reshape(-1).index_select(0, perm).to(y.dtype).unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y.index_select(0, inv).view(T, K, H).sum(1)


@functools.lru_cache(maxsize=8)
def _grouped_mm_probe(device_index: int) -> bool:
    """Does a tiny bf16 grouped MM launch on this device? (the honest availability test)."""
    gmm = _grouped_mm_fn()
    if gmm is None:
        return False
    try:
        dev = torch.device("cuda", device_index)
        a = torch.randn(32, 64, device=dev, dtype=torch.bfloat16)
        b = torch.randn(2, 32, 64, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
        gmm(a, b, offs=torch.tensor([16, 32], device=dev, dtype=torch.int32))
        return True
    except Exception:
        return False


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (ValueError, IndexError):
        return False


def _grouped_mm_available(target) -> bool:
    """CUDA/ROCm only (never CPU, never the interpreter), and only where the op exists and runs.

    With a GPU present a tiny launch decides (once per device). For planning without one
    (``liger-tune explain --arch``), or while a CUDA graph is being captured, the rules of the
    op: torch._grouped_mm of torch <= 2.8 is sm90-only; torch >= 2.9 supports sm80+ (NVIDIA) and
    gfx942/gfx950 (ROCm)."""
    if target.device_type != "cuda" or _grouped_mm_fn() is None:
        return False
    arch = target.arch
    if backend.gpu_present() and backend.detect().name == arch.name and not torch.cuda.is_current_stream_capturing():
        return _grouped_mm_probe(torch.cuda.current_device())
    if arch.vendor == "nvidia":
        sm = int(arch.capability[2:]) if arch.capability[2:].isdigit() else 0
        return sm // 10 == 9 or (_torch_at_least(2, 9) and sm >= 80)
    if arch.vendor == "amd":
        return _torch_at_least(2, 9) and arch.capability in ("gfx942", "gfx950")
    return False


def _supports_grouped_mm(dims: dict, dtype: torch.dtype) -> str | None:
    if dtype != torch.bfloat16:
        return "grouped_mm runs bf16 only (CUTLASS grouped GEMM); use triton or torch for fp32/fp16"
    if dims["hidden"] % 8 or dims["intermediate"] % 8:
        return "grouped_mm needs hidden and intermediate multiples of 8 (16-byte aligned rows)"
    return None


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
    x_ptr, w_ptr, gu_ptr, h_ptr, perm_ptr, tile_ptr, bounds_ptr,
    n_tiles_m, H, I, TOP_K,
    STORE_GU: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """h[r, n] = silu(x[tok_r] . Wg[e, n]) * (x[tok_r] . Wu[e, n]) over the rows r of one expert tile."""
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
    b_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
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
    a_ptr, w_ptr, out_ptr, scale_ptr, perm_ptr, tile_ptr, bounds_ptr,
    n_tiles_m, N, KD, stride_we, stride_wk, stride_wn,
    HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[slot_r, n] = (scale[slot_r] *) sum_k a[r, k] * W[e, k, n]; a in sorted order, out in slot order.

    Forward: a = h (S, I), W[e, k, n] = down[e, n, k]. Backward dX: a = dgu (S, 2I), W = gate_up[e]."""
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(KD, BLOCK_K)):
        if EVEN_K:
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
    slot = tl.load(perm_ptr + o_m, mask=m_m, other=0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + slot, mask=m_m, other=0.0).to(tl.float32)[:, None]
    p_o = out_ptr + slot.to(tl.int64)[:, None] * N + o_n[None, :]
    tl.store(p_o, acc.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & (o_n < N)[None, :])


@triton.jit(do_not_specialize=["n_tiles_m"])
def _moe_up_bwd_kernel(
    dy_ptr, w_ptr, gu_ptr, h_ptr, scale_ptr, dgu_ptr, dwp_ptr, hw_ptr, perm_ptr, tile_ptr, bounds_ptr,
    n_tiles_m, H, I, TOP_K,
    NEED_DW: tl.constexpr, STORE_HW: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """g = dy[tok_r] @ down[e] (fp32); dw partial <g, h>; dgate/dup through SwiGLU of w * g.

    STORE_HW also writes hw = w * h (the scaled A^T of dW_down) while the h tile is in registers,
    so the dW_down GEMM streams both operands straight into shared memory (a scale applied in its
    loads would route them through registers) at the cost of one (S, I) write."""
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
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
def _moe_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, perm_ptr, bounds_ptr,
    M, N, lda, ldb, TOP_K,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[e, m, n] = sum over the rows r of expert e of A[r, m] * B[r, n] (fp32 accumulator).

    A row r is a[tok_r] when A_GATHER else a[r] (sorted order), likewise B.
    dW_gate_up: A = dgu, B = x gathered; dW_down: A = dy gathered, B = hw = w * h."""
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


@triton.jit(do_not_specialize=["n_tiles"])
def _moe_tiles_kernel(bounds_ptr, meta_ptr, n_tiles, E,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tile schedule of a grouped GEMM in one launch: for tile t, the expert owning it (-1 past
    the last tile) and its first sorted row. Expert e owns tiles [tile_start[e], tile_end[e])."""
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
class _Routing:
    """Slots sorted by expert: perm (sorted row -> slot), bounds (E+1 row offsets), tile schedules."""

    def __init__(self, top_k_index: torch.Tensor | None, experts: int, *, saved=None):
        self._tiles: dict[int, tuple[torch.Tensor, int]] = {}
        if saved is not None:                      # (perm int32, bounds int32, k) from a forward
            self.perm, self.bounds, self.K = saved
            self.S, self.E = self.perm.numel(), experts
            return
        flat = top_k_index.reshape(-1)
        self.S = flat.numel()
        self.E = experts
        self.K = top_k_index.shape[-1]
        sorted_e, perm = torch.sort(flat, stable=True)
        bounds = torch.searchsorted(sorted_e, torch.arange(experts + 1, device=flat.device))
        if not torch.compiler.is_compiling():
            # every id in [0, E) <=> the first expert starts at row 0 and the last ends at S (no host sync)
            torch._assert_async((bounds[0] == 0) & (bounds[experts] == self.S),
                                f"moe_experts: top_k_index holds ids outside [0, {experts})")
        self.perm = perm.to(torch.int32)
        self.bounds = bounds.to(torch.int32)

    def tiles(self, block_m: int) -> tuple[torch.Tensor, int]:
        """(2, n) int32: row 0 the expert of each BLOCK_M tile (-1 past the last), row 1 its first row."""
        hit = self._tiles.get(block_m)
        if hit is not None:
            return hit
        # sum_e ceil(c_e / BM) <= (S + E * (BM - 1)) // BM: an upper bound known without a sync
        n = max(1, min(self.S, (self.S + self.E * (block_m - 1)) // block_m))
        meta = torch.empty(2, n, device=self.perm.device, dtype=torch.int32)
        _moe_tiles_kernel[(triton.cdiv(n, 128),)](self.bounds, meta, n, self.E, BLOCK_M=block_m,
                                                   E_PAD=triton.next_power_of_2(self.E), BLOCK_T=128, num_warps=4)
        self._tiles[block_m] = (meta, n)
        return meta, n


def _dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    interp = device.type == "cpu" or interpreter_on()
    dot_fp32 = dtype == torch.float32 or (interp and dtype == torch.bfloat16)
    # fp32 inputs get exact fp32 products (tf32 would miss the fp32 tolerance); 16-bit inputs ignore it
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return dot_fp32, precision


def _launch_opts(c: dict) -> dict:
    return {"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"], "BLOCK_K": c["BLOCK_K"], "GROUP_M": c["GROUP_M"],
            "num_warps": c["num_warps"], "num_stages": c["num_stages"]}


def launch_up_fwd(x, gate_up_proj, route: _Routing, c: dict, h, gu=None) -> None:
    """h (S, I) [and gu (S, 2I)] <- SwiGLU(x[tokens] @ gate_up[e]^T), rows in sorted order."""
    H, I = x.shape[1], h.shape[1]
    dot_fp32, prec = _dot_flags(x.dtype, x.device)
    meta, n_m = route.tiles(c["BLOCK_M"])
    _moe_up_fwd_kernel[(n_m * triton.cdiv(I, c["BLOCK_N"]),)](
        x, gate_up_proj, h if gu is None else gu, h, route.perm, meta, route.bounds, n_m, H, I, route.K,
        STORE_GU=gu is not None, EVEN_K=H % c["BLOCK_K"] == 0, DOT_FP32=dot_fp32, PRECISION=prec, **_launch_opts(c))


def launch_down(a, w, w_strides: tuple[int, int, int], out, scale, route: _Routing, c: dict) -> None:
    """out[slot] <- (scale[slot] *) a[sorted row] @ W[e]; W[e, k, n] at w + e*s0 + k*s1 + n*s2."""
    KD, N = a.shape[1], out.shape[1]
    dot_fp32, prec = _dot_flags(a.dtype, a.device)
    meta, n_m = route.tiles(c["BLOCK_M"])
    _moe_down_kernel[(n_m * triton.cdiv(N, c["BLOCK_N"]),)](
        a, w, out, scale if scale is not None else a, route.perm, meta, route.bounds, n_m, N, KD, *w_strides,
        HAS_SCALE=scale is not None, EVEN_K=KD % c["BLOCK_K"] == 0, DOT_FP32=dot_fp32, PRECISION=prec,
        **_launch_opts(c))


def launch_up_bwd(dy, down_proj, gu, h, w_flat, route: _Routing, c: dict, dgu, dwp=None, hw=None) -> None:
    """dgu (S, 2I) <- SwiGLU'(w * dy[tokens] @ down[e]); dwp (S, I/BLOCK_N) <- partials of d weights;
    hw (S, I) <- w * h."""
    H, I = dy.shape[1], h.shape[1]
    dot_fp32, prec = _dot_flags(dy.dtype, dy.device)
    meta, n_m = route.tiles(c["BLOCK_M"])
    _moe_up_bwd_kernel[(n_m * triton.cdiv(I, c["BLOCK_N"]),)](
        dy, down_proj, gu, h, w_flat, dgu, dgu if dwp is None else dwp, dgu if hw is None else hw, route.perm, meta,
        route.bounds, n_m, H, I, route.K, NEED_DW=dwp is not None, STORE_HW=hw is not None,
        EVEN_K=H % c["BLOCK_K"] == 0, DOT_FP32=dot_fp32, PRECISION=prec, **_launch_opts(c))


def launch_wgrad(a, b, out, route: _Routing, c: dict, *, a_gather: bool, b_gather: bool) -> None:
    """out (E, M, N) <- per expert sum over its rows of A[r]^T B[r] (A, B gathered by token or sorted)."""
    E, M, N = out.shape
    dot_fp32, prec = _dot_flags(a.dtype, a.device)
    grid = (E * triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)
    _moe_wgrad_kernel[grid](
        a, b, out, route.perm, route.bounds, M, N, a.shape[1], b.shape[1], route.K,
        A_GATHER=a_gather, B_GATHER=b_gather, DOT_FP32=dot_fp32, PRECISION=prec,
        **_launch_opts(c))


def _sum_k(slots: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """(T*K, H) slot rows -> (T, H): a contiguous sum over k, accumulated in fp32 by torch."""
    H = slots.shape[1]
    return slots.view(T, K, H).sum(1) if K > 1 else slots.view(T, H)


def moe_experts_fwd(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, w_flat: torch.Tensor,
                    route: _Routing, config: dict, save: bool):
    """Fused forward on contiguous 2-D inputs; returns (y (T, H), gu (S, 2I) or None, h (S, I))."""
    T, H = x.shape
    I = down_proj.shape[2]
    S = route.S
    h = torch.empty(S, I, device=x.device, dtype=x.dtype)
    gu = torch.empty(S, 2 * I, device=x.device, dtype=x.dtype) if save else None
    launch_up_fwd(x, gate_up_proj, route, config["up"], h, gu)
    y_slot = torch.empty(S, H, device=x.device, dtype=x.dtype)
    # W[e, k=i, n=h] = down[e, h, i]
    launch_down(h, down_proj, (H * I, 1, I), y_slot, w_flat, route, config["down"])
    return _sum_k(y_slot, T, route.K), gu, h


def moe_experts_bwd(dy: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    w_flat: torch.Tensor, route: _Routing, gu: torch.Tensor, h: torch.Tensor, config: dict,
                    needs: tuple[bool, bool, bool, bool]):
    """Fused backward; needs = (dx, dgate_up, ddown, dweights). Returns the four grads (None if not needed)."""
    need_dx, need_dgu, need_ddown, need_dw = needs
    T, H = x.shape
    I = down_proj.shape[2]
    S, K = route.S, route.K
    dx = dgate_up = ddown = dw = None
    dgu = torch.empty(S, 2 * I, device=x.device, dtype=x.dtype)
    dwp = None
    if need_dw:
        dwp = torch.empty(S, triton.cdiv(I, config["up_bwd"]["BLOCK_N"]), device=x.device, dtype=torch.float32)
    hw = torch.empty(S, I, device=x.device, dtype=x.dtype) if need_ddown else None
    launch_up_bwd(dy, down_proj, gu, h, w_flat, route, config["up_bwd"], dgu, dwp, hw)
    if need_dw:
        dw = dwp.sum(1).view(T, K)
    if need_dx:
        dx_slot = torch.empty(S, H, device=x.device, dtype=x.dtype)
        # W[e, k=j, n=h] = gate_up[e, j, h]
        launch_down(dgu, gate_up_proj, (2 * I * H, H, 1), dx_slot, None, route, config["down"])
        dx = _sum_k(dx_slot, T, K)
    if need_dgu:
        dgate_up = torch.empty_like(gate_up_proj)
        launch_wgrad(dgu, x, dgate_up, route, config["wgrad"], a_gather=False, b_gather=True)
    if need_ddown:
        ddown = torch.empty_like(down_proj)
        launch_wgrad(dy, hw, ddown, route, config["wgrad"], a_gather=True, b_gather=False)
    return dx, dgate_up, ddown, dw


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


# ================================================================================ autograd
# Under torch.compile the forward and backward run as two opaque custom ops (fake impls give
# dynamo the shapes; tracing into Triton's launcher or the interpreter would break the graph).
# In eager they are called directly (a custom op's dispatch costs microseconds per call).
def _config_str(config) -> str:
    # "fam.KEY=int,..." rather than json: dynamo traces this (fullgraph), it cannot trace json.dumps
    return ",".join(f"{fam}.{k}={int(v)}" for fam, c in sorted(config.items()) if isinstance(c, dict)
                    for k, v in sorted(c.items()))


def _config_parse(text: str) -> dict:
    out: dict = {}
    for kv in text.split(","):
        if kv:
            key, v = kv.split("=")
            fam, k = key.split(".")
            out.setdefault(fam, {})[k] = int(v)
    return out


def _fwd(x, gate_up_proj, down_proj, top_k_index, w_flat, config: dict, save: bool):
    route = _Routing(top_k_index, gate_up_proj.shape[0])
    y, gu, h = moe_experts_fwd(x, gate_up_proj, down_proj, w_flat, route, config, save)
    return y, gu, h, route


@torch.library.custom_op("liger_rt::moe_experts_fwd", mutates_args=())
def _moe_experts_fwd_op(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        top_k_index: torch.Tensor, w_flat: torch.Tensor, config: str,
                        save: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, gu, h, route = _fwd(x, gate_up_proj, down_proj, top_k_index, w_flat, _config_parse(config), save)
    return y, gu if gu is not None else x.new_empty(0), h, route.perm, route.bounds


@_moe_experts_fwd_op.register_fake
def _(x, gate_up_proj, down_proj, top_k_index, w_flat, config, save):
    T, H = x.shape
    E, I2, _ = gate_up_proj.shape
    S = top_k_index.numel()
    return (x.new_empty(T, H), x.new_empty(S, I2) if save else x.new_empty(0), x.new_empty(S, I2 // 2),
            x.new_empty(S, dtype=torch.int32), x.new_empty(E + 1, dtype=torch.int32))


@torch.library.custom_op("liger_rt::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd_op(dy: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        w_flat: torch.Tensor, perm: torch.Tensor, bounds: torch.Tensor, gu: torch.Tensor,
                        h: torch.Tensor, top_k: int, config: str, need_dx: bool, need_dgu: bool, need_ddown: bool,
                        need_dw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    route = _Routing(None, gate_up_proj.shape[0], saved=(perm, bounds, top_k))
    grads = moe_experts_bwd(dy, x, gate_up_proj, down_proj, w_flat, route, gu, h, _config_parse(config),
                            (need_dx, need_dgu, need_ddown, need_dw))
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@_moe_experts_bwd_op.register_fake
def _(dy, x, gate_up_proj, down_proj, w_flat, perm, bounds, gu, h, top_k, config, need_dx, need_dgu, need_ddown,
      need_dw):
    T = x.shape[0]
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
            gate_up_proj.new_empty(gate_up_proj.shape) if need_dgu else x.new_empty(0),
            down_proj.new_empty(down_proj.shape) if need_ddown else x.new_empty(0),
            x.new_empty(T, top_k, dtype=torch.float32) if need_dw else x.new_empty(0))


class MoEExpertsFunction(torch.autograd.Function):
    """Fused experts; inputs already 2-D: x (T, H), top_k_index / top_k_weights (T, k)."""

    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, top_k_index, top_k_weights, config):
        x, gate_up_proj, down_proj = _c(x), _c(gate_up_proj), _c(down_proj)
        w_flat = _c(top_k_weights).reshape(-1)
        save = any(ctx.needs_input_grad)
        if torch.compiler.is_compiling():
            y, gu, h, perm, bounds = _moe_experts_fwd_op(x, gate_up_proj, down_proj, top_k_index, w_flat,
                                                         _config_str(config), save)
            route = None
        else:
            y, gu, h, route = _fwd(x, gate_up_proj, down_proj, top_k_index, w_flat, config, save)
            perm, bounds = route.perm, route.bounds
        if save:
            ctx.save_for_backward(x, gate_up_proj, down_proj, w_flat, gu, h, perm, bounds)
            ctx.route = route          # eager: keeps the tile schedules computed in the forward
            ctx.top_k = top_k_index.shape[-1]
            ctx.config = config
            ctx.w_dtype = top_k_weights.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up_proj, down_proj, w_flat, gu, h, perm, bounds = ctx.saved_tensors
        nx, ngu, ndown, _, nw, _ = ctx.needs_input_grad
        dy = _c(dy)
        if torch.compiler.is_compiling() or ctx.route is None:
            grads = _moe_experts_bwd_op(dy, x, gate_up_proj, down_proj, w_flat, perm, bounds, gu, h, ctx.top_k,
                                        _config_str(ctx.config), nx, ngu, ndown, nw)
            dx, dgu, ddown, dw = (g if need else None for g, need in zip(grads, (nx, ngu, ndown, nw)))
        else:
            dx, dgu, ddown, dw = moe_experts_bwd(dy, x, gate_up_proj, down_proj, w_flat, ctx.route, gu, h,
                                                 ctx.config, (nx, ngu, ndown, nw))
        if dw is not None:
            dw = dw.to(ctx.w_dtype)
        return dx, dgu, ddown, None, dw, None


# ================================================================================ functional
def _check(x, gate_up_proj, down_proj, top_k_index, top_k_weights) -> tuple[int, int, int, int, int]:
    if x.dim() < 1 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError("moe_experts takes x (tokens, hidden), gate_up_proj (experts, 2*intermediate, hidden), "
                         f"down_proj (experts, hidden, intermediate); got {tuple(x.shape)}, "
                         f"{tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}")
    H = x.shape[-1]
    E, I2, H2 = gate_up_proj.shape
    if H2 != H or I2 % 2 or tuple(down_proj.shape) != (E, H, I2 // 2):
        raise ValueError(f"moe_experts: inconsistent shapes x {tuple(x.shape)}, gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}; expected gate_up_proj "
                         f"(E, 2*I, {H}) and down_proj "
                         f"(E, {H}, I) (the transformers v5 experts layout)")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"moe_experts: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be (tokens, k) for x {tuple(x.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"moe_experts: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if not (x.dtype == gate_up_proj.dtype == down_proj.dtype):
        raise TypeError(f"moe_experts: x, gate_up_proj and down_proj must share a dtype (got {x.dtype}, "
                        f"{gate_up_proj.dtype}, {down_proj.dtype}); cast x to the weights' dtype first")
    T = x.numel() // H if H else 0
    return T, E, top_k_index.shape[-1], H, I2 // 2


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts, dispatched (triton / grouped_mm / torch) by arch, dtype and shape.

    x (..., hidden); gate_up_proj (E, 2*I, hidden), gate first; down_proj (E, hidden, I);
    top_k_index, top_k_weights (..., k). Returns (..., hidden) in x.dtype.

    >>> y = liger_rt.ops.moe_experts(x, experts.gate_up_proj, experts.down_proj, idx, w)
    """
    T, E, K, H, I = _check(x, gate_up_proj, down_proj, top_k_index, top_k_weights)
    lead = x.shape[:-1]
    x2, idx2, w2 = x.reshape(T, H), top_k_index.reshape(T, K), top_k_weights.reshape(T, K)
    d = OP.select(x2, tokens=T, experts=E, top_k=K, hidden=H, intermediate=I)
    if d.impl == "torch" or T == 0:
        y = moe_experts_ref(x2, gate_up_proj, down_proj, idx2, w2)
    elif d.impl == "grouped_mm":
        y = moe_experts_grouped_mm(x2, gate_up_proj, down_proj, idx2, w2)
    else:
        y = MoEExpertsFunction.apply(x2, gate_up_proj, down_proj, idx2, w2, d.config)
    return y.reshape(*lead, H)


# ================================================================================ configs
def _gemm(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": warps, "num_stages": stages}


def _combo(up: dict, up_bwd: dict, down: dict, wgrad: dict) -> dict:
    """A config: one launch config per GEMM family. ``up``: the gathered up GEMM with the SwiGLU
    epilogue (two accumulators of BLOCK_N columns each); ``up_bwd``: dy @ down[e] with the
    SwiGLU-backward epilogue (it loads three more tiles there, so it gets narrower tiles than
    ``up``: ptxas spills at 128x128 with 8 warps); ``down``: the down GEMM (fwd) and the dX GEMM
    (bwd), both scattering to slot rows; ``wgrad``: both weight-gradient GEMMs (BLOCK_K runs over
    an expert's rows). The top-level num_warps/num_stages are the maxima, so dispatch's generic
    arch pruner sees the worst case."""
    fams = (up, up_bwd, down, wgrad)
    return {"up": up, "up_bwd": up_bwd, "down": down, "wgrad": wgrad,
            "num_warps": max(f["num_warps"] for f in fams), "num_stages": max(f["num_stages"] for f in fams)}


_g = _gemm
# Hopper (sm90, 227 KiB smem), bf16/fp16. Registers and smem checked by compiling every kernel
# for sm90 with ptxas (Triton 3.9, no GPU): the up tiles 128x(2x128)/8 warps use 255 registers
# (16 B spill), 128x(2x64)/8 warps 128; up_bwd 128x64/8 warps 105 (128x128 spills 96 B);
# down 128x256/8 warps 216. BLOCK_M 64 variants serve few rows per expert (a 128-row tile is
# mostly padding below 128 routed rows per expert). On the first H200 run the heuristic picks
# ([5] at T512, [0] at T4096) beat both peers; `liger-tune sweep --arch hopper` (or
# `bench_moe_experts.py --tune`) times every candidate and persists the fastest per shape.
_HOPPER = [
    _combo(_g(128, 128, 64, 8, 3), _g(128, 64, 64, 8, 4), _g(128, 256, 64, 8, 3), _g(128, 256, 64, 8, 3)),
    _combo(_g(128, 128, 64, 8, 3), _g(128, 64, 64, 8, 4), _g(128, 128, 64, 8, 4), _g(128, 128, 64, 8, 4)),
    _combo(_g(128, 64, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 256, 64, 8, 3), _g(128, 256, 64, 8, 3)),
    _combo(_g(128, 64, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 128, 64, 8, 4), _g(128, 128, 64, 8, 4)),
    _combo(_g(128, 128, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 256, 64, 8, 4), _g(128, 256, 64, 8, 4)),
    _combo(_g(64, 128, 64, 4, 4), _g(64, 64, 64, 4, 4), _g(64, 256, 64, 4, 4), _g(128, 128, 64, 8, 4)),
    _combo(_g(64, 64, 64, 4, 4), _g(64, 64, 64, 4, 4), _g(64, 128, 64, 4, 4), _g(128, 128, 32, 4, 4)),
    _combo(_g(64, 128, 64, 4, 3), _g(64, 64, 64, 4, 4), _g(64, 128, 64, 4, 4), _g(128, 256, 64, 8, 3)),
    # few rows per expert: 64-row up tiles with an 8-warp 64x256 down/dX GEMM and the wide wgrad
    # tile that won at T4096 (smem: up 160 KiB, down 120 KiB, wgrad 144 KiB)
    _combo(_g(64, 128, 64, 4, 4), _g(64, 64, 64, 4, 4), _g(64, 256, 64, 8, 3), _g(128, 256, 64, 8, 3)),
    # many rows per expert: 4-stage up/down/wgrad, up_bwd with BLOCK_K 128 (half the K loop
    # iterations for its narrower tile; smem: up/down/wgrad 192 KiB, up_bwd 144 KiB)
    _combo(_g(128, 128, 64, 8, 4), _g(128, 64, 128, 8, 3), _g(128, 256, 64, 8, 4), _g(128, 256, 64, 8, 4)),
]
# fp32 (ieee dot, 4-byte tiles): small tiles (also what other NVIDIA parts fall back to)
_NVIDIA_FP32 = [
    _combo(_g(64, 64, 32, 4, 3), _g(64, 64, 32, 4, 3), _g(64, 128, 32, 4, 3), _g(64, 128, 32, 4, 3)),
    _combo(_g(32, 64, 32, 4, 2), _g(32, 64, 32, 4, 2), _g(64, 64, 32, 4, 2), _g(64, 64, 32, 4, 2)),
]
# AMD CDNA3 (MI300X/MI325X, gfx942): 64 KiB LDS, num_stages <= 2, num_warps <= 8 (wave64):
# every candidate is HIP-safe; LDS is counted for num_stages buffers (conservative).
_HIP = [
    _combo(_g(64, 64, 64, 4, 2), _g(64, 64, 64, 4, 2), _g(64, 128, 64, 4, 2), _g(64, 128, 64, 4, 2)),
    _combo(_g(128, 64, 32, 8, 2), _g(128, 64, 32, 8, 2), _g(128, 128, 32, 8, 2), _g(128, 128, 32, 8, 2)),
    _combo(_g(64, 128, 32, 4, 2), _g(64, 64, 64, 4, 2), _g(64, 128, 64, 4, 2), _g(128, 128, 32, 8, 2)),
    _combo(_g(128, 128, 32, 8, 2), _g(128, 64, 32, 8, 2), _g(128, 256, 32, 8, 2), _g(128, 128, 32, 8, 2)),
    _combo(_g(32, 64, 64, 4, 2), _g(32, 64, 64, 4, 2), _g(32, 128, 64, 4, 2), _g(64, 64, 64, 4, 2)),
    _combo(_g(64, 64, 64, 4, 1), _g(64, 64, 64, 4, 1), _g(64, 64, 64, 4, 1), _g(64, 64, 64, 4, 1)),
]
# The interpreter runs every program serially in numpy: few, mid-sized tiles are fastest there.
_CPU = [
    _combo(_g(16, 32, 32, 4, 1), _g(16, 32, 32, 4, 1), _g(16, 64, 32, 4, 1), _g(32, 32, 32, 4, 1)),
    _combo(_g(32, 32, 16, 2, 1), _g(32, 16, 32, 2, 1), _g(32, 32, 32, 2, 1), _g(16, 64, 16, 2, 1)),
]
# LIGER_FUSED_MOE_AUTOTUNE=0: fixed, known-safe configs (first one that fits the arch profile).
_PINNED_HIP = _combo(_g(64, 64, 64, 4, 2), _g(64, 64, 64, 4, 2), _g(64, 128, 64, 4, 2), _g(64, 128, 64, 4, 2))
_PINNED_CUDA = _combo(_g(128, 64, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 128, 64, 8, 4), _g(128, 128, 64, 8, 4))
_MINIMAL = _combo(_g(32, 32, 32, 4, 1), _g(32, 32, 32, 4, 1), _g(32, 32, 32, 4, 1), _g(32, 32, 32, 4, 1))


def _smem(config: dict, dims: dict, dtype: torch.dtype) -> int:
    """Shared memory / LDS bytes of the hungriest GEMM: num_stages buffers of its A and B tiles
    (the up GEMM loads two B tiles: gate and up)."""
    es = torch.tensor([], dtype=dtype).element_size()

    def need(c: dict, b_tiles: int) -> int:
        return max(1, c["num_stages"]) * (c["BLOCK_M"] * c["BLOCK_K"] + b_tiles * c["BLOCK_K"] * c["BLOCK_N"]) * es

    return max(need(config["up"], 2), need(config["up_bwd"], 1), need(config["down"], 1), need(config["wgrad"], 1))


def _fits(cfg: dict, arch: backend.Arch, dims: dict, dtype: torch.dtype) -> bool:
    return (cfg["num_warps"] <= arch.max_num_warps and cfg["num_stages"] <= arch.max_num_stages
            and _smem(cfg, dims, dtype) <= arch.smem_bytes)


def _configs(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> list[dict]:
    if arch.name == "cpu":
        return [dict(c) for c in _CPU]
    if arch.is_hip:
        return [dict(c) for c in _HIP]
    if dtype == torch.float32:
        return [dict(c) for c in _NVIDIA_FP32]
    return [dict(c) for c in _HOPPER + _NVIDIA_FP32]


def _first_fit(cands: list[dict], arch, dims, dtype) -> dict:
    for c in cands:
        if _fits(c, arch, dims, dtype):
            return dict(c)
    return dict(_MINIMAL)


def _rows_per_expert(dims: dict) -> float:
    return dims["tokens"] * dims["top_k"] / max(1, dims["experts"])


def _heuristic(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> dict:
    """Default config with nothing measured: BLOCK_M 64 tiles below 128 routed rows per expert
    (a 128-row tile would be over half padding), 128-row tiles above."""
    if arch.name == "cpu":
        return dict(_CPU[0])
    if arch.is_hip:
        return _pinned(arch, dims, dtype)
    if dtype == torch.float32:
        return _first_fit(_NVIDIA_FP32, arch, dims, dtype)
    order = [_HOPPER[5], _HOPPER[0]] if _rows_per_expert(dims) < 128 else [_HOPPER[0], _HOPPER[5]]
    return _first_fit(order + _HOPPER + _NVIDIA_FP32, arch, dims, dtype)


def _pinned(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> dict:
    """LIGER_FUSED_MOE_AUTOTUNE=0: HIP-safe on AMD (stages <= 2, warps <= 8, <= 64 KiB LDS),
    the fixed CUDA config otherwise; shrunk to the arch's limits if they are tighter."""
    if arch.name == "cpu":
        return dict(_CPU[0])
    if arch.is_hip:
        return _first_fit([_PINNED_HIP, *_HIP], arch, dims, dtype)
    return _first_fit([_PINNED_CUDA, *_NVIDIA_FP32], arch, dims, dtype)


def _supports_triton(dims: dict, dtype: torch.dtype) -> str | None:
    if dims["hidden"] < 1 or dims["intermediate"] < 1 or dims["experts"] < 1 or dims["top_k"] < 1:
        return "moe_experts needs hidden, intermediate, experts and top_k >= 1"
    return None


# Hopper heuristic between implementations, measured on an H200 (torch 2.11, Triton 3.6, bf16
# fwd+bwd ms, uniform routing; first run of bench_moe_experts.py, heuristic configs):
#                 hf_grouped_mm  liger_kernel  ours grouped_mm  ours triton
#   E32 T512          1.306         1.621          1.341           1.305
#   E32 T4096         4.151         3.933          3.512           3.455
#   E64 T512          2.123         1.823          1.620           1.439
#   E64 T4096         4.201         4.125          3.621           3.653
# The fused Triton path was fastest or within 1% of grouped MM at every point measured, from 32
# to 512 routed rows per expert (the Liger 0.8.5 anchor that once suggested grouped MM below
# 128 rows per expert does not carry over to this kernel). So: triton everywhere on Hopper;
# a measured crossover row (`bench_moe_experts.py --emit-crossover`, `liger-tune`) overrides it.
# MI325X (seed 004, bf16 fwd+bwd): the fused path wins below ~256 routed rows per expert,
# grouped MM above. The same numbers ship as published crossover rows in defaults/mi325x.jsonl.
HIP_GROUPED_MM_FROM = 256.0


def _heuristic_impl(target, dims: dict, dtype: torch.dtype, avail: list[str]) -> str:
    rows = _rows_per_expert(dims)
    arch = target.arch
    if "grouped_mm" in avail:
        if arch.is_hip and rows >= HIP_GROUPED_MM_FROM:
            return "grouped_mm"
    if "triton" in avail:
        return "triton"
    return "grouped_mm" if "grouped_mm" in avail else "torch"


# ================================================================================ registration
def _routing(T: int, E: int, K: int, tag: str, g: torch.Generator, device) -> torch.Tensor:
    """(T, K) distinct expert ids: ``uniform`` random, or ``skewed`` (Zipf-like: a few hot
    experts, a quarter of the experts empty)."""
    if tag == "uniform":
        return torch.rand(T, E, generator=g, device=device).topk(K, dim=-1).indices
    if tag != "skewed":
        raise ValueError(f"moe_experts routing tag {tag!r}; valid: uniform, skewed")
    live = max(K, E - E // 4)
    p = torch.zeros(E, device=device)
    p[:live] = 1.0 / torch.arange(1, live + 1, device=device, dtype=torch.float32) ** 1.2
    p = p[torch.randperm(E, generator=g, device=device)]
    return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)


def _make_case(dims: dict, dtype: torch.dtype, device: str, tag: str = "uniform") -> dict:
    T, E, K, H, I = (dims[k] for k in ("tokens", "experts", "top_k", "hidden", "intermediate"))
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype).requires_grad_()

    x = randn(T, H)
    gate_up = randn(E, 2 * I, H, scale=H ** -0.5)
    down = randn(E, H, I, scale=I ** -0.5)
    idx = _routing(T, E, K, tag, g, device)
    w = torch.rand(T, K, generator=g, device=device) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    # dy ~ N(0, 1/16): the gradients then have the outputs' magnitudes (O(0.1-1)); with unit dy
    # the dW and d-weights sums (thousands of O(1) terms) make the absolute part of the bf16
    # tolerance meaningless and every bf16 implementation fails it at a few extreme elements
    dy = (torch.randn(T, H, generator=g, device=device) * 0.25).to(dtype)
    return {"x": x, "gate_up": gate_up, "down": down, "idx": idx, "w": w, "dy": dy}


def _grads(y: torch.Tensor, case: dict) -> list:
    return [y, *torch.autograd.grad(y, (case["x"], case["gate_up"], case["down"], case["w"]), case["dy"],
                                    allow_unused=True, materialize_grads=True)]


def _run_torch(case: dict, config) -> list:
    return _grads(moe_experts_ref(case["x"], case["gate_up"], case["down"], case["idx"], case["w"]), case)


def _run_grouped_mm(case: dict, config) -> list:
    return _grads(moe_experts_grouped_mm(case["x"], case["gate_up"], case["down"], case["idx"], case["w"]), case)


def _run_triton(case: dict, config) -> list:
    return _grads(MoEExpertsFunction.apply(case["x"], case["gate_up"], case["down"], case["idx"], case["w"],
                                           dict(config)), case)


_CPU_TINY = [  # (experts, top_k, hidden, intermediate), tokens
    ((4, 2, 32, 32), (16, 64)),
    ((8, 2, 64, 32), (16, 64)),
]


def _plan(preset, arch: backend.Arch, quick: bool) -> list[dict]:
    """Sweep grid: T in {512, 2048, 4096, 16384} ({512, 4096} quick) at the preset's experts
    (E32 K4 H2048 I1792, LFM2-8B-A1B, without a preset); tiny shapes on the cpu arch."""
    names = ("experts", "top_k", "hidden", "intermediate")
    if arch.name == "cpu":
        if preset is not None and getattr(preset, "tiny", False) and preset.experts:
            statics = [((preset.experts, preset.top_k, preset.hidden, preset.moe_intermediate),
                        preset.quick_tokens if quick else preset.tokens)]
        else:
            statics = _CPU_TINY[:1] if quick else _CPU_TINY
        return [dict(tokens=t, **dict(zip(names, s))) for s, ts in statics for t in (ts[:1] if quick else ts)]
    if preset is not None:
        if not preset.experts:
            return []
        static = (preset.experts, preset.top_k, preset.hidden, preset.moe_intermediate)
    else:
        static = (32, 4, 2048, 1792)
    tokens = (512, 4096) if quick else (512, 2048, 4096, 16384)
    return [dict(tokens=t, **dict(zip(names, static))) for t in tokens]


def _reduce_len(dims: dict) -> int:
    # the longest fp32-accumulated sum: hidden (up GEMMs), 2*intermediate (dX) or one expert's rows
    # (dW), which is up to `tokens` under skewed routing (distinct experts per token), not the mean
    return max(dims["hidden"], 2 * dims["intermediate"], dims["tokens"])


OP = register(Op(
    name="moe_experts",
    static=("experts", "top_k", "hidden", "intermediate"),
    dynamic=("tokens",),
    impls=[
        Impl("triton", run=_run_triton, available=triton_available, configs=_configs, heuristic=_heuristic,
             pinned=_pinned, supports=_supports_triton, smem=_smem),
        Impl("grouped_mm", run=_run_grouped_mm, available=_grouped_mm_available, supports=_supports_grouped_mm),
        Impl("torch", run=_run_torch),
    ],
    make_case=_make_case, plan=_plan, reduce_len=_reduce_len, heuristic_impl=_heuristic_impl,
    crossover_axis=_rows_per_expert, crossover_axis_name="rows_per_expert",
    pinned_by_fused_moe_env=True, tags=("uniform", "skewed"),
))
