"""Gated MLP forwards: down(act(gate(x)) * up(x)) with the product fused in liger_rt.ops.swiglu / geglu.

The projections stay the module's own nn.Linear layers (bias, LoRA wrappers and hooks keep
working); only the gate activation and product go through the op:

    Qwen3MLP / LlamaMLP / Qwen3MoeMLP:  gate_proj, up_proj, down_proj   -> swiglu_forward
    Lfm2MLP / Lfm2MoeMLP:               w1 (gate), w3 (up), w2 (down)   -> swiglu_w1_w3_w2_forward
    GemmaMLP / Gemma2MLP / Gemma3MLP:   gate_proj, up_proj, down_proj, gelu_pytorch_tanh -> geglu_forward

x (..., hidden) -> (..., hidden).

With LIGER_RT_RECOMPUTE_SWIGLU=1 the SwiGLU forwards keep less for the backward: where down is a plain nn.Linear
with no hooks, down(swiglu(gate, up)) runs as one autograd node that keeps gate and up (which SwiGLU's own backward
needs anyway) and recomputes the product for down's weight gradient, instead of keeping it too: intermediate values
per token and layer less (Qwen3-1.7B: 12 KB in bf16, a sixth of what a layer keeps), for one more SwiGLU forward
per layer in the backward.  Under torch.compile or autocast, or where down is wrapped (LoRA) or hooked, the plain
path runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import env, ops
from ..launch import launch_memo

_SILU_NAMES = ("silu", "swish")
# HF activation classes computing 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the C kernel
# (gelu_pytorch_tanh) and the Python formulas of the same function (gelu_python_tanh, gelu_new, gelu_fast)
_TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")


class SwiGLUDown(torch.autograd.Function):
    """down(swiglu(gate, up)) as F.linear computes it, keeping gate and up only: the backward recomputes the
    product (the same op, the same bits) for down's weight gradient."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        with torch.no_grad():
            y = ops.swiglu(gate, up)
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return F.linear(y, weight, bias)

    @staticmethod
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            y = ops.swiglu(g, u)
        dgate, dup = torch.autograd.grad(y, (g, u), dout @ weight)
        rows = dout.reshape(-1, dout.shape[-1])
        dweight = rows.T @ y.detach().reshape(-1, y.shape[-1]) if ctx.needs_input_grad[2] else None
        dbias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dgate, dup, dweight, dbias


def _plain_linear(m: torch.nn.Module) -> bool:
    """An nn.Linear itself (no subclass or wrapper) that no forward hook watches; torch has no public query for
    registered hooks, so this reads the module's hook dicts and torch's global ones (absent: none)."""
    glob = torch.nn.modules.module
    return (type(m) is torch.nn.Linear and not (m._forward_hooks or m._forward_pre_hooks)
            and not (getattr(glob, "_global_forward_hooks", None) or getattr(glob, "_global_forward_pre_hooks", None)))


@launch_memo
def _recompute_swiglu() -> bool:
    """LIGER_RT_RECOMPUTE_SWIGLU, read as a decision reads the environment: once, until liger_rt.dispatch.reset()
    (not on every MLP call: each read validates the whole environment)."""
    return env.recompute_swiglu()


def down_of_swiglu(down: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down(ops.swiglu(gate, up)), recomputing the product in the backward where LIGER_RT_RECOMPUTE_SWIGLU says
    and down is a plain, unhooked nn.Linear (see the module docstring)."""
    # is_compiling() first: dynamo then never traces the memoised environment read (it warns on lru_cache wrappers)
    if (not torch.compiler.is_compiling() and _recompute_swiglu() and torch.is_grad_enabled()
            and not torch.is_autocast_enabled(gate.device.type) and _plain_linear(down)):
        return SwiGLUDown.apply(gate, up, down.weight, down.bias)
    return down(ops.swiglu(gate, up))


def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return down_of_swiglu(self.down_proj, self.gate_proj(x), self.up_proj(x))


def swiglu_w1_w3_w2_forward(self, x: torch.Tensor) -> torch.Tensor:
    return down_of_swiglu(self.w2, self.w1(x), self.w3(x))


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
