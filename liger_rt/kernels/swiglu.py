"""SwiGLU: y = silu(gate) * up, the gated activation of Llama/Qwen3/LFM2 MLPs.

Shapes: gate, up (..., cols) -> y (..., cols) in promote(gate.dtype, up.dtype).

    y = liger_rt.ops.swiglu(gate_proj(x), up_proj(x))       # (2, 128, 8192) bf16 each

Casting follows ``act_fn(gate) * up`` in the input dtype: silu is computed in fp32 and rounded to
the gate dtype, then multiplied by up in fp32 and rounded once more.

Kernels are elementwise over (ROWS, BLOCK_N) tiles of a 2-D view with one row stride per tensor,
so the halves of a fused gate_up projection (``gate_up.chunk(2, -1)``) are read in place.  The
backward recomputes sigmoid(gate) (cheaper than storing it).  Minimum traffic: fwd 3MN, bwd 5MN.
The checks, tile walk, config and tuning space are the gated-MLP family's (gated_mlp.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._triton import tl, triton
from ..backend import interpreter_on
from ..launch import bind, launch_memo
from ._common import as_rows, next_pow2, row_layout, to_dtype
from .gated_mlp import GatedMLPConfig as SwiGLUConfig  # noqa: F401  (the op's config, by its name)
from .gated_mlp import gated_op, run_gated
from .gated_mlp import tile as _tile


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 compute; silu(gate) rounded to gate.dtype before the multiply, as the eager module does."""
    s = F.silu(gate.float()).to(gate.dtype)
    return (s.float() * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What the Hugging Face MLP runs (the `torch` implementation)."""
    return F.silu(gate) * up


@triton.jit(do_not_specialize=["M"])
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, M, N,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    s = to_dtype(g * tl.sigmoid(g), G.dtype.element_ty, RNE_BF16).to(tl.float32)
    tl.store(Y + o_m * stride_y + o_n, to_dtype(s * u, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, M, N,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    dy = tl.load(DY + o_m * stride_dy + o_n, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    s = g * sig
    du = dy * to_dtype(s, G.dtype.element_ty, RNE_BF16).to(tl.float32)
    dg = dy * u * (sig + s * (1.0 - sig))          # silu'(g) = sig * (1 + g * (1 - sig))
    tl.store(DG + o_m * stride_dg + o_n, to_dtype(dg, DG.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(DU + o_m * stride_du + o_n, to_dtype(du, DU.dtype.element_ty, RNE_BF16), mask=mask)


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """row_layout(t, n); at n == 1 as_rows, which passes a one-element tensor's own stride."""
    if n > 1:
        return row_layout(t, n)
    t2 = as_rows(t, n)
    return t2, t2.shape[0], t2.stride(0)


@launch_memo
def _launch(kernel, config, num_warps: int, m: int, n: int):
    block_n = min(config.BLOCK_N, next_pow2(n))
    return bind(kernel, (triton.cdiv(m, config.ROWS) * triton.cdiv(n, block_n),), BLOCK_N=block_n, ROWS=config.ROWS,
                RNE_BF16=interpreter_on(), num_warps=num_warps)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, config) -> torch.Tensor:
    n = gate.shape[-1]
    (g2, m, stride_g), (u2, _, stride_u) = _rows(gate, n), _rows(up, n)
    dtype = gate.dtype if up.dtype == gate.dtype else torch.promote_types(gate.dtype, up.dtype)
    y = torch.empty_like(gate, dtype=dtype, memory_format=torch.contiguous_format)    # rows of n
    if m > 0 and n > 0:
        _launch(_swiglu_fwd_kernel, config, config.num_warps, m, n)(g2, u2, y, stride_g, stride_u, n, m, n)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dgate in gate.dtype, dup in up.dtype), fresh contiguous tensors."""
    n = gate.shape[-1]
    (g2, m, stride_g), (u2, _, stride_u), (dy2, _, stride_dy) = _rows(gate, n), _rows(up, n), _rows(dy, n)
    dg = torch.empty_like(gate, memory_format=torch.contiguous_format)    # rows of n
    du = torch.empty_like(up, memory_format=torch.contiguous_format)
    if m > 0 and n > 0:
        _launch(_swiglu_bwd_kernel, config, config.bwd_num_warps, m, n)(dy2, g2, u2, dg, du, stride_dy, stride_g,
                                                                        stride_u, n, n, m, n)
    return dg, du


def _forward(config, gate, up):
    return (swiglu_fwd(gate, up, config),), ()


def _backward(config, args, saved, needs, dy):
    return swiglu_bwd(dy, *args, config)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, dispatched per call: gate, up (..., cols) -> (..., cols).  The halves of a fused
    gate_up projection are read in place (one row stride per tensor):

    >>> gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)        # Phi-3's MLP, (2, 128, 8192) bf16 each
    >>> y = liger_rt.ops.swiglu(gate, up)
    """
    return run_gated(OP, gate, up)


OP = gated_op("swiglu", _swiglu_torch, _forward, _backward)
