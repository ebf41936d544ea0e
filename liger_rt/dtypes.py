"""The dtypes liger_rt's kernels take, by the short names that DB rows, the CLI and env use.

    parse_dtype("bf16") is torch.bfloat16;  dtype_name(torch.float16) == "fp16"
"""
from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a kernel dtype; TypeError for any other dtype."""
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {dtype}; liger_rt kernels take {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A kernel dtype from its short name, torch's name ("bfloat16") or itself; else ValueError (TypeError
    for a torch dtype the kernels do not take)."""
    if isinstance(name, torch.dtype):
        return DTYPES[dtype_name(name)]
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[key]
