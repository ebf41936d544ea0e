"""GeGLU MLP forward: down(gelu_tanh(gate(x)) * up(x)) with the product fused in liger_rt.ops.geglu.

    GemmaMLP / Gemma2MLP / Gemma3MLP:  gate_proj, up_proj, down_proj, act_fn gelu_pytorch_tanh

The projections stay the module's own nn.Linear layers (LoRA wrappers and hooks keep working);
only the activation and product go through the op.  x (..., hidden) -> (..., hidden).
"""
from __future__ import annotations

import torch

from .. import ops

# HF activation classes computing 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the C kernel
# (gelu_pytorch_tanh) and the Python formulas of the same function (gelu_python_tanh, gelu_new, gelu_fast)
_TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")


def geglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """gate_proj / up_proj / down_proj naming (the Gemma MLPs)."""
    return self.down_proj(ops.geglu(self.gate_proj(x), self.up_proj(x)))


def is_tanh_gelu(act) -> bool:
    if isinstance(act, torch.nn.GELU):
        return act.approximate == "tanh"
    return type(act).__name__ in _TANH_GELUS


def gelu_tanh_gated(module) -> str | None:
    """None when the MLP has gate/up/down projections and a tanh-approximate GELU (so GeGLU computes
    what it computes), else why not."""
    gone = [n for n in ("gate_proj", "up_proj", "down_proj")
            if not isinstance(getattr(module, n, None), torch.nn.Module)]
    if gone:
        return f"no {', '.join(gone)} submodule(s) in this transformers' {type(module).__name__}"
    act = getattr(module, "act_fn", None)
    if is_tanh_gelu(act):
        return None
    return f"activation is {type(act).__name__}, not the tanh-approximate GELU (GeGLU would change the model)"
