"""MoE experts (SwiGLU experts of a sparse MoE block), transformers v5 layout.

    y = liger_rt.ops.moe_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights)

x (tokens, hidden); gate_up_proj (experts, 2*intermediate, hidden), gate in the FIRST half (HF: ``gate, up =
linear(x, gate_up_proj[e]).chunk(2, dim=-1)``); down_proj (experts, hidden, intermediate); top_k_index (tokens, k)
expert ids in [0, experts); top_k_weights (tokens, k). Returns (tokens, hidden):

    y[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = idx[t, j]

Implementations: ``triton`` (fused, below), ``grouped_mm`` (CUDA bf16) and ``torch`` (fp32 loop, the reference).
Fused path, S = tokens * k routed slots (slot s = t * k + j), no host sync: a stable sort of the slots by expert gives
``perm`` (sorted row -> slot) and ``bounds`` (E+1 row offsets), and a small launch the tile schedule of a BLOCK_M
(grids cover an upper bound of tiles; the surplus returns at once); the backward reuses all three. The up GEMM
gathers x rows by token in its loads (no permuted copy) and stores h = SwiGLU (S, I) sorted, plus gate|up (S, 2I)
when a backward follows (3*S*I*2 bytes, against recomputing 2/3 of the forward's flops). The down GEMM scales rows by
their routing weight and scatters them to slot rows; y[t] = sum_j y_slot[t*k + j] in fp32, deterministic and with
no fp32 temporary or memset as atomics would need, costs 2*S*H*2 bytes (~0.13 ms at T=16384 on an H200, under 2% of
the fused fwd+bwd). The backward's dX and d top_k_weights are summed the same way; dW is one grouped kernel per
weight with an fp32 accumulator per (expert, tile). DOT_FP32 upcasts tiles for fp32 inputs and for bf16 under the
interpreter (no bf16 arithmetic there); on a GPU 16-bit tiles feed the tensor cores directly.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import backend
from ..backend import interpreter_on
from ..config import STAGES, WARPS, Config, knob, pow2
from ..dispatch import call, register
from ..op import Case, Impl, Op
from ._common import triton_available


# ================================================================================ reference
def moe_experts_ref(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The HF eager experts loop computed in fp32: (T, H) in x.dtype. Also the ``torch`` impl."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    idx = top_k_index.long()
    for e in range(gate_up_proj.shape[0]):
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
    """Sort slots by expert, two grouped GEMMs (CUTLASS on sm90: bf16, int32 end offsets per expert, 16-byte aligned
    rows, column-major weight views), weighted top-k sum; torch autograd backward."""
    gmm = _grouped_mm_fn()
    if gmm is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has neither torch.nn.functional.grouped_mm nor "
                           "torch._grouped_mm; use the triton or torch implementation of moe_experts")
    T, H = x.shape
    K = top_k_index.shape[1]
    sorted_e, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_e, torch.arange(gate_up_proj.shape[0], device=x.device), right=True).int()
    gate, up = gmm(x.index_select(0, perm // K), gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = gmm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offs)
    y = y * top_k_weights.reshape(-1).index_select(0, perm).to(y.dtype).unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y.index_select(0, inv).view(T, K, H).sum(1)


_PROBED: dict[int, bool] = {}      # device index -> grouped_mm launched there (only successes are kept)
PROBE_FAILURES: dict[int, str] = {}  # device index -> why the last probe failed (warned once per reason)


def _grouped_mm_probe(device_index: int) -> bool:
    """Does a tiny bf16 grouped MM launch here? (sync debug mode off: its offsets copy syncs.) Failures are warned once
    per reason, never cached: on the H200 (2026-12-03) a cached RNG-state failure hid grouped_mm from later cases."""
    if _PROBED.get(device_index):
        return True
    gmm = _grouped_mm_fn()
    if gmm is None:
        return False
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        dev = torch.device("cuda", device_index)
        # constant inputs: no RNG call, which failed here after a peer's failed CUDA-graph capture (see above)
        a = torch.ones(32, 64, device=dev, dtype=torch.bfloat16)
        b = torch.ones(2, 32, 64, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
        gmm(a, b, offs=torch.tensor([16, 32], device=dev, dtype=torch.int32))
        _PROBED[device_index] = True
        PROBE_FAILURES.pop(device_index, None)
        return True
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if PROBE_FAILURES.get(device_index) != why:
            warnings.warn(f"liger_rt: grouped_mm probe failed on cuda:{device_index} ({why}); moe_experts "
                          "dispatches without grouped_mm until a probe succeeds", RuntimeWarning)
        PROBE_FAILURES[device_index] = why
        return False
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _grouped_mm_available(target) -> bool:
    """CUDA/ROCm where the op runs: a probe with the GPU present; planning or capturing a CUDA graph, the op's rules
    (torch <= 2.8 sm90 only; torch >= 2.9 sm80+ and gfx942/gfx950)."""
    if target.device_type != "cuda" or _grouped_mm_fn() is None:
        return False
    arch = target.arch
    if backend.gpu_present() and backend.detect().name == arch.name and not torch.cuda.is_current_stream_capturing():
        return _grouped_mm_probe(torch.cuda.current_device())
    torch_2_9 = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 9)
    if arch.vendor == "nvidia":
        sm = int(arch.capability[2:]) if arch.capability[2:].isdigit() else 0
        return sm // 10 == 9 or (torch_2_9 and sm >= 80)
    return arch.vendor == "amd" and torch_2_9 and arch.capability in ("gfx942", "gfx950")


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


def _fake(config, x, gate_up_proj, down_proj, top_k_index, top_k_weights, save):
    E, I2, _ = gate_up_proj.shape
    S = top_k_index.numel()
    i32 = torch.int32
    return ((x.new_empty(x.shape),),
            (x.new_empty(S, I2) if save else x.new_empty(0), x.new_empty(S, I2 // 2), x.new_empty(S, dtype=i32),
             x.new_empty(E + 1, dtype=i32), x.new_empty(2, _n_tiles(S, E, config.down.BLOCK_M), dtype=i32)))


# ================================================================================ functional
def _dims(x, gate_up_proj, down_proj, top_k_index, top_k_weights, save=False) -> dict:
    H = x.shape[-1] if x.dim() else -1
    E, I2, H2 = gate_up_proj.shape if gate_up_proj.dim() == 3 else (-1, -1, -1)
    if H < 0 or E < 0 or H2 != H or I2 % 2 or tuple(down_proj.shape) != (E, H, I2 // 2):
        raise ValueError(f"moe_experts takes x (tokens, hidden), gate_up_proj (experts, 2*intermediate, hidden) and "
                         f"down_proj (experts, hidden, intermediate) (the transformers v5 experts layout); got "
                         f"{tuple(x.shape)}, {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"moe_experts: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be (tokens, k) for x {tuple(x.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"moe_experts: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if not (x.dtype == gate_up_proj.dtype == down_proj.dtype):
        raise TypeError(f"moe_experts: x, gate_up_proj and down_proj must share a dtype (got {x.dtype}, "
                        f"{gate_up_proj.dtype}, {down_proj.dtype}); cast x to the weights' dtype first")
    T = x.numel() // H if H else 0
    return dict(tokens=T, experts=E, top_k=top_k_index.shape[-1], hidden=H, intermediate=I2 // 2)


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts (shapes in the module docstring, leading dims of x any), dispatched by arch, dtype, shape.

    >>> y = liger_rt.ops.moe_experts(x, experts.gate_up_proj, experts.down_proj, idx, w)   # x.shape, x.dtype
    """
    # the fused forward stores gate|up for the backward only when one can follow
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up_proj, down_proj, top_k_weights))
    if x.dim() == 2:
        return call(OP, x, gate_up_proj, down_proj, top_k_index, top_k_weights, save)
    d = _dims(x, gate_up_proj, down_proj, top_k_index, top_k_weights)
    T, K, H = d["tokens"], d["top_k"], d["hidden"]
    y = call(OP, x.reshape(T, H), gate_up_proj, down_proj, top_k_index.reshape(T, K), top_k_weights.reshape(T, K), save)
    return y.view(*x.shape[:-1], H)


