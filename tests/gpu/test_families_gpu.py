"""The model families of liger_rt.tools.models.FAMILIES on the GPU: bf16 parity (liger_rt.tools.parity's
gates) with every flag each family takes (its defaults, rope where it has a rope row, the fused loss),
Triton kernels chosen by dispatch.

    python -m pytest -m gpu tests/gpu/test_families_gpu.py -q -s      # -s prints each parity table

- many layers at released widths: Gemma 3 4B (text model, all 34 layers), Mistral 7B (16 of 32),
  Mixtral 8x7B (2 of 32), Qwen2.5 7B (14 of 28).  Two resident models with gradients, parameter
  snapshots and an AdamW step need 73-100 GiB at these depths (gpu_sizing.parity_need: they fit a
  141 GB H200), so a card with less free memory runs the same widths with fewer layers; the test id
  says so (``gemma3-4b-cut27L`` on an 80 GB H100) and ``-s`` prints the figures;
- every family but Mixtral (above) at its released widths with 4 layers, fewer where they do not
  fit (``qwen3.5-35b-a3b-4L-cut2L`` on an 80 GB H100).

Qwen3.5-MoE's patched model takes the experts the baseline's routers chose (``_pin_routing``): with
256 experts and top-8, bf16 rounding moves near-tied router probabilities past each other, and a
token sent to other experts differs by far more than any kernel error.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import gpu_sizing
from liger_rt import dispatch
from liger_rt.patch import core, specs
from liger_rt.registry import REGISTRY
from liger_rt.tools.models import build_model
from liger_rt.tools.parity import compare, format_table
from liger_rt.tools.presets import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*(causal_conv1d|flash-linear-attention).*")]

# (preset, layers): at most these layers (two resident models of them fit a 141 GB H200), fewer where
# this card's free memory is less
MANY_LAYERS = [("gemma3-4b", None), ("mistral-7b", 16), ("mixtral-8x7b", 2), ("qwen2.5-7b", 14)]
RELEASED = ["qwen2.5-7b", "qwen1.5-moe-a2.7b", "mistral-7b", "gemma-2b", "gemma2-2b", "gemma3-4b",
            "phi3-mini", "olmo2-7b", "granite-3.3-2b", "glm4-9b", "smollm3-3b", "qwen3.5-35b-a3b"]
# the ops each family's layers run, and the implementation they must get at these sizes
KERNELS = {"rms_norm": "triton", "swiglu": "triton", "geglu": "triton"}
FREE = gpu_sizing.free_bytes()


# routers whose near-ties bf16 flips (see _pin_routing): family -> router class
PIN_ROUTING = {"qwen3_5_moe_text": "Qwen3_5MoeTopKRouter"}


def _pin_routing(base, new, router: str) -> list[int]:
    """Make `new`'s routers take the experts `base`'s took, call by call (compare runs base first);
    returns [token choices that differed, token choices].

    A CPU proxy of qwen3.5-35b-a3b at 4 layers (hidden 2048, 256 experts, top-8; expert width 64,
    vocab 4096; bf16, LIGER_RT_DISABLE=1), identical under transformers 5.17/torch 2.11 and
    5.24/torch 2.13: with every parity flag, logits 4.9e-2 of their max against the 3e-2 gate and
    gradients 8.1e-2 against 5e-2; the experts op alone sent 1, 3 and 5 of 16 tokens to other
    experts in layers 1-3 of a forward, while rms_norm and swiglu alone were bit-identical.  Pinned:
    logits 1.8e-2, gradients 3.6e-2, 18 of 192 choices differed.  `new` keeps its own router
    probabilities at the pinned experts, renormalised as HF's router does (softmax in fp32, over
    the top k), so the router's gradient still flows.
    """
    recorded: dict[str, list[torch.Tensor]] = {}
    count = [0, 0]

    def record(name):
        def hook(module, args, out):
            recorded.setdefault(name, []).append(out[2].detach())
        return hook

    def replay(name):
        def hook(module, args, out):
            logits, _, got = out
            want = recorded[name].pop(0)
            count[0] += int((got.sort(-1).values != want.sort(-1).values).any(-1).sum())
            count[1] += want.shape[0]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, want)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), want
        return hook

    pairs = [(name, b, n) for (name, b), (_, n) in zip(base.named_modules(), new.named_modules())
             if type(b).__name__ == router]
    assert pairs, f"no {router} in {type(base).__name__}"
    for name, b, n in pairs:
        b.register_forward_hook(record(name))
        n.register_forward_hook(replay(name))
    return count


def _parity(plan):
    preset = plan.preset
    if plan.note:
        print(plan.note)
    if specs.unavailable(preset.model_type):
        pytest.skip(specs.unavailable(preset.model_type))
    dispatch.reset()
    base = build_model(preset, dtype=torch.bfloat16, device="cuda")
    new = build_model(preset, dtype=torch.bfloat16, device="cuda")
    new.load_state_dict(base.state_dict())
    router = PIN_ROUTING.get(preset.model_type)
    flips = _pin_routing(base, new, router) if router else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", core.PatchWarning)
        report = compare((base, new), patch=specs.parity_flags(preset.model_type))
    del base, new
    print(preset.name, report["patched"]["patched"])
    if flips is not None:       # a few near-ties; most choices differing would be a broken model, not rounding
        print(f"routing pinned: {flips[0]} of {flips[1]} token choices differed")
        assert flips[0] <= flips[1] // 4, flips
    print(format_table(report))
    assert report["ok"], format_table(report)
    assert set(report["patched"]["patched"]) == set(specs.parity_flags(preset.model_type))
    chosen = {d.op: d.impl for op in KERNELS if op in REGISTRY.names()
              for d in dispatch.memo(REGISTRY.get(op)).values() if d.dtype == "bf16"}
    assert all(chosen[op] == KERNELS[op] for op in chosen), chosen


@pytest.mark.parametrize("plan", [gpu_sizing.plan_model(get_preset(name), FREE, layers=layers).param()
                                  for name, layers in MANY_LAYERS])
def test_parity_bf16_many_layers(plan):
    _parity(plan)


@pytest.mark.parametrize("plan", [gpu_sizing.plan_model(get_preset(name), FREE, layers=4).param() for name in RELEASED])
def test_parity_bf16_released_widths_4_layers(plan):
    _parity(plan)
