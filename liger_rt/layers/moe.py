"""MoE forwards: the LFM2-MoE router through liger_rt.ops.moe_router, experts through the
transformers experts interface under the name ``liger_rt`` (moe_experts_interface.py), which instance
patches set in ``config._experts_implementation`` and class-level patches bind (``experts_forward_for``).
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from .. import ops
from .moe_experts_interface import liger_rt_experts_forward


def router_forward(self, hidden_states: torch.Tensor, expert_bias: torch.Tensor | None = None):
    """Lfm2MoeTopKRouter.forward: hidden_states (tokens, hidden) -> (router_logits (tokens, experts),
    weights, indices (tokens, top_k))."""
    router_logits = F.linear(hidden_states, self.weight)
    bias = expert_bias if getattr(self, "use_expert_bias", expert_bias is not None) else None
    weights, indices = ops.moe_router(router_logits, self.top_k, expert_bias=bias,
                                      norm_topk_prob=bool(self.norm_topk_prob),
                                      routed_scaling_factor=float(self.routed_scaling_factor))
    return router_logits, weights.to(router_logits.dtype), indices.long()


def router_compatible(module) -> str | None:
    """None when a router has the LFM2-MoE attributes and signature router_forward reads."""
    need = ("weight", "top_k", "norm_topk_prob", "routed_scaling_factor")
    if gone := [n for n in need if not hasattr(module, n)]:
        return f"no {', '.join(gone)} on this transformers' {type(module).__name__}"
    params = list(inspect.signature(type(module).forward).parameters)
    if params[1:3] != ["hidden_states", "expert_bias"]:
        return f"{type(module).__name__}.forward takes ({', '.join(params[1:])}), not (hidden_states, expert_bias)"
    return None


def experts_forward_for(cls: type):
    """The liger_rt experts forward for one experts class, ``__wrapped__`` pointing at the forward it
    replaces (where the interface's fallback unwraps to)."""
    original = cls.__dict__.get("forward", cls.forward)

    @functools.wraps(original)
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return liger_rt_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    forward._liger_rt_experts = True
    return forward
