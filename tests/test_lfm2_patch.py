"""LFM2 family patchers (lfm2, lfm2_moe, lfm2_vl): parity, the short conv's cache and packing rules,
the MoE router and experts, the SigLIP2 LayerNorm.  Parts whose kernel module is absent skip."""
from __future__ import annotations

import importlib
import importlib.util
import io
import warnings

import pytest
import torch

import liger_rt
from liger_rt import dispatch
from liger_rt.layers import short_conv as sc
from liger_rt.patch import core
from liger_rt.registry import REGISTRY
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import make_inputs
from hf_compat import enable_checkpointing
from patched_models import Counter, ours, pair

_MISSING = [op for op in ("rms_norm", "swiglu", "short_conv")
            if importlib.util.find_spec(f"liger_rt.kernels.{op}") is None]
pytestmark = [pytest.mark.filterwarnings("ignore:.*causal_conv1d.*"),
              pytest.mark.skipif(bool(_MISSING), reason=f"kernel module(s) {', '.join(_MISSING)} not in this checkout")]




@pytest.fixture(autouse=True)
def _clean():
    yield
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)


def _experts_available() -> bool:
    return importlib.util.find_spec("liger_rt.layers.moe_experts_interface") is not None


def _patch(model, **flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", core.PatchWarning)     # experts interface may not be here yet
        return liger_rt.patch(model, **flags)


def _check_parity(base, new, atol):
    inputs = make_inputs(base)
    valid = inputs["attention_mask"].bool()
    outs = []
    for model in (base, new):
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        out.loss.backward()
        outs.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ob, gb), (on, gn) = outs
    torch.testing.assert_close(on.logits[valid], ob.logits[valid], atol=atol, rtol=atol)
    torch.testing.assert_close(on.loss, ob.loss, atol=atol, rtol=atol)
    assert gb.keys() == gn.keys()
    for name in gb:
        torch.testing.assert_close(gn[name], gb[name], atol=atol, rtol=1e-3, msg=lambda m: f"{name}: {m}")


# -- parity ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["lfm2-tiny", "lfm2-moe-tiny", "lfm2-vl-tiny"])
def test_patched_matches_unpatched_torch_fallback(preset, fallback):
    if preset == "lfm2-moe-tiny":
        pytest.importorskip("liger_rt.kernels.moe_router")
    base, new = pair(preset)
    _patch(new)
    info = liger_rt.patch.describe(new)
    assert info["patched"]["rms_norm"] >= 9 and info["patched"]["short_conv"] == 2 and info["patched"]["swiglu"] >= 1
    if preset == "lfm2-moe-tiny":
        assert info["patched"]["moe_router"] == 2
    _check_parity(base, new, atol=1e-5)


@pytest.mark.parametrize("preset", ["lfm2-tiny", "lfm2-moe-tiny"])
def test_patched_matches_unpatched_interpreter(preset):
    for op in ("rms_norm", "swiglu", "short_conv") + (("moe_router",) if "moe" in preset else ()):
        pytest.importorskip(f"liger_rt.kernels.{op}")
    base, new = pair(preset)
    _patch(new)
    _check_parity(base, new, atol=5e-5)
    impls = {d.op: d.impl for op in ("short_conv", "rms_norm") for d in dispatch.memo(REGISTRY.get(op)).values()}
    assert impls == {"short_conv": "triton", "rms_norm": "triton"}


# -- the short conv ------------------------------------------------------------------------------------

def test_short_conv_runs_fused_in_training_and_prefill_but_not_decode(monkeypatch, fallback):
    base, new = pair("lfm2-tiny")
    _patch(new)
    conv = Counter(monkeypatch, "short_conv")
    inputs = make_inputs(new)
    new(**inputs)                         # train mode, HF's default cache: still fused
    assert len(conv.calls) == 2
    (bcx, weight, bias), kwargs = conv.calls[0], conv.kwargs[0]
    assert bcx.shape == (2, 8, 192) and weight.shape == (64, 3) and bias is None
    assert kwargs["seq_idx"].shape == (2, 8)
    conv.calls.clear()
    base.eval(), new.eval()
    ids, mask = inputs["input_ids"][:, :5], inputs["attention_mask"][:, :5].flip(-1)    # left padding
    gb = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    gn = new.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(gb, gn)            # the prefill wrote the conv state the HF decode steps read
    assert len(conv.calls) == 2           # prefill only; decoding stays on the HF path


