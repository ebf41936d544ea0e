"""LayerNorm: y = (x - mean) * rstd * w + b over the last dim (the SigLIP2 vision tower's norm).

Shapes: x (..., hidden), weight (hidden,), bias (hidden,) or None -> y (..., hidden) in x.dtype,
like nn.LayerNorm: statistics and the affine in fp32, one rounding at the end.

    y = liger_rt.ops.layer_norm(x, weight, bias, eps=1e-6)   # x (4, 729, 1152) bf16

Kernels, launch config and tuning space are the row-norm family's (row_norm.py, shared with
rms_norm.py): the forward also stores the mean, the persistent backward writes fp32 partials of dW
and dB.  PyTorch's LayerNorm is fast at small hidden sizes: the dispatcher picks `torch` wherever
the tuning DB measured it faster.  Minimum traffic: fwd 2MN, bwd 3MN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._triton import tl, triton
from ..backend import interpreter_on
from ..dispatch import call, register
from ..launch import bind, launch_memo
from ..op import Case, Impl, Op, check_dtype
from ._common import next_pow2, row_layout, row_plan, to_dtype, triton_available
from .row_norm import MAX_HIDDEN  # noqa: F401  (the op's width limit, as layer_norm.MAX_HIDDEN)
from .row_norm import (bind_partial_sum, bind_persistent_bwd, check_hidden, load_row_block, norm_bwd, norm_candidates,
                       norm_fwd, supports)
from .row_norm import RowNormConfig as LayerNormConfig
from .row_norm import norm_launchable


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float = 1e-5) -> torch.Tensor:
    """fp32 LayerNorm cast to x.dtype (what nn.LayerNorm computes for 16-bit inputs)."""
    w, b = (None if t is None else t.float() for t in (weight, bias))
    return F.layer_norm(x.float(), x.shape[-1:], w, b, eps).to(x.dtype)


def _layer_norm_torch(x, weight, bias, eps):
    """PyTorch's LayerNorm (the `torch` implementation).  On CPU its 16-bit backward is off by 2 ulps
    in dW/dB at 16 rows (CUDA's accumulates in fp32), so 16-bit on CPU runs the fp32 reference; fp64
    stays fp64, as in nn.LayerNorm."""
    same = all(t is None or t.dtype == x.dtype for t in (weight, bias))
    if same and (x.device.type != "cpu" or x.dtype not in (torch.float16, torch.bfloat16)):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return layer_norm_ref(x, weight, bias, eps)


@triton.jit(do_not_specialize=["M"])
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, M, N, eps, BLOCK_N: tl.constexpr,
                           ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr):
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
        tl.store(Y + row * stride_y + o_n, to_dtype(y, Y.dtype.element_ty, RNE_BF16), mask=m_n)
    else:
        x, o_m, o_m64, m_m, mask = load_row_block(X, stride_x, M, o_n, m_n, ROWS)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + o_m64[:, None] * stride_y + o_n[None, :], to_dtype(y, Y.dtype.element_ty, RNE_BF16), mask=mask)
        tl.store(MEAN + o_m, mean, mask=m_m)
        tl.store(RSTD + o_m, rstd, mask=m_m)


@launch_memo
def _fwd_launch(config, m: int, n: int, has_bias: bool):
    return bind(_layer_norm_fwd_kernel, (triton.cdiv(m, config.ROWS),), BLOCK_N=next_pow2(n), ROWS=config.ROWS,
                HAS_BIAS=has_bias, RNE_BF16=interpreter_on(), num_warps=config.num_warps)


@launch_memo
def _bwd_launch(config, m: int, n: int, has_bias: bool, device: torch.device):
    """(programs, the backward kernel, the dW/dB-sum kernel), bound, at m rows of n on `device`."""
    grid, bwd = bind_persistent_bwd(config, m, n, device, centered=True, has_bias=has_bias)
    return grid, bwd, bind_partial_sum(n, device, has_bias=has_bias)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., N), weight/bias (N,) -> (y (..., N) in x.dtype, mean (rows,), rstd (rows,) fp32)."""
    n = x.shape[-1]
    check_hidden("layer_norm", n)
    x2, m, stride_x = row_layout(x, n)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)    # rows of n
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        _fwd_launch(config, m, n, bias is not None)(x2, weight, bias if bias is not None else weight, y, mean, rstd,
                                                    stride_x, n, m, n, float(eps))
    return y, mean, rstd


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   mean: torch.Tensor, rstd: torch.Tensor, config):
    """-> (dx (..., N) in x.dtype, dW (N,) in weight.dtype, dB (N,) in bias.dtype or None)."""
    n = x.shape[-1]
    check_hidden("layer_norm", n)
    (x2, m, stride_x), (dy2, _, stride_dy) = row_layout(x, n), row_layout(dy, n)
    has_bias = bias is not None
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)   # rows of n
    if m == 0:
        return dx, torch.zeros_like(weight), (torch.zeros_like(bias) if has_bias else None)
    grid, bwd_kernel, sum_kernel = _bwd_launch(config, m, n, has_bias, x.device)
    part = torch.empty((2 if has_bias else 1, grid, n), dtype=torch.float32, device=x.device)
    part_b = part[1] if has_bias else None
    bwd_kernel(dy2, x2, weight, mean, rstd, dx, part[0], part_b, None, stride_dy, stride_x, n, 0, m, n,
               None)   # no offset
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    db = torch.empty_like(bias, memory_format=torch.contiguous_format) if has_bias else None
    sum_kernel(part[0], part_b, dw, db, grid, n)
    return dx, dw, db


