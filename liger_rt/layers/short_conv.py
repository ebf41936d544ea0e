"""LFM2 gated short convolution forward (Lfm2ShortConv, Lfm2MoeShortConv) through liger_rt.ops.short_conv.

    y = out_proj(C * causal_depthwise_conv(B * x)),  B, C, x = in_proj(mask(h)).split(3)

The gates and the depthwise conv run as one op on ``bcx`` (batch, seq, 3*hidden), for training and
no-cache calls and a prefill into an empty cache (writing the conv state as the HF layer does);
decoding, continuation from cached state, other caches, accelerate hooks and positional extras run the
module's own forward (docs/patching.md, "The short conv").

Packed sequences: boundaries come from ``seq_idx``, else ``cu_seq_lens_q`` (batch 1), else
``position_ids``.  ``decoder_layer_forward`` hands the last two to the conv as ``seq_idx=Packing(...)``
(transformers 5.17's decoder layer passes its conv ``seq_idx`` and nothing else of its kwargs); the conv
forward unwraps it.  If the op cannot take ``seq_idx`` and the batch is packed, the segment-aware
``short_conv_ref`` runs: sequences are never mixed (HF's own F.conv1d fallback does mix them).
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import NamedTuple

import torch

from .. import ops
from .._swaps import original_function
from ..kernels.short_conv import seq_idx_from_position_ids, short_conv_ref
from ..kernels.short_conv import short_conv as _short_conv_op      # takes seq_idx

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


# -- packing -------------------------------------------------------------------------------------------

def seq_idx_from_cu_seqlens(cu: torch.Tensor, seq: int) -> torch.Tensor:
    """(1, seq) int32 sequence index from cumulative lengths [0, l0, l0+l1, ..., seq]."""
    t = torch.arange(seq, device=cu.device)
    return (torch.searchsorted(cu[1:].to(t.dtype), t, right=True)).to(torch.int32).unsqueeze(0)


class Packing(NamedTuple):
    """The decoder layer's packed-sequence boundaries, handed to its conv as ``seq_idx``."""
    position_ids: torch.Tensor | None
    cu_seq_lens_q: torch.Tensor | None


def _seq_idx(seq_idx, cu, positions, batch: int, seq: int) -> torch.Tensor | None:
    if seq_idx is not None:
        return seq_idx.to(torch.int32).reshape(batch, seq) if seq_idx.numel() == batch * seq else None
    if cu is not None and batch == 1:
        return _shared(seq_idx_from_cu_seqlens, cu, seq)
    if positions is not None and positions.shape[-1] == seq:
        return _shared(seq_idx_from_position_ids, positions, batch)
    return None


_last_seq_idx = [None]   # (fn, source tensor, its version, arg, seq_idx): the conv layers of one forward


def _shared(fn, source: torch.Tensor, arg: int) -> torch.Tensor:
    """fn(source, arg), computed once for the conv layers of a forward (each recomputation costs ~5
    launches): reused for the same tensor object at the same version, which the entry holds so its
    identity cannot pass to another.  Not under torch.compile or for inference tensors (no version)."""
    if torch.compiler.is_compiling() or source.is_inference():
        return fn(source, arg)
    hit = _last_seq_idx[0]
    if hit is not None and hit[0] is fn and hit[1] is source and hit[2] == source._version and hit[3] == arg:
        return hit[4]
    out = fn(source, arg)
    _last_seq_idx[0] = (fn, source, source._version, arg, out)
    return out


