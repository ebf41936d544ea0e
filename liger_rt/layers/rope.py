"""The module-level function the ``rope`` flag swaps into a modeling module (specs.ROPE): HF attention
calls ``apply_rotary_pos_emb`` as a global of its modeling module; this one runs ``liger_rt.ops.rope``
(the fused kernel where it can take the call, HF's formula elsewhere).  Same signature, same results.
"""
from __future__ import annotations

from .. import ops


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """HF's (q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed), through liger_rt.ops.rope."""
    return ops.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
