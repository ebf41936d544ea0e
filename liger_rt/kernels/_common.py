"""Shared helpers for the kernel files: dtype names, the tolerance table, Triton availability,
and the small Triton/launch helpers every kernel file uses (rounding, row views, warps)."""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .. import backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {dtype}; liger_rt kernels take {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return DTYPES[dtype_name(name)]
    key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[key]


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def triton_available(target) -> bool:
    """Triton kernels run on a GPU, or on CPU tensors through TRITON_INTERPRET=1."""
    return interpreter_on() if target.device_type == "cpu" else target.device_type == "cuda"


_LAUNCH_MEMOS: list = []


def launch_memo(fn):
    """Memoise a launcher's constants (grid, blocks, sm_count) per key, e.g. fn(config, rows, cols, device) -> bound
    kernel (:func:`bind`); the key holds all they depend on but TRITON_INTERPRET (dispatch.reset() clears memos)."""
    memo = functools.lru_cache(maxsize=4096)(fn)
    memo.fn = fn               # the freshness hash reads the launch code through .fn
    _LAUNCH_MEMOS.append(memo)
    return memo


def bind(kernel, grid: tuple, **meta):
    """`kernel[grid](*args, **meta)` as one callable to memoise (kernel[grid] builds a new lambda on every call)."""
    return functools.partial(kernel.run, grid=grid, warmup=False, **meta)


def clear_launch_memos() -> None:
    for memo in _LAUNCH_MEMOS:
        memo.cache_clear()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Tolerances, one table: (atol, rtol) for an elementwise result in each dtype; a result reducing over `n`
# terms scales both by sqrt(n / 256) (never below 1). Values: the spread of fp32-accumulated kernels against fp32
# references seen on these tests; tight enough that a wrong mask, a missing term or a swapped gate fails.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def tolerance(dtype: torch.dtype, reduce_len: int = 1) -> tuple[float, float]:
    atol, rtol = TOLERANCES[dtype]
    scale = max(1.0, math.sqrt(max(1, reduce_len) / 256.0))
    return atol * scale, rtol * scale


def close_report(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, reduce_len: int = 1) -> str | None:
    """None when `out` matches the fp32 `ref` within the dtype's tolerance, else what differs."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    atol, rtol = tolerance(dtype, reduce_len)
    o, r = out.detach().float(), ref.detach().float()
    if not torch.isfinite(o).all() and torch.isfinite(r).all():
        return "non-finite values where the reference is finite"
    err = (o - r).abs()
    bad = err > atol + rtol * r.abs()
    if bad.any():
        return (f"{int(bad.sum())}/{bad.numel()} elements off (max abs err {float(err.max()):.3g} at flat index "
                f"{int(err.argmax())}, atol {atol:.2g}, rtol {rtol:.2g})")
    return None


def assert_close(out, ref, dtype, reduce_len: int = 1, name: str = "output") -> None:
    if msg := close_report(out, ref, dtype, reduce_len):
        raise AssertionError(f"{name}: {msg}")


# Relative RMSE bound per dtype: a few times the rounding of one 16-bit store (bf16 2^-8, fp16 2^-11).
REL_RMSE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def validation_report(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, reduce_len: int = 1) -> str | None:
    """What the autotuner accepts: the elementwise tolerance or, for long low-precision reductions with a few elements
    2-3 ulps out, a relative RMSE within REL_RMSE and no element over 8x its tolerance (a dropped term still fails)."""
    msg = close_report(out, ref, dtype, reduce_len)
    if msg is None or msg.startswith("shape") or msg.startswith("non-finite"):
        return msg
    atol, rtol = tolerance(dtype, reduce_len)
    o, r = out.detach().float(), ref.detach().float()
    err = (o - r).abs()
    rel_rmse = float(err.pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30))
    worst = float((err / (atol + rtol * r.abs())).max())
    if rel_rmse <= REL_RMSE[dtype] and worst <= 8.0:
        return None
    return (f"{msg}; relative RMSE {rel_rmse:.3g} (bound {REL_RMSE[dtype]:.0e}), "
            f"worst element {worst:.1f}x its tolerance")


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
