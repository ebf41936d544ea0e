"""Residual add + RMSNorm in one pass: s = x + residual, y = rms_norm(s), both returned.

Shapes: x, residual (..., hidden) of one shape, weight (hidden,) -> (y, s), both (..., hidden): s in
promote(x.dtype, residual.dtype) (what ``x + residual`` gives), y in promote(s.dtype, weight.dtype), exactly
rms_norm(s, weight, eps, offset) (LlamaRMSNorm's casting: the normalised s rounded to s's dtype before the
weight multiply).  offset=1 for Gemma-style (1 + w) weights.

    y, s = liger_rt.ops.fused_add_rms_norm(attn_out, residual, weight, eps=1e-6)   # (2, 2048, 4096) bf16

The decoder-layer step ``h = residual + attn_out; residual = h; h = post_attention_layernorm(h)``.

Kernels: the forward reads x and residual once and writes s and y (4MN; the add then the norm move 5MN).  The
backward is the row-norm family's persistent walk (row_norm.py) with the gradient that reached s added in: one
tensor, ds = dy through the norm + d(s), which is the gradient of x and of the residual alike, returned for both
(reads dy, d(s), s, writes ds: 4MN; the norm's backward then the add of the two gradients move 6MN).  Launch
config, heuristics and tuning space are the family's.
"""
from __future__ import annotations

import torch

from .._triton import tl, triton
from ..backend import interpreter_on
from ..dispatch import call, register
from ..launch import bind, launch_memo
from ..op import Case, Impl, Op
from ._common import next_pow2, row_layout, row_plan, to_dtype, triton_available
from .rms_norm import rms_norm_ref
from .row_norm import (RowNormConfig, bind_partial_sum, bind_persistent_bwd, check_hidden, load_row_block, norm_bwd,
                       norm_candidates, norm_fwd, rms_norm_store_row, rms_norm_store_rows, supports)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                           offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(x + residual), x + residual): the Hugging Face decoder layer's add, then its norm."""
    s = x + residual
    return rms_norm_ref(s, weight, eps, offset), s


@triton.jit(do_not_specialize=["M"])
def _fused_add_rms_norm_fwd_kernel(X, R, W, Y, S, RSTD, stride_x, stride_r, stride_y, M, N, eps, offset,
                                   BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    """ROWS rows per program: s = x + r rounded to S's dtype (what the add returns), stored; y = rms_norm(s) of
    the stored values.  Y and S share a row stride."""
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if ROWS == 1:   # one row per program, 1-D tiles and scalar row statistics
        row = tl.program_id(0).to(tl.int64)
        x = tl.load(X + row * stride_x + o_n, mask=m_n, other=0.0).to(tl.float32)
        r = tl.load(R + row * stride_r + o_n, mask=m_n, other=0.0).to(tl.float32)
        s = to_dtype(x + r, S.dtype.element_ty, RNE_BF16)
        tl.store(S + row * stride_y + o_n, s, mask=m_n)
        rms_norm_store_row(s.to(tl.float32), S, W, Y, RSTD, row, stride_y, o_n, m_n, N, eps, offset, RNE_BF16)
    else:
        x, o_m, o_m64, m_m, mask = load_row_block(X, stride_x, M, o_n, m_n, ROWS)
        r, _, _, _, _ = load_row_block(R, stride_r, M, o_n, m_n, ROWS)
        s = to_dtype(x + r, S.dtype.element_ty, RNE_BF16)
        tl.store(S + o_m64[:, None] * stride_y + o_n[None, :], s, mask=mask)
        rms_norm_store_rows(s.to(tl.float32), S, W, Y, RSTD, o_m, o_m64, m_m, mask, stride_y, o_n, m_n, N, eps, offset,
                            RNE_BF16)


@launch_memo
def _fwd_launch(config, m: int, n: int):
    return bind(_fused_add_rms_norm_fwd_kernel, (triton.cdiv(m, config.ROWS),), BLOCK_N=next_pow2(n),
                ROWS=config.ROWS, RNE_BF16=interpreter_on(), num_warps=config.num_warps)


@launch_memo
def _bwd_launch(config, m: int, n: int, device: torch.device, has_ds: bool):
    """(programs, the persistent backward, the dW-sum kernel), bound, at m rows of n on `device`."""
    grid, bwd = bind_persistent_bwd(config, m, n, device, centered=False, has_ds=has_ds)
    return grid, bwd, bind_partial_sum(n, device)


def fused_add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                           config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual (..., N) -> (y (..., N), s (..., N), rstd (rows,) fp32)."""
    n = x.shape[-1]
    check_hidden("fused_add_rms_norm", n)
    if weight.shape != (n,) or residual.shape != x.shape:
        raise ValueError(f"fused_add_rms_norm: residual shape {tuple(residual.shape)} must equal x's "
                         f"{tuple(x.shape)} and weight shape {tuple(weight.shape)} be ({n},)")
    (x2, m, stride_x), (r2, _, stride_r) = row_layout(x, n), row_layout(residual, n)
    s_dtype = x.dtype if residual.dtype == x.dtype else torch.promote_types(x.dtype, residual.dtype)
    y_dtype = s_dtype if weight.dtype == s_dtype else torch.promote_types(s_dtype, weight.dtype)
    s = torch.empty_like(x, dtype=s_dtype, memory_format=torch.contiguous_format)    # rows of n
    y = torch.empty_like(x, dtype=y_dtype, memory_format=torch.contiguous_format)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        _fwd_launch(config, m, n)(x2, r2, weight, y, s, rstd, stride_x, stride_r, n, m, n, float(eps), float(offset))
    return y, s, rstd


def fused_add_rms_norm_bwd(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
                           rstd: torch.Tensor, offset: float, config) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, d(s) (None: no gradient reached s), s (..., N), rstd (rows,) -> (the gradient of x and of the residual
    (..., N) in s.dtype, dW (N,) in weight.dtype)."""
    n = s.shape[-1]
    check_hidden("fused_add_rms_norm", n)
    (s2, m, stride_s), (dy2, _, stride_dy) = row_layout(s, n), row_layout(dy, n)
    ds2, stride_ds = (None, 0) if ds is None else row_layout(ds, n)[::2]
    dx = torch.empty_like(s, memory_format=torch.contiguous_format)    # rows of n
    if m == 0:
        return dx, torch.zeros_like(weight)
    grid, bwd_kernel, dw_kernel = _bwd_launch(config, m, n, s.device, ds is not None)
    part = torch.empty((grid, n), dtype=torch.float32, device=s.device)
    bwd_kernel(dy2, s2, weight, None, rstd, dx, part, None, ds2, stride_dy, stride_s, n, stride_ds, m, n, float(offset))
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    dw_kernel(part, None, dw, None, grid, n)
    return dx, dw


def _dims(x, residual, weight, eps, offset) -> dict:
    if x.dim() < 1:
        raise ValueError("fused_add_rms_norm: x must have at least one dim (..., hidden)")
    n = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"fused_add_rms_norm: residual must have x's shape {tuple(x.shape)}, "
                         f"got {tuple(residual.shape)}")
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"fused_add_rms_norm: weight must have shape ({n},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    return {"rows": x.numel() // n if n else 0, "hidden": n}


