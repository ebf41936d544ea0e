"""Shared helpers for the kernel files: Triton availability and the small Triton/launch helpers every
kernel file uses (rounding, row views, warps), and the row norms' config and tuning space."""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import backend
from ..backend import interpreter_on
from ..config import WARPS, Config, knob, pow2


def triton_available(target) -> bool:
    """Triton kernels run on a GPU, or on CPU tensors through TRITON_INTERPRET=1."""
    return interpreter_on() if target.device_type == "cpu" else target.device_type == "cuda"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


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


# -- row norms (rms_norm, layer_norm): one launch layout, one config, one tuning space ---------------
@dataclasses.dataclass(frozen=True)
class RowNormConfig(Config):
    """Forward: ROWS rows per program. Backward: sm_count * bwd_progs_per_sm persistent programs walking rows
    with the grid's stride, fp32 partial rows summed by a column-parallel kernel."""
    ROWS: int = knob(1, pow2(1, 8192))                # rows per forward program (packed small rows)
    num_warps: int = knob(4, WARPS)                   # forward
    bwd_num_warps: int = knob(4, WARPS)
    bwd_progs_per_sm: int = knob(2, (1, 2, 3, 4, 6, 8, 12, 16))   # persistent backward programs
    bwd_prefetch: int = knob(1, (0, 1))               # next row's loads in flight (register double buffer)


def persistent_grid(m: int, device: torch.device, progs_per_sm: int) -> int:
    """Persistent programs: sm_count * progs_per_sm, never more than the rows."""
    return max(1, min(m, sm_count(device) * progs_per_sm))


def partial_sum_tile(device: torch.device) -> tuple[int, int]:
    """(columns, partial rows) per tile of the column-parallel sum of (G, N) fp32 partials: 32 columns (128 bytes
    per partial row) by 64 rows, 16 fp32 per thread at 4 warps; on the (serial) interpreter, few wide tiles."""
    return (128, 16) if device.type == "cpu" else (32, 64)


def norm_fwd(arch, block_n: int, tile: int, per_thread: int) -> dict:
    """Forward knobs: tile // block_n rows per program, `per_thread` values per thread."""
    rows = max(1, tile // block_n)
    return {"num_warps": warps_for(rows * block_n, per_thread, arch), "ROWS": rows}


def norm_bwd(arch, block_n: int, per_thread: int, progs: int, prefetch: int) -> dict:
    """Backward knobs: at least 4 warps (arch permitting), `progs` programs per SM."""
    return {"bwd_num_warps": max(min(4, arch.max_num_warps), warps_for(block_n, per_thread, arch)),
            "bwd_progs_per_sm": progs, "bwd_prefetch": prefetch}


def norm_candidates(arch, hidden: int, base: RowNormConfig) -> list[RowNormConfig]:
    """A row norm's tuning space around its heuristic `base` (first), at most 12 configs."""
    e = next_pow2(hidden)
    if arch.name == "cpu":  # the interpreter ignores warps: cover the code paths, not the space
        return [base, base.replace(**norm_bwd(arch, e, 16, 1, 0)),
                base.replace(**norm_fwd(arch, e, 8192, 16), **norm_bwd(arch, e, 8, 3, 0))]
    bwd = [norm_bwd(arch, e, 8, 2, 1), norm_bwd(arch, e, 8, 4, 1),
           norm_bwd(arch, e, 8, 4, 0),      # occupancy instead of prefetch
           norm_bwd(arch, e, 8, 8, 0),
           # 8 warps at 4096 (Triton 3.9 sm_90): rms_norm 98 registers with prefetch (2 programs resident), 71
           # without (3 resident); layer_norm 127 with or without
           norm_bwd(arch, e, 16, 2, 1), norm_bwd(arch, e, 16, 3, 0), norm_bwd(arch, e, 16, 8, 0),
           norm_bwd(arch, e, 16, 16, 0),    # many short programs (8 rows each at 16384 x 4096)
           norm_bwd(arch, e, 32, 8, 0)]     # 4 warps at 4096
    fwd = [norm_fwd(arch, e, min(e, 2048), 8) if e > 2048 else norm_fwd(arch, e, 2048, 16),  # 16 warps/row at 4096
           norm_fwd(arch, e, min(e, 2048), 32),                                               # 4 warps/row at 4096
           norm_fwd(arch, e, 8192, 16)]                                                       # packed rows
    return list(dict.fromkeys([base] + [base.replace(**b) for b in bwd] + [base.replace(**f) for f in fwd]))[:12]


def row_plan(preset, arch, quick: bool, width: str, preset_width: int | None, cpu_widths: tuple,
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
