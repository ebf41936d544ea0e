"""Patchers on the GPU (pytest -m gpu tests/gpu/test_patch_gpu.py).

Real layer sizes with few layers, bf16, the Triton kernels: parity gates of liger_rt.tools.parity,
the kernels really chosen, the LFM2 conv fast path taken in training on this transformers.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import gpu_sizing
import liger_rt
from liger_rt import dispatch
from liger_rt.patch import core
from liger_rt.registry import REGISTRY
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import TOLERANCES, compare, format_table, make_inputs
from liger_rt.tools.presets import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*causal_conv1d.*")]
FREE = gpu_sizing.free_bytes()


def _one_dense(name):
    """A preset with one dense layer at most (LFM2-MoE: the layers after it MoE)."""
    p = get_preset(name)
    return dataclasses.replace(p, dense_layers=min(p.dense_layers, 1))


def _short(name, layers):
    return gpu_sizing.cut(_one_dense(name), layers)


def _case(name, flags):
    """4 layers (fewer where the resident models do not fit this card: id ``-cut<n>L``).  A routed-MoE
    preset is compared against an fp32 reference as well (see _routed_bar): up to four models."""
    need = (lambda s: 2 * gpu_sizing.parity_need(s)) if get_preset(name).experts else gpu_sizing.parity_need
    plan = gpu_sizing.plan_model(_one_dense(name), FREE, layers=4, need=need)
    return plan.param(flags, id_suffix="".join(f"-{k}" for k in flags))


# A token's top-k experts flip when bf16 rounding moves its router scores across a near-tie, so two
# bf16 models that differ only in rounding order (the fused kernels against HF's ops) can route a few
# tokens differently and their logits and gradients differ by far more than the dense gates allow.
# The bar for a routed model is the baseline's own bf16 error: the patched bf16 model's error against
# an fp32 reference (same rounded weights) may be at most ROUTED_SLACK times the bf16 baseline's, or
# within the dense gate.  A wrong kernel (a dropped slot, a wrong expert's weights) is far outside it.
ROUTED_SLACK = 2.0


def _routed_bar(preset, flags):
    """(ok, text): the patched and the unpatched bf16 model, each against an fp32 reference."""
    def pair():
        ref = build_model(preset, dtype=torch.bfloat16, device="cuda").to(torch.float32)
        return ref, build_model(preset, dtype=torch.bfloat16, device="cuda")
    base = compare(pair(), patch=False)["rows"]
    torch.cuda.empty_cache()
    new = compare(pair(), patch=flags)
    gates = TOLERANCES[torch.bfloat16]
    lines, ok = [format_table(new), "bar: the bf16 baseline's error against the same fp32 reference"], True
    for name, row in new["rows"].items():
        bar = max(gates[name], ROUTED_SLACK * base[name][row["gate"]])
        fine = row[row["gate"]] <= bar
        ok &= fine
        lines.append(f"  {name:<14} patched {row[row['gate']]:.3g}  baseline {base[name][row['gate']]:.3g}"
                     f"  bar {bar:.3g}  {'ok' if fine else 'FAIL'}")
    return ok, "\n".join(lines)


@pytest.mark.parametrize("plan,flags", [
    _case("qwen3-4b", {}),
    _case("qwen3-4b", {"fused_linear_cross_entropy": True}),
    _case("llama-3.2-1b", {}),
    _case("lfm2-1.2b", {}),
    _case("lfm2-1.2b", {"rope": True, "fused_linear_cross_entropy": True}),
    _case("lfm2-8b-a1b", {}),
    _case("lfm2-8b-a1b", {"rope": True}),
    _case("lfm2-vl-1.6b", {"layer_norm": True}),
    _case("qwen3-30b-a3b", {}),
])
def test_parity_bf16(plan, flags):
    preset = plan.preset
    if plan.note:
        print(plan.note)
    if preset.model_type not in liger_rt.supported_models():
        pytest.skip(f"{preset.model_type} not on the allowlist in this checkout")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", core.PatchWarning)
        if preset.experts:
            ok, text = _routed_bar(preset, flags)
        else:
            report = compare(lambda: build_model(preset, dtype=torch.bfloat16, device="cuda"), patch=flags)
            ok, text = report["ok"], format_table(report)
    print(text)
    assert ok, text
    impls = {d.op: d.impl for op in ("rms_norm", "swiglu") for d in dispatch.memo(REGISTRY.get(op)).values()
             if d.dtype == "bf16"}
    assert impls.get("rms_norm") == "triton", impls


# one bf16 model: built in fp32 then cast (6 bytes a parameter), weights and gradients (4): 10 counted
@pytest.mark.gpu_mem(gib=gpu_sizing.need_gib_of(_short("lfm2-1.2b", 3), gpu_sizing.training_need(10)))
def test_lfm2_conv_fast_path_in_training_on_this_transformers(monkeypatch):
    model = build_model(_short("lfm2-1.2b", 3), dtype=torch.bfloat16, device="cuda")
    liger_rt.patch(model)
    calls = []
    real = liger_rt.ops.short_conv

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(liger_rt.ops, "short_conv", counting)
    model(**make_inputs(model)).loss.backward()             # train mode, config.use_cache as shipped
    n_conv = sum(type(m).__name__ == "Lfm2ShortConv" for m in model.modules())
    assert len(calls) == n_conv, f"{len(calls)} fused conv calls for {n_conv} conv layers (HF path taken?)"


# two bf16 models with gradients (8 bytes a parameter), one built in fp32 beside the other: 14 counted;
# 2 x 1024 tokens of 151936-wide logits, their fp32 upcast and gradients in the baseline's loss (~5 GiB)
@pytest.mark.gpu_mem(gib=gpu_sizing.need_gib_of(_short("qwen3-4b", 2), gpu_sizing.training_need(14, extra_gib=6)))
def test_fused_linear_cross_entropy_memory_and_loss():
    preset = _short("qwen3-4b", 2)
    base = build_model(preset, dtype=torch.bfloat16, device="cuda")
    new = build_model(preset, dtype=torch.bfloat16, device="cuda")
    new.load_state_dict(base.state_dict())
    liger_rt.patch(new, fused_linear_cross_entropy=True)
    ids = torch.randint(1, preset.vocab, (2, 1024), device="cuda")
    peaks, losses = [], []
    for m in (base, new):
        torch.cuda.reset_peak_memory_stats()
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        peaks.append(torch.cuda.max_memory_allocated())
        losses.append(out.loss.detach().float())
    assert out.logits is None
    torch.testing.assert_close(losses[1], losses[0], atol=2e-2, rtol=5e-3)
    assert peaks[1] < peaks[0], peaks