def _forward(config, x, residual, weight, eps, offset):
    y, s, rstd = fused_add_rms_norm_fwd(x, residual, weight, eps, offset, config)
    return (y, s), (s, rstd)     # s is an output and what the backward reads


def _backward(config, args, saved, needs, dy, ds):
    x, residual, weight, eps, offset = args
    s, rstd = saved
    dsum, dw = fused_add_rms_norm_bwd(dy, ds, s, weight, rstd, offset, config)
    # one tensor for both addends (autograd accumulates it wherever each one flows, without copying)
    dx = dsum if dsum.dtype == x.dtype else dsum.to(x.dtype)
    dr = dsum if dsum.dtype == residual.dtype else dsum.to(residual.dtype)
    return dx if needs[0] else None, dr if needs[1] else None, dw if needs[2] else None, None, None


def _fake(config, x, residual, weight, eps, offset):
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    y, s = x.new_empty(x.shape, dtype=torch.promote_types(s_dtype, weight.dtype)), x.new_empty(x.shape, dtype=s_dtype)
    return (y, s), (x.new_empty(x.shape, dtype=s_dtype), x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, weight), x + residual); x, residual (..., hidden), weight (hidden,).  Dispatched
    per call; both outputs differentiable."""
    return call(OP, x, residual, weight, float(eps), float(offset))


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["hidden"]
    x = torch.randn(m, n, generator=g).to(device, dtype).requires_grad_()
    r = (2.0 * torch.randn(m, n, generator=g)).to(device, dtype).requires_grad_()
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    ds = torch.randn(m, n, generator=g).to(device, dtype)
    return Case(args=(x, r, w, 1e-6, 0.0), grads=(dy, ds))


def _heuristic(arch, dims, dtype):
    """rms_norm's heuristic for its 1-D backward walk: one row per program from hidden 2048 up, 8 values per
    thread up to 2048 and 16 above, small rows packed 2048 elements per program; backward 2 persistent programs
    per SM, 8 values per thread, the next row prefetched (here dy, s and d(s): three rows in flight per program).
    `liger-tune sweep` decides among _configs."""
    e = next_pow2(dims["hidden"])
    return RowNormConfig(**norm_fwd(arch, block_n=e, tile=2048, per_thread=8 if e <= 2048 else 16),
                         **norm_bwd(arch, block_n=e, per_thread=8, progs=2, prefetch=1))


def _configs(arch, dims, dtype):
    """The row norms' space around the heuristic (at most 12)."""
    return norm_candidates(arch, dims["hidden"], _heuristic(arch, dims, dtype))


def _plan(preset, arch, quick):
    return row_plan(preset, arch, quick, width="hidden", preset_width=preset and preset.hidden, cpu_widths=(64, 128),
                    gpu_widths=(2048, 4096), gpu_tokens=(1024, 4096, 16384, 65536))


OP = register(Op(
    name="fused_add_rms_norm", static=("hidden",), dynamic=("rows",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=supports,
                keep=(2,)),   # the backward reads the weight and s (saved): x and residual are freed
           Impl("torch", fn=fused_add_rms_norm_ref)],
    config=RowNormConfig, candidates=_configs, heuristic=_heuristic, fake=_fake, make_case=_make_case, plan=_plan,
    schema="Tensor x, Tensor residual, Tensor weight, float eps, float offset", outputs=2,
    reduce_len=lambda d: d["rows"], compiler_fuses=True))
