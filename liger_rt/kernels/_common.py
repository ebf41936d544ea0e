"""Shared helpers for the kernel files: Triton availability and the small Triton/launch helpers every
kernel file uses (rounding, row views, warps, row-wise sweep plans)."""
from __future__ import annotations

import torch

from .. import _triton, backend
from .._triton import tl, triton
from ..backend import interpreter_on


def triton_available(target) -> bool:
    """Triton kernels run on a GPU, or on CPU tensors through TRITON_INTERPRET=1; nowhere without Triton
    (`liger_rt._triton.reason()` says why), where every op runs its PyTorch implementation."""
    if not _triton.available():
        return False
    return interpreter_on() if target.device_type == "cpu" else target.device_type == "cuda"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# -- launch limits an op's `launchable` hook checks (never called from a launcher) ---------------------
# Triton's largest block, TRITON_MAX_TENSOR_NUMEL in triton/language/core.py: a kernel holding a larger tensor
# fails to compile ("numel (2097152) exceeds triton maximum tensor numel (1048576)"), on a GPU and in the
# interpreter alike.
MAX_BLOCK_NUMEL = 1 << 20
# The most programs on a launch grid's second axis: CUDA's gridDim.y limit (CUDA C++ Programming Guide, "Technical
# Specifications"), applied on every arch.
MAX_GRID_Y = 65535


def block_problem(**blocks: int) -> str | None:
    """Why a launch whose blocks hold these many elements cannot compile (None: it can).

        block_problem(forward=8192 * 256)   # "its forward block holds 2097152 elements, more than Triton's 1048576"
    """
    for name, numel in blocks.items():
        if numel > MAX_BLOCK_NUMEL:
            return f"its {name} block holds {numel} elements, more than Triton's {MAX_BLOCK_NUMEL}"
    return None


# -- helpers shared by the kernel files -------------------------------------------------------------
@triton.jit
def to_dtype(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 -> dtype. The interpreter truncates fp32 -> bf16 (interpreter.py's _convert_float has no rounding mode)
    where the GPU rounds to nearest even; RNE_BF16 (interpreter only) rounds explicitly to match the GPU's bits."""
    if RNE_BF16 and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit column stride; a view whenever rows are uniformly strided."""
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def row_layout(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, rows, row stride) of (..., n) for a kernel walking rows of n with unit column stride: `t` itself
    when contiguous (no reshape or view: each costs a microsecond of host time per call), else as_rows(t, n)."""
    if n and t.is_contiguous():
        return t, t.numel() // n, n
    t2 = as_rows(t, n)
    return t2, t2.shape[0], t2.stride(0)


def warps_for(elems: int, per_thread: int, arch) -> int:
    """Warps that give each thread `per_thread` of a tile's `elems` values, within the arch's ceiling."""
    return int(min(max(elems // (arch.warp_size * per_thread), 1), arch.max_num_warps))


sm_count = backend.sm_count   # SMs/CUs of a launch's device (2 under the interpreter): one source


def row_plan(preset, arch, quick: bool, *, width: str, preset_width: int | None, cpu_widths: tuple,
             gpu_widths: tuple, gpu_tokens: tuple) -> list[dict]:
    """Sweep plan of a row-wise op, dims {"rows", width}: the preset's width and token counts, or the defaults;
    tiny shapes on cpu (the interpreter); one token count (4096) when quick."""
    if arch.name == "cpu":
        widths = (preset_width,) if preset is not None and preset.tiny else cpu_widths
        rows = (8,) if quick else (8, 32)
    elif preset is not None:
        widths, rows = (preset_width,), (preset.quick_tokens if quick else preset.tokens)
    else:
        widths, rows = gpu_widths, ((4096,) if quick else gpu_tokens)
    return [{"rows": r, width: w} for w in widths for r in rows]
