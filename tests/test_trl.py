"""TRL's SFT, GRPO, DPO and KTO trainers on a patched tiny Qwen3 (docs/integrations.md).

These trainers put TRL's own fused LM head on the model (``trl.trainer.utils.add_fused_lm_head``) and
compute the training loss and log-probs through it, so liger_rt's loss flags cannot replace the forward
there: given one, `LigerRTCallback` leaves it off and, when training starts, puts liger_rt's log-probs head
in TRL's per-token entry point (``TRLLogProbHead``), which runs GRPO's and KTO's calls; SFT and DPO
ask TRL's head for a top-1 metric too, so TRL's head stays and the callback says why once
(``ShadowWarning``). The trainer steps run on the torch references (LIGER_RT_DISABLE=1: the plumbing is
under test) against the same trainer on the unpatched model; the head itself through the Triton interpreter
against TRL's kernel and an fp64 formula. A word-level tokenizer built here (no hub), fp32, CPU.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import add_fused_lm_head

import liger_rt
from liger_rt.integrations import (LigerRTCallback, ShadowWarning, TRLLogProbHead, shadows, trl_fused_head, trl_head,
                                   use_liger_rt_head_in_trl)
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


def _grpo(model, out, callbacks=(), cpu=True):
    # fp32 (GRPOConfig's default is bf16 autocast, under which TRL's head rounds its logit tiles to bf16)
    prompts = ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11", "w12 w13"]
    args = GRPOConfig(output_dir=str(out), report_to=[], max_steps=1, use_cpu=cpu, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=Dataset.from_dict(
        {"prompt": prompts}), processing_class=_tokenizer("left"), callbacks=list(callbacks))
    return trainer, trainer.train()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """TRLLogProbHead warns once per process for each cause: forget what it said before this test."""
    import liger_rt.integrations
    monkeypatch.setattr(liger_rt.integrations, "_trl_warned", set())


@pytest.mark.slow
def test_sft_trainer_runs_the_layer_kernels_and_keeps_trls_head_which_it_asks_for_top1(tmp_path, monkeypatch,
                                                                                     fallback):
    """SFTTrainer asks TRL's head for is_top1 (its token-accuracy metric), which liger_rt's head does not compute:
    with fused_linear_cross_entropy=True the callback leaves TRL's head in place when training starts and says
    why, once."""
    _, want = _sft(build_model("qwen3-tiny"), tmp_path / "unpatched")
    norms, fused = OpCalls(monkeypatch, "rms_norm"), OpCalls(monkeypatch, "fused_linear_cross_entropy")
    logprobs = OpCalls(monkeypatch, "fused_linear_logprobs")
    model = build_model("qwen3-tiny")
    with pytest.warns(ShadowWarning, match="asks TRL's head for is_top1, which liger_rt's head does not compute") as w:
        trainer, got = _sft(model, tmp_path / "patched", [LigerRTCallback(fused_linear_cross_entropy=True)])
    assert len([m for m in w if issubclass(m.category, ShadowWarning)]) == 1
    info = liger_rt.patch.describe(model)
    assert not info["flags"]["fused_linear_cross_entropy"]            # left off: TRL's head would bypass it
    assert info["patched"]["rms_norm"] == 9 and info["patched"]["swiglu"] == 2
    assert trl_fused_head(trainer.model) and trl_head(trainer.model) == "trl"
    assert got.global_step == 1 and norms.n > 0 and fused.n == 0 and logprobs.n == 0
    assert abs(got.training_loss - want.training_loss) < 1e-5, (got.training_loss, want.training_loss)
    liger_rt.unpatch(model)


@pytest.mark.slow
def test_a_fused_loss_patched_before_sft_trainer_is_bypassed_and_the_callback_says_so(tmp_path, monkeypatch,
                                                                                    fallback):
    """patch(model, fused_linear_cross_entropy=True), then SFTTrainer: TRL's head wraps the patched forward and
    computes the loss itself, so the fused op never runs; the callback says so, and why liger_rt's head does not
    take TRL's place either (SFT's is_top1)."""
    fused = OpCalls(monkeypatch, "fused_linear_cross_entropy")
    model = liger_rt.patch(build_model("qwen3-tiny"), fused_linear_cross_entropy=True)
    assert any("LigerRTCallback puts its log-probs head there when training starts" in m
               for m in shadows(model, SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)))
    with pytest.warns(ShadowWarning, match="fused_linear_cross_entropy does not run .* asks TRL's head for is_top1"):
        trainer, got = _sft(model, tmp_path, [LigerRTCallback()])
    assert got.global_step == 1 and fused.n == 0
    assert liger_rt.patch.describe(model)["flags"]["fused_linear_cross_entropy"]     # the user's patch stands
    assert trl_head(trainer.model) == "trl"
    assert any("TRL's fused LM head" in m for m in shadows(trainer.model))          # without the Trainer's args
    assert shadows(build_model("qwen3-tiny")) == []
    liger_rt.unpatch(model)


@pytest.mark.slow
def test_grpo_trainer_runs_liger_rts_head_in_trls_place(tmp_path, monkeypatch, fallback):
    """One GRPO step (2 generations of 4 tokens per prompt, sampled under the trainer's seed) with
    LigerRTCallback(logprobs=True): liger_rt's head computes TRL's log-probs and entropy, and the step
    gives the same completions, rewards, entropy and loss as the unpatched run, without a warning."""
    _, want = _grpo(build_model("qwen3-tiny"), tmp_path / "unpatched")
    norms, logprobs = OpCalls(monkeypatch, "rms_norm"), OpCalls(monkeypatch, "fused_linear_logprobs")
    model = build_model("qwen3-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShadowWarning)
        trainer, got = _grpo(model, tmp_path / "patched", [LigerRTCallback(logprobs=True)])
    info = liger_rt.patch.describe(model)
    assert not info["flags"]["logprobs"] and info["patched"]["rms_norm"] == 9
    assert trl_head(trainer.model) == "liger_rt"
    assert got.global_step == 1 and norms.n > 0 and logprobs.n > 0
    for key in ("reward", "reward_std", "completions/mean_length", "entropy"):
        assert abs(got.metrics[key] - want.metrics[key]) < 1e-5, (key, got.metrics, want.metrics)
    assert abs(got.training_loss - want.training_loss) < 1e-5, (got.training_loss, want.training_loss)
    liger_rt.unpatch(model)


def _with_reference(trainer_cls, config_cls, out, callbacks, **columns):
    """One step (fp32) of a TRL trainer with a reference model on four prompts and the given columns."""
    data = Dataset.from_dict({"prompt": ["w3 w4", "w5 w6 w7", "w8", "w9 w10"], **columns})
    args = config_cls(output_dir=str(out), report_to=[], max_steps=1, use_cpu=True, per_device_train_batch_size=4,
                      save_strategy="no", bf16=False)
    trainer = trainer_cls(model=build_model("qwen3-tiny"), ref_model=build_model("qwen3-tiny"), args=args,
                          train_dataset=data, processing_class=_tokenizer("left"), callbacks=callbacks)
    return trainer, trainer.train()


@pytest.mark.slow
def test_dpo_trainer_keeps_one_head_for_policy_and_reference(tmp_path, monkeypatch, fallback):
    """DPOTrainer asks the policy's head for is_top1 and the reference's for log-probs only: liger_rt's head would
    score the reference alone, so the callback leaves TRL's head for both (implicit rewards from one head), warns
    why, and the step's loss equals the unpatched run's."""
    def dpo(out, callbacks):
        return _with_reference(DPOTrainer, DPOConfig, out, callbacks, chosen=["w11 w12", "w13", "w14 w15", "w16"],
                               rejected=["w17", "w18 w19", "w20", "w21 w22"])

    _, want = dpo(tmp_path / "unpatched", [])
    logprobs = OpCalls(monkeypatch, "fused_linear_logprobs")
    with pytest.warns(ShadowWarning, match="asks TRL's head for is_top1.*one head for policy and reference"):
        trainer, got = dpo(tmp_path / "patched", [LigerRTCallback(logprobs=True)])
    assert trl_head(trainer.model) == "trl" and logprobs.n == 0
    assert abs(got.training_loss - want.training_loss) < 1e-6, (got.training_loss, want.training_loss)
    liger_rt.unpatch(trainer.model)


@pytest.mark.slow
def test_kto_trainer_runs_liger_rts_head_with_the_mean_logit(tmp_path, monkeypatch, fallback):
    """KTOTrainer asks the policy's head for log-probs, entropy and the mean logit (its logits/* metrics), all of
    which liger_rt's head computes: it scores policy and reference, without a warning, and the step's loss,
    log-probs and mean-logit metrics equal the unpatched run's."""
    def kto(out, callbacks):
        return _with_reference(KTOTrainer, KTOConfig, out, callbacks, completion=["w11 w12", "w13", "w14 w15", "w16"],
                               label=[True, False, True, False])

    _, want = kto(tmp_path / "unpatched", [])
    logprobs = OpCalls(monkeypatch, "fused_linear_logprobs")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShadowWarning)
        trainer, got = kto(tmp_path / "patched", [LigerRTCallback(logprobs=True)])
    assert trl_head(trainer.model) == "liger_rt" and logprobs.n > 0
    assert abs(got.training_loss - want.training_loss) < 1e-6, (got.training_loss, want.training_loss)
    for key in ("logits/chosen", "logits/rejected", "logps/chosen", "logps/rejected"):
        assert abs(got.metrics[key] - want.metrics[key]) < 1e-5, (key, got.metrics, want.metrics)
    liger_rt.unpatch(trainer.model)


