"""Model presets: the dims that sweeps, parity and model benchmarks are planned from.

Figures follow the released configs of each model family (hidden, layers, intermediate, heads,
vocab...). Tiny variants keep the same structure at CPU-friendly sizes.  ``config`` holds further
transformers config keywords a family needs (softcapping, multipliers, tied head, token ids...);
"-NL" presets cut a released model to N layers, so that a training step (model bench) or two
resident models with gradients and an AdamW step (parity) fit one 141 GB H200 in bf16.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    model_type: str              # a liger_rt.supported_models() family
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE / Qwen3.5-MoE shared expert
    dense_layers: int = 0        # LFM2-MoE: leading dense layers
    conv_kernel: int = 3         # LFM2 short conv width (L_cache)
    attention_layers: tuple[int, ...] = ()   # LFM2: which layers are attention
    vision_hidden: int = 0       # LFM2-VL SigLIP2 tower
    vision_layers: int = 0
    vision_intermediate: int = 0
    vision_heads: int = 0
    vision_tokens: int = 0       # tokens per image at the sweep's resolution
    tokens: tuple[int, ...] = (1024, 4096, 16384, 65536)   # rows a sweep measures
    quick_tokens: tuple[int, ...] = (4096,)
    tiny: bool = False
    config: dict = dataclasses.field(default_factory=dict)   # further transformers config keywords


_TINY = dict(hidden=64, intermediate=96, vocab=160, layers=2, heads=4, kv_heads=2, head_dim=16, tokens=(16, 64),
             quick_tokens=(32,), tiny=True)
_TINY_MOE = dict(experts=8, top_k=2, moe_intermediate=32)     # the tiny MoE presets' experts


def _tiny(name: str, model_type: str, **fields) -> Preset:
    """A CPU-sized preset: the family's structure at the _TINY sizes (hidden 64, 2 layers), `fields` winning."""
    return Preset(name, model_type, **{**_TINY, **fields})


# positional: name, model_type, hidden, intermediate, vocab, layers, heads, kv_heads, head_dim
PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("qwen3-1.7b", "qwen3", 2048, 6144, 151936, 28, 16, 8, 128),
    Preset("qwen3-4b", "qwen3", 2560, 9728, 151936, 36, 32, 8, 128),
    Preset("qwen3-8b", "qwen3", 4096, 12288, 151936, 36, 32, 8, 128),
    Preset("llama-3.2-1b", "llama", 2048, 8192, 128256, 16, 32, 8, 64),
    Preset("qwen3-30b-a3b", "qwen3_moe", 2048, 6144, 151936, 48, 32, 4, 128, experts=128, top_k=8,
           moe_intermediate=768),
    # LFM2-1.2B: intermediate 12288 is auto-adjusted by HF to 2/3 * 12288 rounded to 256 = 8192
    Preset("lfm2-1.2b", "lfm2", 2048, 8192, 65536, 16, 32, 8, 64, attention_layers=(2, 5, 8, 10, 12, 14)),
    Preset("lfm2-8b-a1b", "lfm2_moe", 2048, 7168, 65536, 24, 32, 8, 64, experts=32, top_k=4, moe_intermediate=1792,
           dense_layers=2, attention_layers=(2, 6, 10, 14, 18, 21)),
    Preset("lfm2-24b-a2b", "lfm2_moe", 2048, 7168, 65536, 40, 32, 8, 64, experts=64, top_k=4, moe_intermediate=1536,
           dense_layers=2, attention_layers=(2, 6, 10, 14, 18, 22, 26, 30, 34, 38)),
    Preset("lfm2-vl-1.6b", "lfm2_vl", 2048, 8192, 65536, 16, 32, 8, 64, attention_layers=(2, 5, 8, 10, 12, 14),
           vision_hidden=1152, vision_layers=27, vision_intermediate=4304, vision_heads=16, vision_tokens=1024),
    _tiny("qwen3-tiny", "qwen3"),
    _tiny("qwen3-4b-tiny", "qwen3", hidden=80, intermediate=136, vocab=199, head_dim=20),
    _tiny("llama-tiny", "llama"),
    _tiny("qwen3-moe-tiny", "qwen3_moe", **_TINY_MOE),
    _tiny("lfm2-tiny", "lfm2", layers=3, attention_layers=(1,)),
    _tiny("lfm2-moe-tiny", "lfm2_moe", layers=3, **_TINY_MOE, dense_layers=1, attention_layers=(1,)),
    _tiny("lfm2-vl-tiny", "lfm2_vl", layers=3, attention_layers=(1,), vision_hidden=48, vision_layers=2,
          vision_intermediate=64, vision_heads=4, vision_tokens=16),
    # -- more families: released sizes (config.json of each model on the Hugging Face hub) ------------
    Preset("qwen2.5-7b", "qwen2", 3584, 18944, 152064, 28, 28, 4, 128,
           config=dict(tie_word_embeddings=False, rope_theta=1e6)),
    Preset("qwen1.5-moe-a2.7b", "qwen2_moe", 2048, 5632, 151936, 24, 16, 16, 128, experts=60, top_k=4,
           moe_intermediate=1408, shared_intermediate=5632,
           config=dict(norm_topk_prob=False, tie_word_embeddings=False)),
    Preset("mistral-7b", "mistral", 4096, 14336, 32768, 32, 32, 8, 128,
           config=dict(sliding_window=None, rope_theta=1e6, tie_word_embeddings=False)),   # v0.3
    Preset("mixtral-8x7b", "mixtral", 4096, 14336, 32000, 32, 32, 8, 128, experts=8, top_k=2, moe_intermediate=14336,
           config=dict(rope_theta=1e6)),
    Preset("gemma-2b", "gemma", 2048, 16384, 256000, 18, 8, 1, 256),
    Preset("gemma2-2b", "gemma2", 2304, 9216, 256000, 26, 8, 4, 256, config=dict(
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256, sliding_window=4096)),
    # Gemma 3 4B's text model (the released checkpoint is multimodal; Gemma3ForCausalLM runs its decoder)
    Preset("gemma3-4b", "gemma3_text", 2560, 10240, 262208, 34, 8, 4, 256,
           config=dict(sliding_window=1024, query_pre_attn_scalar=256)),
    Preset("phi3-mini", "phi3", 3072, 8192, 32064, 32, 32, 32, 96, config=dict(tie_word_embeddings=False)),  # 4k
    Preset("olmo2-7b", "olmo2", 4096, 11008, 100352, 32, 32, 32, 128, config=dict(
        rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=100277, eos_token_id=100257)),
    Preset("granite-3.3-2b", "granite", 2048, 8192, 49159, 40, 32, 8, 64, config=dict(
        embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        tie_word_embeddings=True)),
    Preset("glm4-9b", "glm4", 4096, 13696, 151552, 40, 32, 2, 128,
           config=dict(partial_rotary_factor=0.5, attention_bias=True)),          # GLM-4-9B-0414
    Preset("smollm3-3b", "smollm3", 2048, 11008, 128256, 36, 16, 4, 128, config=dict(tie_word_embeddings=True)),
    # Qwen3.5-35B-A3B's text model: gated-delta-net layers, full attention every 4th layer
    Preset("qwen3.5-35b-a3b", "qwen3_5_moe_text", 2048, 512, 248320, 40, 16, 2, 256, experts=256, top_k=8,
           moe_intermediate=512, shared_intermediate=512, attention_layers=tuple(range(3, 40, 4)),
           config=dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4)),
]}
# cut to fit one H200 (see the module docstring): the H200 parity and model-step runs; qwen3-8b-18L (4.7B
# parameters: 38 GB of bf16 weights, gradients and AdamW state) leaves half an 80 GB card to the longest-sequence runs
PRESETS.update({f"{full}-{n}L": dataclasses.replace(PRESETS[full], name=f"{full}-{n}L", layers=n)
                for full, n in (("qwen2.5-7b", 14), ("mistral-7b", 16), ("mixtral-8x7b", 2), ("qwen3-8b", 18))})
