"""Layer forwards for model families whose modules differ from Llama's in one detail.

    GemmaRMSNorm / Gemma2RMSNorm / Gemma3RMSNorm /
    Qwen3_5MoeRMSNorm:  (1 + w) weights, result in x's dtype -> offset_rms_norm_forward
    Olmo2RMSNorm:       w * x in fp32, result in x's dtype    -> rms_norm_as_input_forward
    Phi3MLP / Glm4MLP:  one gate_up_proj (gate first), SiLU   -> gate_up_swiglu_forward
    Olmo2 apply_rotary_pos_emb: outputs cast to q's / k's dtype -> apply_rotary_pos_emb_as_input

Casting: these HF norms multiply by the weight in fp32 and round once; liger_rt.ops.rms_norm
rounds the normalised x to x's dtype before the weight multiply (LlamaRMSNorm's order), so in bf16
the two differ by one rounding of the normalised x, never in fp32.  x (..., hidden) -> same shape.
"""
from __future__ import annotations

import torch

from .. import ops
from .mlp import is_silu, missing_submodules
from .norms import module_eps


def _rms_norm_as_input(self, x: torch.Tensor, offset: float) -> torch.Tensor:
    y = ops.rms_norm(x, self.weight, eps=module_eps(self), offset=offset)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def offset_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm_as_input(self, x, 1.0)


def rms_norm_as_input_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm_as_input(self, x, 0.0)


def gate_up_swiglu_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # the two halves go to the op as strided views (no copy)
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(ops.swiglu(gate, up))


def silu_gate_up(module) -> str | None:
    """None when a fused MLP has gate_up_proj / down_proj and a SiLU activation_fn, else why not."""
    if missing := missing_submodules(module, ("gate_up_proj", "down_proj")):
        return missing
    act = getattr(module, "activation_fn", None)
    return None if is_silu(act) else f"activation is {type(act).__name__}, not SiLU (SwiGLU would change the model)"


def apply_rotary_pos_emb_as_input(q, k, cos, sin, unsqueeze_dim: int = 1):
    # ops.rope returns the promoted dtype; OLMo-2 casts to q's and k's
    q_embed, k_embed = ops.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)
