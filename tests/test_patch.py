"""liger_rt.patch on tiny Qwen3 / Llama models: instance and class level, unpatch, errors, loss forwards.

Most tests run the torch references (LIGER_RT_DISABLE=1) to stay fast; the interpreter tests run
the Triton kernels (TRITON_INTERPRET=1 from conftest) and skip when a kernel module is missing.
"""
from __future__ import annotations

import copy
import gc
import importlib
import importlib.util
import io
import inspect
import pickle
import subprocess
import sys
import types
import warnings

import pytest
import torch

import liger_rt
from liger_rt import _swaps, dispatch
from liger_rt.patch import core, specs
from liger_rt.registry import REGISTRY
from liger_rt.tools.models import build_model
from hf_compat import enable_checkpointing
from patched_models import Counter, ours, pair

QWEN3 = "transformers.models.qwen3.modeling_qwen3"


def needs(*ops):
    """Skip when a kernel module has not landed (the patch would leave that layer on the host)."""
    missing = [op for op in ops if importlib.util.find_spec(f"liger_rt.kernels.{op}") is None]
    return pytest.mark.skipif(bool(missing), reason=f"kernel module(s) {', '.join(missing)} not in this checkout")


NORM_MLP = needs("rms_norm", "swiglu")




@pytest.fixture(autouse=True)
def _no_class_patches():
    yield
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)
    if _swaps.LEDGER:       # instance patches hold module-wide swaps (causal_mask, rope) until their model dies
        gc.collect()
    assert not _swaps.LEDGER


