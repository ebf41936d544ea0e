"""The model families beyond the first six (Qwen2/2.5, Qwen2-MoE, Mistral, Mixtral, Gemma 1/2/3, Phi-3,
OLMo-2, Granite, GLM-4, SmolLM3, Qwen3.5-MoE): specs, presets, layer forwards, parity.

The parity tests run each family's tiny preset (2 layers, hidden 64) patched with every flag it
takes (defaults, rope where it has a rope row, fused_linear_cross_entropy) through the Triton
interpreter in fp32, gated by liger_rt.tools.parity; the others run the torch references
(LIGER_RT_DISABLE=1) or no model at all, to stay fast.  Independent references: the unpatched
Hugging Face model (parity) and the HF modules themselves (layer tests).
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import liger_rt
from liger_rt.kernels import moe_experts
from liger_rt.patch import specs
from liger_rt.tools import parity as P
from liger_rt.tools.models import build_model
from liger_rt.tools.presets import PRESETS, TINY_FOR_MODEL, get_preset
from routing import record_impls, release_patches

pytestmark = pytest.mark.filterwarnings("ignore:.*(causal_conv1d|flash-linear-attention|overflow encountered).*")

NEW = ("qwen2", "qwen2_moe", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
       "glm4", "smollm3", "qwen3_5_moe_text")


def _available(model_type):
    """pytest.param for a family, skipped (with the reason) where this transformers lacks it."""
    why = specs.unavailable(model_type)
    return pytest.param(model_type, marks=pytest.mark.skipif(why is not None, reason=str(why)), id=model_type)


FAMILIES = [_available(m) for m in NEW]


@pytest.fixture(autouse=True)
def _no_class_patches():
    yield
    release_patches()


def _tiny(model_type):
    return lambda: build_model(get_preset("tiny", model_type))


# -- the table ------------------------------------------------------------------------------------------

def test_supported_models_lists_at_least_18_families():
    got = liger_rt.supported_models()
    assert len(got) >= 18, got
    assert got[:6] == ["qwen3", "llama", "lfm2", "lfm2_moe", "lfm2_vl", "qwen3_moe"]
    for m in NEW:
        assert (m in got) == (specs.unavailable(m) is None), m
        assert m in TINY_FOR_MODEL and m in specs.ALLOWLIST


def test_unavailable_family_is_left_out_with_the_reason(monkeypatch):
    gone = dataclasses.replace(specs.SPECS["smollm3"], module="transformers.models.smollm3.modeling_not_here")
    monkeypatch.setitem(specs.SPECS, "smollm3", gone)
    assert "smollm3" not in liger_rt.supported_models()
    with pytest.raises(ValueError, match=r"'smollm3' \(transformers .* has no .*modeling_not_here; pip install -U"):
        liger_rt.patch("smollm3")
    with pytest.raises(ValueError, match=r"'gemma3' \(.*Gemma3ForCausalLM, model type gemma3_text\)"):
        liger_rt.patch("gemma3")           # the multimodal model type points at its text model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_spec_rows_resolve_in_this_transformers(model_type):
    """Every class and function a spec names exists, and each layer forward and predicate imports."""
    mod = importlib.import_module(specs.SPECS[model_type].module)
    for module_name, class_name, row in specs.rows(specs.SPECS[model_type]):
        assert isinstance(getattr(importlib.import_module(module_name), class_name, None), type), class_name
        for path in filter(None, (row.forward, row.applies)):
            name, _, attr = path.partition(":")
            assert callable(getattr(importlib.import_module(name), attr))
    for module_name, fn_name, _ in specs.function_rows(specs.SPECS[model_type]):
        assert callable(getattr(importlib.import_module(module_name), fn_name)), (module_name, fn_name)
    for cls in specs.SPECS[model_type].causal_lm:
        assert isinstance(getattr(mod, cls), type)


def test_moe_families_share_one_experts_row():
    """mixtral, qwen2_moe, qwen3_moe, qwen3_5_moe_text: experts through transformers' interface, one Layer."""
    rows = [r for m in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe_text")
            for _, _, r in specs.rows(specs.SPECS[m]) if r.flag == "moe_experts"]
    assert len(rows) == 4 and all(r is specs.MOE_EXPERTS and r.experts for r in rows)


# -- presets --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", FAMILIES)
def test_tiny_presets_are_tiny_and_build(model_type):
    p = get_preset("tiny", model_type)
    assert p.model_type == model_type and p.tiny and p.layers == 2 and p.hidden == 64
    model = build_model(p)
    assert model.config.model_type == model_type and model.config.num_hidden_layers == 2


# parameters of the released models (model cards), within 3% (vision towers left out)
RELEASED = {"qwen2.5-7b": 7.62e9, "mistral-7b": 7.25e9, "mixtral-8x7b": 46.7e9, "gemma-2b": 2.51e9,
            "gemma2-2b": 2.61e9, "gemma3-4b": 3.88e9, "phi3-mini": 3.82e9, "olmo2-7b": 7.30e9,
            "granite-3.3-2b": 2.53e9, "glm4-9b": 9.40e9, "smollm3-3b": 3.08e9, "qwen1.5-moe-a2.7b": 14.3e9,
            "qwen3.5-35b-a3b": 35e9}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_real_size_presets_match_the_released_models(name):
    p = PRESETS[name]
    if specs.unavailable(p.model_type):
        pytest.skip(specs.unavailable(p.model_type))
    model = build_model(p, device="meta")
    n = sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())
    assert abs(n / RELEASED[name] - 1) < 0.03, f"{name}: {n / 1e9:.3f}B parameters, released {RELEASED[name] / 1e9}B"


