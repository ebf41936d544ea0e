"""The rules the ``causal_mask`` flag swaps into ``transformers.masking_utils`` (specs.CAUSAL_MASK).

transformers asks ``_ignore_causal_mask_sdpa`` whether SDPA may run with no mask (its ``is_causal``
path, the one flash attention takes); eager, it says yes whenever no token is padded, but while
torch.compile traces, transformers 5.17 always says no, so SDPA leaves flash attention for a masked
kernel.  This rule answers as transformers does eagerly when no padding mask was given (known at trace
time) and asks transformers' own rule otherwise; the attention is the same either way.

With no cache (the fused loss asks for none, layers/loss.py), transformers also looks for packed
sequences in the position ids, which it cannot do while compiling: ``find_packed_sequence_indices``
answers "not packed" while the base model runs on positions it made.
"""
from __future__ import annotations

import threading

from transformers import masking_utils

from .. import _swaps

NAME = "_ignore_causal_mask_sdpa"
PACKED = "find_packed_sequence_indices"


def _host(name: str):
    # transformers' own masking_utils.<name>, also when this module is re-imported under a held swap
    fn = getattr(masking_utils, name, None)
    return _swaps.LEDGER[(masking_utils, name)].original if getattr(fn, _swaps.SWAPPED, False) else fn


_HF_RULE, _HF_PACKED = _host(NAME), _host(PACKED)


class _Depth(threading.local):
    """Per thread (DataParallel's replicas run in threads): > 0 while a base model runs on the positions it
    builds itself.  Set in every thread from the start: an attribute that appears at the first eager call
    changes what a compiled graph guards on, and recompiles it."""

    def __init__(self):
        self.depth = 0


_OWN_POSITIONS = _Depth()


def ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
    """transformers' (padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size) -> bool."""
    if padding_mask is not None or not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return _HF_RULE(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False                    # a sliding window needs its mask
    return q_length == 1 or q_length == kv_length or q_offset == 0


def find_packed_sequence_indices(position_ids):
    """transformers' packed-sequence detector: None (one sequence per row, as its ``arange`` positions
    are) while the base model runs on the positions it built itself, else transformers' own answer."""
    if _OWN_POSITIONS.depth:
        return None
    return _HF_PACKED(position_ids)


def enter_own_positions() -> None:
    _OWN_POSITIONS.depth += 1


def leave_own_positions() -> None:
    if _OWN_POSITIONS.depth <= 0:
        raise RuntimeError("leave_own_positions() without a matching enter_own_positions() in this thread")
    _OWN_POSITIONS.depth -= 1


def own_positions_rule_held() -> bool:
    """Whether ``find_packed_sequence_indices`` above stands in transformers (the causal_mask flag)."""
    return _swaps.function_at(masking_utils, PACKED) is find_packed_sequence_indices
