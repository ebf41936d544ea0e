"""Model presets: the dims that sweeps, parity and model benchmarks are planned from.

Figures follow the released configs of each model family (hidden, layers, intermediate, heads,
vocab...). Tiny variants keep the same structure at CPU-friendly sizes.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    model_type: str              # qwen3, llama, qwen3_moe, lfm2, lfm2_moe, lfm2_vl
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TINY_TOKENS = dict(tokens=(16, 64), quick_tokens=(32,), tiny=True)

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
]}
# `--preset tiny` with a model type picks that family's tiny preset
TINY_FOR_MODEL = {"qwen3": "qwen3-tiny", "llama": "llama-tiny", "qwen3_moe": "qwen3-moe-tiny",
                  "lfm2": "lfm2-tiny", "lfm2_moe": "lfm2-moe-tiny", "lfm2_vl": "lfm2-vl-tiny"}


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
