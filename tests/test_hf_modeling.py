"""transformers' own modeling checks, re-created, for every supported family with the class-level
patch held (transformers' tests/ is not shipped in its wheel).

For each family: the tiny preset's checks run unpatched, then the model type is patched at class
level with the flags its parity gates use (defaults, rope where it has a row, the fused loss), a
model with the same weights is built under the patch, and the same checks run again. Each check
mirrors one of transformers' ModelTesterMixin / GenerationTesterMixin tests:
- ``test_model_main_input_name``: the first parameter of ``type(model).forward`` after ``self``;
- the forward signatures every introspecting test reads (``input_ids``, ``position_ids``,
  ``inputs_embeds``, ``logits_to_keep``...): the unpatched ones, plus keyword-only extras only;
- ``test_inputs_embeds``: ``inputs_embeds`` gives the ``input_ids`` logits;
- ``logits_to_keep``: supported, and the last position's logits;
- forward and backward: logits, loss, gradients (parity gates, fp32);
- ``test_training_gradient_checkpointing``: one recomputed call per decoder layer in the backward;
- generate with a cache and left padding (greedy); where the patch writes the cache itself (the
  LFM2 short conv), equal to generate without a cache;
- ``save_pretrained`` / ``from_pretrained``: the reloaded model gives the same logits.
Every op runs its torch reference (LIGER_RT_DISABLE=1), as transformers' tests run torch: only the
plumbing differs between the two runs.
"""
from __future__ import annotations

import gc
import inspect
import warnings

import pytest
import torch

import liger_rt
from liger_rt import _swaps
from liger_rt.patch import core, specs
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import TOLERANCES
from liger_rt.tools.presets import get_preset
from hf_compat import enable_checkpointing

pytestmark = pytest.mark.filterwarnings("ignore:.*(causal_conv1d|flash-linear-attention|gradient_checkpointing).*")
TOL = TOLERANCES[torch.float32]
FAMILIES = [pytest.param(m, id=m, marks=pytest.mark.skipif(specs.unavailable(m) is not None,
                                                           reason=str(specs.unavailable(m))))
            for m in specs.ALLOWLIST]


@pytest.fixture(autouse=True)
def _no_class_patches():
    yield
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)
    gc.collect()
    assert not _swaps.LEDGER


def _signatures(model) -> dict[str, inspect.Signature]:
    return {type(m).__name__: inspect.signature(type(m).forward) for m in model.modules()}


def _decoder_layers(model):
    return next(m for name, m in model.named_modules()
                if isinstance(m, torch.nn.ModuleList) and name.endswith("layers") and "vision" not in name)


def _checks(model, tmp_path, no_cache=False) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(2, vocab - 1, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out: dict = {"signatures": _signatures(model), "main_input": list(_signatures(model)[type(model).__name__]
                                                                       .parameters)[1]}
    model.eval()
    with torch.no_grad():
        out["logits"] = model(input_ids=ids, attention_mask=mask).logits
        embeds = model.get_input_embeddings()(ids)
        out["embeds_logits"] = model(inputs_embeds=embeds, attention_mask=mask).logits
        out["supports_keep"] = model._supports_logits_to_keep()
        out["kept"] = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        # generate: left padding (the second prompt padded by 3), with and without a cache
        left = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids[1:, :5]], 1), torch.cat(
            [torch.zeros(1, 3, dtype=mask.dtype), mask[1:, :5]], 1)
        prompt = torch.cat([ids[:1], left[0]]), torch.cat([mask[:1], left[1]])
        kw = dict(attention_mask=prompt[1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        out["generated"] = model.generate(prompt[0], use_cache=True, **kw)
        if no_cache:
            out["generated_no_cache"] = model.generate(prompt[0], use_cache=False, **kw)
        model.save_pretrained(tmp_path)
        reloaded = type(model).from_pretrained(tmp_path, dtype=torch.float32).eval()
        out["reloaded_logits"] = reloaded(input_ids=ids, attention_mask=mask).logits
    # forward and backward with gradient checkpointing: one recomputed call per decoder layer, counted
    # on a norm inside it (the recompute runs the layer's forward, not the layer's hooks)
    calls = []
    for layer in _decoder_layers(model):
        norm = next(m for m in layer.children() if "Norm" in type(m).__name__)
        norm.register_forward_pre_hook(lambda *_: calls.append(1))
    model.train()
    enable_checkpointing(model, use_reentrant=False)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    forward = len(calls)
    loss.backward()
    out.update(loss=loss.detach(), layer_calls=(forward, len(calls) - forward),
               grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    return out


def _ratio(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_hf_modeling_checks_hold_under_the_class_patch(model_type, tmp_path, fallback):
    preset = get_preset("tiny", model_type)
    want = _checks(build_model(preset), tmp_path / "unpatched")
    flags = specs.parity_flags(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error", core.PatchWarning)
        liger_rt.patch(model_type, **flags)
    model = build_model(preset)                                  # the same weights, built under the patch
    info = liger_rt.patch.describe(model)
    assert info["level"] == "class" and info["patched"].get("fused_linear_cross_entropy") == 1, info
    # the patched short conv writes the conv state of the cache itself: decoding from it must agree
    # with decoding without a cache (the other layers leave the cache to the host)
    got = _checks(model, tmp_path / "patched", no_cache="short_conv" in flags)

    assert got["main_input"] == want["main_input"] == model.main_input_name
    assert got["signatures"].keys() == want["signatures"].keys()
    changed = 0
    for name, sig in got["signatures"].items():
        host = want["signatures"][name]
        extra = [p for p in sig.parameters.values() if p.name not in host.parameters]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), (name, extra)
        assert sig.replace(parameters=[p for p in sig.parameters.values() if p.name in host.parameters]) == host, name
        changed += sig != host
    assert changed == 1                                          # the LM head's forward: + return_logits
    assert got["supports_keep"] and want["supports_keep"]
    assert got["kept"].shape[1] == 1
    assert _ratio(got["kept"], got["logits"][:, -1:]) <= TOL["logits"]
    for key in ("logits", "embeds_logits", "reloaded_logits"):
        assert _ratio(got[key], want["logits"]) <= TOL["logits"], key
    assert torch.equal(got["generated"], want["generated"])
    if "generated_no_cache" in got:
        assert torch.equal(got["generated"], got["generated_no_cache"])
    layers = len(_decoder_layers(model))
    assert got["layer_calls"] == want["layer_calls"] == (layers, layers)
    assert _ratio(got["loss"], want["loss"]) <= TOL["optimisation_loss"]
    assert got["grads"].keys() == want["grads"].keys()
    worst = max(_ratio(g, want["grads"][n]) for n, g in got["grads"].items() if want["grads"][n].abs().max() > 0)
    assert worst <= TOL["gradients"], worst
