"""liger_rt.tools.parity: the compare() API and `liger-tune parity` (JSON output, failing on a perturbed patch)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

import liger_rt
from liger_rt.layers import norms
from liger_rt.tools import parity as P
from liger_rt.tools.models import build_model

_MISSING = [op for op in ("rms_norm", "swiglu") if importlib.util.find_spec(f"liger_rt.kernels.{op}") is None]
pytestmark = [pytest.mark.filterwarnings("ignore:.*causal_conv1d.*"),
              pytest.mark.skipif(bool(_MISSING), reason=f"kernel module(s) {', '.join(_MISSING)} not in this checkout")]




def _noisy(monkeypatch, scale=1e-2):
    """A deliberately wrong RMSNorm layer: the parity tool must see it and fail."""
    real = norms.rms_norm_forward

    def noisy(self, hidden_states):
        out = real(self, hidden_states)
        g = torch.Generator(device=out.device).manual_seed(0)
        return out + scale * torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype)
    monkeypatch.setattr(norms, "rms_norm_forward", noisy)


def test_make_inputs_is_seed_000s_input():
    model = build_model("qwen3-tiny")
    x = P.make_inputs(model)
    assert x["input_ids"].shape == (2, 8) and x["attention_mask"].tolist()[1] == [1] * 5 + [0] * 3
    assert (x["labels"][1, 5:] == -100).all() and (x["labels"][0] == x["input_ids"][0]).all()
    vl = P.make_inputs(build_model("lfm2-vl-tiny"))
    assert vl["pixel_values"].shape == (1, 16, 48) and vl["spatial_shapes"].tolist() == [[4, 4]]
    image_token = build_model("lfm2-vl-tiny").config.image_token_id
    assert int((vl["input_ids"] == image_token).sum()) == 4 and vl["input_ids"].shape == (2, 12)


def test_compare_passes_for_the_real_patch(fallback):
    report = P.compare(lambda: build_model("qwen3-tiny"))
    assert report["ok"], P.format_table(report)
    assert list(report["rows"]) == list(P.ROWS)
    for row in report["rows"].values():
        assert row["max_abs"] <= 1e-5 and row["ok"]
    assert report["rows"]["gradients"]["tensor"] and report["patched"]["patched"]["rms_norm"] == 9


def test_compare_fails_for_a_perturbed_patch(monkeypatch, fallback):
    _noisy(monkeypatch)
    report = P.compare(lambda: build_model("qwen3-tiny"))
    assert not report["ok"]
    for name in ("logits", "action_logprobs", "entropy", "optimisation_loss", "gradients", "adamw_update"):
        assert report["rows"][name]["max_abs"] > 0, name
    assert not report["rows"]["logits"]["ok"] and report["rows"]["logits"]["linf_over_baseline_max"] > 1e-3


def test_compare_takes_a_pair_and_a_model(fallback):
    base, mine = build_model("llama-tiny"), build_model("llama-tiny")
    mine.load_state_dict(base.state_dict())
    liger_rt.patch(mine, swiglu=False)
    report = P.compare((base, mine), patch=False)
    assert report["ok"] and report["patched"]["patched"] == {"rms_norm": 5}
    report = P.compare(build_model("llama-tiny"), patch={"rms_norm": False})
    assert report["ok"] and report["patched"]["patched"] == {"swiglu": 2}


def test_compare_lfm2_vl_with_an_image(fallback):
    report = P.compare(lambda: build_model("lfm2-vl-tiny"), patch={"layer_norm": True})
    assert report["ok"], P.format_table(report)
    assert report["patched"]["patched"]["layer_norm"] == 5


def test_cli_json_parses_and_passes(fallback):
    result = CliRunner().invoke(P.parity, ["--model", "qwen3", "--preset", "tiny", "--dtype", "fp32",
                                           "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["model_type"] == "qwen3" and report["preset"] == "qwen3-tiny"
    assert set(report["rows"]) == set(P.ROWS)
    assert report["rows"]["logits"]["tolerance"] == P.TOLERANCES[torch.float32]["logits"]


def test_cli_table_and_flags(fallback):
    result = CliRunner().invoke(P.parity, ["--model", "lfm2", "--flags", "fused_linear_cross_entropy=1"])
    assert result.exit_code == 0, result.output
    assert "action log-probs" in result.output and "AdamW update" in result.output and "PASS" in result.output
    assert "fused_linear_cross_entropy x1" in result.output


def test_cli_fails_with_nonzero_exit_on_a_perturbed_patch(monkeypatch, fallback):
    _noisy(monkeypatch)
    result = CliRunner().invoke(P.parity, ["--model", "llama", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert not report["ok"]
    assert report["rows"]["logits"]["max_abs"] > 0 and report["rows"]["gradients"]["max_abs"] > 0
    plain = CliRunner().invoke(P.parity, ["--model", "llama"])
    assert plain.exit_code == 1 and "FAIL" in plain.output


def test_cli_errors_are_actionable():
    bad = CliRunner().invoke(P.parity, ["--model", "gpt2"])
    assert bad.exit_code != 0 and "supported: qwen3" in bad.output
    mismatch = CliRunner().invoke(P.parity, ["--model", "qwen3", "--preset", "llama-tiny"])
    assert mismatch.exit_code != 0 and "llama model, not qwen3" in mismatch.output
    flag = CliRunner().invoke(P.parity, ["--model", "qwen3", "--flags", "bogus=1"])
    assert flag.exit_code != 0 and "valid flags" in flag.output


def test_cli_is_registered_in_liger_tune():
    from liger_rt.tools.cli import main
    assert "parity" in main.commands