# ================================================================================ configs
@dataclasses.dataclass(frozen=True)
class Gemm(Config):
    """One GEMM family's launch: BLOCK_M x BLOCK_N tiles, BLOCK_K per step, GROUP_M row tiles per column walk."""
    BLOCK_M: int = knob(64, pow2(16, 256))
    BLOCK_N: int = knob(64, pow2(16, 256))
    BLOCK_K: int = knob(32, pow2(16, 256))
    num_warps: int = knob(4, WARPS)
    num_stages: int = knob(2, STAGES)
    GROUP_M: int = knob(8, pow2(1, 16))


@dataclasses.dataclass(frozen=True)
class MoEExpertsConfig(Config):
    """One launch per GEMM family: ``up`` (SwiGLU epilogue, two accumulators), ``up_bwd`` (dy @ down[e] with the
    SwiGLU backward: three more tiles loaded, so narrower tiles; ptxas spills at 128x128 with 8 warps), ``down``
    (down, dX and up_bwd_split's dy @ down GEMMs), ``wgrad`` (both weight gradients; BLOCK_K over an expert's rows)."""
    up: Gemm
    up_bwd: Gemm
    down: Gemm
    wgrad: Gemm
    # the weight gradients read 0: gathered rows, 1: sorted copies, 2: sorted copies through TMA (1 where it cannot run)
    wgrad_sorted: int = knob(1, (0, 1, 2))
    # through tensor descriptors (TMA; pointers where they cannot run): the up GEMMs' expert weights (forward, and
    # dy @ down), and both operands of the down and dX GEMMs. H200 (session 15, T16384, fused up backward): neither
    # helped alone (E32 435.9-438.3 TFLOP/s on against 446.1 off); down_desc helps the split below.
    up_desc: int = knob(0, (0, 1))
    down_desc: int = knob(0, (0, 1))
    # 1: the up backward split in two: dy @ down[e] as a plain GEMM through the down/dX launch (its tiles,
    # dy copied into sorted order, down_desc applies), then the SwiGLU backward as its own pass over the rows.
    # The fused kernel (0) is held to 128x64 tiles by its epilogue's registers (222-231 TFLOP/s at E64 T16384,
    # H200, benchmarks/profile_moe.py, session 15), where the down GEMM runs at 600.
    up_bwd_split: int = knob(0, (0, 1))


