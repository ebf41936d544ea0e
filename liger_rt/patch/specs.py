"""Model-family specs for ``liger_rt.patch``: one small table per family.

Spec format
-----------
::

    ModelSpec(model_type,
              layers={"<ClassName>": LAYER, ...},      # module class -> liger_rt forward
              causal_lm=("<LM-head class>", ...),       # whose forward/loss the loss flags replace
              defaults={"<flag>", ...},                 # flags on when the caller does not say
              includes=("<other model_type>",),         # borrow another family's layers
              functions={"<function name>": LAYER})     # module-level functions of the modeling module

- Class names resolve through the family's modeling module,
  ``transformers.models.<model_type>.modeling_<model_type>``, *at patch time* (importlib, then
  getattr): never a from-import captured when liger_rt was imported, so the patch sees the class
  the model is really built from.  ``"torch.nn:LayerNorm"`` names a class in another module.
- A ``Layer`` is a row's right-hand side:
    ``flag``      the patch flag that switches it (``rms_norm``, ``swiglu``, ...);
    ``forward``   ``"module:function"`` under liger_rt.layers, bound as the module's forward;
    ``op``        the op whose kernel module it needs (``liger_rt.kernels.<op>``);
    ``within``    instance patching only touches modules below a submodule of this name
                  (the SigLIP2 vision tower's LayerNorms, not the projector's);
    ``applies``   ``"module:function"`` predicate, module -> None or why it is left alone
                  (an MLP whose activation is not SiLU);
    ``experts``   the forward comes from transformers' experts interface: instance patching sets
                  ``config._experts_implementation = "liger_rt"``, class patching binds the
                  registered function;
    ``class_level`` False: instance patching only (patching ``torch.nn.LayerNorm`` itself would
                  change every LayerNorm in the process).
- ``functions`` rows swap a function of the modeling module itself (``apply_rotary_pos_emb``, which
  the attention forward looks up as a module global) for ``forward``; the swap is module-wide (every
  model of that family in the process uses it) and reference-counted, undone by the last unpatch.
- Every family also takes ``rope``, ``cross_entropy``, ``fused_linear_cross_entropy`` and
  ``keep_logits``, all off by default.  ``rope=True`` (families with a rope function row) swaps
  HF's ``apply_rotary_pos_emb`` for ``liger_rt.ops.rope``, same signature and results; the host
  keeps computing cos/sin (its rotary layout and scaling), and attention is never touched.

Adding a family is adding one ``ModelSpec`` here, a tiny preset in tools/presets.py and a parity
test; ``supported_models()`` is the list of families validated that way.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Layer:
    flag: str
    forward: str
    op: str | None = None
    within: str | None = None
    applies: str | None = None
    experts: bool = False
    class_level: bool = True


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    layers: Mapping[str, Layer]
    causal_lm: tuple[str, ...] = ()
    defaults: frozenset = frozenset()
    includes: tuple[str, ...] = ()
    functions: Mapping[str, Layer] = dataclasses.field(default_factory=dict)
    module: str = ""          # default: transformers.models.<model_type>.modeling_<model_type>

    def __post_init__(self):
        object.__setattr__(self, "defaults", frozenset(self.defaults))
        if not self.module:
            object.__setattr__(self, "module", f"transformers.models.{self.model_type}.modeling_{self.model_type}")


LOSS_FLAGS = ("cross_entropy", "fused_linear_cross_entropy", "keep_logits")
COMMON_FLAGS = ("rope", *LOSS_FLAGS)
LOSS_OPS = {"cross_entropy": "cross_entropy", "fused_linear_cross_entropy": "fused_linear_cross_entropy"}

_L = "liger_rt.layers."
RMS_NORM = Layer("rms_norm", _L + "norms:rms_norm_forward", op="rms_norm")
SWIGLU = Layer("swiglu", _L + "mlp:swiglu_forward", op="swiglu", applies=_L + "mlp:silu_gated")
SWIGLU_W132 = Layer("swiglu", _L + "mlp:swiglu_w1_w3_w2_forward", op="swiglu",         # w1 gate, w3 up, w2 down
                    applies=_L + "mlp:w1_w3_w2")
SHORT_CONV = Layer("short_conv", _L + "short_conv:short_conv_forward", op="short_conv",
                   applies=_L + "short_conv:conv_compatible")
CONV_POSITIONS = Layer("short_conv", _L + "short_conv:decoder_layer_forward")            # position_ids -> conv
MOE_ROUTER = Layer("moe_router", _L + "moe:router_forward", op="moe_router", applies=_L + "moe:router_compatible")
MOE_EXPERTS = Layer("moe_experts", _L + "moe:experts_forward", op="moe_experts", experts=True)
ROPE = Layer("rope", _L + "rope:apply_rotary_pos_emb", op="rope")
VISION_LAYER_NORM = Layer("layer_norm", _L + "norms:layer_norm_forward", op="layer_norm", within="vision_tower",
                          class_level=False)

SPECS: dict[str, ModelSpec] = {s.model_type: s for s in [
    ModelSpec("qwen3", {"Qwen3RMSNorm": RMS_NORM, "Qwen3MLP": SWIGLU},
              causal_lm=("Qwen3ForCausalLM",), defaults={"rms_norm", "swiglu"},
              functions={"apply_rotary_pos_emb": ROPE}),
    ModelSpec("llama", {"LlamaRMSNorm": RMS_NORM, "LlamaMLP": SWIGLU},
              causal_lm=("LlamaForCausalLM",), defaults={"rms_norm", "swiglu"},
              functions={"apply_rotary_pos_emb": ROPE}),
    ModelSpec("qwen3_moe", {"Qwen3MoeRMSNorm": RMS_NORM, "Qwen3MoeMLP": SWIGLU, "Qwen3MoeExperts": MOE_EXPERTS},
              causal_lm=("Qwen3MoeForCausalLM",), defaults={"rms_norm", "swiglu", "moe_experts"},
              functions={"apply_rotary_pos_emb": ROPE}),
    ModelSpec("lfm2", {"Lfm2RMSNorm": RMS_NORM, "Lfm2MLP": SWIGLU_W132, "Lfm2ShortConv": SHORT_CONV,
                       "Lfm2DecoderLayer": CONV_POSITIONS},
              causal_lm=("Lfm2ForCausalLM",), defaults={"rms_norm", "swiglu", "short_conv"}),
    ModelSpec("lfm2_moe", {"Lfm2MoeRMSNorm": RMS_NORM, "Lfm2MoeMLP": SWIGLU_W132, "Lfm2MoeShortConv": SHORT_CONV,
                           "Lfm2MoeDecoderLayer": CONV_POSITIONS, "Lfm2MoeTopKRouter": MOE_ROUTER,
                           "Lfm2MoeExperts": MOE_EXPERTS},
              causal_lm=("Lfm2MoeForCausalLM",),
              defaults={"rms_norm", "swiglu", "short_conv", "moe_router", "moe_experts"}),
    # the text decoder is LFM2; the SigLIP2 tower's LayerNorm is off by default (native LayerNorm
    # is faster at hidden 1152, NOTES.md)
    ModelSpec("lfm2_vl", {"torch.nn:LayerNorm": VISION_LAYER_NORM}, includes=("lfm2",),
              causal_lm=("Lfm2VlForConditionalGeneration",), defaults={"rms_norm", "swiglu", "short_conv"}),
]}

# validated families; qwen3_moe joins once its experts implementation is in the checkout
ALLOWLIST = ("qwen3", "llama", "lfm2", "lfm2_moe", "lfm2_vl")
NEEDS_EXPERTS = ("qwen3_moe",)


def rows(spec: ModelSpec) -> list[tuple[str, str, Layer]]:
    """(module name, class name, Layer) for every row of a spec and the specs it includes."""
    out = []
    for other in spec.includes:
        out += rows(SPECS[other])
    for key, layer in spec.layers.items():
        module, _, name = key.rpartition(":")
        out.append((module or spec.module, name, layer))
    return out


def function_rows(spec: ModelSpec) -> list[tuple[str, str, Layer]]:
    """(module name, function name, Layer) for every function row of a spec and its includes."""
    out = []
    for other in spec.includes:
        out += function_rows(SPECS[other])
    out += [(spec.module, name, layer) for name, layer in spec.functions.items()]
    return out


def flags(spec: ModelSpec) -> tuple[str, ...]:
    """Every flag the family takes, its layer flags first."""
    seen = []
    for _, _, layer in rows(spec):
        if layer.flag not in seen:
            seen.append(layer.flag)
    return (*seen, *COMMON_FLAGS)
