"""RMSNorm: y = (x * rstd).to(x.dtype) * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps).

Shapes: x (..., hidden), weight (hidden,) -> y (..., hidden) in promote(x.dtype, weight.dtype),
the dtype the Hugging Face module returns.  offset=0 for Llama/Qwen3/LFM2, 1 for Gemma-style
weights stored as w - 1.

    y = liger_rt.ops.rms_norm(x, weight, eps=1e-6)           # x (2, 128, 4096) bf16, weight (4096,)

Casting follows LlamaRMSNorm: statistics in fp32, the normalised x is rounded to the input dtype
*before* the weight multiply (``weight * hidden.to(input_dtype)``).

Kernels: the forward takes ROWS rows per program and stores rstd (fp32, one per row).  The
backward is persistent: G = min(rows, sm_count * bwd_progs_per_sm) programs walk rows p, p + G,
... (the row-norm family's kernel, row_norm.py) or, for small hidden, (bwd_rows, N) tiles (this
file's), each keeping one fp32 dW partial row, which a column-parallel kernel sums into the weight
dtype.  No atomics.  Minimum traffic: fwd 2MN, bwd 3MN.
"""
from __future__ import annotations

import dataclasses

import torch

from .._triton import tl, triton
from ..backend import interpreter_on
from ..config import knob, pow2
from ..dispatch import call, register
from ..launch import bind, launch_memo
from ..op import Case, Impl, Op, check_dtype
from ._common import next_pow2, row_layout, row_plan, to_dtype, triton_available
from .row_norm import MAX_HIDDEN  # noqa: F401  (the op's width limit, as rms_norm.MAX_HIDDEN)
from .row_norm import (RowNormConfig, bind_partial_sum, bind_persistent_bwd, check_hidden, load_row_block, norm_bwd,
                       norm_candidates, norm_fwd, persistent_grid, rms_norm_store_row, rms_norm_store_rows, supports)
from ._common import block_problem

TILE_BWD_MAX_HIDDEN = 256   # the heuristic's backward walks (rows, hidden) tiles up to this hidden


