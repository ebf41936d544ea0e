"""Causal-LM forward for RL (the ``logprobs`` flag): given labels, per-token log-probs and entropy, no logits.

A call with ``labels`` (or ``shift_labels``) runs the base model, then, with HF's causal shift,

    logprobs, entropy = liger_rt.ops.fused_linear_logprobs(hidden (B, S, H), lm_head.weight,
                                                           shifted labels (B, S), lm_head.bias,
                                                           temperature=temperature, return_entropy=True)

and returns a ``CausalLMLogProbsOutput``: ``logprobs`` and ``entropy`` (B, S) fp32, 0 where the shifted
label is -100, ``loss`` and ``logits`` None.  Granite's ``logits_scaling`` s is the op at temperature
s * T; a softcapped head (Gemma 2/3) runs ``softcapped_logprobs`` in torch, a checkpointed chunk of
``SOFTCAP_CHUNK_BYTES`` of fp32 logits at a time.  The host forward runs when the call has no labels,
asks for logits, keeps only some (``logits_to_keep`` != 0), or the lm_head is not a plain Linear; eval
mode and no_grad keep the fused path.  docs/logprobs.md has the details.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from .. import ops
from .._swaps import original_function
from .loss import bind_call


# transformers renamed the output field past_key_values to cache (5.2x); follow the installed one
_CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# HF's CausalLMOutputWithPast fields (loss and logits None) plus logprobs and entropy, (batch, seq) fp32
CausalLMLogProbsOutput = dataclasses.make_dataclass(
    "CausalLMLogProbsOutput",
    [(name, object, dataclasses.field(default=None)) for name in
     ("loss", "logits", "logprobs", "entropy", _CACHE, "hidden_states", "attentions", "router_logits", "aux_loss")],
    bases=(ModelOutput,), namespace={"__module__": __name__})


def _fused_call(self, opts, args, kwargs, return_logits) -> dict | None:
    if opts is None or (return_logits if return_logits is not None else opts.keep_logits):
        return None
    if (split := bind_call(opts, args, kwargs)) is None:
        return None
    named = {**split[0], **split[1]}
    if named.get("labels") is None and named.get("shift_labels") is None:
        return None
    keep = named.get("logits_to_keep", 0)
    head = getattr(self, "lm_head", None)
    if not (isinstance(keep, int) and keep == 0) or type(head) is not torch.nn.Linear \
            or getattr(head, "_hf_hook", None) is not None or getattr(self, "model", None) is None:
        return None
    return named


SOFTCAP_CHUNK_BYTES = 256 << 20        # fp32 logits per chunk of the softcapped (torch) path


def _softcap_chunk(x, weight, bias, target, scale: float, softcap: float, temperature: float, ignore_index: int):
    z = F.linear(x, weight, bias).float() / scale
    z = softcap * torch.tanh(z / softcap) / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    lp = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = lp.new_zeros(())
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def softcapped_logprobs(hidden, lm_head, target, softcap: float, *, scale: float = 1.0, temperature: float = 1.0,
                        ignore_index: int = -100):
    """(lp, entropy), fp32 of target's shape, of z = c * tanh(lm_head(hidden) / s / c) / T, in torch a
    checkpointed chunk of token rows at a time."""
    if not (temperature > 0.0 and softcap > 0.0 and scale > 0.0):
        raise ValueError(f"softcapped log-probs need temperature, softcap and logits_scaling > 0; got {temperature}, "
                         f"{softcap}, {scale}")
    x, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    rows = max(1, SOFTCAP_CHUNK_BYTES // (4 * lm_head.weight.shape[0]))
    grad = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in (x, lm_head.weight, lm_head.bias))
    parts = []
    for s in range(0, x.shape[0], rows):
        args = (x[s:s + rows], lm_head.weight, lm_head.bias, t[s:s + rows], scale, softcap, temperature, ignore_index)
        parts.append(torch.utils.checkpoint.checkpoint(_softcap_chunk, *args, use_reentrant=False) if grad
                     else _softcap_chunk(*args))
    if not parts:
        return (hidden.new_zeros(target.shape, dtype=torch.float32),) * 2
    return tuple(torch.cat(p).view(target.shape) for p in zip(*parts))


def _head_logprobs(self, hidden, target, temperature: float):
    scale = float(getattr(self.config, "logits_scaling", None) or 1.0)
    cap = getattr(self.config, "final_logit_softcapping", None)
    if cap is not None:
        return softcapped_logprobs(hidden, self.lm_head, target, float(cap), scale=scale, temperature=temperature)
    return ops.fused_linear_logprobs(hidden, self.lm_head.weight, target, self.lm_head.bias,
                                     temperature=temperature * scale, ignore_index=-100, return_entropy=True)


def causal_lm_logprobs_forward(self, *args, return_logits: bool | None = None, temperature: float = 1.0,
                               **kwargs):
    """A *ForCausalLM forward returning per-token log-probs and entropy (module docstring)."""
    opts = getattr(self, "_liger_rt_logprobs", None)
    named = _fused_call(self, opts, args, kwargs, return_logits)
    if named is None:
        return original_function(self)(self, *args, **kwargs)
    labels, shift_labels = named.pop("labels", None), named.pop("shift_labels", None)
    named.pop("logits_to_keep", None)
    named.pop("num_items_in_batch", None)
    if (return_dict := named.pop("return_dict", None)) is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = self.model(**named)
    hidden = outputs[0]
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    logprobs, entropy = _head_logprobs(self, hidden, shift_labels.to(hidden.device), temperature)
    values = {name: getattr(outputs, name, None) for name in (_CACHE, "hidden_states", "attentions", "router_logits")}
    if named.get("output_router_logits") and values["router_logits"] is not None \
            and opts.load_balancing_loss is not None:
        values["aux_loss"] = opts.load_balancing_loss(values["router_logits"], self.num_experts,
                                                      self.num_experts_per_tok, named.get("attention_mask"))
    out = CausalLMLogProbsOutput(logprobs=logprobs, entropy=entropy, **values)
    return out if return_dict else out.to_tuple()