def test_cut_presets_keep_the_released_widths():
    for cut, full, layers in (("qwen2.5-7b-14L", "qwen2.5-7b", 14), ("mistral-7b-16L", "mistral-7b", 16),
                              ("mixtral-8x7b-2L", "mixtral-8x7b", 2)):
        assert PRESETS[cut] == dataclasses.replace(PRESETS[full], name=cut, layers=layers)


# -- layer forwards against the HF modules -------------------------------------------------------------------

def test_offset_rms_norm_matches_gemma_and_qwen3_5_norms(fallback):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from liger_rt.layers.families import offset_rms_norm_forward, rms_norm_as_input_forward
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=g)
    for cls, fwd in ((Gemma2RMSNorm, offset_rms_norm_forward), (Olmo2RMSNorm, rms_norm_as_input_forward)):
        norm = cls(48, eps=1e-6)
        with torch.no_grad():
            norm.weight.normal_(0, 0.5, generator=g)
        torch.testing.assert_close(fwd(norm, x), norm(x))            # HF computes in fp32 whatever x is
        assert fwd(norm, x.bfloat16()).dtype == torch.bfloat16 == norm(x.bfloat16()).dtype


def test_applies_predicates_refuse_other_activations(fallback):
    """A Gemma MLP with exact GELU and a Phi-3 MLP with GELU stay on the host, with the reason."""
    gemma = build_model(get_preset("tiny", "gemma2"), hidden_activation="gelu")         # exact (erf) GELU
    liger_rt.patch(gemma)
    skipped = dict(liger_rt.patch.describe(gemma)["skipped"])
    assert "GELUActivation, not the tanh-approximate GELU" in skipped["model.layers.0.mlp"]
    phi3 = build_model(get_preset("tiny", "phi3"), hidden_act="gelu_pytorch_tanh")
    liger_rt.patch(phi3)
    assert "not SiLU" in dict(liger_rt.patch.describe(phi3)["skipped"])["model.layers.1.mlp"]


# -- the loss: what each causal LM does to its logits ----------------------------------------------------------

@pytest.mark.parametrize("model_type,drop", [("gemma2", "softcap"), ("granite", "logits_scaling")])
def test_fused_loss_applies_the_head_transform(model_type, drop, monkeypatch, fallback):
    """Gemma 2's final-logit softcapping and Granite's logits_scaling: parity passes with them, and
    fails on the loss and gradients without them (the gate can fail)."""
    from liger_rt.layers import loss
    flags = {"fused_linear_cross_entropy": True}
    report = P.compare(_tiny(model_type), patch=flags)
    assert report["ok"] and report["patched"]["patched"]["fused_linear_cross_entropy"] == 1, P.format_table(report)
    real = loss.head_transform
    monkeypatch.setattr(loss, "head_transform", lambda config, head: {k: v for k, v in real(config, head).items()
                                                                      if k != drop})
    report = P.compare(_tiny(model_type), patch=flags)
    assert not report["rows"]["optimisation_loss"]["ok"] and not report["rows"]["gradients"]["ok"]


def test_scaled_head_with_a_bias_keeps_the_host_forward(monkeypatch, fallback):
    from liger_rt.layers import loss
    model = build_model(get_preset("tiny", "granite"))
    model.lm_head = torch.nn.Linear(64, 160, bias=True)
    assert loss.head_transform(model.config, model.lm_head) is None
    liger_rt.patch(model, fused_linear_cross_entropy=True)
    ids = torch.randint(1, 160, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None and torch.isfinite(out.loss)          # the host's own loss


# -- MoE experts through transformers' experts interface ------------------------------------------------------

@pytest.mark.parametrize("model_type", [_available(m) for m in ("mixtral", "qwen2_moe", "qwen3_moe")])
@pytest.mark.parametrize("level", ["instance", "class"])
def test_experts_run_through_the_interface_registration(model_type, level, monkeypatch, fallback):
    """No per-model code: instance patching switches config._experts_implementation to liger_rt,
    class patching binds the registered function; either way ops.moe_experts runs, and matches."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ids = torch.randint(1, 160, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = build_model(get_preset("tiny", model_type))(input_ids=ids).logits     # before any patch
    if level == "class":
        liger_rt.patch(model_type)
        model = build_model(get_preset("tiny", model_type))
    else:
        model = build_model(get_preset("tiny", model_type))
        liger_rt.patch(model)
        assert model.config._experts_implementation == "liger_rt"
    assert "liger_rt" in ALL_EXPERTS_FUNCTIONS
    ran = record_impls(monkeypatch, moe_experts.OP)
    torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert len(ran) == 2, ran                                      # one per layer
    liger_rt.unpatch(model if level == "instance" else model_type)
    if level == "instance":
        assert model.config._experts_implementation != "liger_rt"


# -- parity through the interpreter ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_parity_cpu_fp32_interpreter(model_type):
    """Every flag of the family on, the Triton kernels through the interpreter, the parity gates."""
    flags = specs.parity_flags(model_type)
    report = P.compare(_tiny(model_type), patch=flags)
    assert report["ok"], P.format_table(report)
    patched = report["patched"]["patched"]
    assert set(patched) == set(flags), (patched, flags)          # every flag replaced something
    assert not report["patched"]["skipped"]