@dataclasses.dataclass(frozen=True)
class RMSNormConfig(RowNormConfig):
    # rows per backward tile: 1 is the 1-D row walk; above 1, (bwd_rows, hidden) tiles for small hidden
    bwd_rows: int = knob(1, pow2(1, 256))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xn = (xf * rstd).to(x.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    return ((weight.float() + offset) * xn.float()).to(out_dtype)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, M, N, eps, offset,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RNE_BF16: tl.constexpr):
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if ROWS == 1:   # one row per program, 1-D tiles and scalar row statistics (Liger-Kernel's shape)
        row = tl.program_id(0).to(tl.int64)
        x = tl.load(X + row * stride_x + o_n, mask=m_n, other=0.0).to(tl.float32)
        rms_norm_store_row(x, X, W, Y, RSTD, row, stride_y, o_n, m_n, N, eps, offset, RNE_BF16)
    else:
        x, o_m, o_m64, m_m, mask = load_row_block(X, stride_x, M, o_n, m_n, ROWS)
        rms_norm_store_rows(x, X, W, Y, RSTD, o_m, o_m64, m_m, mask, stride_y, o_n, m_n, N, eps, offset, RNE_BF16)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_bwd_tile_kernel(DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, M, N, offset,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RNE_BF16: tl.constexpr):
    """The backward on (BLOCK_M, BLOCK_N) tiles for small hidden, where one row is too little work
    per step: program pid takes row blocks pid, pid + G, ... (G = grid <= blocks)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    o_m = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32) + offset
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, tl.cdiv(tl.cdiv(M, BLOCK_M) - pid, G)):
        rows = (pid + i * G).to(tl.int64) * BLOCK_M + o_m
        m_m = rows < M
        mask = m_m[:, None] & m_n[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + o_n[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=m_m, other=0.0)
        xhat = x * rstd[:, None]
        acc += dy * to_dtype(xhat, X.dtype.element_ty, RNE_BF16).to(tl.float32)
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + o_n[None, :], to_dtype(dx, DX.dtype.element_ty, RNE_BF16), mask=mask)
    tl.store(DW_PART + pid.to(tl.int64) * N + o_n, tl.sum(acc, axis=0), mask=m_n)


@launch_memo
def _fwd_launch(config, m: int, n: int):
    return bind(_rms_norm_fwd_kernel, (triton.cdiv(m, config.ROWS),), BLOCK_N=next_pow2(n), ROWS=config.ROWS,
                RNE_BF16=interpreter_on(), num_warps=config.num_warps)


@launch_memo
def _bwd_launch(config, m: int, n: int, device: torch.device):
    """(programs, the backward kernel, the dW-sum kernel), bound, at m rows of n on `device`: the family's
    persistent row walk, or (bwd_rows > 1) this file's tile walk."""
    if config.bwd_rows > 1:
        grid = persistent_grid(triton.cdiv(m, config.bwd_rows), device, config.bwd_progs_per_sm)
        bwd = bind(_rms_norm_bwd_tile_kernel, (grid,), BLOCK_M=config.bwd_rows, BLOCK_N=next_pow2(n),
                   RNE_BF16=interpreter_on(), num_warps=config.bwd_num_warps)
    else:
        grid, bwd = bind_persistent_bwd(config, m, n, device, centered=False)
    return grid, bwd, bind_partial_sum(n, device)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 config) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., N) -> (y (..., N), rstd (rows,) fp32)."""
    n = x.shape[-1]
    check_hidden("rms_norm", n)
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({n},)")
    x2, m, stride_x = row_layout(x, n)
    dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)    # rows of n
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        _fwd_launch(config, m, n)(x2, weight, y, rstd, stride_x, n, m, n, float(eps), float(offset))
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
                 config) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x (..., N), rstd (rows,) -> (dx (..., N) in x.dtype, dW (N,) in weight.dtype)."""
    n = x.shape[-1]
    check_hidden("rms_norm", n)
    (x2, m, stride_x), (dy2, _, stride_dy) = row_layout(x, n), row_layout(dy, n)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)    # rows of n
    if m == 0:
        return dx, torch.zeros_like(weight)
    grid, bwd_kernel, dw_kernel = _bwd_launch(config, m, n, x.device)
    part = torch.empty((grid, n), dtype=torch.float32, device=x.device)
    if config.bwd_rows > 1:
        bwd_kernel(dy2, x2, weight, rstd, dx, part, stride_dy, stride_x, n, m, n, float(offset))
    else:   # (DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, ...): no mean, no bias
        bwd_kernel(dy2, x2, weight, None, rstd, dx, part, None, None, stride_dy, stride_x, n, 0, m, n, float(offset))
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    dw_kernel(part, None, dw, None, grid, n)
    return dx, dw


