"""liger_rt as an experts implementation of transformers v5 (``ExpertsInterface``).

transformers v5 MoE experts modules look their forward up at every call by
``config._experts_implementation``; ``register_experts_interface()`` adds ``"liger_rt"`` there, a forward
through ``liger_rt.ops.moe_experts``.  Register first (transformers validates the name), then
``from_pretrained(..., experts_implementation="liger_rt")`` or ``config._experts_implementation = "liger_rt"``.

The layout it takes: gate_up_proj (E, 2*I, H) gate first, down_proj (E, H, I), SiLU, no bias, not
transposed.  A module with another layout or activation runs its own eager forward, warned once.
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

from .. import ops

NAME = "liger_rt"
_warned: set[str] = set()


def _unsupported(module) -> str | None:
    for attr in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(module, attr, None), torch.Tensor):
            return f"no {attr} tensor"
    act = getattr(module, "act_fn", None)
    checks = (
        (getattr(module, "has_gate", True), "experts without a gate (up_proj only)"),
        (not getattr(module, "has_bias", False), "expert biases"),
        (not getattr(module, "is_transposed", False), "transposed expert weights"),
        (getattr(module, "is_concatenated", True), "interleaved gate/up weights"),
        (not getattr(module, "has_post_expert_norm", False), "a post-expert norm"),
        (not getattr(module, "_is_expert_parallel", False), "expert parallelism (sentinel expert ids)"),
        (act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU"),
         f"activation {act!r} (SiLU only)"),
    )
    for ok, what in checks:
        if not ok:
            return what
    default_gate = _default_apply_gate()
    if default_gate is not None and getattr(type(module), "_apply_gate", default_gate) is not default_gate:
        return "a custom _apply_gate"
    return None


_UNSET = object()
_DEFAULT_GATE = _UNSET


def _default_apply_gate():
    """transformers' ``_default_apply_gate`` (None where it has none), read once by
    register_experts_interface(): torch 2.11's dynamo cannot import from the lazy
    ``transformers.integrations`` package inside a compiled forward ("Bad import result")."""
    global _DEFAULT_GATE
    if _DEFAULT_GATE is _UNSET:
        from transformers.integrations import moe
        _DEFAULT_GATE = getattr(moe, "_default_apply_gate", None)
    return _DEFAULT_GATE


def _eager_forward(module):
    # unwrapped past use_experts_implementation's wrapper (and a class-level patch's), so a fallback
    # never dispatches back here
    fwd = inspect.unwrap(type(module).forward)
    if fwd is liger_rt_experts_forward or getattr(fwd, "_liger_rt_experts", False):
        raise RuntimeError(f"liger_rt experts: {type(module).__name__} has no eager forward to fall back to")
    return fwd


def liger_rt_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """ExpertsInterface forward: hidden_states (tokens, hidden), top_k_* (tokens, k) -> (tokens, hidden)."""
    if (why := _unsupported(self)) is not None:
        key = f"{type(self).__name__}: {why}"
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"liger_rt experts: {key} is not supported by liger_rt.ops.moe_experts; "
                          "this module runs its eager forward", RuntimeWarning, stacklevel=2)
        return _eager_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    w = self.gate_up_proj
    # autocast can hand fp32 activations to bf16 experts (as transformers' grouped_mm does: cast to the weights)
    x = hidden_states if hidden_states.dtype == w.dtype else hidden_states.to(w.dtype)
    out = ops.moe_experts(x, w, self.down_proj, top_k_index, top_k_weights)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def register_experts_interface(name: str = NAME) -> bool:
    """Register ``name`` in transformers' ExpertsInterface (idempotent): True, or an ImportError (transformers < 5)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:
        import transformers
        raise ImportError(f"transformers {transformers.__version__} has no ExpertsInterface; "
                          "liger_rt experts need transformers >= 5: pip install -U 'transformers>=5'") from exc
    _default_apply_gate()
    if ExpertsInterface._global_mapping.get(name) is not liger_rt_experts_forward:
        ExpertsInterface.register(name, liger_rt_experts_forward)
    return True


def unregister_experts_interface(name: str = NAME) -> bool:
    """Remove ``name`` from ExpertsInterface (models still set to it then fail at forward); False if absent."""
    if not is_registered(name):
        return False
    from transformers.integrations.moe import ExpertsInterface
    del ExpertsInterface._global_mapping[name]
    return True


def is_registered(name: str = NAME) -> bool:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    return ExpertsInterface._global_mapping.get(name) is liger_rt_experts_forward