def _dims(x, weight, bias, eps) -> dict:
    if x.dim() < 1:
        raise ValueError(f"layer_norm: x must have at least one dim (..., hidden), got shape {tuple(x.shape)}")
    n = x.shape[-1]
    check_dtype("layer_norm", "x", x, OP.accepted_dtypes)     # weight=None skips dispatch.call's check of x
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != n):
            raise ValueError(f"layer_norm: {name} must have shape ({n},) for x of shape {tuple(x.shape)}, "
                             f"got {tuple(t.shape)}")
        check_dtype("layer_norm", name, t, OP.accepted_dtypes)
    return {"rows": x.numel() // n if n else 0, "hidden": n}


def _forward(config, x, weight, bias, eps):
    # x as given, flattened by the launcher (no view nodes in the autograd graph: see rms_norm.py)
    y, mean, rstd = layer_norm_fwd(x, weight, bias, eps, config)
    return (y,), (mean, rstd)


def _backward(config, args, saved, needs, dy):
    x, weight, bias, eps = args
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, *saved, config)
    return dx, dw, db, None


def _fake(config, x, weight, bias, eps):
    stat = x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)
    return (x.new_empty(x.shape),), (stat, torch.empty_like(stat))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim; weight=None (no affine) runs PyTorch's LayerNorm."""
    if weight is None:
        OP.dims(x, weight, bias, eps)
        return OP.reference(x, None, bias, float(eps))
    # the kernels read weight and bias with unit stride
    weight = weight if weight.is_contiguous() else weight.contiguous()
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    return call(OP, x, weight, bias, float(eps))


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["hidden"]
    x = (0.5 + torch.randn(m, n, generator=g)).to(device, dtype).requires_grad_()   # nonzero mean
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return Case(args=(x, w, b, 1e-5), grads=(dy,))


def _heuristic(arch, dims, dtype):
    """rms_norm's 1-D heuristic, but the next row is prefetched up to hidden 2048 only: LayerNorm's
    backward holds two accumulators, and with prefetch a 16-warp program at 4096 takes 82
    registers on Triton 3.9 sm_90 (one resident per SM), without it 64 (two resident).
    Not measured on a GPU yet: `liger-tune sweep` decides (torch where it is faster)."""
    e = next_pow2(dims["hidden"])
    return LayerNormConfig(**norm_fwd(arch, block_n=e, tile=2048, per_thread=8 if e <= 2048 else 16),
                           **norm_bwd(arch, block_n=e, per_thread=8, progs=2, prefetch=1 if e <= 2048 else 0))


def _configs(arch, dims, dtype):
    return norm_candidates(arch, dims["hidden"], _heuristic(arch, dims, dtype))


def _plan(preset, arch, quick):
    vision = preset is not None and preset.model_type == "lfm2_vl" and preset.vision_hidden
    width = preset and (preset.vision_hidden if vision else preset.hidden)
    # GPU defaults: SigLIP2 (1152) and two LLM widths
    return row_plan(preset, arch, quick, width="hidden", preset_width=width, cpu_widths=(64, 128),
                    gpu_widths=(1152, 2048, 4096), gpu_tokens=(1024, 4096, 16384, 65536))


OP = register(Op(
    name="layer_norm", static=("hidden",), dynamic=("rows",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=supports),
           Impl("torch", fn=_layer_norm_torch)],
    config=LayerNormConfig, candidates=_configs, heuristic=_heuristic, launchable=norm_launchable,
    schema="Tensor x, Tensor weight, Tensor? bias, float eps", fake=_fake, make_case=_make_case, plan=_plan,
    reduce_len=lambda d: d["rows"],
    schema_version=2, compiler_fuses=True))   # the config layout's version: DB rows of another are stale