def test_packed_sequences_do_not_mix(fallback):
    # an all-conv LFM2: attention packing is the host's business, the conv's boundaries are ours
    base, new = pair("lfm2-tiny", layer_types=["conv"] * 3)
    _patch(new)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, 150, (1, 5), generator=g), torch.randint(1, 150, (1, 4), generator=g)
    packed, pos = torch.cat([a, b], 1), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    no_cache = dict(use_cache=False)      # HF's cache cannot hold an all-conv model's sequence length
    separate = torch.cat([base(input_ids=a, **no_cache).logits, base(input_ids=b, **no_cache).logits], 1)
    got = new(input_ids=packed, position_ids=pos, **no_cache).logits
    torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 5, 9])
    got = new(input_ids=packed, cu_seq_lens_q=cu, **no_cache).logits
    torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)
    got = new(input_ids=packed, seq_idx=torch.tensor([[0] * 5 + [1] * 4]), **no_cache).logits
    torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)


def test_packed_sequences_fall_back_to_the_segment_reference_when_the_op_cannot(monkeypatch, fallback):
    base, new = pair("lfm2-tiny", layer_types=["conv"] * 3)
    _patch(new)

    def no_seq_idx(bcx, weight, bias=None):            # an op without seq_idx support
        return sc.short_conv_ref(bcx, weight, bias)
    monkeypatch.setattr(liger_rt.ops, "short_conv", no_seq_idx)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 150, (1, 4), generator=g), torch.randint(1, 150, (1, 4), generator=g)
    separate = torch.cat([base(input_ids=a, use_cache=False).logits, base(input_ids=b, use_cache=False).logits], 1)
    got = new(input_ids=torch.cat([a, b], 1), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
              use_cache=False).logits
    torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)


def test_conv_layers_share_one_seq_idx_per_forward(monkeypatch, fallback):
    """The conv layers of a forward receive one position_ids tensor: its sequence ids are computed
    once (each recomputation costs launches), and again only for another tensor, another batch, or
    the same tensor changed in place; inference tensors (no version counter) are not cached."""
    base, new = pair("lfm2-tiny", layer_types=["conv"] * 3)
    _patch(new)
    calls = []
    real = sc.seq_idx_from_position_ids
    monkeypatch.setattr(sc, "seq_idx_from_position_ids", lambda p, b=None: calls.append(p) or real(p, b))
    monkeypatch.setattr(sc, "_last_seq_idx", [None])
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 150, (1, 4), generator=g), torch.randint(1, 150, (1, 4), generator=g)
    separate = torch.cat([base(input_ids=a, use_cache=False).logits, base(input_ids=b, use_cache=False).logits], 1)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    got = new(input_ids=torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1                                   # three conv layers, one computation

    x = sc._seq_idx(None, None, pos, 1, 8)
    assert x is sc._seq_idx(None, None, pos, 1, 8) and len(calls) == 1
    pos[0, 4:] = torch.arange(4, 8)                          # in place: one sequence now
    assert sc._seq_idx(None, None, pos, 1, 8).tolist() == [[0] * 8] and len(calls) == 2
    assert sc._seq_idx(None, None, pos.clone(), 1, 8).tolist() == [[0] * 8] and len(calls) == 3
    assert sc._seq_idx(None, None, pos, 2, 8).shape == (2, 8) and len(calls) == 4
    with torch.inference_mode():
        ip = torch.tensor([[0, 1, 0]])
        assert sc._seq_idx(None, None, ip, 1, 3).tolist() == sc._seq_idx(None, None, ip, 1, 3).tolist() == [[0, 0, 1]]
    assert len(calls) == 6


def test_seq_idx_helpers():
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6]])
    assert sc.seq_idx_from_position_ids(pos, 2).tolist() == [[0, 0, 0, 1, 1, 2, 2]] * 2
    assert sc.seq_idx_from_cu_seqlens(torch.tensor([0, 3, 5, 7]), 7).tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    bcx = torch.randn(1, 7, 6)
    w = torch.randn(2, 3)
    seq = sc.seq_idx_from_position_ids(pos, 1)
    got = sc.short_conv_ref(bcx, w, None, seq)
    want = torch.cat([sc.short_conv_ref(bcx[:, s:e], w) for s, e in ((0, 3), (3, 5), (5, 7))], 1)
    torch.testing.assert_close(got, want)