def _fp64_logprobs(x, w, b, t, temperature, scale):
    z = (x.double() @ w.double().T + b.double()) * scale / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy"), ("log_probs", "entropy", "mean_logits")])
def test_liger_rts_head_in_trls_place_matches_trls_kernel_and_fp64(outputs):
    """TRLLogProbHead.apply with TRL's arguments (temperature 0.7, a logit scale, a bias; 13 odd rows, a vocab of
    50 over TRL tiles of 16): log-probs, entropy and the mean logit against an fp64 formula and TRL's kernel, and
    the gradients of hidden, weight and bias under random upstream gradients against TRL's; liger_rt's op runs in
    the interpreter."""
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(13, 24, generator=g), torch.randn(50, 24, generator=g) / 3, torch.randn(50, generator=g)
    t = torch.randint(0, 50, (13,), generator=g)
    ups = [torch.randn(13, generator=g) for _ in range(2)]
    results = []
    for fn in (ChunkedLogProbFunction, TRLLogProbHead):
        xs, ws, bs = (v.clone().requires_grad_() for v in (x, w, b))
        out = fn.apply(xs, ws, bs, t, 0.7, 16, None, 1.5, outputs)
        assert out[2] is None and out[4] is None
        assert [out[1] is None, out[3] is None] == [f not in outputs for f in ("entropy", "mean_logits")]
        loss = (out[0] * ups[0]).sum() + (0 if out[1] is None else (out[1] * ups[1]).sum())
        results.append((out[0], out[1], out[3], *torch.autograd.grad(loss, (xs, ws, bs))))
    want_lp, want_ent = _fp64_logprobs(x, w, b, t, 0.7, 1.5)
    (trl_lp, trl_ent, trl_mean, *trl_grads), (lp, ent, mean, *grads) = results
    if mean is not None:
        want_mean = ((x.double() @ w.double().T + b.double()) * 1.5 / 0.7).mean(-1)
        torch.testing.assert_close(mean.double(), want_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mean, trl_mean, rtol=1e-5, atol=1e-5)
        assert not mean.requires_grad
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-5, atol=1e-5)
    if ent is not None:
        torch.testing.assert_close(ent.double(), want_ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, trl_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, trl_lp, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, trl_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_liger_rts_head_in_trls_place_keeps_fp32_logits_for_bf16_inputs():
    """bf16 hidden and weight (64 rows, hidden 256, vocab 2048): the log-probs and entropy within 1e-5 relative of
    an fp64 formula on the same bf16 values (TRL's kernel rounds its logit tiles to bf16 here)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g).bfloat16(), (torch.randn(2048, 256, generator=g) / 4).bfloat16()
    t = torch.randint(0, 2048, (64,), generator=g)
    want_lp, want_ent = _fp64_logprobs(x, w, torch.zeros(2048), t, 1.0, 1.0)
    with torch.no_grad():
        lp, ent, *_ = TRLLogProbHead.apply(x, w, None, t, 1.0, 512, None, 1.0, ("log_probs", "entropy"))
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-5, atol=0)
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-5, atol=0)


def test_a_trl_entry_point_with_other_arguments_is_left_to_trl(monkeypatch):
    """A TRL whose kernel takes other arguments than TRLLogProbHead stands in for: the head is not put there, and
    the reason (which the callback's warning carries) names both argument lists."""
    import trl.trainer.utils

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, temperature):
            return hidden

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Other)
    model = liger_rt.patch(build_model("qwen3-tiny"))
    why = use_liger_rt_head_in_trl(model)
    assert "_ChunkedLogProbFunction takes (hidden, weight, targets, temperature), not the (hidden, weight" in why
    assert trl.trainer.utils._ChunkedLogProbFunction is Other and trl_head(model) is None
    args = GRPOConfig(output_dir="unused", report_to=[], use_cpu=True)
    assert any("takes (hidden, weight, targets, temperature)" in m for m in shadows(model, args, ["logprobs"]))
    liger_rt.unpatch(model)


