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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TINY_TOKENS = dict(tokens=(16, 64), quick_tokens=(32,), tiny=True)
# the tiny shape of the issue-17 families (token ids: pad 0, bos 1, eos 2 go into `config` below)
_TINY = dict(hidden=64, intermediate=96, vocab=160, layers=2, heads=4, kv_heads=2, head_dim=16, **_TINY_TOKENS)

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("qwen3-1.7b", "qwen3", hidden=2048, intermediate=6144, vocab=151936, layers=28, heads=16,
           kv_heads=8, head_dim=128),
    Preset("qwen3-4b", "qwen3", hidden=2560, intermediate=9728, vocab=151936, layers=36, heads=32,
           kv_heads=8, head_dim=128),
    Preset("llama-3.2-1b", "llama", hidden=2048, intermediate=8192, vocab=128256, layers=16, heads=32,
           kv_heads=8, head_dim=64),
    Preset("qwen3-30b-a3b", "qwen3_moe", hidden=2048, intermediate=6144, vocab=151936, layers=48, heads=32,
           kv_heads=4, head_dim=128, experts=128, top_k=8, moe_intermediate=768),
    # LFM2-1.2B: intermediate 12288 is auto-adjusted by HF to 2/3 * 12288 rounded to 256 = 8192
    Preset("lfm2-1.2b", "lfm2", hidden=2048, intermediate=8192, vocab=65536, layers=16, heads=32,
           kv_heads=8, head_dim=64, attention_layers=(2, 5, 8, 10, 12, 14)),
    Preset("lfm2-8b-a1b", "lfm2_moe", hidden=2048, intermediate=7168, vocab=65536, layers=24, heads=32,
           kv_heads=8, head_dim=64, experts=32, top_k=4, moe_intermediate=1792, dense_layers=2,
           attention_layers=(2, 6, 10, 14, 18, 21)),
    Preset("lfm2-24b-a2b", "lfm2_moe", hidden=2048, intermediate=7168, vocab=65536, layers=40, heads=32,
           kv_heads=8, head_dim=64, experts=64, top_k=4, moe_intermediate=1536, dense_layers=2,
           attention_layers=(2, 6, 10, 14, 18, 22, 26, 30, 34, 38)),
    Preset("lfm2-vl-1.6b", "lfm2_vl", hidden=2048, intermediate=8192, vocab=65536, layers=16, heads=32,
           kv_heads=8, head_dim=64, attention_layers=(2, 5, 8, 10, 12, 14), vision_hidden=1152,
           vision_layers=27, vision_intermediate=4304, vision_heads=16, vision_tokens=1024),
    # tiny variants for CPU: same structure, small sizes
    Preset("qwen3-tiny", "qwen3", hidden=64, intermediate=96, vocab=160, layers=2, heads=4, kv_heads=2,
           head_dim=16, **_TINY_TOKENS),
    Preset("qwen3-4b-tiny", "qwen3", hidden=80, intermediate=136, vocab=199, layers=2, heads=4, kv_heads=2,
           head_dim=20, **_TINY_TOKENS),
    Preset("llama-tiny", "llama", hidden=64, intermediate=96, vocab=160, layers=2, heads=4, kv_heads=2,
           head_dim=16, **_TINY_TOKENS),
    Preset("qwen3-moe-tiny", "qwen3_moe", hidden=64, intermediate=96, vocab=160, layers=2, heads=4,
           kv_heads=2, head_dim=16, experts=8, top_k=2, moe_intermediate=32, **_TINY_TOKENS),
    Preset("lfm2-tiny", "lfm2", hidden=64, intermediate=96, vocab=160, layers=3, heads=4, kv_heads=2,
           head_dim=16, attention_layers=(1,), **_TINY_TOKENS),
    Preset("lfm2-moe-tiny", "lfm2_moe", hidden=64, intermediate=96, vocab=160, layers=3, heads=4, kv_heads=2,
           head_dim=16, experts=8, top_k=2, moe_intermediate=32, dense_layers=1, attention_layers=(1,),
           **_TINY_TOKENS),
    Preset("lfm2-vl-tiny", "lfm2_vl", hidden=64, intermediate=96, vocab=160, layers=3, heads=4, kv_heads=2,
           head_dim=16, attention_layers=(1,), vision_hidden=48, vision_layers=2, vision_intermediate=64,
           vision_heads=4, vision_tokens=16, **_TINY_TOKENS),
    # -- families of issue 17: released sizes (config.json of each model on the Hugging Face hub) ------------
    Preset("qwen2.5-7b", "qwen2", hidden=3584, intermediate=18944, vocab=152064, layers=28, heads=28, kv_heads=4,
           head_dim=128, config=dict(tie_word_embeddings=False, rope_theta=1e6)),
    Preset("qwen1.5-moe-a2.7b", "qwen2_moe", hidden=2048, intermediate=5632, vocab=151936, layers=24, heads=16,
           kv_heads=16, head_dim=128, experts=60, top_k=4, moe_intermediate=1408, shared_intermediate=5632,
           config=dict(norm_topk_prob=False, tie_word_embeddings=False)),
    Preset("mistral-7b", "mistral", hidden=4096, intermediate=14336, vocab=32768, layers=32, heads=32, kv_heads=8,
           head_dim=128, config=dict(sliding_window=None, rope_theta=1e6, tie_word_embeddings=False)),   # v0.3
    Preset("mixtral-8x7b", "mixtral", hidden=4096, intermediate=14336, vocab=32000, layers=32, heads=32, kv_heads=8,
           head_dim=128, experts=8, top_k=2, moe_intermediate=14336, config=dict(rope_theta=1e6)),
    Preset("gemma-2b", "gemma", hidden=2048, intermediate=16384, vocab=256000, layers=18, heads=8, kv_heads=1,
           head_dim=256),
    Preset("gemma2-2b", "gemma2", hidden=2304, intermediate=9216, vocab=256000, layers=26, heads=8, kv_heads=4,
           head_dim=256, config=dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                     query_pre_attn_scalar=256, sliding_window=4096)),
    # Gemma 3 4B's text model (the released checkpoint is multimodal; Gemma3ForCausalLM runs its decoder)
    Preset("gemma3-4b", "gemma3_text", hidden=2560, intermediate=10240, vocab=262208, layers=34, heads=8, kv_heads=4,
           head_dim=256, config=dict(sliding_window=1024, query_pre_attn_scalar=256)),
    Preset("phi3-mini", "phi3", hidden=3072, intermediate=8192, vocab=32064, layers=32, heads=32, kv_heads=32,
           head_dim=96, config=dict(tie_word_embeddings=False)),                       # Phi-3-mini-4k
    Preset("olmo2-7b", "olmo2", hidden=4096, intermediate=11008, vocab=100352, layers=32, heads=32, kv_heads=32,
           head_dim=128, config=dict(rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=100277,
                                     eos_token_id=100257)),
    Preset("granite-3.3-2b", "granite", hidden=2048, intermediate=8192, vocab=49159, layers=40, heads=32, kv_heads=8,
           head_dim=64, config=dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                                    attention_multiplier=0.015625, tie_word_embeddings=True)),
    Preset("glm4-9b", "glm4", hidden=4096, intermediate=13696, vocab=151552, layers=40, heads=32, kv_heads=2,
           head_dim=128, config=dict(partial_rotary_factor=0.5, attention_bias=True)),          # GLM-4-9B-0414
    Preset("smollm3-3b", "smollm3", hidden=2048, intermediate=11008, vocab=128256, layers=36, heads=16, kv_heads=4,
           head_dim=128, config=dict(tie_word_embeddings=True)),
    # Qwen3.5-35B-A3B's text model: gated-delta-net layers, full attention every 4th layer
    Preset("qwen3.5-35b-a3b", "qwen3_5_moe_text", hidden=2048, intermediate=512, vocab=248320, layers=40, heads=16,
           kv_heads=2, head_dim=256, experts=256, top_k=8, moe_intermediate=512, shared_intermediate=512,
           attention_layers=tuple(range(3, 40, 4)),
           config=dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4)),
    # cut to fit one H200 (see the module docstring): the H200 parity and model-step runs
    Preset("qwen2.5-7b-14L", "qwen2", hidden=3584, intermediate=18944, vocab=152064, layers=14, heads=28, kv_heads=4,
           head_dim=128, config=dict(tie_word_embeddings=False, rope_theta=1e6)),
    Preset("mistral-7b-16L", "mistral", hidden=4096, intermediate=14336, vocab=32768, layers=16, heads=32, kv_heads=8,
           head_dim=128, config=dict(sliding_window=None, rope_theta=1e6, tie_word_embeddings=False)),
    Preset("mixtral-8x7b-2L", "mixtral", hidden=4096, intermediate=14336, vocab=32000, layers=2, heads=32, kv_heads=8,
           head_dim=128, experts=8, top_k=2, moe_intermediate=14336, config=dict(rope_theta=1e6)),
    # tiny variants of the issue-17 families: 2 layers, hidden 64, token ids inside the vocab
    Preset("qwen2-tiny", "qwen2", **_TINY, config=dict(tie_word_embeddings=True)),
    Preset("qwen2-moe-tiny", "qwen2_moe", **_TINY, experts=8, top_k=2, moe_intermediate=32, shared_intermediate=48,
           config=dict(norm_topk_prob=False)),
    Preset("mistral-tiny", "mistral", **_TINY, config=dict(sliding_window=None)),
    Preset("mixtral-tiny", "mixtral", **_TINY, experts=8, top_k=2, moe_intermediate=32),
    Preset("gemma-tiny", "gemma", **_TINY),
    Preset("gemma2-tiny", "gemma2", **_TINY, config=dict(final_logit_softcapping=1.0, attn_logit_softcapping=50.0,
                                                         query_pre_attn_scalar=16, sliding_window=4)),
    Preset("gemma3-tiny", "gemma3_text", **_TINY, config=dict(sliding_window=4, query_pre_attn_scalar=16,
                                                              layer_types=["sliding_attention", "full_attention"])),
    Preset("phi3-tiny", "phi3", **_TINY),
    Preset("olmo2-tiny", "olmo2", **_TINY),
    Preset("granite-tiny", "granite", **_TINY, config=dict(embedding_multiplier=12.0, logits_scaling=8.0,
                                                           residual_multiplier=0.22, attention_multiplier=0.0625,
                                                           tie_word_embeddings=True)),
    Preset("glm4-tiny", "glm4", **_TINY, config=dict(partial_rotary_factor=0.5, attention_bias=True)),
    Preset("smollm3-tiny", "smollm3", **_TINY, config=dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    Preset("qwen3.5-moe-tiny", "qwen3_5_moe_text", **_TINY, experts=8, top_k=2, moe_intermediate=32,
           shared_intermediate=48, attention_layers=(1,),
           config=dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4)),
]}
# `--preset tiny` with a model type picks that family's tiny preset
TINY_FOR_MODEL = {"qwen3": "qwen3-tiny", "llama": "llama-tiny", "qwen3_moe": "qwen3-moe-tiny",
                  "lfm2": "lfm2-tiny", "lfm2_moe": "lfm2-moe-tiny", "lfm2_vl": "lfm2-vl-tiny",
                  "qwen2": "qwen2-tiny", "qwen2_moe": "qwen2-moe-tiny", "mistral": "mistral-tiny",
                  "mixtral": "mixtral-tiny", "gemma": "gemma-tiny", "gemma2": "gemma2-tiny",
                  "gemma3_text": "gemma3-tiny", "phi3": "phi3-tiny", "olmo2": "olmo2-tiny",
                  "granite": "granite-tiny", "glm4": "glm4-tiny", "smollm3": "smollm3-tiny",
                  "qwen3_5_moe_text": "qwen3.5-moe-tiny"}


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
        for key in ("tokens", "quick_tokens", "attention_layers"):
            if key in data:
                data[key] = tuple(data[key])
        data.setdefault("name", path.stem)
        try:
            return Preset(**data)
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}; fields: {', '.join(f.name for f in dataclasses.fields(Preset))}") from None
    raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}, tiny, or a PATH.json")


def presets_for(model_type: str) -> list[Preset]:
    return [p for p in PRESETS.values() if p.model_type == model_type]
