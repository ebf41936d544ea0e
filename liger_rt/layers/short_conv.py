"""LFM2 gated short convolution forward (Lfm2ShortConv, Lfm2MoeShortConv) through liger_rt.ops.short_conv.

    y = out_proj(C * causal_depthwise_conv(B * x)),  B, C, x = in_proj(mask(h)).split(3)

``in_proj`` and ``out_proj`` stay the module's own Linear layers; the gates and the causal
depthwise conv (weight (hidden, kernel) = ``conv.weight.squeeze(1)``) run as one op on
``bcx`` (batch, seq, 3*hidden).

When the fused op runs, and when the Hugging Face path does:
- training and no-cache calls, and a prefill into an empty cache (the conv state the cache keeps,
  the last ``kernel`` columns of B*x, is written the way the HF layer writes it): liger_rt
  (a training forward into a cache whose API this layer does not know fuses too and leaves that
  cache's conv state unwritten);
- decoding and any call continuing from cached state, caches the layer cannot read, accelerate
  offload hooks, positional extras: the module's own forward, unchanged.

Packed sequences: boundaries come from ``seq_idx`` (TransformersKwargs), else ``cu_seq_lens_q``
(flash-attention packing, batch 1), else ``position_ids`` (a new sequence starts wherever the
position does not follow the previous one), which the decoder-layer forward below hands to the
conv.  The op receives ``seq_idx`` so no tap crosses a boundary; if the op cannot take
``seq_idx`` and the batch really is packed, the segment-aware ``short_conv_ref`` runs instead:
sequences are never mixed (HF's own F.conv1d fallback does mix them).
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch

from .. import ops
from .._swaps import original_function
from ..kernels.short_conv import seq_idx_from_position_ids, short_conv_ref
from ..kernels.short_conv import short_conv as _short_conv_op      # takes seq_idx

# the decoder layer passes position_ids to its conv under this key (popped before any HF call)
POSITIONS_KWARG = "_liger_rt_position_ids"
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


# -- packing -------------------------------------------------------------------------------------------

def seq_idx_from_cu_seqlens(cu: torch.Tensor, seq: int) -> torch.Tensor:
    """(1, seq) int32 sequence index from cumulative lengths [0, l0, l0+l1, ..., seq]."""
    t = torch.arange(seq, device=cu.device)
    return (torch.searchsorted(cu[1:].to(t.dtype), t, right=True)).to(torch.int32).unsqueeze(0)


def _seq_idx(kwargs: dict, positions, batch: int, seq: int) -> torch.Tensor | None:
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        return seq_idx.to(torch.int32).reshape(batch, seq) if seq_idx.numel() == batch * seq else None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and batch == 1:
        return seq_idx_from_cu_seqlens(cu, seq)
    if positions is not None and positions.shape[-1] == seq:
        return seq_idx_from_position_ids(positions, batch)
    return None


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

def _fresh_prefill(self, cache, kwargs: dict, seq: int):
    """How to write the conv state when the fused op runs with a cache: a callable(bcx), or None
    when the HF path must run (decode, continuation, recorded past, unknown cache API)."""
    idx = getattr(self, "layer_idx", None)
    if idx is None or seq < 2:
        return None
    kernel = self.conv.weight.shape[-1]
    if hasattr(cache, "get_conv_state") and hasattr(cache, "update_conv_state"):      # transformers >= 5.2x
        if cache.get_conv_state(idx) is not None:
            return None
        recording = getattr(cache, "is_recording_past", None)
        if recording is not None and recording(idx):
            return None

        def write(bcx):
            tail = bcx[:, -kernel:].detach()
            b, _, x = tail.chunk(3, dim=-1)
            cache.update_conv_state((b * x).transpose(-1, -2), idx, conv_kernel_size=kernel)
        return write
    conv_cache = getattr(cache, "conv_cache", None)                                    # Lfm2HybridConvCache
    cache_position = kwargs.get("cache_position")
    if isinstance(conv_cache, (list, tuple)) and cache_position is not None and int(cache_position[0]) == 0:
        def write_old(bcx):
            b, _, x = bcx[:, -kernel:].detach().chunk(3, dim=-1)
            bx = (b * x).transpose(-1, -2)
            conv_cache[idx].copy_(torch.nn.functional.pad(bx, (kernel - bx.shape[-1], 0)))
        return write_old
    if self.training and torch.is_grad_enabled():
        # a training forward into a cache API this layer does not know (transformers creates one
        # whenever config.use_cache is on): fuse, and leave that cache's conv state unwritten —
        # nobody decodes from a training step's cache; inference prefill keeps the HF path
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
    """Lfm2ShortConv.forward through liger_rt.ops.short_conv; hidden_states (batch, seq, hidden)."""
    positions = kwargs.pop(POSITIONS_KWARG, None)
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    write_state = None
    if cache is not None:
        write_state = _fresh_prefill(self, cache, kwargs, hidden_states.shape[1])
    if args or (cache is not None and write_state is None) or getattr(self.conv, "_hf_hook", None) is not None:
        return original_function(self)(self, hidden_states, *args, **kwargs)

    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None:
        # the module's own masking rule (it changed across transformers releases)
        mask_fn = getattr(sys.modules.get(type(self).__module__), "apply_mask_to_padding_states", None)
        if mask_fn is not None:
            hidden_states = mask_fn(hidden_states, attention_mask)
        elif attention_mask.dim() == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    bcx = self.in_proj(hidden_states)
    batch, seq = bcx.shape[:2]
    seq_idx = _seq_idx(kwargs, positions, batch, seq)
    y = _conv(bcx, self.conv.weight.squeeze(1), self.conv.bias, seq_idx)
    if write_state is not None:
        write_state(bcx)
    return self.out_proj(y)


def _runs_ours(conv) -> bool:
    """The conv module runs short_conv_forward (instance patch, accelerate hook, or class patch)."""
    for fn in (conv.__dict__.get("_old_forward"), conv.__dict__.get("forward"), type(conv).forward):
        fn = getattr(fn, "__func__", fn)
        if fn is not None and (fn is short_conv_forward or getattr(fn, "_liger_rt_function", None) is short_conv_forward):
            return True
    return False


def decoder_layer_forward(self, *args, **kwargs):
    """Lfm2DecoderLayer.forward unchanged, except that a conv layer's conv also receives the
    layer's position_ids (under POSITIONS_KWARG) so packed sequences keep their boundaries.

    It calls the forward it replaced as a function (``original_function``): at instance level that
    is transformers' checkpointing wrapper, still ``type(self).forward``, so gradient checkpointing
    works; at class level the patch wraps this forward in that same wrapper."""
    positions = kwargs.get("position_ids")
    conv = getattr(self, "conv", None)
    if positions is not None and conv is not None and not getattr(self, "is_attention_layer", False) \
            and _runs_ours(conv):
        kwargs[POSITIONS_KWARG] = positions
    return original_function(self)(self, *args, **kwargs)
