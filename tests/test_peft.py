"""PEFT LoRA on a patched model (recipe in docs/integrations.md).

A tiny Qwen3 (hidden 64, 2 layers, fp32, random weights) gets the same LoRA adapters (same seed)
twice: once patched with liger_rt (kernels through the Triton interpreter, fused loss), once not
(the independent reference: HF's modules and loss). One AdamW step on both, then:
- the patched step matches the unpatched one within the parity gates (loss, adapter gradients,
  adapter update), only the adapters move, and the kernels ran (dispatch decided "triton");
- ``merge_and_unload`` of the patched model gives the unmerged model's outputs, its merged weights
  equal the unpatched path's, and its patched layers survive the merge (the LoRA projections are
  replaced by plain Linears, the norms and MLPs keep their liger_rt forwards).
"""
from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, get_peft_model

import liger_rt
from liger_rt.tools import distributed as D
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import TOLERANCES, make_inputs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = TOLERANCES[torch.float32]


def _lora(patch: bool):
    model = build_model("qwen3-tiny")                      # seed 0: the same base weights each time
    torch.manual_seed(1)                                   # the same LoRA A init each time
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    if patch:
        liger_rt.patch(peft_model, fused_linear_cross_entropy=True)     # unwraps to the Qwen3 model
    return peft_model


def _step(model, inputs) -> dict:
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainable.items()}
    torch.optim.AdamW(trainable.values(), lr=1e-2).step()
    moved = all(not torch.equal(p.detach(), frozen[n]) for n, p in model.named_parameters() if n in frozen)
    return {"loss": loss.detach(), "grads": grads, "update": {n: p.detach() - before[n] for n, p in trainable.items()},
            "frozen_moved": moved}


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both models after one step (built once for the module: conftest's per-test DB is not set up
    yet, so the same isolation here: no LIGER_* variables, a private DB, fresh decisions)."""
    from liger_rt import dispatch
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("LIGER_")]:
            mp.delenv(key)
        mp.setenv("LIGER_RT_TUNING_DB", str(tmp_path_factory.mktemp("peft") / "tuning.db"))
        dispatch.reset()
        inputs = make_inputs(build_model("qwen3-tiny"))
        ref, new = _lora(patch=False), _lora(patch=True)
        out = {"inputs": inputs, "ref": ref, "new": new, "ref_step": _step(ref, inputs),
               "new_step": _step(new, inputs), "decisions": sorted({(d["op"], d["impl"]) for d in D.decisions()})}
        dispatch.reset()
    return out


@pytest.mark.slow
def test_lora_adapters_train_on_a_patched_model_as_on_the_unpatched(trained):
    ref, new = trained["ref_step"], trained["new_step"]
    info = liger_rt.patch.describe(trained["new"])
    assert info["patched"]["rms_norm"] == 9 and info["patched"]["swiglu"] == 2
    assert info["patched"]["fused_linear_cross_entropy"] == 1
    decided = dict(trained["decisions"])                   # the kernels ran, not the torch references
    assert {op: decided.get(op) for op in ("rms_norm", "swiglu", "fused_linear_cross_entropy")} == \
        {"rms_norm": "triton", "swiglu": "triton", "fused_linear_cross_entropy": "triton"}, decided
    assert set(new["grads"]) == set(ref["grads"]) and all("lora_" in n for n in new["grads"])
    assert len(new["grads"]) == 2 * len(TARGETS) * 2       # A and B, per target, per layer
    assert not new["frozen_moved"] and not ref["frozen_moved"]
    assert _ratio(new["loss"], ref["loss"]) <= TOL["optimisation_loss"]
    worst = max(_ratio(new["grads"][n], g) for n, g in ref["grads"].items() if g.abs().max() > 0)
    assert worst <= TOL["gradients"], worst
    # every B starts at 0: the step moves every adapter matrix
    assert all(u.abs().max() > 0 for u in new["update"].values())
    mean = sum((new["update"][n] - u).abs().mean() for n, u in ref["update"].items()) / \
        sum(u.abs().mean() for u in ref["update"].values())
    assert mean <= TOL["adamw_update"], mean


@pytest.mark.slow
def test_merge_and_unload_keeps_outputs_weights_and_the_patch(trained):
    inputs = {k: v for k, v in trained["inputs"].items() if k != "labels"}
    new, ref = trained["new"], trained["ref"]
    new.eval()
    with torch.no_grad():
        unmerged = new(**inputs).logits
    merged = new.merge_and_unload()
    ref_merged = ref.merge_and_unload()
    # the patched layers survive: the same liger_rt forwards on the norms, the MLPs and the LM head
    info = liger_rt.patch.describe(merged)
    assert info["level"] == "instance" and info["patched"]["swiglu"] == 2 and info["patched"]["rms_norm"] == 9
    mlp = merged.model.layers[0].mlp
    assert "forward" in mlp.__dict__ and type(mlp.gate_proj) is torch.nn.Linear
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    merged.eval()
    with torch.no_grad():
        got = merged(**inputs).logits
        want = ref_merged.eval()(**inputs).logits
    assert _ratio(got, unmerged) <= TOL["logits"]
    assert _ratio(got, want) <= TOL["logits"]                      # and the unpatched path's merged model
    # merged weights: what the merge added to each base weight, against the unpatched path's
    base = build_model("qwen3-tiny")
    with torch.no_grad():
        base_logits = base.eval()(**inputs).logits
    base_weights, ref_weights = dict(base.named_parameters()), dict(ref_merged.named_parameters())
    added = {n: (p.detach() - base_weights[n], ref_weights[n].detach() - base_weights[n])
             for n, p in merged.named_parameters()}
    moved = sorted(n for n, (_, want_delta) in added.items() if want_delta.abs().max() > 0)
    assert moved == sorted(n for n, _ in base.named_parameters() if n.split(".")[-2] in TARGETS)
    assert all(torch.equal(d, w) for n, (d, w) in added.items() if n not in moved)
    mean = sum((d - w).abs().mean() for d, w in added.values()) / sum(w.abs().mean() for _, w in added.values())
    assert mean <= TOL["adamw_update"], mean
    assert _ratio(got, base_logits) > 100 * TOL["logits"]          # a check that can fail: the merge changed it
