"""transformers config keywords of the issue-17 families, from a Preset (tools/models.py builds with them).

    from liger_rt.tools.family_configs import FAMILIES, config_kwargs
    kwargs = config_kwargs(get_preset("gemma2-tiny"))    # head_dim, token ids, softcapping, ...

Each family maps the Preset's structural fields (head_dim, experts, top_k, expert and shared-expert
widths, which layers are full attention) onto its config's own names; ``Preset.config`` (softcapping,
multipliers, tied head...) is applied last and wins.  Keyword names checked against transformers
5.24 (CI: tests/test_families.py builds every preset, the released ones to their parameter counts);
a config takes unknown keywords as plain attributes, so a renamed one would show there, not raise.
The common ones (vocab, hidden, intermediate, layers, heads) come from tools/models.py.
"""
from __future__ import annotations

from typing import Any

# families whose config declares head_dim (the others derive it as hidden / heads)
_HEAD_DIM = ("mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "glm4", "qwen3_5_moe_text")
FAMILIES = ("qwen2", "qwen2_moe", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
            "granite", "glm4", "smollm3", "qwen3_5_moe_text")


def _moe(p) -> dict[str, Any]:
    if p.model_type == "mixtral":          # experts of width intermediate_size, no dense MLP
        return dict(num_local_experts=p.experts, num_experts_per_tok=p.top_k, intermediate_size=p.moe_intermediate)
    out = dict(num_experts=p.experts, num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate,
               shared_expert_intermediate_size=p.shared_intermediate)
    if p.model_type == "qwen2_moe":        # every layer sparse, as released
        out.update(decoder_sparse_step=1, mlp_only_layers=[])
    return out


def config_kwargs(p) -> dict[str, Any]:
    """Keywords for ``AutoConfig.for_model(p.model_type, ...)`` beyond the common ones."""
    out: dict[str, Any] = {}
    if p.model_type in _HEAD_DIM:
        out["head_dim"] = p.head_dim
    if p.tiny:                             # defaults such as Phi-3's pad id 32000 lie outside a tiny vocab
        out.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if p.experts:
        out.update(_moe(p))
    if p.model_type == "qwen3_5_moe_text":
        out["layer_types"] = ["full_attention" if i in p.attention_layers else "linear_attention"
                              for i in range(p.layers)]
    out.update(p.config)
    return out
