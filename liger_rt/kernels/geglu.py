"""GeGLU: y = gelu_tanh(gate) * up, the gated activation of Gemma MLPs (``gelu_pytorch_tanh``).

Shapes: gate, up (..., cols) -> y (..., cols) in promote(gate.dtype, up.dtype).

    y = liger_rt.ops.geglu(gate_proj(x), up_proj(x))        # (2, 128, 10240) bf16 each

gelu_tanh(g) = 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), computed as g * sigmoid(2z)
(0.5 (1 + tanh(z)) = sigmoid(2z): no tanh, which not every Triton release has).  Its derivative
is s + 2 g s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 g^2) with s = sigmoid(2z).

Casting and kernel layout are swiglu's; the checks, tile walk, config and tuning space are the
gated-MLP family's (gated_mlp.py): both ops stream the same bytes, the extra arithmetic here is a
few FMAs per element.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._triton import tl, triton
from ..backend import interpreter_on
from ._common import as_rows, next_pow2, to_dtype
from .gated_mlp import GatedMLPConfig as GeGLUConfig  # noqa: F401  (the op's config, by its name)
from .gated_mlp import gated_op, run_gated
from .gated_mlp import tile as _tile

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def geglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 compute; gelu_tanh(gate) rounded to gate.dtype before the multiply, as the eager module does."""
    a = F.gelu(gate.float(), approximate="tanh").to(gate.dtype)
    return (a.float() * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


def _geglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What the Hugging Face Gemma MLP runs (the `torch` implementation)."""
    return F.gelu(gate, approximate="tanh") * up


@triton.jit
def _gelu_tanh_parts(g, K: tl.constexpr, C: tl.constexpr):
    """(gelu_tanh(g), s) with s = sigmoid(2z) = 0.5 (1 + tanh(z)), z = K (g + C g^3)."""
    s = tl.sigmoid(2.0 * K * (g + C * g * g * g))
    return g * s, s


@triton.jit(do_not_specialize=["M"])
def _geglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, M, N, K: tl.constexpr, C: tl.constexpr,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    a, _ = _gelu_tanh_parts(g, K, C)
    a = to_dtype(a, G.dtype.element_ty, RNE_BF16).to(tl.float32)
    tl.store(Y + o_m * stride_y + o_n, to_dtype(a * u, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _geglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, M, N, K: tl.constexpr,
                      C: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_m, o_n, mask = _tile(M, N, BLOCK_N, ROWS)
    dy = tl.load(DY + o_m * stride_dy + o_n, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + o_m * stride_g + o_n, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + o_m * stride_u + o_n, mask=mask, other=0.0).to(tl.float32)
    a, s = _gelu_tanh_parts(g, K, C)
    du = dy * to_dtype(a, G.dtype.element_ty, RNE_BF16).to(tl.float32)
    da = s + 2.0 * g * s * (1.0 - s) * K * (1.0 + 3.0 * C * g * g)
    tl.store(DG + o_m * stride_dg + o_n, to_dtype(dy * u * da, DG.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(DU + o_m * stride_du + o_n, to_dtype(du, DU.dtype.element_ty, RNE_BF16), mask=mask)


def _grid(m: int, n: int, config) -> tuple[int, int]:
    block_n = min(config.BLOCK_N, next_pow2(n))
    return block_n, triton.cdiv(m, config.ROWS) * triton.cdiv(n, block_n)


def _launch(kernel, num_warps: int, config, *tensors) -> None:
    """One elementwise launch over the (rows, N) views of same-shaped (..., N) tensors, inputs then
    outputs (fresh contiguous ones: their views write through), in the kernel's pointer order."""
    n = tensors[0].shape[-1]
    views = [as_rows(t, n) for t in tensors]
    m = views[0].shape[0]
    if m * n:
        block_n, grid = _grid(m, n, config)
        kernel[(grid,)](*views, *(v.stride(0) for v in views), m, n, K=_K, C=_C, BLOCK_N=block_n, ROWS=config.ROWS,
                        RNE_BF16=interpreter_on(), num_warps=num_warps)


def geglu_fwd(gate: torch.Tensor, up: torch.Tensor, config) -> torch.Tensor:
    y = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    _launch(_geglu_fwd_kernel, config.num_warps, config, gate, up, y)
    return y


def _forward(config, gate, up):
    return (geglu_fwd(gate, up, config),), ()


def geglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dgate in gate.dtype, dup in up.dtype), fresh contiguous tensors."""
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    _launch(_geglu_bwd_kernel, config.bwd_num_warps, config, dy, gate, up, dg, du)
    return dg, du


def _backward(config, args, saved, needs, dy):
    return geglu_bwd(dy, *args, config)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up, dispatched per call: gate, up (..., cols) -> (..., cols).

    >>> y = liger_rt.ops.geglu(mlp.gate_proj(x), mlp.up_proj(x))     # Gemma's MLP, then mlp.down_proj(y)
    """
    return run_gated(OP, gate, up)


OP = gated_op("geglu", _geglu_torch, _forward, _backward)
