"""The patch mechanism behind ``liger_rt.patch`` / ``unpatch`` / ``patched``; specs.py holds the tables,
docs/patching.md the semantics.

Instance patching binds the layer forward as a plain method (``_swaps.bound_forward``) on every module
whose class is a spec row; class-level patching replaces ``Cls.forward``.  Both record what they replaced
in the swap ledger (liger_rt/_swaps.py), which the layer forwards read, so liger_rt.layers never imports
liger_rt.patch.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import inspect
import sys
import warnings
import weakref
from typing import Any

import torch

from .. import _swaps
from ..registry import REGISTRY
from .._swaps import ORIG_KEY as _ORIG_KEY, original
from . import specs
from .warning import PatchWarning

_RECORD_KEY = "_liger_rt_patch"           # root module attribute: the InstanceRecord


# -- flags, specs, classes -----------------------------------------------------------------------------

def supported_models() -> list[str]:
    """The validated allowlist, less the families this checkout or transformers cannot patch (specs.unavailable)."""
    return [m for m in specs.ALLOWLIST if specs.unavailable(m) is None]


def _spec(model_type: str) -> specs.ModelSpec:
    allowed = supported_models()
    if model_type not in allowed:
        why = f" ({specs.unavailable(model_type)})" if specs.unavailable(model_type) else ""
        raise ValueError(f"liger_rt.patch does not support model type {model_type!r}{why}; "
                         f"supported: {', '.join(allowed)}")
    return specs.SPECS[model_type]


def _flags(spec: specs.ModelSpec, given: dict[str, Any]) -> dict[str, bool]:
    valid, defaults = specs.flags(spec), spec.defaults | specs.COMMON_DEFAULTS
    if unknown := [k for k in given if k not in valid]:
        raise ValueError(f"unknown flag(s) {', '.join(map(repr, unknown))} for {spec.model_type}; "
                         f"valid flags: {', '.join(valid)} (defaults on: {', '.join(sorted(defaults))})")
    out = {f: f in defaults for f in valid}
    for k, v in given.items():
        if not (isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))):
            raise TypeError(f"flag {k}={v!r}: flags are booleans (True/False)")
        out[k] = bool(v)
    if out["rope"] and not specs.has_rope(spec):
        with_rope = [m for m in specs.ALLOWLIST if specs.has_rope(specs.SPECS[m])]
        raise NotImplementedError(f"rope=True is not supported for {spec.model_type}: its RoPE stays with the host "
                                  f"model; omit rope or pass rope=False (rope=True works for {', '.join(with_rope)})")
    if out["logprobs"] and out["fused_linear_cross_entropy"]:
        raise ValueError("logprobs=True and fused_linear_cross_entropy=True both replace the causal LM's forward; "
                         "pass one of them (logprobs for RL log-probs/entropy, fused_linear_cross_entropy for a loss)")
    return out


def check_flags(model_type: str, given: dict[str, Any]) -> dict[str, bool]:
    """Every flag of the family, as ``patch(model_type, **given)`` would take them (raises as it would)."""
    return _flags(_spec(model_type), given)


def _modeling_module(name: str, model_type: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        import transformers
        raise ImportError(f"transformers {transformers.__version__} has no {name} (model type {model_type!r}); "
                          f"upgrade it: pip install -U transformers") from exc


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _op_missing(op: str | None) -> str | None:
    if op is None:
        return None
    name = REGISTRY.module(op)
    return None if hasattr(importlib.import_module(name), op) else f"{name} has no function {op}"


@dataclasses.dataclass
class _Plan:
    model_type: str
    flags: dict[str, bool]
    given: dict[str, bool]
    layers: list[tuple[type, specs.Layer, Any]]       # (class, row, forward function)
    causal_lm: list[type]
    # (module, name, our function, row): module-wide function swaps
    functions: list[tuple[Any, str, Any, specs.Layer]] = dataclasses.field(default_factory=list)
    keys: list = dataclasses.field(default_factory=list)      # class level: the swaps it holds (_CLASS_RECORDS)

    def class_names(self) -> list[str]:
        """The classes a class-level patch swaps, and the module functions that run an op."""
        loss_on = any(self.flags[f] for f in specs.LOSS_FLAGS)
        return sorted({cls.__name__ for cls, _, _ in self.layers} | {c.__name__ for c in self.causal_lm if loss_on}
                      | {name for _, name, _, row in self.functions if row.op is not None})


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside liger_rt.patch (the user's patch() call), for warnings."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("liger_rt.patch"):
        frame, level = frame.f_back, level + 1
    return level


def _refuse(flag: str, reason: str, explicit: set[str], model_type: str, exc=ImportError) -> None:
    msg = f"liger_rt.patch({model_type!r}): {flag} cannot be patched: {reason}"
    if flag in explicit:
        raise exc(msg)
    warnings.warn(msg + f"; it stays on the host path (pass {flag}=False to silence this)", PatchWarning,
                  stacklevel=_user_stacklevel())


_TRITON_WARNED: list[bool] = []


def _warn_without_triton() -> None:
    """One warning per process where Triton cannot be imported: the patch holds, every op runs PyTorch."""
    from .. import _triton     # import time: it imports triton
    if not _triton.available() and not _TRITON_WARNED:
        _TRITON_WARNED.append(True)
        warnings.warn(f"liger_rt: {_triton.reason()}", PatchWarning, stacklevel=_user_stacklevel())


def _plan(model_type: str, given: dict[str, Any], *, for_class: bool) -> _Plan:
    spec = _spec(model_type)
    flags = _flags(spec, given)
    explicit = {k for k, v in given.items() if v}
    import transformers
    lm_module = _modeling_module(spec.module, model_type)
    layers: list = []
    dropped: set[str] = set()
    for module_name, class_name, row in specs.rows(spec):
        if not flags[row.flag] or row.flag in dropped:
            continue
        if for_class and not row.class_level:
            _refuse(row.flag, f"it patches {module_name}.{class_name} instances inside {row.within} only; "
                              f"patch the loaded model instead: liger_rt.patch(model, {row.flag}=True)",
                    explicit, model_type, NotImplementedError)
            continue
        cls = getattr(_modeling_module(module_name, model_type), class_name, None)
        if not isinstance(cls, type):
            reason = (f"transformers {transformers.__version__} has no {module_name}.{class_name}; "
                      f"pip install -U transformers")
        elif row.experts:
            reason = specs.experts_interface_missing() or _op_missing(row.op)
            if reason is None:
                # import time: liger_rt.layers imports triton (through liger_rt.ops)
                from ..layers.moe_experts_interface import register_experts_interface
                register_experts_interface()
        else:
            reason = _op_missing(row.op)
        if reason is not None:
            _refuse(row.flag, reason, explicit, model_type)
            dropped.add(row.flag)
            continue
        layers.append((cls, row, _load(row.forward)))
    layers = [entry for entry in layers if entry[1].flag not in dropped]
    for flag, op in specs.LOSS_OPS.items():
        if flags[flag] and (reason := _op_missing(op)) is not None:
            _refuse(flag, reason, explicit, model_type)
            flags[flag] = False
    functions = []
    for module_name, fn_name, row in specs.function_rows(spec):
        if not flags[row.flag]:
            continue
        mod = _modeling_module(module_name, model_type)
        reason = _op_missing(row.op) if callable(getattr(mod, fn_name, None)) else (
            f"transformers {transformers.__version__} has no {module_name}.{fn_name}")
        if reason is not None:
            _refuse(row.flag, reason, explicit, model_type)
            flags[row.flag] = False
            continue
        functions.append((mod, fn_name, _load(row.forward), row))
    causal_lm = [c for c in (getattr(lm_module, n, None) for n in spec.causal_lm) if isinstance(c, type)]
    return _Plan(model_type, flags, {k: bool(v) for k, v in given.items()}, layers, causal_lm, functions)


def _key(cls: type) -> tuple[str, str]:
    # robust to a reloaded modeling module, and never a same-named class from remote code
    return cls.__module__, cls.__qualname__


# -- instance patching ------------------------------------------------------------------------------

@dataclasses.dataclass
class InstanceRecord:
    model_type: str
    flags: dict[str, bool]
    given: dict[str, bool]
    counts: dict[str, int] = dataclasses.field(default_factory=collections.Counter)   # per flag: modules on an op
    modules: dict[str, int] = dataclasses.field(default_factory=collections.Counter)  # per class: modules rebound
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    saved: list[tuple[Any, str, bool, Any]] = dataclasses.field(default_factory=list)    # (obj, attr, had own, old)
    bound: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)         # (module, attr, layer fn)
    config_saved: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)
    function_keys: list = dataclasses.field(default_factory=list)       # module-wide swaps this patch holds
    finalizer: Any = None                                               # releases them if the model dies patched
    root: Any = None                                                    # weakref to the patched model

    def hold_functions(self, root, swaps) -> None:
        """Hold module-wide swaps [(module, name, function)] for `root` until unpatch or its death."""
        self.root, holder = weakref.ref(root), f"instance:{id(root)}"
        for mod, fn_name, fn in swaps:
            if (mod, fn_name) not in self.function_keys:
                _swaps.hold(mod, fn_name, fn, holder, self.function_keys)
        if self.finalizer is not None:          # a later hold (integrations): one finalizer for all of them
            self.finalizer.detach()
        if self.function_keys:
            self.finalizer = weakref.finalize(root, _swaps.release, list(self.function_keys), holder)

    # pickle and deepcopy: a copy of a patched model is patched to itself, holding the module-wide
    # swaps on its own account (they travel as (module name, attribute, function)).  A bound method
    # pickles as getattr(module, "forward"), which on load finds the class forward: __setstate__ binds
    # the layer forwards again.  The submodules are loaded by then; the root is not, so the record comes
    # before the root's bound forwards in its __dict__ (_patch_instance), and their getattr finds them.
    def __getstate__(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("function_keys", "finalizer", "root")}
        state["functions"] = [(mod.__name__, attr, _swaps.LEDGER[(mod, attr)].value)
                              for mod, attr in self.function_keys if (mod, attr) in _swaps.LEDGER]
        state["root"] = self.root() if self.root is not None else None
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        functions, root = state.pop("functions"), state.pop("root")
        self.__dict__.update({"bound": [], **state})
        self.function_keys, self.finalizer, self.root = [], None, None
        if self.config_saved:               # configs name the "liger_rt" experts: register it here too
            # import time: liger_rt.layers imports triton (through liger_rt.ops)
            from ..layers.moe_experts_interface import register_experts_interface
            register_experts_interface()
        for module, attr, fn in self.bound:
            module.__dict__[attr] = _swaps.bound_forward(module, fn)
        if root is not None:
            self.hold_functions(root, [(importlib.import_module(m), a, fn) for m, a, fn in functions])

    def describe(self) -> dict:
        return {"model_type": self.model_type, "level": "instance", "flags": dict(self.flags),
                "patched": dict(self.counts), "modules": dict(self.modules), "skipped": list(self.skipped)}


def unwrap(model):
    """The transformers model inside a PEFT-style wrapper."""
    from transformers import PreTrainedModel
    for _ in range(4):
        if isinstance(model, PreTrainedModel):
            break
        if callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        elif isinstance(getattr(getattr(model, "base_model", None), "model", None), torch.nn.Module):
            model = model.base_model.model
        else:
            break
    return model


def _set(record: InstanceRecord, obj, attr: str, value) -> None:
    record.saved.append((obj, attr, attr in obj.__dict__, obj.__dict__.get(attr)))
    setattr(obj, attr, value)


def _bind(record: InstanceRecord, module: torch.nn.Module, fn) -> None:
    # accelerate hooks live in the instance forward and call _old_forward: replace that instead
    attr = "_old_forward" if getattr(module, "_hf_hook", None) is not None and "_old_forward" in module.__dict__ \
        else "forward"
    record.saved.append((module, attr, attr in module.__dict__, module.__dict__.get(attr)))
    record.bound.append((module, attr, fn))
    _swaps.bind(module, fn, attr)


def _patch_instance(model, given: dict[str, Any]):
    root = unwrap(model)
    if not (model_type := getattr(getattr(root, "config", None), "model_type", None)):
        raise ValueError(f"liger_rt.patch needs a transformers model (its config.model_type picks the spec); got "
                         f"{type(root).__name__}. Supported model types: {', '.join(supported_models())}")
    plan = _plan(model_type, given, for_class=False)
    _unpatch_instance(root)
    record = root.__dict__[_RECORD_KEY] = InstanceRecord(plan.model_type, plan.flags, plan.given)  # first: pickling
    by_class = {_key(cls): (row, fn) for cls, row, fn in plan.layers}
    lm_classes = {_key(c) for c in plan.causal_lm}
    configs: dict[int, Any] = {}
    for name, module in root.named_modules():
        key = _key(type(module))
        if (hit := by_class.get(key)) is not None:
            row, fn = hit
            if row.within and row.within not in name.split("."):
                continue
            if row.applies and (why := _load(row.applies)(module)):
                record.skipped.append((name or type(module).__name__, why))
                continue
            if row.experts:
                if (config := getattr(module, "config", None)) is None:
                    record.skipped.append((name, "experts module without a config to switch"))
                    continue
                configs[id(config)] = config
            else:
                _bind(record, module, fn)
            record.modules[type(module).__name__] += 1
            if row.op is not None:
                record.counts[row.flag] += 1
        if key in lm_classes:
            _patch_loss_instance(record, module, plan.flags)
    record.hold_functions(root, [entry[:3] for entry in plan.functions])   # module-wide, held by this patch
    record.counts.update(_function_counts(plan))
    for config in configs.values():
        from ..layers.moe_experts_interface import NAME     # import time: it imports triton (liger_rt.ops)
        old = getattr(config, "_experts_implementation", None)
        record.config_saved.append((config, "_experts_implementation", old))
        config._experts_implementation = NAME
    return model


def _loss_heads(flags: dict[str, bool]) -> list[tuple[str, Any, str]]:
    # (flag, causal-LM forward, options attribute) of the loss heads on: at most one (_flags)
    from ..layers import logprobs, loss     # import time: liger_rt.layers imports transformers and triton
    heads = (("fused_linear_cross_entropy", loss.causal_lm_forward, "_liger_rt_loss"),
             ("logprobs", logprobs.causal_lm_logprobs_forward, "_liger_rt_logprobs"))
    return [head for head in heads if flags[head[0]]]


def _patch_loss_instance(record: InstanceRecord, module, flags: dict[str, bool]) -> None:
    from ..layers import loss     # import time: liger_rt.layers imports transformers and triton
    for flag, forward, attr in _loss_heads(flags):
        # read the host forward's parameters and output class now, not in the (traced) forward
        opts = loss.loss_options(inspect.signature(original(module)), type(module).__module__,
                                 keep_logits=flags["keep_logits"])
        _bind(record, module, forward)
        _set(record, module, attr, opts)
        record.counts[flag] += 1
    if flags["cross_entropy"]:
        from transformers.loss.loss_utils import LOSS_MAPPING
        if module.loss_function is not LOSS_MAPPING.get("ForCausalLM"):
            record.skipped.append((type(module).__name__, "cross_entropy: the model has its own loss_function"))
            return
        _set(record, module, "_loss_function", loss.causal_lm_loss)
        record.counts["cross_entropy"] += 1


def _unpatch_instance(root) -> None:
    if (record := root.__dict__.pop(_RECORD_KEY, None)) is None:
        return
    if record.finalizer is not None:
        record.finalizer()        # releases the module-wide swaps (once)
    for config, attr, old in reversed(record.config_saved):
        setattr(config, attr, old)
    for obj, attr, had, old in reversed(record.saved):
        if had:
            setattr(obj, attr, old)
        elif attr in obj.__dict__:
            delattr(obj, attr)
        obj.__dict__.pop(_ORIG_KEY, None)


# -- class-level patching -------------------------------------------------------------------------------

_CLASS_RECORDS: dict[str, _Plan] = {}


def _class_forward(cls: type, fn):
    """``fn`` as ``cls.forward``: a copy dressed as the host forward (name, doc, ``__wrapped__``, its signature
    plus fn's keyword-only extras)."""
    host = _swaps.class_original(cls)
    fn = _swaps.dressed(fn, host, _swaps.merged_signature(inspect.signature(host), inspect.signature(fn)))
    # GradientCheckpointingLayer.__init_subclass__ wraps each subclass's forward in a function that
    # checkpoints only while it *is* type(self).forward: run it on a throwaway subclass whose forward is fn
    base = next((k for k in cls.__mro__ if k.__name__ == "GradientCheckpointingLayer"
                 and k.__module__.startswith("transformers.")), None)
    if base is None:
        return fn
    carrier = type(f"_Checkpointed{cls.__name__}", (base,), {"forward": fn, "__module__": __name__})
    return carrier.__dict__["forward"]


def _patch_class(model_type: str, given: dict[str, Any]) -> None:
    plan = _plan(model_type, given, for_class=True)
    _unpatch_class(model_type)
    from ..layers import loss, moe      # import time: liger_rt.layers imports transformers and triton
    keys = plan.keys
    for cls, row, fn in plan.layers:
        if row.experts:
            rec = _swaps.LEDGER.get((cls, "forward"))
            value = rec.value if rec is not None else _class_forward(cls, moe.experts_forward_for(cls))
        else:
            value = _class_forward(cls, fn)
        _swaps.hold(cls, "forward", value, model_type, keys)
    for cls in plan.causal_lm:
        for _, forward, attr in _loss_heads(plan.flags):
            opts = loss.loss_options(inspect.signature(_swaps.class_original(cls)), cls.__module__,
                                     keep_logits=plan.flags["keep_logits"], has_self=True)
            _swaps.hold(cls, "forward", _class_forward(cls, forward), model_type, keys)
            _swaps.hold(cls, attr, opts, model_type, keys)
        if plan.flags["cross_entropy"]:
            _swaps.hold(cls, "_loss_function", staticmethod(loss.causal_lm_loss), model_type, keys)
    for mod, fn_name, fn, _ in plan.functions:
        _swaps.hold(mod, fn_name, fn, model_type, keys)
    _CLASS_RECORDS[model_type] = plan


def _function_counts(plan: _Plan) -> collections.Counter:
    # per flag, the module-wide function swaps that run an op (rope; not the causal-mask rule)
    return collections.Counter(row.flag for *_, row in plan.functions if row.op is not None)


def _unpatch_class(model_type: str) -> None:
    if (record := _CLASS_RECORDS.pop(model_type, None)) is not None:
        _swaps.release(record.keys, model_type)


# -- public entry points ------------------------------------------------------------------------------

def patch(target, **layers):
    """Patch a loaded model (instance level, returns it) or a model type (class level, returns None).

        liger_rt.patch(model, fused_linear_cross_entropy=True)  # SFT: loss without logits
        liger_rt.patch("lfm2", short_conv=False)                # classes, before building models
    """
    _warn_without_triton()
    if isinstance(target, str):
        _patch_class(target, layers)
        return None
    if isinstance(target, torch.nn.Module):
        return _patch_instance(target, layers)
    raise TypeError(f"liger_rt.patch takes a model (torch.nn.Module) or a model type string "
                    f"({', '.join(supported_models())}); got {type(target).__name__}")


def unpatch(target):
    """Undo patch(target) (a no-op where nothing is patched)."""
    if isinstance(target, str):
        if target not in specs.SPECS:
            raise ValueError(f"unknown model type {target!r}; supported: {', '.join(supported_models())}")
        _unpatch_class(target)
        return None
    if isinstance(target, torch.nn.Module):
        _unpatch_instance(unwrap(target))
        return target
    raise TypeError(f"liger_rt.unpatch takes a model or a model type string; got {type(target).__name__}")


def instance_record(target) -> InstanceRecord | None:
    """The instance patch of a model (or of the model inside a PEFT-style wrapper), or None."""
    return unwrap(target).__dict__.get(_RECORD_KEY) if isinstance(target, torch.nn.Module) else None


def describe(target) -> dict | None:
    """What is patched: model type, level, flags in force, modules patched per flag (None if nothing);
    a model with no instance patch that runs class-patched classes is described at level "class"."""
    if isinstance(target, str):
        plan = _CLASS_RECORDS.get(target)
        return None if plan is None else {"model_type": target, "level": "class", "flags": dict(plan.flags),
                                          "classes": plan.class_names()}
    rec = instance_record(target)
    return rec.describe() if rec is not None else _describe_class_patched(unwrap(target))


def _describe_class_patched(root) -> dict | None:
    model_type = getattr(getattr(root, "config", None), "model_type", None)
    for family in sorted(_CLASS_RECORDS, key=lambda t: t != model_type):     # its own family first
        plan = _CLASS_RECORDS[family]
        classes = {cls: row.flag for cls, row, _ in plan.layers if row.op is not None}   # -> the flag of its op
        patched, modules = collections.Counter(), collections.Counter()
        for module in root.modules():
            cls = type(module)
            if (flag := classes.get(cls)) is not None and "forward" not in module.__dict__:
                patched[flag] += 1
                modules[cls.__name__] += 1
            if cls in plan.causal_lm:
                patched.update(f for f in specs.LOSS_FLAGS if plan.flags[f])
        if patched:
            patched.update(_function_counts(plan))
            return {"model_type": family, "level": "class", "flags": dict(plan.flags), "patched": dict(patched),
                    "modules": dict(modules), "skipped": []}
    return None


@contextlib.contextmanager
def patched(target, **layers):
    """Patch for the duration of a with-block; on exit the target is back as it was."""
    if isinstance(target, str):
        before = getattr(_CLASS_RECORDS.get(target), "given", None)
    else:
        rec = instance_record(target)
        before = None if rec is None else rec.given
    patch(target, **layers)
    try:
        yield target
    finally:
        if before is None:
            unpatch(target)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PatchWarning)
                patch(target, **before)
