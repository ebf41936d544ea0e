"""Causal-LM loss forwards: fused linear cross-entropy (no logits) and a cross-entropy loss function.

``causal_lm_forward`` (the ``fused_linear_cross_entropy`` flag), given labels and no need of logits, runs
the base model (with no KV cache unless asked for one), then

    loss = liger_rt.ops.fused_linear_cross_entropy(hidden (N, H), lm_head.weight (V, H),
                                                   shifted labels (N,), lm_head.bias, ignore_index, reduction)

with HF's ForCausalLMLoss semantics, returning the host's output class with ``logits=None``.
``causal_lm_loss`` is ForCausalLMLoss through liger_rt.ops.cross_entropy (the ``cross_entropy`` flag).
docs/patching.md ("Loss forwards") says when the host forward runs instead.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import typing

import torch
import torch.nn.functional as F

from .. import ops
from . import attention
from .._swaps import original_function


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The patch's options and what it read of the host forward (``_liger_rt_loss`` on the model or class)."""
    keep_logits: bool = False
    parameters: tuple[str, ...] = ()        # the host forward's named parameters (no self), positional first
    positional: int = 0                     # how many of them a call may pass by position
    var_keyword: bool = True                # it takes **kwargs
    output_class: type | None = None        # the ModelOutput class it returns
    output_fields: tuple[str, ...] = ()
    load_balancing_loss: typing.Callable | None = None    # its modeling module's MoE aux loss, if any


def _shifted_targets(labels, shift_labels, ignore_index: int) -> torch.Tensor:
    if shift_labels is None:
        # pad-then-shift like ForCausalLMLoss: the last position of each row is ignored
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _reduce(loss_sum_or_mean: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss_sum_or_mean
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum_or_mean.device)
    return loss_sum_or_mean / num_items_in_batch


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, **kwargs) -> torch.Tensor:
    """ForCausalLMLoss through liger_rt.ops.cross_entropy; logits (..., vocab), labels (...)."""
    target = _shifted_targets(labels, shift_labels, ignore_index)
    logits = logits.reshape(-1, vocab_size)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = ops.cross_entropy(logits, target.to(logits.device), ignore_index=ignore_index, reduction=reduction)
    return _reduce(loss.float(), num_items_in_batch)


def fused_causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels, num_items_in_batch=None,
                         ignore_index: int = -100, shift_labels=None, softcap: float | None = None,
                         logits_scaling: float | None = None, **kwargs) -> torch.Tensor:
    """The causal-LM loss of logits lm_head(hidden (..., H)) / logits_scaling, then softcap * tanh(. / softcap),
    never materialised."""
    target = _shifted_targets(labels, shift_labels, ignore_index).to(hidden.device)
    x = hidden.reshape(-1, hidden.shape[-1])
    if logits_scaling is not None:      # (x / s) W^T = (x W^T) / s: a bias-free head only (head_transform)
        x = x / logits_scaling
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = ops.fused_linear_cross_entropy(x, lm_head.weight, target, lm_head.bias,
                                          ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    return _reduce(loss.float(), num_items_in_batch)


def head_transform(config, lm_head) -> dict | None:
    """What the host does to lm_head's output, as fused_causal_lm_loss arguments (Gemma 2/3's softcap,
    Granite's logits_scaling); None when a scaled head has a bias (the host forward runs then)."""
    out = {}
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
        out["softcap"] = float(cap)
    scale = getattr(config, "logits_scaling", None)
    if scale is not None and float(scale) != 1.0:
        if lm_head.bias is not None:
            return None
        out["logits_scaling"] = float(scale)
    return out


# -- the forward ------------------------------------------------------------------------------------

def _output_class(sig: inspect.Signature, module_name: str):
    from transformers.utils import ModelOutput
    ann = sig.return_annotation
    if isinstance(ann, str):
        ann = getattr(sys.modules.get(module_name), ann.split("|")[-1].strip(), None)
    candidates = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) else (ann,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, ModelOutput)
                 and dataclasses.is_dataclass(c)), None)