# -- MoE ----------------------------------------------------------------------------------------------

def test_moe_router_goes_through_liger(monkeypatch, fallback):
    pytest.importorskip("liger_rt.kernels.moe_router")
    model = build_model("lfm2-moe-tiny")
    _patch(model)
    router = Counter(monkeypatch, "moe_router")
    model(**make_inputs(model))
    routers = [m for m in model.modules() if type(m).__name__ == "Lfm2MoeTopKRouter"]
    assert len(router.calls) == len(routers) == 2
    (logits, top_k), kwargs = router.calls[0][:2], router.kwargs[0]
    assert top_k == 2 and kwargs["expert_bias"] is not None and kwargs["norm_topk_prob"] is True


def test_moe_experts_through_the_experts_interface(fallback):
    model = build_model("lfm2-moe-tiny")
    before = model.config._experts_implementation
    if not _experts_available():
        with pytest.warns(core.PatchWarning, match="moe_experts_interface"):
            liger_rt.patch(model)
        with pytest.raises(ImportError, match="moe_experts_interface"):
            liger_rt.patch(model, moe_experts=True)
        pytest.skip("liger_rt.layers.moe_experts_interface is not in this checkout yet")
    liger_rt.patch(model)
    assert model.config._experts_implementation == "liger_rt"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert "liger_rt" in ALL_EXPERTS_FUNCTIONS
    base = build_model("lfm2-moe-tiny")
    base.load_state_dict(model.state_dict())
    _check_parity(base, model, atol=1e-5)
    liger_rt.unpatch(model)
    assert model.config._experts_implementation == before


def test_qwen3_moe_is_allowlisted_only_with_experts(fallback):
    model = build_model("qwen3-moe-tiny")
    if not _experts_available():
        with pytest.raises(ValueError, match="qwen3_moe.*experts"):
            liger_rt.patch(model)
        return
    base = build_model("qwen3-moe-tiny")
    base.load_state_dict(model.state_dict())
    liger_rt.patch(model)
    assert model.config._experts_implementation == "liger_rt"
    _check_parity(base, model, atol=1e-5)


# -- LFM2-VL ---------------------------------------------------------------------------------------------

