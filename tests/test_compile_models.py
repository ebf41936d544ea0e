"""torch.compile(fullgraph=True) of every supported family, patched with the flags its parity gates
run with (specs.parity_flags: the defaults, rope where the family has a rope row, the fused loss):
no graph break, one compile for two calls of the same shapes, and a training step (loss and every
gradient) that matches the eager patched model; the compiled loss also matches the unpatched
Hugging Face model.  Tiny presets (2-3 layers, hidden 64), fp32, the Triton kernels through the
interpreter, backend aot_eager (dynamo + AOTAutograd, the graphs inductor would get; no codegen).
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import liger_rt
from liger_rt import _swaps, dispatch
from liger_rt.patch import core, specs
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import make_inputs
from liger_rt.tools.presets import get_preset
from routing import record_impls

pytestmark = pytest.mark.filterwarnings("ignore:.*(causal_conv1d|flash-linear-attention|overflow encountered).*")


def _family(model_type):
    why = specs.unavailable(model_type)
    return pytest.param(model_type, marks=pytest.mark.skipif(why is not None, reason=str(why)), id=model_type)


@pytest.fixture(autouse=True)
def _clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)
    gc.collect()                # instance patches hold module-wide swaps (rope) until their model dies
    assert not _swaps.LEDGER


def _ops(model_type: str, flags: dict[str, bool]) -> set[str]:
    """The ops the flags route through (every one of them must run a Triton kernel)."""
    spec = specs.SPECS[model_type]
    rows = specs.rows(spec) + specs.function_rows(spec)
    ops = {row.op for _, _, row in rows if row.op and flags.get(row.flag)}
    return ops | {op for flag, op in specs.LOSS_OPS.items() if flags.get(flag)}


def _preset(model_type):
    """The family's tiny preset cut to the fewest decoder layers that still hold one of each kind of
    layer: LFM2's conv and attention layers (LFM2-MoE: a dense and a sparse one), Qwen3.5's linear
    and full attention; one layer elsewhere (Gemma 3: a sliding-window one)."""
    p = get_preset("tiny", model_type)
    if p.model_type == "qwen3_5_moe_text":
        return p                                                    # linear attention, then full attention
    if p.attention_layers:                                          # the LFM2 families
        return dataclasses.replace(p, layers=2, vision_layers=min(p.vision_layers, 1))
    config = dict(p.config)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:1]
    return dataclasses.replace(p, layers=1, config=config)


def _inputs(model, seed):
    inputs = make_inputs(model, seed=seed)
    inputs["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    return inputs


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [_family(m) for m in specs.ALLOWLIST])
def test_compiled_training_step_matches_eager(model_type, monkeypatch):
    flags = specs.parity_flags(model_type)
    preset = _preset(model_type)
    base = build_model(preset)
    model = build_model(preset)                                 # same seed: the same weights
    liger_rt.patch(model, **flags)
    patched = liger_rt.patch.describe(model)["patched"]
    assert set(patched) <= set(flags) and "fused_linear_cross_entropy" in patched, patched
    inputs = _inputs(model, seed=0)

    eager = model(**inputs)
    eager.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)

    # another model patched with rope holds a module-wide swap in the ledger during the trace, and lets
    # go before the second call: a compiled model must not read (and guard on) the ledger
    other = build_model(get_preset("tiny", "llama" if model_type != "llama" else "qwen3"))
    liger_rt.patch(other, rope=True)

    ran = {name: record_impls(monkeypatch, dispatch.get_op(name)) for name in _ops(model_type, patched)}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager_decomp_partition")(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)     # fullgraph: a break raises
    out = compiled(**inputs)
    out.loss.backward()
    assert len(graphs) == 1
    assert {name: "triton" in impls for name, impls in ran.items()} == dict.fromkeys(ran, True), ran
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-6)
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    liger_rt.unpatch(other)
    second = _inputs(model, seed=1)                             # same shapes, other tokens: no recompile
    loss2 = compiled(**second).loss
    assert len(graphs) == 1
    with torch.no_grad():                                       # independent reference: Hugging Face's model
        torch.testing.assert_close(out.loss.detach(), base(**inputs).loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss2.detach(), base(**second).loss, rtol=1e-5, atol=1e-5)
