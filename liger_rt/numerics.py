"""The tolerance policy: what "matches the reference" means, for the autotuner's validation of every
candidate and for the tests.

One table (STYLE 8): (atol, rtol) for an elementwise result in each dtype; a result reducing over `n`
terms scales both by sqrt(n / 256) (never below 1).  Values: the spread of fp32-accumulated kernels
against fp32 references seen on the tests; tight enough that a wrong mask, a missing term or a swapped
gate fails.

    assert_close(y, y_ref, torch.bfloat16, reduce_len=4096)
"""
from __future__ import annotations

import math

import torch

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

# Relative RMSE bound per dtype: a few times the rounding of one 16-bit store (bf16 2^-8, fp16 2^-11).
REL_RMSE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def tolerance(dtype: torch.dtype, reduce_len: int = 1) -> tuple[float, float]:
    """(atol, rtol) for a result in `dtype` that reduces over `reduce_len` terms."""
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