@pytest.mark.slow
def test_liger_rts_head_runs_in_a_models_trl_head_until_unpatch(monkeypatch, fresh_warnings):
    """TRL's fused head on qwen3-tiny (temperature 0.7, masked labels): with liger_rt's head held by the model's
    patch, the same log-probs, entropy, loss and gradients as TRL's own head, liger_rt's op called; a softcapped
    call goes back to TRL's kernel with a warning; unpatch gives TRL's entry point back."""
    import trl.trainer.utils
    model = build_model("qwen3-tiny")
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.masked_fill(torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.3, -100)

    def run():
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.loss + out.entropy.sum() / 7).backward()
        return out, model.lm_head.weight.grad.clone()

    want, want_dw = run()
    calls = OpCalls(monkeypatch, "fused_linear_logprobs")
    assert "only an instance patch" in use_liger_rt_head_in_trl(model)
    top1 = liger_rt.patch(build_model("qwen3-tiny"))
    add_fused_lm_head(top1, outputs=("log_probs", "is_top1"))
    assert "asks TRL's head for is_top1" in use_liger_rt_head_in_trl(top1) and trl_head(top1) == "trl"
    liger_rt.unpatch(top1)
    liger_rt.patch(model, rms_norm=False, swiglu=False, rope=False)
    assert use_liger_rt_head_in_trl(model) is None and trl_head(model) == "liger_rt"
    got, got_dw = run()
    assert calls.n == 1
    for name in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)
    assert (got.log_probs[labels[:, 1:] == -100] == 0).all()
    torch.testing.assert_close(got_dw, want_dw, rtol=1e-4, atol=1e-5)
    head = trl.trainer.utils._ChunkedLogProbFunction
    x, w, t = torch.randn(3, 8), torch.randn(11, 8), torch.randint(0, 11, (3,))
    with pytest.warns(ShadowWarning, match="softcaps its logits"):
        capped = head.apply(x, w, None, t, 1.0, 16, 5.0, 1.0, ("log_probs",))
    torch.testing.assert_close(capped[0], ChunkedLogProbFunction.apply(x, w, None, t, 1.0, 16, 5.0, 1.0,
                                                                       ("log_probs",))[0])
    liger_rt.unpatch(model)
    gc.collect()                          # models of earlier tests that held the entry point too
    assert trl.trainer.utils._ChunkedLogProbFunction is ChunkedLogProbFunction and trl_head(model) == "trl"


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
