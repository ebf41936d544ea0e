"""Build Hugging Face configs and randomly initialised models from presets (never the hub).

    config = build_config("qwen3-tiny")                     # a transformers Qwen3Config
    model = build_model("lfm2-moe-tiny", dtype=torch.float32, device="cpu", seed=0)

Config keyword names used here exist in transformers 5.17 and 5.24.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from .presets import Preset, get_preset

# the issue-17 families: _family_kwargs maps their Preset fields onto each config's own names
FAMILIES = ("qwen2", "qwen2_moe", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
            "granite", "glm4", "smollm3", "qwen3_5_moe_text")
MODEL_TYPES = ("qwen3", "llama", "qwen3_moe", "lfm2", "lfm2_moe", "lfm2_vl", *FAMILIES)
# families whose config declares head_dim (the others derive it as hidden / heads)
_HEAD_DIM = ("mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "glm4", "qwen3_5_moe_text")


def _resolve(preset: str | Preset) -> Preset:
    return preset if isinstance(preset, Preset) else get_preset(preset)


def _text_kwargs(p: Preset) -> dict[str, Any]:
    common = dict(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                  num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                  max_position_embeddings=4096 if p.tiny else 32768)
    if p.model_type in ("qwen3", "llama", "qwen3_moe"):
        # as released: Qwen3 <= 4B and Llama 3.2 1B/3B tie the LM head to the embedding
        tie = {"qwen3": p.hidden <= 2560, "llama": p.hidden <= 3072, "qwen3_moe": False}[p.model_type]
        common.update(head_dim=p.head_dim, hidden_act="silu", tie_word_embeddings=tie)
    if p.model_type == "qwen3_moe":
        common.update(num_experts=p.experts, num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate,
                      decoder_sparse_step=1, norm_topk_prob=True)
    if p.model_type in ("lfm2", "lfm2_moe", "lfm2_vl"):
        # layer_types given explicitly: Lfm2MoeConfig with fewer layers than the default fails to build otherwise
        common.update(layer_types=["full_attention" if i in p.attention_layers else "conv" for i in range(p.layers)],
                      conv_L_cache=p.conv_kernel, conv_bias=False)
        if p.model_type != "lfm2_moe":
            # presets hold the effective MLP width (HF's auto-adjust already applied)
            common.update(block_auto_adjust_ff_dim=False)
    if p.model_type == "lfm2_moe":
        common.update(num_experts=p.experts, num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate,
                      num_dense_layers=p.dense_layers, use_expert_bias=True, norm_topk_prob=True)
    if p.model_type in FAMILIES:
        common.update(_family_kwargs(p))
    return common


def _family_kwargs(p: Preset) -> dict[str, Any]:
    """An issue-17 family's structural Preset fields under its config's own names, then ``Preset.config``,
    which wins.  A config takes unknown keywords as plain attributes, so a renamed keyword does not raise:
    tests/test_families.py builds every preset, the released ones to their parameter counts."""
    out: dict[str, Any] = {}
    if p.model_type in _HEAD_DIM:
        out["head_dim"] = p.head_dim
    if p.tiny:                             # defaults such as Phi-3's pad id 32000 lie outside a tiny vocab
        out.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if p.experts and p.model_type == "mixtral":         # experts of width intermediate_size, no dense MLP
        out.update(num_local_experts=p.experts, num_experts_per_tok=p.top_k, intermediate_size=p.moe_intermediate)
    elif p.experts:
        out.update(num_experts=p.experts, num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate,
                   shared_expert_intermediate_size=p.shared_intermediate)
        if p.model_type == "qwen2_moe":                 # every layer sparse, as released
            out.update(decoder_sparse_step=1, mlp_only_layers=[])
    if p.model_type == "qwen3_5_moe_text":
        out["layer_types"] = ["full_attention" if i in p.attention_layers else "linear_attention"
                              for i in range(p.layers)]
    out.update(p.config)
    return out


def build_config(preset: str | Preset, **overrides):
    """The transformers config for a preset (name, ``Preset`` or PATH.json); overrides win (for
    ``lfm2_vl`` on the top-level config, with ``text_config``/``vision_config`` dicts for the sub-configs)."""
    p = _resolve(preset)
    if p.model_type not in MODEL_TYPES:
        raise ValueError(f"preset {p.name!r} has model_type {p.model_type!r}; buildable: {', '.join(MODEL_TYPES)}")
    from transformers import AutoConfig
    if p.model_type != "lfm2_vl":
        return AutoConfig.for_model(p.model_type, **{**_text_kwargs(p), **overrides})
    text = {**_text_kwargs(p), "model_type": "lfm2", **(overrides.pop("text_config", {}) or {})}
    side = 4 if p.tiny else 16
    vision = dict(model_type="siglip2_vision_model", hidden_size=p.vision_hidden,
                  intermediate_size=p.vision_intermediate, num_hidden_layers=p.vision_layers,
                  num_attention_heads=p.vision_heads, patch_size=4 if p.tiny else 16,
                  num_patches=side * side, vision_use_head=False)     # position grid 16x16 as released
    vision.update(overrides.pop("vision_config", {}) or {})
    kwargs = dict(text_config=text, vision_config=vision, image_token_id=p.vocab - 1, downsample_factor=2)
    if p.tiny:
        kwargs["projector_hidden_size"] = 2 * p.hidden
    kwargs.update(overrides)
    return AutoConfig.for_model("lfm2_vl", **kwargs)


def model_class(model_type: str):
    if model_type == "lfm2_vl":
        return importlib.import_module("transformers.models.lfm2_vl.modeling_lfm2_vl").Lfm2VlForConditionalGeneration
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"transformers has no causal LM for {model_type!r}")
    return getattr(importlib.import_module("transformers"), name, AutoModelForCausalLM)


def build_model(preset: str | Preset, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int = 0, attn_implementation: str = "sdpa", **config_overrides):
    """A model in train mode with random weights for a preset: initialised in fp32 on `device` under
    ``torch.manual_seed(seed)``, then cast to `dtype`, so the same seed gives the same weights for any dtype."""
    p = _resolve(preset)
    config, cls = build_config(p, **config_overrides), model_class(p.model_type)
    if attn_implementation == "sdpa" and not getattr(cls, "_supports_sdpa", True):
        attn_implementation = "eager"       # Gemma 2: SDPA has no attention-logit softcapping
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=torch.float32) if hasattr(cls, "_from_config") else cls(config)
    return model.to(dtype=dtype).train()
