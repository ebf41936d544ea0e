"""The ``logprobs`` patch flag: a patched causal LM given labels returns per-token
log-probs and entropy (no logits) through liger_rt.ops.fused_linear_logprobs.

Independent reference: the unpatched Hugging Face model's logits (softcapping and logits scaling
applied by HF itself), taken to fp64: log_softmax(logits / T) gathered at the shifted labels, and
the entropy of softmax(logits / T).  Gradients of an RL-style loss, sum(lp * adv) + 0.01 * sum(ent),
are compared through the whole fp32 model (lm_head weight, final hidden states, every parameter).
Tiny presets, fp32, Triton interpreter.
"""
from __future__ import annotations


import pytest
import torch

import liger_rt
from liger_rt.kernels import fused_linear_logprobs as K
from liger_rt.layers import logprobs as L
from liger_rt.patch import core, specs
from liger_rt.tools.models import build_model
from liger_rt.tools.presets import get_preset
from routing import record_impls, release_patches

T = 0.7
ENT_COEF = 0.01


@pytest.fixture(autouse=True)
def _no_class_patches():
    yield
    release_patches()


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0                                   # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100                              # a prompt
    adv = torch.randn(ids.shape, generator=g)
    return ids, mask, labels, adv


def _capture_hidden(model):
    """Keep the base model's last hidden state (with its .grad after backward) in the returned list."""
    kept = []

    def hook(_module, _args, out):
        h = out[0]
        h.retain_grad()
        kept.append(h)
    return kept, model.model.register_forward_hook(hook)


def _reference(model, ids, mask, labels, adv):
    """fp64 log-probs and entropy from the unpatched model's logits, and the fp32 model's gradients
    of the RL loss built from them."""
    kept, handle = _capture_hidden(model)
    logits = model(input_ids=ids, attention_mask=mask).logits
    handle.remove()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    valid = shifted != -100
    logp = torch.log_softmax(logits.double() / T, dim=-1)
    lp = logp.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    ent = -(logp.exp() * logp).sum(-1) * valid
    ((lp * adv).sum() + ENT_COEF * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent.detach(), kept[0].grad.clone(), grads


def _close(got, want, atol, what):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"


@pytest.mark.slow
@pytest.mark.parametrize("model_type,flags", [
    ("qwen3", dict(rms_norm=False, swiglu=False)),        # the head alone: fp64-tight
    ("llama", {}),                                        # with the family's default kernels on
    ("gemma2", dict(rms_norm=False, geglu=False)),        # final_logit_softcapping 1.0 (torch chunked path)
    ("granite", dict(rms_norm=False, swiglu=False)),      # logits_scaling 8, tied embeddings
])
def test_patched_logprobs_match_the_unpatched_model(model_type, flags, monkeypatch):
    model = build_model(get_preset("tiny", model_type))
    vocab = model.config.vocab_size
    ids, mask, labels, adv = _batch(vocab)
    lp_ref, ent_ref, dh_ref, grads_ref = _reference(model, ids, mask, labels, adv)

    liger_rt.patch(model, logprobs=True, **flags)
    assert liger_rt.patch.describe(model)["patched"]["logprobs"] == 1
    if model_type == "gemma2":           # several chunks of the softcapped path
        monkeypatch.setattr(L, "SOFTCAP_CHUNK_BYTES", 4 * vocab * 5)
    ran = record_impls(monkeypatch, K.OP)
    kept, handle = _capture_hidden(model)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, temperature=T)
    handle.remove()
    assert out.logits is None and out.loss is None
    assert out.logprobs.shape == ids.shape and out.logprobs.dtype == torch.float32
    assert ran == ([] if model_type == "gemma2" else ["triton"])      # softcap: the layer's torch path
    tol = 1e-4 if flags == {} else 1e-5            # the default kernels change hidden states at fp32 rounding
    _close(out.logprobs, lp_ref, tol, "log-probs")
    _close(out.entropy, ent_ref, tol, "entropy")
    ignored = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:] == -100
    assert (out.logprobs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
    assert (out.entropy[~ignored] > 0).all()

    ((out.logprobs * adv).sum() + ENT_COEF * out.entropy.sum()).backward()
    _close(kept[0].grad, dh_ref, tol, "d hidden")
    _close(model.lm_head.weight.grad, grads_ref["lm_head.weight"] if "lm_head.weight" in grads_ref
           else grads_ref["model.embed_tokens.weight"], tol, "d lm_head.weight")
    for name, p in model.named_parameters():
        _close(p.grad, grads_ref[name], 10 * tol, f"d {name}")

    liger_rt.unpatch(model)
    assert "forward" not in model.__dict__ and not hasattr(model, "_liger_rt_logprobs")
    again = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert again.logits is not None and again.loss is not None and not hasattr(again, "logprobs")


@pytest.mark.slow
def test_host_forward_runs_when_logits_are_wanted_and_eval_stays_fused():
    model = build_model(get_preset("tiny", "qwen3"))
    ids, mask, labels, _ = _batch(model.config.vocab_size)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels)
    liger_rt.patch(model, logprobs=True, rms_norm=False, swiglu=False)
    with torch.no_grad():
        no_labels = model(input_ids=ids, attention_mask=mask)
        asked = model(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True)
        model.eval()
        scored = model(ids, mask, labels=labels)            # positional, eval, no grad: still fused
    torch.testing.assert_close(no_labels.logits, want.logits)
    torch.testing.assert_close(asked.loss, want.loss)
    assert scored.logits is None and scored.logprobs is not None
    nll = -scored.logprobs.sum() / (labels[:, 1:] != -100).sum()
    torch.testing.assert_close(nll, want.loss, atol=1e-5, rtol=1e-5)    # HF's mean cross-entropy


