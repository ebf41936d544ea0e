"""Functional kernels: autograd-aware, dispatched per call (arch, dtype and shape pick the implementation
and config).  One function per op of the registry (`liger_rt.registry.OP_MODULES`).

    y = liger_rt.ops.rms_norm(x, weight, eps=1e-6)

Importing this module imports every kernel module (`import liger_rt` alone imports none).
"""
from __future__ import annotations

from .kernels.cross_entropy import cross_entropy
from .kernels.fused_add_rms_norm import fused_add_rms_norm
from .kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from .kernels.fused_linear_logprobs import fused_linear_logprobs
from .kernels.geglu import geglu
from .kernels.layer_norm import layer_norm
from .kernels.moe_experts import moe_experts
from .kernels.moe_router import moe_router
from .kernels.rms_norm import rms_norm
from .kernels.rope import rope
from .kernels.short_conv import short_conv
from .kernels.swiglu import swiglu

__all__ = ["rms_norm", "swiglu", "layer_norm", "short_conv", "moe_router", "moe_experts", "cross_entropy",
           "fused_linear_cross_entropy", "fused_linear_logprobs", "rope", "geglu", "fused_add_rms_norm"]
