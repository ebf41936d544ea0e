"""Model-family specs for ``liger_rt.patch``: one small table per family (format: docs/patching.md).

Class names resolve through the family's modeling module at patch time (importlib, then getattr), so the
patch sees the class the model is really built from; a "module:name" key names one elsewhere.
``functions`` rows swap a function of the modeling module (``apply_rotary_pos_emb``): module-wide,
reference-counted, undone by the last unpatch.  Adding a family is adding one ``ModelSpec`` here, a tiny
preset in tools/presets.py and a parity test.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Layer:
    flag: str                       # the patch flag (rms_norm, swiglu, ...)
    forward: str                    # "module:function" under liger_rt.layers, bound as the module's forward
    op: str | None = None           # the op whose kernel module it needs (liger_rt.kernels.<op>)
    within: str | None = None       # instance patching only below a submodule of this name (SigLIP2's tower)
    applies: str | None = None      # "module:function" predicate: module -> None, or why it is left alone
    experts: bool = False           # through transformers' experts interface (config._experts_implementation)
    class_level: bool = True        # False: instance only (patching torch.nn.LayerNorm would hit every one)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    layers: Mapping[str, Layer]                 # module class name -> liger_rt forward
    causal_lm: tuple[str, ...] = ()             # LM-head classes whose forward/loss the loss flags replace
    defaults: frozenset = frozenset()           # flags on when the caller does not say
    includes: tuple[str, ...] = ()              # other families whose rows this one borrows
    functions: Mapping[str, Layer] = dataclasses.field(default_factory=dict)    # modeling-module functions
    module: str = ""          # default: transformers.models.<model_type>.modeling_<model_type>

    def __post_init__(self):
        object.__setattr__(self, "defaults", frozenset(self.defaults))
        if not self.module:
            object.__setattr__(self, "module", f"transformers.models.{self.model_type}.modeling_{self.model_type}")


# the loss flags: each replaces the causal LM's loss / log-probs path, running the op named
LOSS_OPS = {"cross_entropy": "cross_entropy", "fused_linear_cross_entropy": "fused_linear_cross_entropy",
            "logprobs": "fused_linear_logprobs"}
LOSS_FLAGS = tuple(LOSS_OPS)
COMMON_FLAGS = ("rope", *LOSS_FLAGS, "keep_logits", "causal_mask")      # every family takes these
COMMON_DEFAULTS = frozenset({"causal_mask"})    # on for every family unless the caller says otherwise

_L = "liger_rt.layers."
RMS_NORM = Layer("rms_norm", _L + "norms:rms_norm_forward", op="rms_norm")
SWIGLU = Layer("swiglu", _L + "mlp:swiglu_forward", op="swiglu", applies=_L + "mlp:silu_gated")
SWIGLU_W132 = Layer("swiglu", _L + "mlp:swiglu_w1_w3_w2_forward", op="swiglu",         # w1 gate, w3 up, w2 down
                    applies=_L + "mlp:w1_w3_w2")
SHORT_CONV = Layer("short_conv", _L + "short_conv:short_conv_forward", op="short_conv",
                   applies=_L + "short_conv:conv_compatible")
CONV_POSITIONS = Layer("short_conv", _L + "short_conv:decoder_layer_forward")            # position_ids -> conv
MOE_ROUTER = Layer("moe_router", _L + "moe:router_forward", op="moe_router", applies=_L + "moe:router_compatible")
MOE_EXPERTS = Layer("moe_experts", _L + "moe_experts_interface:liger_rt_experts_forward", op="moe_experts",
                    experts=True)
ROPE = Layer("rope", _L + "rope:apply_rotary_pos_emb", op="rope")
VISION_LAYER_NORM = Layer("layer_norm", _L + "norms:layer_norm_forward", op="layer_norm", within="vision_tower",
                          class_level=False)

# families whose modules differ from Llama's in one detail (layers/families.py, layers/mlp.py)
OFFSET_RMS_NORM = Layer("rms_norm", _L + "families:offset_rms_norm_forward", op="rms_norm")      # (1 + w)
RMS_NORM_AS_INPUT = Layer("rms_norm", _L + "families:rms_norm_as_input_forward", op="rms_norm")  # OLMo-2
GATE_UP_SWIGLU = Layer("swiglu", _L + "families:gate_up_swiglu_forward", op="swiglu",            # fused gate_up_proj
                       applies=_L + "families:silu_gate_up")
GEGLU = Layer("geglu", _L + "mlp:geglu_forward", op="geglu", applies=_L + "mlp:gelu_tanh_gated")
ROPE_AS_INPUT = Layer("rope", _L + "families:apply_rotary_pos_emb_as_input", op="rope")         # OLMo-2's casts
# the Llama-shaped decoder layer, its residual add fused into the post-attention norm (layers/fused_add_norm.py)
FUSED_ADD_NORM = Layer("fused_add_norm", _L + "fused_add_norm:decoder_layer_forward", op="fused_add_rms_norm",
                       applies=_L + "fused_add_norm:fusable")
OFFSET_FUSED_ADD_NORM = Layer("fused_add_norm", _L + "fused_add_norm:offset_decoder_layer_forward",   # (1 + w)
                              op="fused_add_rms_norm", applies=_L + "fused_add_norm:fusable")
# layer flags a family takes but leaves off unless the caller turns them on: fused_add_norm until a model step
# measures a gain on the H100 and the H200
OFF_BY_DEFAULT = frozenset({"fused_add_norm"})
# every family: under torch.compile, no padding mask keeps SDPA on is_causal (flash attention), as eager does
# (and no cache, positions the model made itself: not packed, known without reading them)
CAUSAL_MASK = Layer("causal_mask", _L + "attention:ignore_causal_mask_sdpa")
OWN_POSITIONS = Layer("causal_mask", _L + "attention:find_packed_sequence_indices")
COMMON_FUNCTIONS = {"transformers.masking_utils:_ignore_causal_mask_sdpa": CAUSAL_MASK,
                    "transformers.masking_utils:find_packed_sequence_indices": OWN_POSITIONS}


def _llama_like(model_type: str, prefix: str, rope: Layer | None = ROPE, norm: Layer = RMS_NORM,
                mlp: Layer | None = SWIGLU, experts: bool = False, models: str = "", decoder: Layer | None = None,
                **more: Layer) -> ModelSpec:
    """A decoder family shaped like Llama: rows <prefix>RMSNorm, [<prefix>MLP], ``more`` (class name ->
    row), [<prefix>Experts], [<prefix>DecoderLayer: ``decoder``], the causal LM <prefix>ForCausalLM,
    [apply_rotary_pos_emb]; its layer flags on by default but OFF_BY_DEFAULT's.  ``models``: the
    transformers.models folder, where it is not the model type."""
    layers = {f"{prefix}RMSNorm": norm, **({f"{prefix}MLP": mlp} if mlp else {}), **more}
    if experts:
        layers[f"{prefix}Experts"] = MOE_EXPERTS
    if decoder:
        layers[f"{prefix}DecoderLayer"] = decoder
    return ModelSpec(model_type, layers, causal_lm=(prefix + "ForCausalLM",),
                     defaults={row.flag for row in layers.values()} - OFF_BY_DEFAULT,
                     functions={"apply_rotary_pos_emb": rope} if rope else {},
                     module=f"transformers.models.{models}.modeling_{models}" if models else "")


SPECS: dict[str, ModelSpec] = {s.model_type: s for s in [
    _llama_like("qwen3", "Qwen3", decoder=FUSED_ADD_NORM),
    _llama_like("llama", "Llama", decoder=FUSED_ADD_NORM),
    _llama_like("qwen3_moe", "Qwen3Moe", experts=True, decoder=FUSED_ADD_NORM),
    _llama_like("lfm2", "Lfm2", mlp=SWIGLU_W132, Lfm2ShortConv=SHORT_CONV, Lfm2DecoderLayer=CONV_POSITIONS),
    _llama_like("lfm2_moe", "Lfm2Moe", mlp=SWIGLU_W132, experts=True, Lfm2MoeShortConv=SHORT_CONV,
                Lfm2MoeDecoderLayer=CONV_POSITIONS, Lfm2MoeTopKRouter=MOE_ROUTER),
    # the text decoder is LFM2; the SigLIP2 tower's LayerNorm is off by default (native LayerNorm
    # is faster at hidden 1152 in wall time: docs/perf.md)
    ModelSpec("lfm2_vl", {"torch.nn:LayerNorm": VISION_LAYER_NORM}, includes=("lfm2",),
              causal_lm=("Lfm2VlForConditionalGeneration",), defaults={"rms_norm", "swiglu", "short_conv"}),
    # Llama-shaped decoders (HF modeling code read for each: norm casting and offset, MLP layout and
    # activation, what the causal LM does to its logits: layers/loss.py head_transform)
    _llama_like("qwen2", "Qwen2", decoder=FUSED_ADD_NORM),             # Qwen2 / Qwen2.5 (q/k/v biases: attention)
    _llama_like("qwen2_moe", "Qwen2Moe", experts=True,                 # MLP rows: the shared expert and dense layers
                decoder=FUSED_ADD_NORM),
    _llama_like("mistral", "Mistral", decoder=FUSED_ADD_NORM),
    _llama_like("mixtral", "Mixtral", mlp=None, experts=True,          # experts only, no dense MLP class
                decoder=FUSED_ADD_NORM),
    _llama_like("gemma", "Gemma", norm=OFFSET_RMS_NORM, mlp=GEGLU, decoder=OFFSET_FUSED_ADD_NORM),
    _llama_like("gemma2", "Gemma2", norm=OFFSET_RMS_NORM, mlp=GEGLU),  # post-norms too; final logit softcapping
    _llama_like("gemma3_text", "Gemma3", norm=OFFSET_RMS_NORM, mlp=GEGLU, models="gemma3"),   # q/k norms too
    _llama_like("phi3", "Phi3", rope=None, mlp=GATE_UP_SWIGLU),       # rope: partial rotary (rotary_dim < head_dim)
    _llama_like("olmo2", "Olmo2", rope=ROPE_AS_INPUT, norm=RMS_NORM_AS_INPUT),   # post-norms, q/k norms
    _llama_like("granite", "Granite"),                                # logits / logits_scaling
    _llama_like("glm4", "Glm4", rope=None, mlp=GATE_UP_SWIGLU),       # rope: interleaved and partial
    _llama_like("smollm3", "SmolLM3", decoder=FUSED_ADD_NORM),         # NoPE layers skip rope inside attention
    # Qwen3.5-MoE's text model (what AutoModelForCausalLM builds, config.model_type qwen3_5_moe_text):
    # (1 + w) norms; gated-delta-net layers and their gated norm, partial rope stay with the host
    _llama_like("qwen3_5_moe_text", "Qwen3_5Moe", rope=None, norm=OFFSET_RMS_NORM, experts=True,
                models="qwen3_5_moe"),
]}

# validated families (each has a tiny preset and a CPU parity test), in the order supported_models()
# lists them; a family joins only where this transformers has its modeling module, and those needing
# liger_rt experts only where it has the experts interface (unavailable() says why not)
ALLOWLIST = ("qwen3", "llama", "lfm2", "lfm2_moe", "lfm2_vl", "qwen3_moe", "qwen2", "qwen2_moe", "mistral",
             "mixtral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "glm4", "smollm3",
             "qwen3_5_moe_text")
NEEDS_EXPERTS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_5_moe_text")


# multimodal model types whose text model is validated (its config.model_type differs)
TEXT_MODEL = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
              "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM, what AutoModelForCausalLM builds")}


def experts_interface_missing() -> str | None:
    """None when this transformers has the experts interface liger_rt experts register in, else why not."""
    if importlib.util.find_spec("transformers.integrations.moe") is None:
        return "this transformers has no experts interface (transformers.integrations.moe); pip install -U transformers"
    return None


def unavailable(model_type: str) -> str | None:
    """Why a model type cannot be patched here (None: it can, or it is not in the allowlist)."""
    if model_type in TEXT_MODEL:
        text, cls = TEXT_MODEL[model_type]
        return f"its multimodal model is not validated; its text model is: {cls}, model type {text}"
    if model_type not in ALLOWLIST:
        return None
    if model_type in NEEDS_EXPERTS:
        if (why := experts_interface_missing()) is not None:
            return f"{model_type} is validated with liger_rt experts, and {why}"
    for module in {SPECS[m].module for m in (model_type, *SPECS[model_type].includes)}:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            import transformers
            return f"transformers {transformers.__version__} has no {module}; pip install -U transformers"
    return None


def _resolved(spec: ModelSpec, table: Mapping[str, Layer]) -> list[tuple[str, str, Layer]]:
    # "module:name" keys name an object outside the family's modeling module
    return [(key.rpartition(":")[0] or spec.module, key.rpartition(":")[2], layer) for key, layer in table.items()]


def rows(spec: ModelSpec) -> list[tuple[str, str, Layer]]:
    """(module name, class name, Layer) for every row of a spec and the specs it includes."""
    return [row for other in spec.includes for row in rows(SPECS[other])] + _resolved(spec, spec.layers)


def function_rows(spec: ModelSpec) -> list[tuple[str, str, Layer]]:
    """(module name, function name, Layer) for every function row of a spec, its includes and COMMON_FUNCTIONS."""
    out = [row for other in spec.includes for row in function_rows(SPECS[other])]
    return list(dict.fromkeys(out + _resolved(spec, {**spec.functions, **COMMON_FUNCTIONS})))


def has_rope(spec: ModelSpec) -> bool:
    return any(row.flag == "rope" for _, _, row in function_rows(spec))


def flags(spec: ModelSpec) -> tuple[str, ...]:
    """Every flag the family takes, its layer flags first."""
    return (*dict.fromkeys(layer.flag for _, _, layer in rows(spec)), *COMMON_FLAGS)


def parity_flags(model_type: str) -> dict[str, bool]:
    """The flags a family's parity gates run with: its defaults, rope where it has a rope row, the fused loss."""
    spec = SPECS[model_type]
    rope = {"rope": True} if has_rope(spec) else {}
    return {**dict.fromkeys(sorted(spec.defaults), True), **rope, "fused_linear_cross_entropy": True}