def _dims(x, weight, eps, offset) -> dict:
    if x.dim() < 1:
        raise ValueError(f"rms_norm: x must have at least one dim (..., hidden), got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"rms_norm: weight must have shape ({n},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    check_dtype("rms_norm", "weight", weight, OP.accepted_dtypes)
    return {"rows": x.numel() // n if n else 0, "hidden": n}


def _forward(config, x, weight, eps, offset):
    # x as given: flattened by the launcher, not before the Function (view nodes in the autograd
    # graph each cost host time in the backward, which bounds a norm's wall clock on the H200)
    y, rstd = rms_norm_fwd(x, weight, eps, offset, config)
    return (y,), (rstd,)


def _backward(config, args, saved, needs, dy):
    x, weight, eps, offset = args
    dx, dw = rms_norm_bwd(dy, x, weight, saved[0], offset, config)
    return dx, dw, None, None


def _fake(config, x, weight, eps, offset):
    return ((x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),),
            (x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32),))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim; x (..., hidden), weight (hidden,).  Dispatched per call."""
    if not weight.is_contiguous():      # the kernels read the weight with unit stride
        weight = weight.contiguous()
    return call(OP, x, weight, float(eps), float(offset))


def _make_case(dims, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n = dims["rows"], dims["hidden"]
    x = torch.randn(m, n, generator=g).to(device, dtype).requires_grad_()
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device, dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    return Case(args=(x, w, 1e-6, 0.0), grads=(dy,))


def _heuristic(arch, dims, dtype):
    """Forward: one row per program from hidden 2048 up (Liger-Kernel's shape, 3.76 TB/s on the
    H200), 8 values per thread up to 2048 and 16 above; small rows pack 2048 elements per program.
    Backward: 2 persistent programs per SM, 8 values per thread (16 warps at 4096: 57 registers on
    Triton 3.9 sm_90, both programs resident), the next row prefetched: 4 row pairs (64 KB at 4096)
    of loads in flight per SM; fp32 dW partials 4 MB at 4096.  Up to hidden 256 (per-head q/k
    norms) the backward walks 2048-element tiles, 4 programs per SM: one row per step left each
    program ~1000 dependent steps at 262144 x 64.  `liger-tune sweep` decides among _configs."""
    e = next_pow2(dims["hidden"])
    fwd = norm_fwd(arch, block_n=e, tile=2048, per_thread=8 if e <= 2048 else 16)
    if e <= TILE_BWD_MAX_HIDDEN:
        return RMSNormConfig(**fwd, **norm_bwd(arch, block_n=2048, per_thread=16, progs=4, prefetch=0),
                             bwd_rows=min(256, 2048 // e))
    return RMSNormConfig(**fwd, **norm_bwd(arch, block_n=e, per_thread=8, progs=2, prefetch=1))


def _configs(arch, dims, dtype):
    """The row norms' space; from hidden 512 down, backward tiles of 2048-8192 elements at 4 and 8
    programs per SM take the place of most 1-D backward variants (12 at most)."""
    base, e = _heuristic(arch, dims, dtype), next_pow2(dims["hidden"])
    if arch.name == "cpu":   # the interpreter: both backward kernels' code paths
        return norm_candidates(arch, dims["hidden"], base) + [
            base.replace(bwd_rows=4 if base.bwd_rows == 1 else 1,
                         **norm_bwd(arch, block_n=e, per_thread=16, progs=2, prefetch=0))]
    if e > 2 * TILE_BWD_MAX_HIDDEN:
        return norm_candidates(arch, dims["hidden"], base)
    walk = base.replace(bwd_rows=1, **norm_bwd(arch, block_n=e, per_thread=8, progs=2, prefetch=1))
    tiles = [base.replace(bwd_rows=min(256, tile // e),
                          **norm_bwd(arch, block_n=tile, per_thread=16, progs=progs, prefetch=0))
             for tile in (2048, 4096, 8192) for progs in (4, 8)]
    fwds = [base.replace(**norm_fwd(arch, block_n=e, tile=tile, per_thread=16)) for tile in (1024, 4096, 8192)]
    wide = walk.replace(**norm_bwd(arch, block_n=e, per_thread=8, progs=8, prefetch=0))
    return list(dict.fromkeys([base, *tiles, walk, wide, *fwds]))[:12]


def _launchable(config, dims, arch, dtype):
    """Why `config` cannot launch at `dims` (None: it can): the forward's (ROWS, padded hidden) and the backward's
    (bwd_rows, padded hidden) blocks within Triton's largest."""
    e = next_pow2(dims["hidden"])
    return block_problem(forward=config.ROWS * e, backward=config.bwd_rows * e)


def _plan(preset, arch, quick):
    return row_plan(preset, arch, quick, width="hidden", preset_width=preset and preset.hidden, cpu_widths=(64, 128),
                    gpu_widths=(2048, 4096), gpu_tokens=(1024, 4096, 16384, 65536))


OP = register(Op(
    name="rms_norm", static=("hidden",), dynamic=("rows",), dims=_dims,
    impls=[Impl("triton", forward=_forward, backward=_backward, available=triton_available, supports=supports),
           Impl("torch", fn=rms_norm_ref)],
    config=RMSNormConfig, candidates=_configs, heuristic=_heuristic, launchable=_launchable, fake=_fake,
    make_case=_make_case, plan=_plan,
    schema="Tensor x, Tensor weight, float eps, float offset", reduce_len=lambda d: d["rows"],
    schema_version=3, compiler_fuses=True))   # the config layout's version: DB rows of another are stale