@functools.lru_cache(maxsize=None)
def _takes_seq_idx(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "seq_idx" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _conv(bcx, weight, bias, seq_idx):
    fn = ops.short_conv
    if seq_idx is None:
        return fn(bcx, weight, bias)
    if fn is _short_conv_op or _takes_seq_idx(fn):      # no signature read (lru_cache) under torch.compile
        return fn(bcx, weight, bias, seq_idx=seq_idx)
    if bool((seq_idx[:, -1] != seq_idx[:, 0]).any()):      # packed, and the op cannot see boundaries
        return short_conv_ref(bcx, weight, bias, seq_idx)
    return fn(bcx, weight, bias)


# -- cache handling ----------------------------------------------------------------------------------

def _fresh_conv_state(cache, idx: int) -> bool | None:
    """Whether a transformers cache holds no conv state for layer idx and records no past (a speculative
    rollback keeps every column); None for a cache without these methods."""
    if hasattr(cache, "get_conv_state"):                                     # transformers 5.24
        if cache.get_conv_state(idx) is not None:
            return False
    elif hasattr(cache, "has_previous_state") and isinstance(getattr(cache, "layers", None), (list, tuple)):
        if idx >= len(cache.layers) or cache.has_previous_state(idx):       # transformers 5.17
            return False
    else:
        return None
    recording = getattr(cache, "is_recording_past", None)                     # 5.24; 5.17: layers[i].record_past
    return not (recording(idx) if recording is not None else getattr(cache.layers[idx], "record_past", False))


def _conv_state(bcx: torch.Tensor, kernel: int) -> torch.Tensor:
    """The conv state the HF layer caches: B*x of the last ``kernel`` positions, (batch, hidden, <= kernel)."""
    b, _, x = bcx[:, -kernel:].detach().chunk(3, dim=-1)
    return (b * x).transpose(-1, -2)


def _fresh_prefill(self, cache, kwargs: dict, seq: int):
    """How to write the conv state when the fused op runs with a cache: a callable(bcx), or None
    when the HF path must run."""
    idx = getattr(self, "layer_idx", None)
    if idx is None or seq < 2:
        return None
    kernel = self.conv.weight.shape[-1]
    fresh = _fresh_conv_state(cache, idx)
    if fresh is not None and hasattr(cache, "update_conv_state"):
        if not fresh:
            return None
        return lambda bcx: cache.update_conv_state(_conv_state(bcx, kernel), idx, conv_kernel_size=kernel)
    conv_cache = getattr(cache, "conv_cache", None)                                    # Lfm2HybridConvCache
    cache_position = kwargs.get("cache_position")
    if isinstance(conv_cache, (list, tuple)) and cache_position is not None and int(cache_position[0]) == 0:
        def write_old(bcx):
            bx = _conv_state(bcx, kernel)
            conv_cache[idx].copy_(torch.nn.functional.pad(bx, (kernel - bx.shape[-1], 0)))
        return write_old
    if self.training and torch.is_grad_enabled():
        # a training forward into a cache API this layer does not know (transformers creates one
        # whenever config.use_cache is on): nobody decodes from it, so fuse and leave it unwritten
        return lambda bcx: None
    return None


def conv_compatible(module) -> str | None:
    """None when an Lfm2ShortConv has the layout this forward reads, else why not."""
    conv = getattr(module, "conv", None)
    for name in ("in_proj", "out_proj"):
        if not isinstance(getattr(module, name, None), torch.nn.Module):
            return f"no {name} in this transformers' {type(module).__name__}"
    if not isinstance(conv, torch.nn.Conv1d) or conv.groups != conv.out_channels or conv.weight.shape[1] != 1:
        return f"{type(module).__name__}.conv is not a depthwise Conv1d"
    return None


def short_conv_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Lfm2ShortConv.forward; hidden_states (batch, seq, hidden)."""
    packing = kwargs.pop("seq_idx") if isinstance(kwargs.get("seq_idx"), Packing) else None
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    write_state = _fresh_prefill(self, cache, kwargs, hidden_states.shape[1]) if cache is not None else None
    if args or (cache is not None and write_state is None) or getattr(self.conv, "_hf_hook", None) is not None:
        return original_function(self)(self, hidden_states, *args, **kwargs)

    if (attention_mask := kwargs.get("attention_mask")) is not None:
        # the module's own masking rule (it changed across transformers releases)
        mask_fn = getattr(sys.modules.get(type(self).__module__), "apply_mask_to_padding_states", None)
        if mask_fn is not None:
            hidden_states = mask_fn(hidden_states, attention_mask)
        elif attention_mask.dim() == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    bcx = self.in_proj(hidden_states)
    batch, seq = bcx.shape[:2]
    if packing is not None:
        seq_idx = _seq_idx(None, packing.cu_seq_lens_q, packing.position_ids, batch, seq)
    else:
        seq_idx = _seq_idx(kwargs.get("seq_idx"), kwargs.get("cu_seq_lens_q"), None, batch, seq)
    y = _conv(bcx, self.conv.weight.squeeze(1), self.conv.bias, seq_idx)
    if write_state is not None:
        write_state(bcx)
    return self.out_proj(y)


def _runs_ours(conv) -> bool:
    # instance patch, accelerate hook, or class patch
    for fn in (conv.__dict__.get("_old_forward"), conv.__dict__.get("forward"), type(conv).forward):
        fn = getattr(fn, "__func__", fn)
        if fn is not None and short_conv_forward in (fn, getattr(fn, "_liger_rt_function", None)):
            return True
    return False


def decoder_layer_forward(self, *args, **kwargs):
    """Lfm2DecoderLayer.forward unchanged, except that a conv layer's conv also receives the layer's
    position_ids and cu_seq_lens_q (as ``seq_idx=Packing(...)``, where the caller gave no seq_idx)."""
    positions, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    conv = getattr(self, "conv", None)
    if (positions is not None or cu is not None) and kwargs.get("seq_idx") is None and conv is not None \
            and not getattr(self, "is_attention_layer", False) and _runs_ours(conv):
        kwargs["seq_idx"] = Packing(positions, cu)
    return original_function(self)(self, *args, **kwargs)
