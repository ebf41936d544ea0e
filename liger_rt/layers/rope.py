"""The module-level function the ``rope`` flag swaps into a modeling module (specs.ROPE).

Hugging Face attention forwards call ``apply_rotary_pos_emb(query_states, key_states, cos, sin)``
as a global of their modeling module; ``liger_rt.patch(model, rope=True)`` replaces that global
with this function, which runs ``liger_rt.ops.rope`` (the fused kernel, dispatched per call; the
HF formula where the kernel cannot take the call).  Same signature, same results.
"""
from __future__ import annotations


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """HF's (q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed), through liger_rt.ops.rope."""
    from ..ops import rope
    return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