@pytest.mark.slow
def test_class_level_patch_and_unpatch():
    from transformers.models.qwen3 import modeling_qwen3 as M
    original = M.Qwen3ForCausalLM.__dict__["forward"]
    liger_rt.patch("qwen3", logprobs=True, rms_norm=False, swiglu=False)
    assert M.Qwen3ForCausalLM.forward._liger_rt_function is L.causal_lm_logprobs_forward
    import inspect
    params = inspect.signature(M.Qwen3ForCausalLM.forward).parameters
    assert "temperature" in params and "labels" in params
    model = build_model(get_preset("tiny", "qwen3"))
    assert liger_rt.patch.describe(model)["patched"] == {"logprobs": 1}
    ids, mask, labels, _ = _batch(model.config.vocab_size)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and out.logprobs.shape == ids.shape
    liger_rt.unpatch("qwen3")
    assert M.Qwen3ForCausalLM.__dict__["forward"] is original
    assert "_liger_rt_logprobs" not in M.Qwen3ForCausalLM.__dict__
    assert model(input_ids=ids, labels=labels).logits is not None


# -- no model -------------------------------------------------------------------------------------

def test_logprobs_flag_is_listed_and_refused_with_the_fused_loss():
    assert "logprobs" in specs.flags(specs.SPECS["qwen3"])
    assert specs.LOSS_OPS["logprobs"] == "fused_linear_logprobs"
    with pytest.raises(ValueError, match="logprobs=True and fused_linear_cross_entropy=True") as info:
        liger_rt.patch("qwen3", logprobs=True, fused_linear_cross_entropy=True)
    assert "\n" not in str(info.value)
    assert "qwen3" not in core._CLASS_RECORDS


def test_softcapped_logprobs_match_fp64(monkeypatch):
    """The softcapped torch path against the formula in fp64, several chunks, bias, scaling, ignored rows."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 37)
    with torch.no_grad():
        head.weight.mul_(4)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 37, (3, 5), generator=g)
    target[0, :2] = -100
    g_lp, g_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    monkeypatch.setattr(L, "SOFTCAP_CHUNK_BYTES", 4 * 37 * 4)       # 4 rows a chunk: 4 chunks
    lp, ent = L.softcapped_logprobs(x, head, target, 2.0, scale=1.5, temperature=T)
    gx, gw, gb = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), (x, head.weight, head.bias))

    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, head.weight, head.bias))
    z = 2.0 * torch.tanh((xd @ wd.T + bd) / 1.5 / 2.0) / T
    logp = torch.log_softmax(z, -1)
    valid = target != -100
    lp_ref = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    ent_ref = -(logp.exp() * logp).sum(-1) * valid
    refs = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_h).sum(), (xd, wd, bd))
    for got, want, what in [(lp, lp_ref, "lp"), (ent, ent_ref, "entropy"), *zip((gx, gw, gb), refs, "xwb")]:
        _close(got, want, 1e-5, what)
    assert lp.dtype == ent.dtype == torch.float32 and (lp[0, :2] == 0).all() and (ent[0, :2] == 0).all()
    with pytest.raises(ValueError, match="temperature, softcap and logits_scaling > 0"):
        L.softcapped_logprobs(x, head, target, 2.0, temperature=0.0)