def test_vl_patches_the_text_decoder_and_optionally_the_vision_layer_norms(monkeypatch, fallback):
    pytest.importorskip("liger_rt.kernels.layer_norm")
    base, new = pair("lfm2-vl-tiny")
    _patch(new, layer_norm=True)
    ln = Counter(monkeypatch, "layer_norm")
    info = liger_rt.patch.describe(new)
    tower = [m for m in new.model.vision_tower.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert info["patched"]["layer_norm"] == len(tower) == 5            # 2 layers x 2 + post_layernorm
    assert "forward" not in new.model.multi_modal_projector.layer_norm.__dict__
    inputs = make_inputs(new)
    assert "pixel_values" in inputs
    new(**inputs)
    assert len(ln.calls) == len(tower)
    monkeypatch.undo()
    _check_parity(base, new, atol=1e-5)
    with pytest.raises(NotImplementedError, match="patch the loaded model instead"):
        liger_rt.patch("lfm2_vl", layer_norm=True)


def test_vl_layer_norm_is_off_by_default(fallback):
    model = build_model("lfm2-vl-tiny")
    _patch(model)
    assert "layer_norm" not in liger_rt.patch.describe(model)["patched"]
    assert not any("forward" in m.__dict__ for m in model.model.vision_tower.modules())


def test_shared_classes_are_held_jointly_by_families(fallback):
    mod = importlib.import_module("transformers.models.lfm2.modeling_lfm2")
    original = mod.Lfm2RMSNorm.__dict__["forward"]
    liger_rt.patch("lfm2")
    liger_rt.patch("lfm2_vl")
    liger_rt.unpatch("lfm2")
    assert ours(mod.Lfm2RMSNorm.forward) is liger_rt.layers.norms.rms_norm_forward      # lfm2_vl still holds it
    liger_rt.unpatch("lfm2_vl")
    assert mod.Lfm2RMSNorm.forward is original
    assert ours(mod.Lfm2ShortConv.forward) is not liger_rt.layers.short_conv.short_conv_forward


def test_class_level_lfm2_affects_models_built_afterwards(monkeypatch, fallback):
    mod = importlib.import_module("transformers.models.lfm2.modeling_lfm2")
    originals = {c: c.__dict__["forward"] for c in (mod.Lfm2ShortConv, mod.Lfm2DecoderLayer, mod.Lfm2MLP)}
    liger_rt.patch("lfm2")
    conv = Counter(monkeypatch, "short_conv")
    base = build_model("lfm2-tiny")
    base(**make_inputs(base))
    assert len(conv.calls) == 2
    liger_rt.unpatch("lfm2")
    for cls, fn in originals.items():
        assert cls.forward is fn


def test_class_level_experts_and_router(monkeypatch, fallback):
    pytest.importorskip("liger_rt.layers.moe_experts_interface")
    pytest.importorskip("liger_rt.kernels.moe_experts")
    mod = importlib.import_module("transformers.models.lfm2_moe.modeling_lfm2_moe")
    originals = {c: c.__dict__["forward"] for c in (mod.Lfm2MoeExperts, mod.Lfm2MoeTopKRouter)}
    base = build_model("lfm2-moe-tiny")
    liger_rt.patch("lfm2_moe")
    experts, router = Counter(monkeypatch, "moe_experts"), Counter(monkeypatch, "moe_router")
    model = build_model("lfm2-moe-tiny")
    assert model.config._experts_implementation != "liger_rt"       # classes, not configs, at class level
    model.load_state_dict(base.state_dict())
    model(**make_inputs(model))
    assert len(experts.calls) == 2 and len(router.calls) == 2
    monkeypatch.undo()
    liger_rt.unpatch("lfm2_moe")
    for cls, fn in originals.items():
        assert cls.forward is fn


def test_gradient_checkpointing_keeps_parity(fallback):
    base, new = pair("lfm2-moe-tiny")
    _patch(new)
    for m in (base, new):
        enable_checkpointing(m)
    _check_parity(base, new, atol=1e-5)


def test_training_with_an_unknown_cache_api_still_fuses(monkeypatch, fallback):
    base, new = pair("lfm2-tiny")
    _patch(new)
    conv = Counter(monkeypatch, "short_conv")
    layer_b, layer_n = base.model.layers[0].conv, new.model.layers[0].conv
    h = torch.randn(2, 6, 64)
    want = layer_b(hidden_states=h)
    got = layer_n(hidden_states=h, cache=object())          # a cache this layer cannot read
    assert len(conv.calls) == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_torch_compile_of_a_patched_lfm2_does_not_recurse(fallback):
    """The decoder-layer forward calls its host as a function of the module: through a bound method,
    dynamo would rebuild it after a graph break as ``layer.forward`` (the patched forward: RecursionError).
    A correct compiled run is what this checks, graph breaks allowed (backend eager, cold decisions).
    (Instance level only: the class level runs the same layer code, and each costs ~15 s.)"""
    model = _patch(build_model("lfm2-tiny"))
    inputs = make_inputs(model)
    torch._dynamo.reset()
    dispatch.reset()                    # cold decisions: the first call decides while tracing
    got = torch.compile(model, backend="eager")(**inputs)
    want = model(**inputs)
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)
    torch._dynamo.reset()


def test_a_saved_moe_model_loads_back_patched_in_a_process_without_liger_experts(fallback):
    iface = pytest.importorskip("liger_rt.layers.moe_experts_interface")
    pytest.importorskip("liger_rt.kernels.moe_experts")
    model = _patch(build_model("lfm2-moe-tiny"))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    iface.unregister_experts_interface()            # as in a fresh process
    loaded = torch.load(buf, weights_only=False)
    assert iface.is_registered() and loaded.config._experts_implementation == "liger_rt"
    assert liger_rt.patch.describe(loaded)["patched"] == liger_rt.patch.describe(model)["patched"]
    inputs = make_inputs(model)
    torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits)
