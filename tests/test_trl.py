"""TRL's SFTTrainer and GRPOTrainer on a patched tiny Qwen3 (docs/integrations.md).

Both trainers put TRL's own fused LM head on the model (``trl.trainer.utils.add_fused_lm_head``) and
compute the training loss and log-probs through it, so liger_rt's loss flags cannot run there:
`LigerRTCallback` leaves them off and says so once (``ShadowWarning``), and the layer kernels run
inside TRL's head. One step each, on the torch references (LIGER_RT_DISABLE=1: the plumbing is
under test), against the same trainer on the unpatched model. A word-level tokenizer built here
(no hub), fp32, CPU.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

import liger_rt
from liger_rt.integrations import LigerRTCallback, ShadowWarning, shadows, trl_fused_head
from liger_rt.tools.models import build_model
from routing import OpCalls

VOCAB = 160                                        # qwen3-tiny's


def _tokenizer(padding_side="right"):
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   padding_side=padding_side)




def _sft(model, out, callbacks=(), train=True):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(2, VOCAB, (8,), generator=g).tolist() for _ in range(8)]
    args = SFTConfig(output_dir=str(out), report_to=[], max_steps=1, use_cpu=True, per_device_train_batch_size=4,
                     save_strategy="no")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
                         processing_class=_tokenizer(), callbacks=list(callbacks))
    return trainer, (trainer.train() if train else None)


def _reward(completions, **kwargs):
    return [float(len(c.split())) for c in completions]


def _grpo(model, out, callbacks=()):
    prompts = ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11", "w12 w13"]
    args = GRPOConfig(output_dir=str(out), report_to=[], max_steps=1, use_cpu=True, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=Dataset.from_dict(
        {"prompt": prompts}), processing_class=_tokenizer("left"), callbacks=list(callbacks))
    return trainer, trainer.train()


@pytest.mark.slow
def test_sft_trainer_runs_the_layer_kernels_and_warns_that_its_head_shadows_the_fused_loss(
        tmp_path, monkeypatch, fallback):
    _, want = _sft(build_model("qwen3-tiny"), tmp_path / "unpatched")
    norms, fused = OpCalls(monkeypatch, "rms_norm"), OpCalls(monkeypatch, "fused_linear_cross_entropy")
    model = build_model("qwen3-tiny")
    with pytest.warns(ShadowWarning, match="TRL's fused LM head .* fused_linear_cross_entropy"):
        trainer, got = _sft(model, tmp_path / "patched", [LigerRTCallback(fused_linear_cross_entropy=True)])
    info = liger_rt.patch.describe(model)
    assert not info["flags"]["fused_linear_cross_entropy"]            # left off: TRL's head would bypass it
    assert info["patched"]["rms_norm"] == 9 and info["patched"]["swiglu"] == 2
    assert trl_fused_head(trainer.model)
    assert got.global_step == 1 and norms.n > 0 and fused.n == 0
    assert abs(got.training_loss - want.training_loss) < 1e-5, (got.training_loss, want.training_loss)


@pytest.mark.slow
def test_a_fused_loss_patched_before_sft_trainer_is_bypassed_and_the_callback_says_so(
        tmp_path, monkeypatch, fallback):
    """The case of the issue: patch(model, fused_linear_cross_entropy=True), then SFTTrainer. TRL's
    head wraps the patched forward and computes the loss itself: the fused op never runs."""
    fused = OpCalls(monkeypatch, "fused_linear_cross_entropy")
    model = liger_rt.patch(build_model("qwen3-tiny"), fused_linear_cross_entropy=True)
    with pytest.warns(ShadowWarning, match="fused_linear_cross_entropy=False to silence"):
        trainer, got = _sft(model, tmp_path, [LigerRTCallback()])
    assert got.global_step == 1 and fused.n == 0
    assert liger_rt.patch.describe(model)["flags"]["fused_linear_cross_entropy"]     # the user's patch stands
    assert any("TRL's fused LM head" in m for m in shadows(trainer.model))          # without the Trainer's args
    assert shadows(build_model("qwen3-tiny")) == []


@pytest.mark.slow
def test_grpo_trainer_trains_a_patched_model(tmp_path, monkeypatch, fallback):
    """One GRPO step (2 generations of 4 tokens per prompt, sampled under the trainer's seed): the
    same completions, rewards and entropy as the unpatched run; `logprobs` is shadowed like the loss."""
    _, want = _grpo(build_model("qwen3-tiny"), tmp_path / "unpatched")
    norms = OpCalls(monkeypatch, "rms_norm")
    model = build_model("qwen3-tiny")
    with pytest.warns(ShadowWarning, match="liger_rt's logprobs does not run"):
        _, got = _grpo(model, tmp_path / "patched", [LigerRTCallback(logprobs=True)])
    info = liger_rt.patch.describe(model)
    assert not info["flags"]["logprobs"] and info["patched"]["rms_norm"] == 9
    assert got.global_step == 1 and norms.n > 0
    for key in ("reward", "reward_std", "completions/mean_length", "entropy"):
        assert abs(got.metrics[key] - want.metrics[key]) < 1e-5, (key, got.metrics, want.metrics)


@pytest.mark.slow
def test_a_fused_loss_patched_over_trls_head_is_refused_when_training_starts(tmp_path, fallback):
    """patch(fused_linear_cross_entropy=True) *after* SFTTrainer was built replaces TRL's head, whose
    training step then fails on a missing `log_probs`: the callback says why before the step."""
    model = build_model("qwen3-tiny")
    trainer, _ = _sft(model, tmp_path, [LigerRTCallback()], train=False)
    liger_rt.patch(model, fused_linear_cross_entropy=True)
    with pytest.raises(ValueError, match="patched over TRL's fused LM head .* fused_linear_cross_entropy=False"):
        trainer.train()
    liger_rt.unpatch(model)
    assert trl_fused_head(model)                        # unpatch gives TRL's head back


def test_a_plain_trainer_does_not_warn(tmp_path):
    from transformers import TrainingArguments
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShadowWarning)
        model = build_model("qwen3-tiny")
        LigerRTCallback(fused_linear_cross_entropy=True).on_init_end(
            TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True), None, None, model=model)
    assert liger_rt.patch.describe(model)["flags"]["fused_linear_cross_entropy"]
    assert not trl_fused_head(model)