_C, _g = MoEExpertsConfig, Gemm     # _C(up, up_bwd, down, wgrad), _g(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
# Hopper (sm90, 227 KiB smem), bf16/fp16. Registers and smem checked by compiling every kernel for sm90 with ptxas
# (Triton 3.9, no GPU): the up tiles 128x(2x128)/8 warps use 255 registers (16 B spill), 128x(2x64)/8 warps 128;
# up_bwd 128x64/8 warps 105 (128x128 spills 96 B); down 128x256/8 warps 216. BLOCK_M 64 variants serve few rows per
# expert. On the first H200 run the heuristic picks ([5] at T512, [0] at T4096) beat both peers.
_HOPPER = [
    _C(_g(128, 128, 64, 8, 3), _g(128, 64, 64, 8, 4), _g(128, 256, 64, 8, 3), _g(128, 256, 64, 8, 3)),
    _C(_g(128, 128, 64, 8, 3), _g(128, 64, 64, 8, 4), _g(128, 128, 64, 8, 4), _g(128, 128, 64, 8, 4)),
    _C(_g(128, 64, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 256, 64, 8, 3), _g(128, 256, 64, 8, 3)),
    _C(_g(128, 64, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 128, 64, 8, 4), _g(128, 128, 64, 8, 4)),
    _C(_g(128, 128, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 256, 64, 8, 4), _g(128, 256, 64, 8, 4)),
    _C(_g(64, 128, 64, 4, 4), _g(64, 64, 64, 4, 4), _g(64, 256, 64, 4, 4), _g(128, 128, 64, 8, 4)),
    _C(_g(64, 64, 64, 4, 4), _g(64, 64, 64, 4, 4), _g(64, 128, 64, 4, 4), _g(128, 128, 32, 4, 4)),
    _C(_g(64, 128, 64, 4, 3), _g(64, 64, 64, 4, 4), _g(64, 128, 64, 4, 4), _g(128, 256, 64, 8, 3)),
    # few rows per expert: 64-row up tiles, an 8-warp 64x256 down/dX GEMM, the wgrad tile that won at T4096 (smem:
    # up 160 KiB, down 120 KiB, wgrad 144 KiB)
    _C(_g(64, 128, 64, 4, 4), _g(64, 64, 64, 4, 4), _g(64, 256, 64, 8, 3), _g(128, 256, 64, 8, 3)),
    # many rows per expert: 4-stage up/down/wgrad, up_bwd with BLOCK_K 128 (half the K loop
    # iterations for its narrower tile; smem: up/down/wgrad 192 KiB, up_bwd 144 KiB)
    _C(_g(128, 128, 64, 8, 4), _g(128, 64, 128, 8, 3), _g(128, 256, 64, 8, 4), _g(128, 256, 64, 8, 4)),
]
# fp32 (ieee dot, 4-byte tiles): small tiles (also what other NVIDIA parts fall back to)
_NVIDIA_FP32 = [
    _C(_g(64, 64, 32, 4, 3), _g(64, 64, 32, 4, 3), _g(64, 128, 32, 4, 3), _g(64, 128, 32, 4, 3)),
    _C(_g(32, 64, 32, 4, 2), _g(32, 64, 32, 4, 2), _g(64, 64, 32, 4, 2), _g(64, 64, 32, 4, 2)),
]
# AMD CDNA3 (MI300X/MI325X, gfx942): 64 KiB LDS, num_stages <= 2, num_warps <= 8 (wave64):
# every candidate is HIP-safe; LDS is counted for num_stages buffers (conservative).
_HIP = [
    _C(_g(64, 64, 64, 4, 2), _g(64, 64, 64, 4, 2), _g(64, 128, 64, 4, 2), _g(64, 128, 64, 4, 2)),
    _C(_g(128, 64, 32, 8, 2), _g(128, 64, 32, 8, 2), _g(128, 128, 32, 8, 2), _g(128, 128, 32, 8, 2)),
    _C(_g(64, 128, 32, 4, 2), _g(64, 64, 64, 4, 2), _g(64, 128, 64, 4, 2), _g(128, 128, 32, 8, 2)),
    _C(_g(128, 128, 32, 8, 2), _g(128, 64, 32, 8, 2), _g(128, 256, 32, 8, 2), _g(128, 128, 32, 8, 2)),
    _C(_g(32, 64, 64, 4, 2), _g(32, 64, 64, 4, 2), _g(32, 128, 64, 4, 2), _g(64, 64, 64, 4, 2)),
    _C(_g(64, 64, 64, 4, 1), _g(64, 64, 64, 4, 1), _g(64, 64, 64, 4, 1), _g(64, 64, 64, 4, 1)),
]
# The interpreter runs every program serially in numpy: few, mid-sized tiles are fastest there.
_CPU = [
    _C(_g(16, 32, 32, 4, 1), _g(16, 32, 32, 4, 1), _g(16, 64, 32, 4, 1), _g(32, 32, 32, 4, 1)),
    _C(_g(32, 32, 16, 2, 1), _g(32, 16, 32, 2, 1), _g(32, 32, 32, 2, 1), _g(16, 64, 16, 2, 1)),
]
# LIGER_FUSED_MOE_AUTOTUNE=0: fixed, known-safe configs (first one that fits the arch profile).
_PINNED_HIP = _C(_g(64, 64, 64, 4, 2), _g(64, 64, 64, 4, 2), _g(64, 128, 64, 4, 2), _g(64, 128, 64, 4, 2))
_PINNED_CUDA = _C(_g(128, 64, 64, 8, 4), _g(128, 64, 64, 8, 4), _g(128, 128, 64, 8, 4), _g(128, 128, 64, 8, 4))
_MINIMAL = _C(_g(32, 32, 32, 4, 1), _g(32, 32, 32, 4, 1), _g(32, 32, 32, 4, 1), _g(32, 32, 32, 4, 1))


