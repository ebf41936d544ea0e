"""liger_rt in the training stacks: a Trainer callback and an Auto-class loader (docs/integrations.md).

    from liger_rt.integrations import AutoLigerRTModelForCausalLM, LigerRTCallback
    model = AutoLigerRTModelForCausalLM.from_pretrained(path, fused_linear_cross_entropy=True)  # loads, patches
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[LigerRTCallback(fused_linear_cross_entropy=True)])           # or patch here

Both patch at instance level.  TRL's trainers put their own fused LM head on the model
(``trl.trainer.utils.add_fused_lm_head``), which computes the loss, log-probs and entropy in chunks without
logits, so liger_rt's loss flags cannot replace the model's forward there.  Given a loss flag under a TRL
trainer, the callback leaves the flag off and, when training starts, puts liger_rt's log-probs head in TRL's
per-token entry point instead (``TRLLogProbHead``): TRL's head then runs liger_rt.ops.fused_linear_logprobs, with
TRL's masking, temperature and logit scale.  Where the trainer asks its head for more than log-probs, entropy and
the mean logit (the top-1 metric of SFT and DPO), TRL's head stays for every call, policy and reference alike,
and the callback says why once (``ShadowWarning``), as it warns for Liger-Kernel (``use_liger_kernel``) and hub
kernels (``use_kernels``).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from . import _swaps
from .patch import core, specs


class ShadowWarning(UserWarning):
    """Another part of the training stack replaces what a liger_rt patch would run."""


# -- detection -------------------------------------------------------------------------------------------

def _trl_head_function(fn):
    """TRL's fused-head forward (the function), found down fn's ``__wrapped__`` chain, or None."""
    for _ in range(8):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        if "fused_lm_head" in code.co_varnames and fn.__globals__.get("__name__", "").startswith("trl."):
            return fn
        fn = getattr(fn, "__wrapped__", None)
    return None


def _trl_head_candidates(model) -> list:
    root = core.unwrap(model)
    candidates = [root.__dict__.get("forward"), root.__dict__.get("_original_forward")]
    if "forward" in root.__dict__:
        candidates.append(core.original(root))
    return candidates


def trl_fused_head(model) -> bool:
    """Whether TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) is on the model: as its forward,
    inside a ``functools.wraps`` wrapper of it, or as the forward a liger_rt patch replaced."""
    return any(_trl_head_function(fn) is not None for fn in _trl_head_candidates(model))


def _trl_head_fields(model) -> tuple | None:
    """The per-token fields TRL's fused head on `model` asks its kernel for (add_fused_lm_head's `outputs`, which
    its forward closes over), or None where no such head or closure is found."""
    for fn in map(_trl_head_function, _trl_head_candidates(model)):
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())) if fn is not None else {}
        if "outputs" in cells:
            return tuple(cells["outputs"].cell_contents)
    return None


def _loss_over_trl_head(model) -> list[str]:
    # the liger_rt loss flags patched *over* TRL's head (after the TRL trainer was built)
    root = core.unwrap(model)
    info = core.describe(root) or {}
    flags = [f for f in ("fused_linear_cross_entropy", "logprobs") if (info.get("flags") or {}).get(f)]
    return flags if flags and info.get("level") == "instance" and _trl_head_function(core.original(root)) else []


# the TRL configs whose trainers add the fused head (TRL 1.16); at on_init_end it is not there yet
_TRL_FUSED_HEAD_CONFIGS = {"SFTConfig", "GRPOConfig", "DPOConfig", "KTOConfig", "RLOOConfig"}


def _is_trl(args) -> bool:
    return any(c.__module__.startswith("trl.") and c.__name__ in _TRL_FUSED_HEAD_CONFIGS for c in type(args).__mro__)


def _loss_flags(model, wanted=()) -> list[str]:
    flags = (core.describe(model) or {}).get("flags") or {}
    return sorted({f for f in specs.LOSS_FLAGS if flags.get(f) or f in wanted})


def _trl_shadow(model, args, wanted=()) -> str | None:
    """Why liger_rt's loss flags do not run under TRL's fused head, or None (no such flag, head or trainer, or
    liger_rt's head holds TRL's entry point for this model)."""
    loss, head = _loss_flags(model, wanted), trl_fused_head(model)
    if not loss or not (head or _is_trl(args)) or trl_head(model) == "liger_rt":
        return None
    later = "" if head else " when training starts"
    instead = _why_not_liger_rt_head(model) or f"LigerRTCallback puts its log-probs head there{later}"
    return (f"TRL's fused LM head computes the training loss and log-probs itself, so liger_rt's {', '.join(loss)} "
            f"does not run in the TRL trainer's training steps (liger_rt's layer kernels still do; {instead}); "
            f"leave {', '.join(f + '=False' for f in loss)} to silence this")


def shadows(model, args=None, wanted=()) -> list[str]:
    """Why parts of a liger_rt patch of `model` (the flags in force, plus `wanted`) would not run under
    TrainingArguments `args` (or None): one message per cause."""
    out = [message for message in [_trl_shadow(model, args, wanted)] if message]
    if args is not None and getattr(args, "use_liger_kernel", False):
        out.append("TrainingArguments(use_liger_kernel=True) applies Liger-Kernel to the same layers when "
                   "training starts, replacing liger_rt's forwards where both apply; use one of them")
    if getattr(core.unwrap(model), "_use_kernels", False):
        out.append("the model runs transformers' hub kernels (use_kernels=True / kernelize), which replace the "
                   "same layer forwards as liger_rt; load without use_kernels to run liger_rt")
    return out


# -- liger_rt's log-probs head in TRL's place ------------------------------------------------------------

_TRL_MODULE, _TRL_ENTRY = "trl.trainer.utils", "_ChunkedLogProbFunction"     # where TRL's head calls its kernel
_OURS = {"log_probs", "entropy", "mean_logits"}     # what liger_rt's head computes of TRL's per-token fields
# the arguments TRL 1.16's fused head passes its kernel (ChunkedLogProbFunction.forward, less ctx)
_TRL_ARGS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
             "logit_scale", "outputs")
_trl_warned: set[str] = set()


def _why_not_liger_rt_head(model) -> str | None:
    """None when liger_rt's head can take TRL's per-token entry point for `model`, else why not."""
    if not hasattr(importlib.import_module(_TRL_MODULE), _TRL_ENTRY):
        return f"TRL {importlib.metadata.version('trl')} has no {_TRL_MODULE}.{_TRL_ENTRY} for liger_rt's head to take"
    takes = tuple(inspect.signature(_trl_function().forward).parameters)[1:]      # less ctx
    if takes != _TRL_ARGS:
        return (f"TRL {importlib.metadata.version('trl')}'s {_TRL_ENTRY} takes ({', '.join(takes)}), "
                f"not the ({', '.join(_TRL_ARGS)}) liger_rt's head takes")
    if core.instance_record(model) is None:
        return "only an instance patch (liger_rt.patch(model)) can hold liger_rt's head in TRL's place"
    if extra := sorted(set(_trl_head_fields(model) or ()) - _OURS):
        return (f"this trainer asks TRL's head for {', '.join(extra)}, which liger_rt's head does not compute, so "
                f"TRL's head scores every call, the reference model's too (one head for policy and reference)")
    return None


def _trl_function():
    """What TRL's head calls when liger_rt's head is not in its place."""
    swap = _swaps.LEDGER.get((sys.modules.get(_TRL_MODULE), _TRL_ENTRY))
    return swap.original if swap is not None else getattr(importlib.import_module(_TRL_MODULE), _TRL_ENTRY)


class TRLLogProbHead:
    """Stands for ``trl.kernels.ChunkedLogProbFunction`` where TRL's fused LM head calls it, with its arguments:
    hidden (N, H), weight (V, H), bias, targets (N,), temperature, TRL's tile width, final_logit_softcapping,
    logit_scale, the requested fields.  log-probs and entropy come from liger_rt.ops.fused_linear_logprobs at
    temperature / logit_scale (TRL's z = logits * logit_scale / temperature), the mean logit (no gradient, as
    TRL's) from the mean weight row: mean_v z_v = (h . mean_v W_v + mean_v b_v) * logit_scale / temperature.  A
    call asking for another field (log_sum_sq_probs, is_top1), a softcap or a scale <= 0 runs TRL's function, and
    says so once."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        extra = sorted(set(outputs) - _OURS)
        why = (f"asks for {', '.join(extra)}" if extra else
               f"softcaps its logits (final_logit_softcapping={final_logit_softcapping})"
               if final_logit_softcapping is not None else
               f"scales its logits by {logit_scale}" if not logit_scale > 0 else None)
        if why is not None:
            message = (f"TRL's fused LM head {why}, which liger_rt's log-probs head does not compute: TRL's own "
                       f"head runs these calls")
            if message not in _trl_warned:
                _trl_warned.add(message)
                warnings.warn(message, ShadowWarning, stacklevel=2)
            return _trl_function().apply(hidden, weight, bias, targets, temperature, chunk_size,
                                         final_logit_softcapping, logit_scale, outputs)
        from . import ops         # import time: liger_rt.ops imports triton
        lp, entropy = ops.fused_linear_logprobs(hidden, weight, targets, bias, temperature=temperature / logit_scale,
                                                return_entropy=True)
        mean = None
        if "mean_logits" in outputs:
            with torch.no_grad():
                w_mean = torch.mean(weight, 0, dtype=torch.float32)
                mean = hidden.to(torch.float32) @ w_mean
                mean = (mean if bias is None else mean + bias.to(torch.float32).mean()) * (logit_scale / temperature)
        return lp, (entropy if "entropy" in outputs else None), None, mean, None


def trl_head(model) -> str | None:
    """Which head TRL's fused LM head runs for `model`: "liger_rt" where LigerRTCallback put TRLLogProbHead in
    its place for this model, else "trl" once TRL's head is on the model, else None."""
    record = core.instance_record(model)
    entry = sys.modules.get(_TRL_MODULE)
    if record is not None and entry is not None and (entry, _TRL_ENTRY) in record.function_keys:
        return "liger_rt"
    return "trl" if trl_fused_head(model) else None


def use_liger_rt_head_in_trl(model) -> str | None:
    """Put TRLLogProbHead in TRL's per-token entry point, held by `model`'s liger_rt patch (released by
    liger_rt.unpatch(model) or when the model is gone); None, or why it cannot."""
    if (why := _why_not_liger_rt_head(model)) is not None:
        return why
    entry = (sys.modules[_TRL_MODULE], _TRL_ENTRY, TRLLogProbHead)
    core.instance_record(model).hold_functions(core.unwrap(model), [entry])
    return None


# -- Trainer callback ------------------------------------------------------------------------------------

class LigerRTCallback(TrainerCallback):
    """Patches the Trainer's model with ``liger_rt.patch(model, **layers)`` when the Trainer is built, and
    when training starts if the model has no liger_rt patch by then (``model_init``)."""

    def __init__(self, **layers):
        self.layers = dict(layers)
        self._warned: set[str] = set()

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._apply(args, model)

    on_train_begin = on_init_end

    def _apply(self, args, model) -> None:
        # TRL's trainers add their fused head after on_init_end: liger_rt's head goes in its place (or the warning
        # says why not) once the head, and the fields it asks for, are on the model, at on_train_begin
        if model is None:
            return
        wanted = [f for f in specs.LOSS_FLAGS if self.layers.get(f)]
        if over := _loss_over_trl_head(model):
            raise ValueError(f"liger_rt's {', '.join(over)} was patched over TRL's fused LM head (liger_rt.patch "
                             f"after the TRL trainer was built), so TRL's training step would not get its "
                             f"log-probs; patch before building the trainer, or pass {over[0]}=False")
        head = trl_fused_head(model)
        trl = _is_trl(args) or head
        if core.describe(model) is None:
            layers = dict(self.layers)
            if trl:
                layers.update({f: False for f in wanted})
            core.patch(model, **layers)
        if head and _loss_flags(model, wanted):
            use_liger_rt_head_in_trl(model)      # where it cannot, shadows() below says why
        deferred = None if head else _trl_shadow(model, args, wanted)    # to on_train_begin
        for message in shadows(model, args, wanted):
            if message == deferred:
                continue
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, ShadowWarning, stacklevel=2)


# -- loader ----------------------------------------------------------------------------------------------

_ALL_FLAGS = frozenset(f for spec in specs.SPECS.values() for f in specs.flags(spec))
_CONFIG_KWARGS = ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only", "subfolder")


class AutoLigerRTModelForCausalLM:
    """``AutoModelForCausalLM`` that patches what it loads: keyword arguments that are liger_rt flags go to
    ``liger_rt.patch`` (checked before the weights load), the rest to transformers."""

    def __init__(self):
        raise TypeError("AutoLigerRTModelForCausalLM is built with from_pretrained(...) or from_config(...)")

    @staticmethod
    def _layers(config, kwargs: dict) -> dict:
        layers = {k: kwargs.pop(k) for k in list(kwargs) if k in _ALL_FLAGS}
        core.check_flags(config.model_type, layers)
        return layers

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> torch.nn.Module:
        config = kwargs.get("config")
        if not hasattr(config, "model_type"):
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path,
                                                **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
        layers = cls._layers(config, kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return core.patch(model, **layers)

    @classmethod
    def from_config(cls, config, **kwargs) -> torch.nn.Module:
        layers = cls._layers(config, kwargs)
        return core.patch(AutoModelForCausalLM.from_config(config, **kwargs), **layers)
