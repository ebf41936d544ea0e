"""liger_rt inside the training stacks people use (docs/integrations.md): HF Trainer for now.

Tiny models from configs (random weights, no hub), every op on its torch reference
(LIGER_RT_DISABLE=1: the plumbing is under test here, the kernels have their own tests), default
``TrainingArguments`` apart from a temporary output dir, no reporting, two steps, CPU.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import liger_rt
from liger_rt.patch import core
from liger_rt.tools.models import build_model

pytest.importorskip("accelerate", reason="HF Trainer needs accelerate (pip install -e '.[dev]' installs it)")

FLAGS = {"defaults": {}, "fused_loss": {"fused_linear_cross_entropy": True}}


@pytest.fixture(autouse=True)
def _no_class_patches():
    yield
    for model_type in list(core._CLASS_RECORDS):
        core.unpatch(model_type)


def _dataset(vocab: int, rows: int = 8, seq: int = 12) -> list[dict]:
    """Eight rows (one default batch) of causal-LM samples; the last two are right-padded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        ids = torch.randint(1, vocab, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        if i >= rows - 2:
            mask[seq - 3:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _train(model, output_dir) -> tuple[float, int]:
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=str(output_dir), report_to=[], max_steps=2, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size))
    result = trainer.train()
    return result.training_loss, result.global_step


_UNPATCHED: dict[str, float] = {}


def _unpatched_loss(preset: str, tmp_path_factory) -> float:
    if preset not in _UNPATCHED:
        _UNPATCHED[preset] = _train(build_model(preset), tmp_path_factory.mktemp("unpatched"))[0]
    return _UNPATCHED[preset]


class _Calls:
    """Counts calls of liger_rt.ops.<name> (the patched layers look the op up at call time)."""

    def __init__(self, monkeypatch, name):
        self.fn, self.n = getattr(liger_rt.ops, name), 0
        monkeypatch.setattr(liger_rt.ops, name, self)

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["instance", "class"])
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("preset", ["qwen3-tiny", "lfm2-tiny"])
def test_hf_trainer_trains_a_patched_model(preset, flags, level, tmp_path, tmp_path_factory, monkeypatch, fallback):
    pytest.importorskip("liger_rt.kernels.fused_linear_cross_entropy")
    want = _unpatched_loss(preset, tmp_path_factory)
    fused, norms = _Calls(monkeypatch, "fused_linear_cross_entropy"), _Calls(monkeypatch, "rms_norm")
    with warnings.catch_warnings():
        warnings.simplefilter("error", core.PatchWarning)
        if level == "class":                              # patch the model type, then load
            liger_rt.patch(build_model(preset).config.model_type, **FLAGS[flags])
            model = build_model(preset)
        else:                                             # load, then patch the model
            model = liger_rt.patch(build_model(preset), **FLAGS[flags])
    loss, steps = _train(model, tmp_path)
    assert steps == 2
    assert norms.n > 0
    assert fused.n == (2 if flags == "fused_loss" else 0)             # the loss ran without logits
    assert abs(loss - want) < 1e-5, (loss, want)                       # same two steps as unpatched
