"""Decoder-layer forwards with the residual add fused into the post-attention norm (the ``fused_add_norm`` flag).

The Llama-shaped decoder layer (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, SmolLM3, Gemma)::

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, <the layer's other arguments>)
    hidden_states = residual + hidden_states                          # \\
    residual = hidden_states                                          #  > one liger_rt.ops.fused_add_rms_norm
    hidden_states = self.post_attention_layernorm(hidden_states)      # /
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states

The norm's weight and eps are read from ``post_attention_layernorm`` (its own forward, patched or not, is not
called).  The next layer's input norm stays unfused: fusing it would change what a decoder layer returns (the
hidden states the model records and the checkpointed layer's output).
"""
from __future__ import annotations

import functools
import inspect

import torch

from .. import ops
from .._swaps import original_function
from .norms import module_eps

_SUBMODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _attn_kwargs(self, args: tuple, kwargs: dict) -> dict:
    """The layer's arguments after hidden_states as keywords, what the host passes on to self_attn (positional
    ones named by the host forward's signature: the model loops pass keywords, so this is the rare path)."""
    if not args:
        return kwargs
    sig = inspect.signature(original_function(self))
    out: dict = {}
    for name, value in list(sig.bind(self, None, *args, **kwargs).arguments.items())[2:]:
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _layer(self, offset: float, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **_attn_kwargs(self, args, kwargs))
    norm = self.post_attention_layernorm
    normed, residual = ops.fused_add_rms_norm(hidden_states, residual, norm.weight, eps=module_eps(norm),
                                              offset=offset)
    if offset and normed.dtype != residual.dtype:     # the (1 + w) norms return x's dtype
        normed = normed.to(residual.dtype)
    hidden_states = self.mlp(normed)
    return residual + hidden_states


def _forward(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict, offset: float) -> torch.Tensor:
    # An instance forward replaces the class's, and with it transformers' checkpointing wrapper
    # (GradientCheckpointingLayer.__init_subclass__): checkpoint here as it does, around the layer itself (so the
    # recomputation does not checkpoint again), the cache off.  A class-level patch is inside that wrapper already.
    instance = "forward" in self.__dict__ or "_old_forward" in self.__dict__
    if instance and getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            kwargs.update({k: None for k in ("cache", "layer_past") if kwargs.get(k) is not None})
        return self._gradient_checkpointing_func(functools.partial(_layer, self, offset, **kwargs),
                                                 hidden_states, *args)
    return _layer(self, offset, hidden_states, *args, **kwargs)


def decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """A Llama-shaped decoder layer's forward, its residual add and post-attention RMSNorm in one op."""
    return _forward(self, hidden_states, args, kwargs, 0.0)


def offset_decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """decoder_layer_forward for (1 + w) post-attention norms (Gemma)."""
    return _forward(self, hidden_states, args, kwargs, 1.0)


def fusable(module) -> str | None:
    """None when a decoder layer has the submodules the fused forward calls and an RMSNorm-style
    post_attention_layernorm (a 1-D weight and an eps), else why it is left alone."""
    if missing := [name for name in _SUBMODULES if not isinstance(getattr(module, name, None), torch.nn.Module)]:
        return f"no {', '.join(missing)} submodule(s)"
    norm = module.post_attention_layernorm
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        return f"post_attention_layernorm ({type(norm).__name__}) has no RMSNorm weight"
    if getattr(norm, "variance_epsilon", getattr(norm, "eps", None)) is None:
        return f"post_attention_layernorm ({type(norm).__name__}) has no eps"
    return None
