"""Causal-LM loss forwards: fused linear cross-entropy (no logits) and a cross-entropy loss function.

``causal_lm_forward`` replaces a ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward when the
patch asks for ``fused_linear_cross_entropy``.  A call that gives labels and does not need logits
runs the base model (``self.model(...)``), then

    loss = liger_rt.ops.fused_linear_cross_entropy(hidden (N, H), lm_head.weight (V, H),
                                                   shifted labels (N,), lm_head.bias,
                                                   ignore_index, reduction)

with HF's ForCausalLMLoss semantics: labels shifted left by one (or ``shift_labels`` as given),
``reduction="sum"`` divided by ``num_items_in_batch`` when the trainer passes it, else the mean
over non-ignored tokens; MoE load-balancing aux loss added as the host adds it.  The output is the
host's own output class with ``logits=None``.

Logits stay materialised (the host's forward runs unchanged) whenever the caller needs them:
no labels, ``return_logits=True`` in the call, ``keep_logits=True`` in the patch, eval mode
(``model.eval()``: evaluation loops read logits; pass ``return_logits=False`` to fuse there too),
``logits_to_keep`` other than 0, a custom loss function, or an lm_head that is not a plain Linear
(LoRA on the head).  RL (log-probs, entropy, KL) calls without labels, so it always gets logits.

``causal_lm_loss`` is a drop-in for HF's ForCausalLMLoss computing the cross-entropy with
liger_rt.ops.cross_entropy on the materialised logits; the ``cross_entropy`` flag installs it as
the model's ``loss_function``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing

import torch
import torch.nn.functional as F

from .. import ops
from .._swaps import original


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """What the patch asked of the causal-LM forward (stored as ``_liger_rt_loss`` on the model or class)."""
    fused_linear_cross_entropy: bool = False
    keep_logits: bool = False


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
                         ignore_index: int = -100, shift_labels=None, **kwargs) -> torch.Tensor:
    """The causal-LM loss from final hidden states (..., H) without materialising logits."""
    target = _shifted_targets(labels, shift_labels, ignore_index).to(hidden.device)
    x = hidden.reshape(-1, hidden.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = ops.fused_linear_cross_entropy(x, lm_head.weight, target, lm_head.bias,
                                          ignore_index=ignore_index, reduction=reduction)
    return _reduce(loss.float(), num_items_in_batch)


# -- the forward ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


@functools.lru_cache(maxsize=None)
def _output_class(fn, module_name: str):
    """The ModelOutput class the host forward returns (its return annotation), or None."""
    from transformers.utils import ModelOutput
    ann = _signature(fn).return_annotation
    if isinstance(ann, str):
        ann = getattr(sys.modules.get(module_name), ann.split("|")[-1].strip(), None)
    candidates = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) else (ann,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, ModelOutput) and dataclasses.is_dataclass(c):
            return c
    return None


def _default_loss(model) -> bool:
    from transformers.loss.loss_utils import LOSS_MAPPING
    fn = model.loss_function
    return fn is LOSS_MAPPING.get("ForCausalLM") or fn is causal_lm_loss


def _fused_plan(self, orig, args, kwargs, return_logits):
    """(bound arguments, var-kwargs) when the fused path can run for this call, else None."""
    opts = getattr(self, "_liger_rt_loss", None)
    if opts is None or not opts.fused_linear_cross_entropy:
        return None
    want_logits = return_logits if return_logits is not None else (opts.keep_logits or not self.training)
    if want_logits:
        return None
    func = getattr(orig, "__func__", None)
    method = func is not None and getattr(orig, "__self__", None) is self
    try:
        # signatures are cached per function, never per bound method (that would keep models alive)
        sig = _signature(func) if method else inspect.signature(orig)
        bound = sig.bind(self, *args, **kwargs) if method else sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    arguments = dict(bound.arguments)
    if method:
        arguments.pop(next(iter(sig.parameters)))
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(arguments.pop(var_kw, {}) or {}) if var_kw else {}
    if arguments.get("labels") is None and extra.get("shift_labels") is None:
        return None
    keep = arguments.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return None
    head = getattr(self, "lm_head", None)
    if type(head) is not torch.nn.Linear or getattr(head, "_hf_hook", None) is not None:
        return None
    if getattr(self, "model", None) is None or not _default_loss(self):
        return None
    return arguments, extra


def causal_lm_forward(self, *args, return_logits: bool | None = None, **kwargs):
    """A *ForCausalLM forward whose loss runs through fused linear cross-entropy when labels are
    given and logits are not needed (see the module docstring for when logits stay)."""
    orig = original(self)
    plan = _fused_plan(self, orig, args, kwargs, return_logits)
    if plan is None:
        return orig(*args, **kwargs)
    arguments, extra = plan
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    labels = arguments.pop("labels", None)
    arguments.pop("logits_to_keep", None)
    outputs = self.model(**arguments, **extra)
    hidden = outputs[0]
    loss = fused_causal_lm_loss(hidden, self.lm_head, labels, **extra)

    out_cls = _output_class(getattr(orig, "__func__", orig), type(self).__module__)
    fields = {f.name for f in dataclasses.fields(out_cls)} if out_cls is not None else set()
    values = {}
    if "aux_loss" in fields and arguments.get("output_router_logits"):
        lb = getattr(sys.modules.get(type(self).__module__), "load_balancing_loss_func", None)
        router_logits = getattr(outputs, "router_logits", None)
        if lb is not None and router_logits is not None:
            aux = lb(router_logits, self.num_experts, self.num_experts_per_tok, arguments.get("attention_mask"))
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
