"""Norm forwards the patchers bind onto Hugging Face modules (weights stay where they are).

    Qwen3RMSNorm / LlamaRMSNorm / Lfm2RMSNorm:  y = liger_rt.ops.rms_norm(x, weight, eps)
    torch.nn.LayerNorm (SigLIP2 vision tower):  y = liger_rt.ops.layer_norm(x, weight, bias, eps)

x is (..., hidden).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops


def module_eps(module) -> float:
    # HF RMSNorms call it variance_epsilon; Gemma-style ones eps
    eps = getattr(module, "variance_epsilon", None)
    return float(module.eps if eps is None else eps)


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm(hidden_states, self.weight, eps=module_eps(self), offset=0.0)


def layer_norm_forward(self, input: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm over the last dim through liger_rt; no affine weight or several normalised dims stay
    on F.layer_norm, as the module itself runs."""
    if self.weight is None or len(self.normalized_shape) != 1:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
    return ops.layer_norm(input, self.weight, self.bias, eps=self.eps)
