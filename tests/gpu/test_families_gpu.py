"""The issue-17 families on the GPU (run on the H200: pytest -m gpu tests/gpu/test_families_gpu.py).

bf16 parity (liger_rt.tools.parity's gates) with every flag each family takes (its defaults, rope
where it has a rope row, the fused loss), Triton kernels chosen by dispatch:
- the issue's four at real sizes: Gemma 3 4B (text model, all 34 layers), Mistral 7B (16 of 32
  layers), Mixtral 8x7B (2 layers), Qwen2.5 7B (14 of 28 layers): two resident models with
  gradients, parameter snapshots and an AdamW step must fit one 141 GB H200;
- every family at its released widths with 4 layers (Mixtral: the 2-layer run above; 4 layers of
  8x7B experts do not fit twice).
"""
from __future__ import annotations

import dataclasses
import gc
import warnings

import pytest
import torch

from liger_rt import dispatch
from liger_rt.patch import core, specs
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import compare, format_table
from liger_rt.tools.presets import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*(causal_conv1d|flash-linear-attention).*")]

ISSUE = ["gemma3-4b", "mistral-7b-16L", "mixtral-8x7b-2L", "qwen2.5-7b-14L"]
RELEASED = ["qwen2.5-7b", "qwen1.5-moe-a2.7b", "mistral-7b", "gemma-2b", "gemma2-2b", "gemma3-4b",
            "phi3-mini", "olmo2-7b", "granite-3.3-2b", "glm4-9b", "smollm3-3b", "qwen3.5-35b-a3b"]
# the ops each family's layers run, and the implementation they must get at these sizes
KERNELS = {"rms_norm": "triton", "swiglu": "triton", "geglu": "triton"}


@pytest.fixture(autouse=True)
def _free():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _short(name, layers):
    p = get_preset(name)
    attn = tuple(i for i in p.attention_layers if i < layers) or ((layers - 1,) if p.attention_layers else ())
    return dataclasses.replace(p, name=f"{name}-{layers}L", layers=layers, attention_layers=attn)


def _parity(preset):
    if specs.unavailable(preset.model_type):
        pytest.skip(specs.unavailable(preset.model_type))
    dispatch.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", core.PatchWarning)
        report = compare(lambda: build_model(preset, dtype=torch.bfloat16, device="cuda"),
                         patch=specs.parity_flags(preset.model_type))
    print(preset.name, report["patched"]["patched"])
    print(format_table(report))
    assert report["ok"], format_table(report)
    assert set(report["patched"]["patched"]) == set(specs.parity_flags(preset.model_type))
    chosen = {d.op: d.impl for op in KERNELS if op in dispatch.OP_MODULES
              for d in dispatch.get_op(op)._memo.values() if d.dtype == "bf16"}
    assert all(chosen[op] == KERNELS[op] for op in chosen), chosen


@pytest.mark.parametrize("name", ISSUE)
def test_parity_bf16_issue_sizes(name):
    _parity(get_preset(name))


@pytest.mark.parametrize("name", RELEASED)
def test_parity_bf16_released_widths_4_layers(name):
    _parity(_short(name, 4))