def loss_options(sig: inspect.Signature, module_name: str, *, keep_logits: bool = False,
                 has_self: bool = False) -> LossOptions:
    """LossOptions for a host forward of signature ``sig`` defined in ``module_name``, read at patch time
    so the forward itself never inspects."""
    params = list(sig.parameters.values())[1 if has_self else 0:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    out_cls = _output_class(sig, module_name)
    return LossOptions(keep_logits, tuple(positional + keyword), len(positional),
                       any(p.kind is p.VAR_KEYWORD for p in params), out_cls,
                       tuple(f.name for f in dataclasses.fields(out_cls)) if out_cls is not None else (),
                       getattr(sys.modules.get(module_name), "load_balancing_loss_func", None))


def _default_loss(model) -> bool:
    from transformers.loss.loss_utils import LOSS_MAPPING
    fn = model.loss_function
    return fn is LOSS_MAPPING.get("ForCausalLM") or fn is causal_lm_loss


def bind_call(opts: LossOptions, args: tuple, kwargs: dict):
    """(named arguments, **kwargs extras) of a call as the host forward binds them; None when the
    call would not bind (the host forward then runs, and raises its own error)."""
    if len(args) > opts.positional or any(k in kwargs for k in opts.parameters[:len(args)]):
        return None
    if not opts.var_keyword and any(k not in opts.parameters for k in kwargs):
        return None
    arguments = {**dict(zip(opts.parameters, args)), **{k: v for k, v in kwargs.items() if k in opts.parameters}}
    return arguments, {k: v for k, v in kwargs.items() if k not in opts.parameters}


def _fused_plan(self, opts, args, kwargs, return_logits):
    if opts is None:
        return None
    want_logits = return_logits if return_logits is not None else (opts.keep_logits or not self.training)
    if want_logits or (split := bind_call(opts, args, kwargs)) is None:
        return None
    arguments, extra = split
    keep = arguments.get("logits_to_keep", 0)
    no_labels = arguments.get("labels") is None and extra.get("shift_labels") is None
    if no_labels or not (isinstance(keep, int) and keep == 0):
        return None
    head = getattr(self, "lm_head", None)
    if type(head) is not torch.nn.Linear or getattr(head, "_hf_hook", None) is not None:
        return None
    if getattr(self, "model", None) is None or not _default_loss(self) or head_transform(self.config, head) is None:
        return None
    return arguments, extra


def causal_lm_forward(self, *args, return_logits: bool | None = None, **kwargs):
    """A *ForCausalLM forward whose loss runs through fused linear cross-entropy (module docstring)."""
    opts = getattr(self, "_liger_rt_loss", None)
    if (plan := _fused_plan(self, opts, args, kwargs, return_logits)) is None:
        return original_function(self)(self, *args, **kwargs)
    arguments, extra = plan
    if (return_dict := extra.pop("return_dict", None)) is None:
        return_dict = getattr(self.config, "return_dict", True)
    labels = arguments.pop("labels", None)
    arguments.pop("logits_to_keep", None)
    # no logits come back, so a KV cache would only hold memory; without one transformers looks for
    # packed sequences in the positions, which the causal_mask flag answers when the model makes them
    # (a cache passed in: cache, or past_key_values before transformers renamed it)
    no_cache = ("use_cache" in opts.parameters and arguments.get("use_cache") is None
                and arguments.get("position_ids") is None
                and all(d.get(k) is None for d in (arguments, extra) for k in ("cache", "past_key_values"))
                and attention.own_positions_rule_held())
    if no_cache:
        arguments["use_cache"] = False
        attention.enter_own_positions()
    try:
        outputs = self.model(**arguments, **extra)
    finally:
        if no_cache:
            attention.leave_own_positions()
    hidden = outputs[0]
    loss = fused_causal_lm_loss(hidden, self.lm_head, labels, **head_transform(self.config, self.lm_head), **extra)

    out_cls, fields = opts.output_class, set(opts.output_fields)
    values = {}
    if "aux_loss" in fields and arguments.get("output_router_logits"):
        router_logits = getattr(outputs, "router_logits", None)
        if opts.load_balancing_loss is not None and router_logits is not None:
            aux = opts.load_balancing_loss(router_logits, self.num_experts, self.num_experts_per_tok,
                                           arguments.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            values["aux_loss"] = aux
    if out_cls is None:
        from transformers.modeling_outputs import CausalLMOutputWithPast
        out_cls, fields = CausalLMOutputWithPast, {"past_key_values", "hidden_states", "attentions"}
    for name in fields - {"loss", "logits", "aux_loss"}:
        value = getattr(outputs, name, None) if not isinstance(outputs, tuple) else None
        if value is not None:
            values[name] = value
    out = out_cls(loss=loss, logits=None, **values)
    return out if return_dict else out.to_tuple()