PRESETS.update({p.name: p for p in [
    _tiny("qwen2-tiny", "qwen2", config=dict(tie_word_embeddings=True)),
    _tiny("qwen2-moe-tiny", "qwen2_moe", **_TINY_MOE, shared_intermediate=48, config=dict(norm_topk_prob=False)),
    _tiny("mistral-tiny", "mistral", config=dict(sliding_window=None)),
    _tiny("mixtral-tiny", "mixtral", **_TINY_MOE),
    _tiny("gemma-tiny", "gemma"),
    _tiny("gemma2-tiny", "gemma2", config=dict(final_logit_softcapping=1.0, attn_logit_softcapping=50.0,
                                               query_pre_attn_scalar=16, sliding_window=4)),
    _tiny("gemma3-tiny", "gemma3_text", config=dict(sliding_window=4, query_pre_attn_scalar=16,
                                                    layer_types=["sliding_attention", "full_attention"])),
    _tiny("phi3-tiny", "phi3"),
    _tiny("olmo2-tiny", "olmo2"),
    _tiny("granite-tiny", "granite", config=dict(embedding_multiplier=12.0, logits_scaling=8.0,
                                                 residual_multiplier=0.22, attention_multiplier=0.0625,
                                                 tie_word_embeddings=True)),
    _tiny("glm4-tiny", "glm4", config=dict(partial_rotary_factor=0.5, attention_bias=True)),
    _tiny("smollm3-tiny", "smollm3", config=dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    _tiny("qwen3.5-moe-tiny", "qwen3_5_moe_text", **_TINY_MOE, shared_intermediate=48, attention_layers=(1,),
          config=dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4)),
]})
# `--preset tiny` with a model type picks that family's tiny preset (qwen3-4b-tiny is a second qwen3 shape)
TINY_FOR_MODEL = {p.model_type: p.name for p in PRESETS.values() if p.tiny and p.name != "qwen3-4b-tiny"}


def get_preset(name: str, model_type: str | None = None) -> Preset:
    """A preset by name, `tiny` for the model type's tiny preset, or a JSON file of Preset fields."""
    if name == "tiny" and model_type:
        if model_type not in TINY_FOR_MODEL:
            raise ValueError(f"no tiny preset for {model_type!r}; model types: {', '.join(TINY_FOR_MODEL)}")
        name = TINY_FOR_MODEL[model_type]
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        data = json.loads(path.read_text())
        data.update({k: tuple(data[k]) for k in ("tokens", "quick_tokens", "attention_layers") if k in data})
        data.setdefault("name", path.stem)
        try:
            return Preset(**data)
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}; fields: {', '.join(f.name for f in dataclasses.fields(Preset))}") from None
    raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}, tiny, or a PATH.json")


def presets_for(model_type: str) -> list[Preset]:
    return [p for p in PRESETS.values() if p.model_type == model_type]