def _smem(config: MoEExpertsConfig, dims: dict, dtype: torch.dtype) -> int:
    """Shared memory / LDS bytes of the hungriest GEMM: num_stages buffers of A and B tiles (two B tiles in up)."""
    return max(c.num_stages * (c.BLOCK_M * c.BLOCK_K + b_tiles * c.BLOCK_K * c.BLOCK_N) * dtype.itemsize
               for c, b_tiles in ((config.up, 2), (config.up_bwd, 1), (config.down, 1), (config.wgrad, 1)))


def _fits(cfg: MoEExpertsConfig, arch: backend.Arch, dims: dict, dtype: torch.dtype) -> bool:
    warps, stages = cfg.limits()
    return (warps <= arch.max_num_warps and stages <= arch.max_num_stages
            and _smem(cfg, dims, dtype) <= arch.smem_bytes)


def _configs(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> list[MoEExpertsConfig]:
    if arch.name == "cpu":
        return _CPU
    if arch.is_hip:   # sorted copies (the knob's default) and gathered rows: neither measured on AMD yet
        return _HIP + [c.replace(wgrad_sorted=0) for c in _HIP[:2]]
    if dtype == torch.float32:
        return _NVIDIA_FP32
    # on the first tiles (the variants are independent of the tiles): the weight-gradient operand variants, the up
    # and down/dX GEMMs through tensor descriptors (both or one, with TMA weight gradients)
    desc = [c.replace(wgrad_sorted=2, up_desc=u, down_desc=d) for u, d, tiles in ((1, 1, 4), (0, 1, 2), (1, 0, 2))
            for c in _HOPPER[:tiles]]
    # and the split up backward (its GEMM on the down tiles), with pointer or descriptor loads there
    split = [c.replace(wgrad_sorted=2, up_bwd_split=1, down_desc=d) for d in (0, 1) for c in _HOPPER[:4]]
    return _HOPPER + [c.replace(wgrad_sorted=v) for c in _HOPPER[:4] for v in (0, 2)] + desc + split + _NVIDIA_FP32


def _first_fit(cands: list[MoEExpertsConfig], arch, dims, dtype) -> MoEExpertsConfig:
    return next((c for c in cands if _fits(c, arch, dims, dtype)), _MINIMAL)


def _rows_per_expert(dims: dict) -> float:
    return dims["tokens"] * dims["top_k"] / max(1, dims["experts"])


def _heuristic(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> MoEExpertsConfig:
    """Default config: BLOCK_M 64 below 128 routed rows per expert (a 128-row tile would be over half padding)."""
    if arch.name == "cpu" or arch.is_hip:
        return _pinned(arch, dims, dtype)
    if dtype == torch.float32:
        return _first_fit(_NVIDIA_FP32, arch, dims, dtype)
    order = [_HOPPER[5], _HOPPER[0]] if _rows_per_expert(dims) < 128 else [_HOPPER[0], _HOPPER[5]]
    cfg = _first_fit(order + _HOPPER + _NVIDIA_FP32, arch, dims, dtype)
    # bf16: the weight gradients through tensor descriptors (sorted copies where TMA cannot run). H200,
    # benchmarks/profile_moe_wgrad.py at these tiles, fwd+bwd: 33.9 / 9.9 / 9.2 ms against 36.5 / 10.2 /
    # 9.4 with sorted copies and 42.7 / 11.7 / 10.4 with gathered rows (E8 H4096 T8192, E32 and E64 at T16384)
    if dtype != torch.bfloat16:
        return cfg
    # and on Hopper from 1024 rows per expert the split up backward with TMA down/dX operands. H200, session 15,
    # benchmarks/profile_moe_wgrad.py at T16384, fwd+bwd medians of 3: 8.82 against 9.61 ms (E32), 8.20 against
    # 8.97 (E64); sweeps chose it at T8192 and T16384. Measured at H 2048 only; not below 1024 rows per expert
    big = arch.name == "hopper" and _rows_per_expert(dims) >= 1024
    return cfg.replace(wgrad_sorted=2, up_bwd_split=int(big), down_desc=int(big))


def _pinned(arch: backend.Arch, dims: dict, dtype: torch.dtype) -> MoEExpertsConfig:
    """LIGER_FUSED_MOE_AUTOTUNE=0: HIP-safe on AMD, the fixed CUDA config otherwise; shrunk to the arch's limits."""
    if arch.name == "cpu":
        return _CPU[0]
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
# The fused Triton path was fastest or within 1% of grouped MM at every point measured, from 32 to 512 routed rows per
# expert (the Liger 0.8.5 anchor that once suggested grouped MM below 128 rows per expert does not carry over to this
# kernel). So: triton everywhere on Hopper; a measured crossover row (`bench_moe_experts.py --emit-crossover`,
# `liger-tune`) overrides it. MI325X (Liger-Kernel PR #1317, bf16 fwd+bwd): the fused path wins below ~256 routed rows
# per expert, grouped MM above. The same numbers ship as published crossover rows in defaults/mi325x.jsonl.
HIP_GROUPED_MM_FROM = 256.0


def _heuristic_impl(target, dims: dict, dtype: torch.dtype, avail: list[str]) -> str:
    if "grouped_mm" in avail and target.arch.is_hip and _rows_per_expert(dims) >= HIP_GROUPED_MM_FROM:
        return "grouped_mm"
    return next((impl for impl in ("triton", "grouped_mm") if impl in avail), "torch")


# ================================================================================ the op
def _routing(T: int, E: int, K: int, tag: str, g: torch.Generator, device) -> torch.Tensor:
    """(T, K) distinct expert ids: ``uniform`` random, or ``skewed`` (Zipf-like, a quarter of the experts empty)."""
    if tag == "uniform":
        return torch.rand(T, E, generator=g, device=device).topk(K, dim=-1).indices
    if tag != "skewed":
        raise ValueError(f"moe_experts routing tag {tag!r}; valid: uniform, skewed")
    live = max(K, E - E // 4)
    p = torch.zeros(E, device=device)
    p[:live] = 1.0 / torch.arange(1, live + 1, device=device, dtype=torch.float32) ** 1.2
    p = p[torch.randperm(E, generator=g, device=device)]
    return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)


def _make_case(dims: dict, dtype: torch.dtype, device: str, tag: str = "uniform") -> Case:
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
    # dy ~ N(0, 1/16) gives gradients the outputs' magnitudes; with unit dy the dW and d-weights sums (thousands of
    # O(1) terms) make the bf16 atol meaningless and every bf16 implementation fails it at a few extreme elements
    dy = (torch.randn(T, H, generator=g, device=device) * 0.25).to(dtype)
    return Case(args=(x, gate_up, down, idx, w, True), grads=(dy,))


def _plan(preset, arch: backend.Arch, quick: bool) -> list[dict]:
    """Sweep grid: T 512..16384 at the preset's experts (E32 K4 H2048 I1792 without one); tiny shapes on cpu."""
    moe = preset is not None and preset.experts
    static = (preset.experts, preset.top_k, preset.hidden, preset.moe_intermediate) if moe else (32, 4, 2048, 1792)
    if arch.name == "cpu":
        if moe and getattr(preset, "tiny", False):
            statics, tokens = [static], (preset.quick_tokens if quick else preset.tokens)
        else:   # (experts, top_k, hidden, intermediate)
            statics, tokens = [(4, 2, 32, 32), (8, 2, 64, 32)], (16, 64)
        if quick:
            statics, tokens = statics[:1], tokens[:1]
    elif preset is not None and not moe:
        return []
    else:
        statics, tokens = [static], ((512, 4096) if quick else (512, 2048, 4096, 16384))
    names = ("experts", "top_k", "hidden", "intermediate")
    return [dict(tokens=t, **dict(zip(names, s))) for s in statics for t in tokens]


def _reduce_len(dims: dict) -> int:
    # the longest fp32 sum: hidden (up GEMMs), 2*intermediate (dX) or one expert's rows (dW), up to `tokens` under
    # skewed routing (distinct experts per token), not the mean
    return max(dims["hidden"], 2 * dims["intermediate"], dims["tokens"])


def _native(fn):
    """A native implementation on the op's args (the trailing `save` is the fused path's alone)."""
    return functools.wraps(fn)(lambda x, gate_up_proj, down_proj, top_k_index, top_k_weights, save=False:
                               fn(x, gate_up_proj, down_proj, top_k_index, top_k_weights))


OP = register(Op(
    name="moe_experts", static=("experts", "top_k", "hidden", "intermediate"), dynamic=("tokens",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=_supports_triton),
           Impl("grouped_mm", fn=_native(moe_experts_grouped_mm), available=_grouped_mm_available,
                supports=_supports_grouped_mm),
           Impl("torch", fn=_native(moe_experts_ref))],
    config=MoEExpertsConfig, candidates=_configs, heuristic=_heuristic, pinned=_pinned, smem=_smem,
    schema="Tensor x, Tensor gate_up_proj, Tensor down_proj, Tensor top_k_index, Tensor top_k_weights, bool save",
    fake=_fake, make_case=_make_case, plan=_plan, reduce_len=_reduce_len, heuristic_impl=_heuristic_impl,
    crossover_axis=_rows_per_expert, crossover_axis_name="rows_per_expert", pinned_by_fused_moe_env=True,
    tags=("uniform", "skewed"), schema_version=4))
# schema 2: one frozen Gemm per family, no top-level num_warps/num_stages; 3: up_desc, down_desc; 4: up_bwd_split
