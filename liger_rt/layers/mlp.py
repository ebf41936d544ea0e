"""Gated MLP forwards: down(act(gate(x)) * up(x)) with the product fused in liger_rt.ops.swiglu / geglu.

The projections stay the module's own nn.Linear layers (bias, LoRA wrappers and hooks keep
working); only the gate activation and product go through the op:

    Qwen3MLP / LlamaMLP / Qwen3MoeMLP:  gate_proj, up_proj, down_proj   -> swiglu_forward
    Lfm2MLP / Lfm2MoeMLP:               w1 (gate), w3 (up), w2 (down)   -> swiglu_w1_w3_w2_forward
    GemmaMLP / Gemma2MLP / Gemma3MLP:   gate_proj, up_proj, down_proj, gelu_pytorch_tanh -> geglu_forward

x (..., hidden) -> (..., hidden).
"""
from __future__ import annotations

import torch

from .. import ops

_SILU_NAMES = ("silu", "swish")
# HF activation classes computing 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the C kernel
# (gelu_pytorch_tanh) and the Python formulas of the same function (gelu_python_tanh, gelu_new, gelu_fast)
_TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")


def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def swiglu_w1_w3_w2_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.w2(ops.swiglu(self.w1(x), self.w3(x)))


def geglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(ops.geglu(self.gate_proj(x), self.up_proj(x)))


def missing_submodules(module, names) -> str | None:
    gone = [n for n in names if not isinstance(getattr(module, n, None), torch.nn.Module)]
    return f"no {', '.join(gone)} submodule(s) in this transformers' {type(module).__name__}" if gone else None


def is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is torch.nn.functional.silu


def w1_w3_w2(module) -> str | None:
    return missing_submodules(module, ("w1", "w3", "w2"))


def silu_gated(module) -> str | None:
    """None when the MLP has gate/up/down projections and a SiLU activation, else why not."""
    if missing := missing_submodules(module, ("gate_proj", "up_proj", "down_proj")):
        return missing
    act = getattr(module, "act_fn", None)
    name = getattr(getattr(module, "config", None), "hidden_act", None)
    if is_silu(act) or isinstance(name, str) and name.lower() in _SILU_NAMES:
        return None
    return f"activation is {name or type(act).__name__}, not SiLU (SwiGLU would change the model)"


def gelu_tanh_gated(module) -> str | None:
    """None when the MLP has gate/up/down projections and a tanh-approximate GELU, else why not."""
    if missing := missing_submodules(module, ("gate_proj", "up_proj", "down_proj")):
        return missing
    act = getattr(module, "act_fn", None)
    if isinstance(act, torch.nn.GELU) and act.approximate == "tanh" or type(act).__name__ in _TANH_GELUS:
        return None
    return f"activation is {type(act).__name__}, not the tanh-approximate GELU (GeGLU would change the model)"
