"""Memoised launch constants: a kernel file computes a launch's grid, blocks and bound kernel once per key
(`launch_memo`, `bind`); `dispatch.reset()` forgets them with the decisions (`clear_launch_memos`)."""
from __future__ import annotations

import functools

_LAUNCH_MEMOS: list = []


def launch_memo(fn):
    """Memoise a launcher's constants (grid, blocks, sm_count) per key, e.g. fn(config, rows, cols, device) -> bound
    kernel (:func:`bind`); the key holds all they depend on but TRITON_INTERPRET and the environment
    (dispatch.reset() clears memos, as it clears decisions)."""
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