def _inputs(vocab=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _patched_pair(preset, vocab=160, **flags):
    """An unpatched model, a copy with its weights patched (instance level) with `flags`, and a batch
    (`_inputs(vocab)`: ids, mask, labels)."""
    base, new = pair(preset)
    liger_rt.patch(new, **flags)
    return base, new, _inputs(vocab)


def _fwd_bwd(model, ids, mask, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(base, new, ids, mask, labels, atol, **kw):
    ob, gb = _fwd_bwd(base, ids, mask, labels)
    on, gn = _fwd_bwd(new, ids, mask, labels, **kw)
    valid = mask.bool()
    if on.logits is not None:
        torch.testing.assert_close(on.logits[valid], ob.logits[valid], atol=atol, rtol=atol)
    torch.testing.assert_close(on.loss, ob.loss, atol=atol, rtol=atol)
    assert gb.keys() == gn.keys()
    for name in gb:
        torch.testing.assert_close(gn[name], gb[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    return on


def _modules(model, class_name):
    return [m for m in model.modules() if type(m).__name__ == class_name]


# -- the allowlist ---------------------------------------------------------------------------------------

def test_supported_models_is_the_allowlist():
    got = liger_rt.supported_models()
    assert got[:5] == ["qwen3", "llama", "lfm2", "lfm2_moe", "lfm2_vl"]
    has_experts = importlib.util.find_spec("liger_rt.layers.moe_experts_interface") is not None
    assert ("qwen3_moe" in got) == has_experts
    assert liger_rt.patch is not None and callable(liger_rt.patch)


def test_the_patchers_are_plain_functions():
    from liger_rt.patch import describe, patch                # the package's modules load: the name stays
    import liger_rt.patch as imported
    assert liger_rt.patch is patch is imported and type(patch) is types.FunctionType
    assert liger_rt.patch.describe is describe and liger_rt.patch.PatchWarning is core.PatchWarning
    light = "import sys, liger_rt; liger_rt.patch, liger_rt.unpatch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", light], check=True)  # import liger_rt stays free of torch


# -- instance patching: numerics ----------------------------------------------------------------------------

@NORM_MLP
@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
def test_instance_patch_matches_unpatched_torch_fallback(preset, fallback):
    base, new = pair(preset)
    text_before = repr(new)
    state_before = {k: v.clone() for k, v in new.state_dict().items()}
    liger_rt.patch(new)
    assert repr(new) == text_before                                   # print(model) still works, unchanged
    assert new.state_dict().keys() == state_before.keys()
    assert all(torch.equal(new.state_dict()[k], v) for k, v in state_before.items())
    ids, mask, labels = _inputs()
    _assert_same(base, new, ids, mask, labels, atol=1e-6)
    info = liger_rt.patch.describe(new)
    n_norms = len(_modules(new, f"{type(new).__name__.replace('ForCausalLM', '')}RMSNorm"))
    assert info["patched"] == {"rms_norm": n_norms, "swiglu": 2}


@pytest.mark.parametrize("preset,vocab", [("qwen3-4b-tiny", 199), ("llama-tiny", 160)])
def test_instance_patch_matches_unpatched_interpreter(preset, vocab):
    pytest.importorskip("liger_rt.kernels.rms_norm")
    pytest.importorskip("liger_rt.kernels.swiglu")
    # qwen3-4b-tiny: odd sizes (hidden 80, intermediate 136, vocab 199)
    base, new, (ids, mask, labels) = _patched_pair(preset, vocab=vocab)
    _assert_same(base, new, ids, mask, labels, atol=2e-5)
    decisions = [d for name in ("rms_norm", "swiglu") for d in dispatch.memo(REGISTRY.get(name)).values()]
    assert decisions, "patched layers never reached the dispatcher"
    assert {d.impl for d in decisions} == {"triton"}, [(d.op, d.impl, d.reason) for d in decisions]


@NORM_MLP
def test_every_targeted_module_goes_through_liger(monkeypatch, fallback):
    model = build_model("qwen3-tiny")
    norms, swiglu = Counter(monkeypatch, "rms_norm"), Counter(monkeypatch, "swiglu")
    liger_rt.patch(model)
    ids, mask, _ = _inputs()
    model(input_ids=ids, attention_mask=mask)
    norm_weights = {id(m.weight) for m in _modules(model, "Qwen3RMSNorm")}
    assert {id(args[1]) for args in norms.calls} == norm_weights       # decoder, final and q/k norms
    assert len(norms.calls) == len(norm_weights)                        # once each: no double wrapping
    assert len(swiglu.calls) == len(_modules(model, "Qwen3MLP"))
    for m in _modules(model, "Qwen3RMSNorm") + _modules(model, "Qwen3MLP"):
        assert isinstance(m.__dict__["forward"], types.MethodType) and m.__dict__["forward"].__self__ is m

    liger_rt.unpatch(model)
    norms.calls.clear(), swiglu.calls.clear()
    model(input_ids=ids, attention_mask=mask)
    assert norms.calls == [] and swiglu.calls == []
    assert not any("forward" in m.__dict__ or core._ORIG_KEY in m.__dict__ for m in model.modules())
    assert liger_rt.patch.describe(model) is None


@NORM_MLP
def test_patch_twice_is_idempotent_and_repatch_takes_the_new_flags(monkeypatch, fallback):
    model = build_model("qwen3-tiny")
    norms, swiglu = Counter(monkeypatch, "rms_norm"), Counter(monkeypatch, "swiglu")
    liger_rt.patch(model)
    liger_rt.patch(model)
    ids, mask, _ = _inputs()
    model(input_ids=ids, attention_mask=mask)
    assert len(norms.calls) == 9 and len(swiglu.calls) == 2
    liger_rt.patch(model, swiglu=False)
    norms.calls.clear(), swiglu.calls.clear()
    model(input_ids=ids, attention_mask=mask)
    assert len(norms.calls) == 9 and swiglu.calls == []
    liger_rt.unpatch(model)
    liger_rt.unpatch(model)                                             # unpatching twice: no-op
    assert not any("forward" in m.__dict__ for m in model.modules())


@NORM_MLP
def test_patched_context_manager_restores_previous_state(fallback):
    model = build_model("qwen3-tiny")
    with liger_rt.patched(model) as m:
        assert m is model and liger_rt.patch.describe(model)["patched"]["swiglu"] == 2
    assert liger_rt.patch.describe(model) is None
    liger_rt.patch(model, swiglu=False)
    with liger_rt.patched(model, swiglu=True, rms_norm=False):
        assert liger_rt.patch.describe(model)["patched"] == {"swiglu": 2}
    assert liger_rt.patch.describe(model)["patched"] == {"rms_norm": 9}
    with pytest.raises(RuntimeError):
        with liger_rt.patched(model, rms_norm=False):
            raise RuntimeError("boom")
    assert liger_rt.patch.describe(model)["patched"] == {"rms_norm": 9}


@NORM_MLP
def test_deepcopy_of_a_patched_model_is_patched_to_itself(fallback):
    model = build_model("qwen3-tiny")
    liger_rt.patch(model)
    clone = copy.deepcopy(model)
    norm = clone.model.norm
    assert norm.__dict__["forward"].__self__ is norm
    ids, mask, _ = _inputs()
    torch.testing.assert_close(clone(input_ids=ids).logits, model(input_ids=ids).logits)


@NORM_MLP
def test_non_silu_mlp_is_left_alone(fallback):
    model = build_model("llama-tiny", hidden_act="gelu")
    liger_rt.patch(model)
    info = liger_rt.patch.describe(model)
    assert "swiglu" not in info["patched"] and info["patched"]["rms_norm"] == 5
    assert any("not SiLU" in why for _, why in info["skipped"])


# -- wrappers ---------------------------------------------------------------------------------------------

class _FakeLora(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


class _FakePeft(torch.nn.Module):
    """Duck-typed PeftModel: base_model.model holds the transformers model; attributes forward."""

    def __init__(self, model):
        super().__init__()
        self.base_model = _FakeLora(model)

    def get_base_model(self):
        return self.base_model.model

    def forward(self, *args, **kwargs):
        return self.base_model.model(*args, **kwargs)


class _Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.base_model = _FakeLora(model)


@NORM_MLP
@pytest.mark.parametrize("wrap", [_FakePeft, _Wrapper])
def test_peft_style_wrappers_are_unwrapped(wrap, monkeypatch, fallback):
    inner = build_model("qwen3-tiny")
    wrapped = wrap(inner)
    norms = Counter(monkeypatch, "rms_norm")
    assert liger_rt.patch(wrapped) is wrapped
    assert liger_rt.patch.describe(wrapped)["patched"]["rms_norm"] == 9
    ids, _, _ = _inputs()
    inner(input_ids=ids)
    assert len(norms.calls) == 9
    liger_rt.unpatch(wrapped)
    assert not any("forward" in m.__dict__ for m in inner.modules())


@NORM_MLP
def test_accelerate_hooked_modules_keep_their_hook(monkeypatch, fallback):
    model = build_model("qwen3-tiny")
    norm = model.model.norm
    calls = []
    norm._old_forward = norm.forward
    norm._hf_hook = object()

    def hooked(*args, **kwargs):
        calls.append(1)
        return norm._old_forward(*args, **kwargs)
    norm.forward = hooked
    counter = Counter(monkeypatch, "rms_norm")
    liger_rt.patch(model)
    assert norm.__dict__["forward"] is hooked
    model(input_ids=_inputs()[0])
    assert calls == [1] and len(counter.calls) == 9
    liger_rt.unpatch(model)
    assert norm.__dict__["forward"] is hooked and norm._old_forward.__func__ is type(norm).forward


# -- class level ----------------------------------------------------------------------------------------

@NORM_MLP
def test_class_level_patch_and_exact_unpatch(monkeypatch, fallback):
    mod = importlib.import_module(QWEN3)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as captured   # a from-import made before
    originals = {c: c.__dict__["forward"] for c in (mod.Qwen3RMSNorm, mod.Qwen3MLP, mod.Qwen3ForCausalLM)}
    built_before = build_model("qwen3-tiny")
    norms = Counter(monkeypatch, "rms_norm")
    assert liger_rt.patch("qwen3") is None
    assert ours(captured.forward) is liger_rt.layers.norms.rms_norm_forward
    assert ours(mod.Qwen3MLP.forward) is liger_rt.layers.mlp.swiglu_forward
    assert mod.Qwen3ForCausalLM.forward is originals[mod.Qwen3ForCausalLM]           # loss kernels off
    assert liger_rt.patch.describe("qwen3")["classes"] == ["Qwen3MLP", "Qwen3RMSNorm"]
    built_after = build_model("qwen3-tiny")
    ids = _inputs()[0]
    built_after(input_ids=ids)
    assert len(norms.calls) == 9                        # models built afterwards run liger_rt ...
    built_before(input_ids=ids)
    assert len(norms.calls) == 18                       # ... and, documented, so do earlier instances
    liger_rt.patch("qwen3")                             # idempotent
    liger_rt.unpatch("qwen3")
    for cls, fn in originals.items():
        assert cls.forward is fn
    norms.calls.clear()
    built_after(input_ids=ids)
    assert norms.calls == []


@NORM_MLP
def test_instance_patch_on_top_of_class_patch_falls_back_to_the_true_original(fallback):
    mod = importlib.import_module(QWEN3)
    original = mod.Qwen3RMSNorm.__dict__["forward"]
    liger_rt.patch("qwen3")
    model = build_model("qwen3-tiny")
    liger_rt.patch(model)
    assert core.original(model.model.norm).__func__ is original
    liger_rt.unpatch(model)
    assert ours(mod.Qwen3RMSNorm.forward) is liger_rt.layers.norms.rms_norm_forward
    liger_rt.unpatch("qwen3")
    assert mod.Qwen3RMSNorm.forward is original


# -- errors ------------------------------------------------------------------------------------------------

def test_unknown_flag_lists_valid_flags():
    model = build_model("qwen3-tiny")
    with pytest.raises(ValueError, match=r"unknown flag.*'rmsnorm'.*valid flags: rms_norm, swiglu, fused_add_norm, rope"):
        liger_rt.patch(model, rmsnorm=True)
    with pytest.raises(ValueError, match="short_conv"):
        liger_rt.patch("qwen3", short_conv=True)        # a flag of another family
    with pytest.raises(TypeError, match="booleans"):
        liger_rt.patch(model, rms_norm="yes")
    liger_rt.patch(model, rope=False)
    liger_rt.unpatch(model)
    assert liger_rt.patch.describe(model) is None
    with pytest.raises(NotImplementedError, match="RoPE stays with the host.*rope=True works for qwen3, llama, lfm2"):
        liger_rt.patch(build_model("phi3-tiny"), rope=True)       # a family without a rope row (partial rotary)


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: qwen3, llama, lfm2, lfm2_moe, lfm2_vl"):
        liger_rt.patch("gpt2")
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ValueError, match="supported: qwen3"):
        liger_rt.patch(gpt2)
    with pytest.raises(ValueError, match="config.model_type"):
        liger_rt.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model type string"):
        liger_rt.patch(42)


def test_missing_modeling_module_names_the_upgrade(monkeypatch):
    import dataclasses
    gone = dataclasses.replace(specs.SPECS["qwen3"], module="transformers.models.qwen3.modeling_qwen3_not_here")
    monkeypatch.setitem(specs.SPECS, "qwen3", gone)
    # ImportError from the patch, or ValueError once the allowlist leaves such families out
    with pytest.raises((ImportError, ValueError), match=r"pip install -U transformers"):
        liger_rt.patch("qwen3")


@NORM_MLP
def test_missing_class_or_kernel_raises_when_asked_and_warns_when_default(monkeypatch):
    import dataclasses
    renamed = dataclasses.replace(specs.SPECS["qwen3"], layers={"Qwen3RMSNorm": specs.RMS_NORM,
                                                                "Qwen3MLPRenamed": specs.SWIGLU})
    monkeypatch.setitem(specs.SPECS, "qwen3", renamed)
    model = build_model("qwen3-tiny")
    with pytest.raises(ImportError, match=r"no transformers\.models\.qwen3\.modeling_qwen3\.Qwen3MLPRenamed.*pip install -U"):
        liger_rt.patch(model, swiglu=True)
    with pytest.warns(core.PatchWarning, match="swiglu=False to silence"):
        liger_rt.patch(model)
    assert liger_rt.patch.describe(model)["patched"] == {"rms_norm": 9}
    monkeypatch.setattr(core, "_op_missing", lambda op: f"its kernel module liger_rt.kernels.{op} is not in this checkout"
                        if op == "rms_norm" else None)
    with pytest.raises(ImportError, match="liger_rt.kernels.rms_norm"):
        liger_rt.patch(model, rms_norm=True)


# -- loss forwards -----------------------------------------------------------------------------------------

@needs("fused_linear_cross_entropy")
def test_fused_linear_cross_entropy_loss_and_grads_without_logits(monkeypatch, fallback):
    flce, ce = Counter(monkeypatch, "fused_linear_cross_entropy"), Counter(monkeypatch, "cross_entropy")
    base, new, (ids, mask, labels) = _patched_pair("qwen3-tiny", fused_linear_cross_entropy=True)
    out = _assert_same(base, new, ids, mask, labels, atol=1e-6)
    assert out.logits is None and len(flce.calls) == 1 and ce.calls == []
    x, weight, target = flce.calls[0][:3]
    assert weight is new.lm_head.weight and x.shape == (16, 64) and target.shape == (16,)
    # the trainer's token-sum path (gradient accumulation)
    n = (labels[:, 1:] != -100).sum()
    got = new(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    want = base(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss)
    # return_dict=False gives the tuple without logits
    tup = new(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], got.loss)


@needs("fused_linear_cross_entropy")
@pytest.mark.parametrize("preset", ["qwen3-tiny", "lfm2-tiny"])
def test_fused_loss_builds_no_kv_cache_unless_asked(preset, fallback):
    """transformers builds a KV cache in every training forward (config.use_cache); the fused loss returns
    no logits, so it asks for none, unless the caller passes use_cache=True.  The loss is unchanged."""
    base, new, (ids, mask, labels) = _patched_pair(preset, fused_linear_cross_entropy=True)
    want = base(input_ids=ids, attention_mask=mask, labels=labels)
    assert want.past_key_values is not None                     # the host's default, which we leave
    got = new(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None and got.past_key_values is None
    torch.testing.assert_close(got.loss, want.loss)
    asked = new(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True)
    assert asked.logits is None and asked.past_key_values is not None
    torch.testing.assert_close(asked.loss, want.loss)


@needs("fused_linear_cross_entropy")
def test_logits_stay_when_the_caller_needs_them(monkeypatch, fallback):
    flce = Counter(monkeypatch, "fused_linear_cross_entropy")
    base, new, (ids, mask, labels) = _patched_pair("qwen3-tiny", fused_linear_cross_entropy=True)
    want = base(input_ids=ids, attention_mask=mask, labels=labels)
    # RL: no labels -> logits (log-probs, entropy, KL)
    got = new(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.logits, base(input_ids=ids, attention_mask=mask).logits)
    # asked for in the call
    got = new(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    # logits_to_keep other than 0: the host path (HF itself cannot take labels with it)
    with pytest.raises(ValueError, match="batch_size"):
        base(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=1)
    with pytest.raises(ValueError, match="batch_size"):
        new(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=1)
    # eval mode
    new.eval()
    assert new(input_ids=ids, attention_mask=mask, labels=labels).logits is not None
    assert new(input_ids=ids, attention_mask=mask, labels=labels, return_logits=False).logits is None
    new.train()
    assert flce.calls and len(flce.calls) == 1
    # keep_logits in the patch
    liger_rt.patch(new, fused_linear_cross_entropy=True, keep_logits=True)
    got = new(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want.logits)
    assert len(flce.calls) == 1
    liger_rt.unpatch(new)
    assert "forward" not in new.__dict__ and "_liger_rt_loss" not in new.__dict__



# -- signatures: callers that introspect the forward ---------------------------------------------------

def _host_signatures(model):
    return {name: inspect.signature(m.forward) for name, m in model.named_modules()}


def _check_signatures(model, before, extras=("return_logits",)):
    """Every forward's signature is what it was, plus (only on a loss forward) keyword-only extras."""
    changed = 0
    for name, module in model.named_modules():
        sig = inspect.signature(module.forward)
        if sig != before[name]:
            added = [p for p in sig.parameters.values() if p.name not in before[name].parameters]
            assert [p.name for p in added] == list(extras), name
            assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in added), name
            kept = [p for p in sig.parameters.values() if p.name in before[name].parameters]
            assert sig.replace(parameters=kept) == before[name], name
            changed += 1
    return changed


@needs("fused_linear_cross_entropy")
@pytest.mark.parametrize("level", ["instance", "class"])
@pytest.mark.parametrize("preset", ["qwen3-tiny", "lfm2-tiny"])
def test_patched_forwards_keep_the_host_signature(preset, level, fallback):
    before = _host_signatures(build_model(preset))
    model_type = build_model(preset).config.model_type
    if level == "class":
        liger_rt.patch(model_type, fused_linear_cross_entropy=True)
        model = build_model(preset)
    else:
        model = build_model(preset)
        liger_rt.patch(model, fused_linear_cross_entropy=True)
    assert _check_signatures(model, before) == 1                  # the LM head's forward, + return_logits
    assert model._supports_logits_to_keep()
    assert list(inspect.signature(model.forward).parameters)[0] == "input_ids"
    info = liger_rt.patch.describe(model)
    assert info["level"] == level and info["patched"]["fused_linear_cross_entropy"] == 1
    assert info["patched"]["rms_norm"] == sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


@needs("fused_linear_cross_entropy")
def test_instance_forwards_are_plain_bound_methods(fallback):
    """What introspecting callers read (Liger-Kernel's instance-patch tests among them): a bound method of
    the module whose function wears the replaced forward's name, doc, ``__wrapped__`` and signature."""
    model = build_model("qwen3-tiny")
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    before = {m: (m.forward.__func__, inspect.getsource(m.forward)) for m in (model, norm, mlp)}
    liger_rt.patch(model, fused_linear_cross_entropy=True)
    for module, ours in ((model, liger_rt.layers.loss.causal_lm_forward),
                         (norm, liger_rt.layers.norms.rms_norm_forward), (mlp, liger_rt.layers.mlp.swiglu_forward)):
        host, source = before[module]
        forward = module.forward
        assert type(forward) is types.MethodType and forward.__self__ is module
        assert forward.__func__.__wrapped__.__func__ is host and forward.__func__._liger_rt_function is ours
        assert (forward.__name__, forward.__doc__, forward.__module__) == (host.__name__, host.__doc__, host.__module__)
        assert inspect.getsource(forward) == source           # unwrapped to the host's, as functools.wraps gives
        assert inspect.getsource(forward.__func__.__code__) == inspect.getsource(ours)
    assert list(inspect.signature(norm.forward).parameters) == ["hidden_states"]
    liger_rt.unpatch(model)
    assert all(m.forward.__func__ is before[m][0] for m in before)


@needs("fused_linear_cross_entropy")
@pytest.mark.parametrize("level", ["instance", "class"])
def test_fused_loss_binds_positional_arguments_like_the_host(level, fallback):
    base, new = pair("qwen3-tiny")
    if level == "class":
        liger_rt.patch("qwen3", fused_linear_cross_entropy=True)
    else:
        liger_rt.patch(new, fused_linear_cross_entropy=True)
    ids, mask, labels = _inputs()
    want = base(ids, mask, labels=labels)
    got = new(ids, mask, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss)
    with pytest.raises(TypeError):                                # as the host: input_ids given twice
        new(ids, input_ids=ids, labels=labels)


@needs("fused_linear_cross_entropy")
def test_fused_loss_forward_never_inspects(monkeypatch, fallback):
    model = build_model("qwen3-tiny")
    liger_rt.patch(model, fused_linear_cross_entropy=True)
    ids, mask, labels = _inputs()

    def no_inspect(*args, **kwargs):
        raise AssertionError("inspect.signature called in the forward")
    monkeypatch.setattr(inspect, "signature", no_inspect)
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is None



@needs("fused_linear_cross_entropy")
@pytest.mark.parametrize("level", ["instance", "class"])
def test_generate_under_the_fused_loss_patch(level, monkeypatch, fallback):
    base, new = pair("qwen3-tiny")
    if level == "class":
        liger_rt.patch("qwen3", fused_linear_cross_entropy=True)
    else:
        liger_rt.patch(new, fused_linear_cross_entropy=True)
    keep = []
    head = new.lm_head.forward
    monkeypatch.setattr(new.lm_head, "forward", lambda x: keep.append(x.shape[1]) or head(x))
    ids = _inputs()[0]
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(new.generate(ids, **kwargs), base.generate(ids, **kwargs))
    assert keep == [1, 1, 1]                      # logits_to_keep: the last position only

def test_describe_a_model_built_under_a_class_patch(fallback):
    liger_rt.patch("llama")
    model = build_model("llama-tiny")
    info = liger_rt.patch.describe(model)
    assert info["level"] == "class" and info["model_type"] == "llama"
    assert info["patched"] == {"rms_norm": 5, "swiglu": 2}
    liger_rt.unpatch("llama")
    assert liger_rt.patch.describe(model) is None
    assert liger_rt.patch.describe(build_model("qwen3-tiny")) is None

def test_fused_linear_cross_entropy_interpreter():
    pytest.importorskip("liger_rt.kernels.fused_linear_cross_entropy")
    base, new, (ids, mask, labels) = _patched_pair("qwen3-tiny", rms_norm=False, swiglu=False,
                                                   fused_linear_cross_entropy=True)
    out = _assert_same(base, new, ids, mask, labels, atol=2e-5)
    assert out.logits is None


@needs("cross_entropy")
def test_cross_entropy_flag_installs_the_loss_function(monkeypatch, fallback):
    ce = Counter(monkeypatch, "cross_entropy")
    base, new, (ids, mask, labels) = _patched_pair("llama-tiny", cross_entropy=True)
    out = _assert_same(base, new, ids, mask, labels, atol=1e-6)
    assert out.logits is not None and len(ce.calls) == 1
    liger_rt.unpatch(new)
    from transformers.loss.loss_utils import LOSS_MAPPING
    assert new.loss_function is LOSS_MAPPING["ForCausalLM"]


@needs("fused_linear_cross_entropy")
def test_class_level_fused_linear_cross_entropy(fallback):
    mod = importlib.import_module(QWEN3)
    original = mod.Qwen3ForCausalLM.__dict__["forward"]
    liger_rt.patch("qwen3", fused_linear_cross_entropy=True, rms_norm=False, swiglu=False)
    model = build_model("qwen3-tiny")
    ids, mask, labels = _inputs()
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is None
    assert model(input_ids=ids, attention_mask=mask).logits is not None
    liger_rt.unpatch("qwen3")
    assert mod.Qwen3ForCausalLM.forward is original
    assert "_liger_rt_loss" not in mod.Qwen3ForCausalLM.__dict__
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


@NORM_MLP
def test_no_warnings_on_a_plain_patch(fallback):
    model = build_model("qwen3-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", core.PatchWarning)
        liger_rt.patch(model)


@NORM_MLP
def test_patched_context_manager_at_class_level(fallback):
    mod = importlib.import_module(QWEN3)
    original = mod.Qwen3MLP.__dict__["forward"]
    with liger_rt.patched("qwen3", rms_norm=False):
        assert ours(mod.Qwen3MLP.forward) is liger_rt.layers.mlp.swiglu_forward
        assert liger_rt.patch.describe("qwen3")["classes"] == ["Qwen3MLP"]
    assert mod.Qwen3MLP.forward is original and liger_rt.patch.describe("qwen3") is None


# -- rope: a module-wide swap of apply_rotary_pos_emb -------------------------------------------------------

ROPE = needs("rms_norm", "swiglu", "rope")


@ROPE
@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
def test_rope_patch_matches_unpatched_interpreter(preset, monkeypatch):
    base, new = pair(preset)
    mod = importlib.import_module(type(new).__module__)
    host = mod.apply_rotary_pos_emb
    ids, mask, labels = _inputs()
    ob, gb = _fwd_bwd(base, ids, mask, labels)          # before the swap: it is module-wide (base too)
    calls = Counter(monkeypatch, "rope")
    liger_rt.patch(new, rope=True)
    try:
        assert _swaps.function_at(mod, "apply_rotary_pos_emb") is liger_rt.layers.rope.apply_rotary_pos_emb
        assert liger_rt.patch.describe(new)["patched"]["rope"] == 1
        on, gn = _fwd_bwd(new, ids, mask, labels)
        assert len(calls.calls) == new.config.num_hidden_layers      # every attention layer went through it
    finally:
        liger_rt.unpatch(new)
    assert mod.apply_rotary_pos_emb is host
    valid = mask.bool()
    torch.testing.assert_close(on.logits[valid], ob.logits[valid], atol=2e-5, rtol=2e-5)
    for name in gb:
        torch.testing.assert_close(gn[name], gb[name], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@ROPE
def test_rope_swap_is_held_until_the_last_holder_goes():
    mod = importlib.import_module(QWEN3)
    host = mod.apply_rotary_pos_emb
    a, b = build_model("qwen3-tiny"), build_model("qwen3-tiny")
    liger_rt.patch(a, rope=True)
    liger_rt.patch(b, rope=True)
    liger_rt.patch("qwen3", rope=True)
    liger_rt.unpatch(a)
    assert mod.apply_rotary_pos_emb is not host                   # b and the class patch still hold it
    liger_rt.unpatch("qwen3")
    assert mod.apply_rotary_pos_emb is not host
    del b                                                         # a model dropped while patched releases it
    import gc
    gc.collect()
    assert mod.apply_rotary_pos_emb is host
    liger_rt.patch(a, rope=True)
    liger_rt.patch(a, rope=False)                                 # re-patching applies the latest flags
    assert mod.apply_rotary_pos_emb is host
    liger_rt.unpatch(a)


@ROPE
def test_rope_class_patch_runs_the_kernel_for_new_models(monkeypatch):
    calls = Counter(monkeypatch, "rope")
    liger_rt.patch("llama", rope=True, rms_norm=False, swiglu=False)
    model = build_model("llama-tiny")
    ids, mask, labels = _inputs()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert len(calls.calls) == model.config.num_hidden_layers
    liger_rt.unpatch("llama")
    mod = importlib.import_module(type(model).__module__)
    assert _swaps.function_at(mod, "apply_rotary_pos_emb") is not liger_rt.layers.rope.apply_rotary_pos_emb


class _KernelFunc(torch.nn.Module):
    """kernels' shape of a hub-decorated function: an nn.Module a model keeps private copies of, which
    unpickle as ``type(<module global>)()`` (transformers >= 5.25 requires the kernels package)."""
    def forward(self, x):
        return x + 1

    def __reduce__(self):
        return _rebuild_private_copy, ()


def _rebuild_private_copy():
    return type(_fake_module.shared)()


_fake_module = type(importlib)("liger_rt_test_fake_modeling")


def test_a_function_swapped_over_a_callable_object_stands_in_for_its_type():
    _fake_module.shared = host = _KernelFunc()
    private = _KernelFunc()
    keys = []
    _swaps.hold(_fake_module, "shared", lambda x: x * 2, "t", keys)
    try:
        placed = _fake_module.shared
        assert isinstance(placed, _swaps.StandIn) and placed(torch.tensor(3.0)).item() == 6.0
        rebuilt = pickle.loads(pickle.dumps(private))              # a plain function here: TypeError
        assert type(rebuilt) is _KernelFunc and rebuilt(torch.tensor(3.0)).item() == 4.0
        _swaps.hold(_fake_module, "shared", _swaps.LEDGER[(_fake_module, "shared")].value, "u", keys)
        assert _fake_module.shared is placed                       # one object while held: compile guards on it
    finally:
        _swaps.release(keys, "t")
        _swaps.release(keys, "u")
    assert _fake_module.shared is host and not _swaps.LEDGER


@ROPE
def test_deepcopy_of_a_rope_patched_model_holds_the_swap_itself():
    mod = importlib.import_module(QWEN3)
    host = mod.apply_rotary_pos_emb
    model = build_model("qwen3-tiny")
    liger_rt.patch(model, rope=True)
    clone = copy.deepcopy(model)
    assert liger_rt.patch.describe(clone)["patched"]["rope"] == 1
    liger_rt.unpatch(model)
    assert _swaps.function_at(mod, "apply_rotary_pos_emb") is liger_rt.layers.rope.apply_rotary_pos_emb    # the clone holds it
    liger_rt.unpatch(clone)
    assert mod.apply_rotary_pos_emb is host


@ROPE
@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_rope_patched_model_saves_whole_and_loads_back_patched(how, fallback):
    mod = importlib.import_module(QWEN3)
    host = mod.apply_rotary_pos_emb
    model = build_model("qwen3-tiny")
    liger_rt.patch(model, rope=True, fused_linear_cross_entropy=True)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(model))
    assert liger_rt.patch.describe(loaded) == liger_rt.patch.describe(model)
    assert isinstance(loaded.model.norm.__dict__["forward"], types.MethodType)
    assert loaded.model.norm.forward.__self__ is loaded.model.norm
    ids, mask, labels = _inputs()
    want = model(input_ids=ids, attention_mask=mask, labels=labels)
    got = loaded(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss)
    liger_rt.unpatch(model)
    assert _swaps.function_at(mod, "apply_rotary_pos_emb") is liger_rt.layers.rope.apply_rotary_pos_emb     # the loaded model holds it
    liger_rt.unpatch(loaded)
    assert mod.apply_rotary_pos_emb is host
    assert not any("forward" in m.__dict__ for m in loaded.modules())


# -- gradient checkpointing -------------------------------------------------------------------------------

def _recomputed_layer_calls(model) -> tuple[int, int]:
    """(decoder-layer calls in the forward, calls again in the backward) with checkpointing on:
    counted on each layer's MLP, which runs inside the checkpointed forward."""
    calls = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None) or layer.feed_forward
        mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    enable_checkpointing(model, use_reentrant=False)
    ids, mask, labels = _inputs()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    forward = len(calls)
    loss.backward()
    return forward, len(calls) - forward


@pytest.mark.parametrize("level", ["instance", "class"])
@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "lfm2-tiny", "lfm2-moe-tiny"])
def test_gradient_checkpointing_is_kept(preset, level, fallback):
    layers = build_model(preset).config.num_hidden_layers
    model_type = build_model(preset).config.model_type
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", core.PatchWarning)     # lfm2_moe: experts interface may be absent
        if level == "class":
            liger_rt.patch(model_type, fused_linear_cross_entropy=True)
            model = build_model(preset)
        else:
            model = liger_rt.patch(build_model(preset), fused_linear_cross_entropy=True)
    assert _recomputed_layer_calls(model) == (layers, layers)
