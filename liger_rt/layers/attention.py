"""The rule the ``causal_mask`` flag swaps into ``transformers.masking_utils`` (specs.CAUSAL_MASK).

transformers asks ``_ignore_causal_mask_sdpa`` whether SDPA may run with no mask, on its ``is_causal``
path (the one flash attention takes).  Eager, it says yes whenever no token is padded.  While
torch.compile traces, transformers 5.17 (the H200 image's, with torch 2.11) always says no, so a compiled
model builds a (batch, 1, q, kv) mask and SDPA leaves flash attention for a masked kernel; later releases
skip the mask again on newer torch.  This rule answers as transformers does eagerly when no padding mask
was given (known at trace time, no tensor is read) and asks transformers' own rule otherwise.  The
attention is the same either way: a causal mask and ``is_causal`` select the same keys.
"""
from __future__ import annotations

from transformers import masking_utils

from .. import _swaps

NAME = "_ignore_causal_mask_sdpa"
_HF_RULE = getattr(masking_utils, NAME, None)
if getattr(_HF_RULE, _swaps.SWAPPED, False):           # this module re-imported while the swap is held
    _HF_RULE = _swaps.LEDGER[(masking_utils, NAME)].original


def ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
    """transformers' (padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size) -> bool."""
    if padding_mask is not None or not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return _HF_RULE(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False                    # a sliding window needs its mask
    return q_length == 1 or q_length == kv_length or q_offset == 0
