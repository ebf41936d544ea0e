"""liger_rt inside the training stacks people use (docs/integrations.md): HF Trainer, the
`liger_rt.integrations` entry points (callback, loader), Accelerate and torch.compile recipes.
PEFT and TRL are in tests/test_peft.py and tests/test_trl.py, FSDP2/DDP in tests/test_distributed.py.

Tiny models from configs (random weights, no hub), every op on its torch reference
(LIGER_RT_DISABLE=1: the plumbing is under test here, the kernels have their own tests), default
``TrainingArguments`` apart from a temporary output dir, no reporting, two steps, CPU.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import liger_rt
from liger_rt.integrations import AutoLigerRTModelForCausalLM, LigerRTCallback, ShadowWarning
from liger_rt.patch import core
from liger_rt.tools.models import build_config, build_model
from routing import OpCalls

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


def _args(output_dir, **kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=str(output_dir), report_to=[], max_steps=2, use_cpu=True, **kw)


def _train(model, output_dir, callbacks=None, model_init=None) -> tuple[float, int]:
    from transformers import Trainer
    vocab = (model or model_init()).config.vocab_size
    trainer = Trainer(model=model, model_init=model_init, args=_args(output_dir), callbacks=callbacks,
                      train_dataset=_dataset(vocab))
    result = trainer.train()
    return result.training_loss, result.global_step


_UNPATCHED: dict[str, float] = {}


def _unpatched_loss(preset: str, tmp_path_factory) -> float:
    if preset not in _UNPATCHED:
        _UNPATCHED[preset] = _train(build_model(preset), tmp_path_factory.mktemp("unpatched"))[0]
    return _UNPATCHED[preset]




@pytest.mark.slow
@pytest.mark.parametrize("level", ["instance", "class"])
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("preset", ["qwen3-tiny", "lfm2-tiny"])
def test_hf_trainer_trains_a_patched_model(preset, flags, level, tmp_path, tmp_path_factory, monkeypatch, fallback):
    pytest.importorskip("liger_rt.kernels.fused_linear_cross_entropy")
    want = _unpatched_loss(preset, tmp_path_factory)
    fused, norms = OpCalls(monkeypatch, "fused_linear_cross_entropy"), OpCalls(monkeypatch, "rms_norm")
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


# -- liger_rt.integrations: the Trainer callback ----------------------------------------------------------

@pytest.mark.slow
def test_callback_patches_the_trainers_model(tmp_path, tmp_path_factory, monkeypatch, fallback):
    """Trainer(callbacks=[LigerRTCallback(...)]) patches at init, before accelerate prepares the model."""
    from transformers import Trainer
    want = _unpatched_loss("qwen3-tiny", tmp_path_factory)
    fused = OpCalls(monkeypatch, "fused_linear_cross_entropy")
    model = build_model("qwen3-tiny")
    callback = LigerRTCallback(fused_linear_cross_entropy=True)
    trainer = Trainer(model=model, args=_args(tmp_path), callbacks=[callback], train_dataset=_dataset(160))
    info = liger_rt.patch.describe(model)
    assert info["level"] == "instance" and info["flags"]["fused_linear_cross_entropy"]
    assert info["patched"]["rms_norm"] > 0 and info["patched"]["swiglu"] == 2
    result = trainer.train()                       # on_train_begin: already patched, left alone
    assert liger_rt.patch.describe(model)["flags"] == info["flags"]
    assert fused.n == 2 and abs(result.training_loss - want) < 1e-5


@pytest.mark.slow
def test_callback_patches_a_model_init_model_when_training_starts(tmp_path, monkeypatch, fallback):
    built = []

    def model_init():
        built.append(build_model("qwen3-tiny"))
        return built[-1]
    norms = OpCalls(monkeypatch, "rms_norm")
    _, steps = _train(None, tmp_path, callbacks=[LigerRTCallback()], model_init=model_init)
    assert steps == 2 and norms.n > 0
    assert liger_rt.patch.describe(built[-1])["patched"]["rms_norm"] > 0


def test_callback_keeps_an_existing_patch_and_validates_flags(tmp_path):
    model = liger_rt.patch(build_model("qwen3-tiny"), swiglu=False)
    cb = LigerRTCallback(rms_norm=False)
    cb.on_init_end(_args(tmp_path), None, None, model=model)
    assert liger_rt.patch.describe(model)["flags"]["swiglu"] is False          # the user's patch stands
    assert liger_rt.patch.describe(model)["flags"]["rms_norm"] is True
    with pytest.raises(ValueError, match="valid flags"):
        LigerRTCallback(swigloo=True).on_init_end(_args(tmp_path), None, None, model=build_model("qwen3-tiny"))


def test_callback_warns_once_when_liger_kernel_or_hub_kernels_shadow_it(tmp_path):
    model = build_model("qwen3-tiny")
    cb = LigerRTCallback()
    args = _args(tmp_path, use_liger_kernel=True)
    with pytest.warns(ShadowWarning, match="use_liger_kernel=True"):
        cb.on_init_end(args, None, None, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShadowWarning)
        cb.on_train_begin(args, None, None, model=model)                      # once per callback
        LigerRTCallback().on_init_end(_args(tmp_path), None, None, model=build_model("qwen3-tiny"))
    model = build_model("qwen3-tiny")
    model._use_kernels = True                                                  # what kernelize() sets
    with pytest.warns(ShadowWarning, match="hub kernels"):
        LigerRTCallback().on_init_end(_args(tmp_path), None, None, model=model)


# -- liger_rt.integrations: the loader --------------------------------------------------------------------

def test_loader_patches_what_it_loads(tmp_path, fallback):
    from transformers import AutoModelForCausalLM
    build_model("qwen3-tiny").save_pretrained(tmp_path)
    model = AutoLigerRTModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                        fused_linear_cross_entropy=True, swiglu=False)
    info = liger_rt.patch.describe(model)
    assert info["flags"]["fused_linear_cross_entropy"] and not info["flags"]["swiglu"]
    assert "swiglu" not in info["patched"] and info["patched"]["rms_norm"] > 0
    assert not hasattr(model.config, "swiglu")                                # flags never reach the config
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = _dataset(160)[0]["input_ids"][None]
    assert torch.equal(model(ids).logits, plain(ids).logits)
    cfg = build_config("lfm2-tiny")
    assert liger_rt.patch.describe(AutoLigerRTModelForCausalLM.from_config(cfg, short_conv=False))["flags"] \
        == {**liger_rt.patch.describe(liger_rt.patch(build_model("lfm2-tiny")))["flags"], "short_conv": False}


def test_loader_refuses_before_loading(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, GPT2Config
    build_model("qwen3-tiny").save_pretrained(tmp_path / "qwen3")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path / "gpt2")

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the checks")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ValueError, match="supported: .*qwen3"):
        AutoLigerRTModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unknown flag.*'short_conv' for qwen3; valid flags"):
        AutoLigerRTModelForCausalLM.from_pretrained(tmp_path / "qwen3", short_conv=True)
    with pytest.raises(TypeError, match="from_pretrained"):
        AutoLigerRTModelForCausalLM()


# -- recipes: Accelerate (your own loop), torch.compile -------------------------------------------------

def _accelerate_losses(patch: bool) -> list[float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    model = build_model("qwen3-tiny")
    if patch:
        liger_rt.patch(model, fused_linear_cross_entropy=True)
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_dataset(160), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    AcceleratorState._reset_state(reset_partial_state=True)      # the next Accelerator/Trainer starts afresh
    return losses


@pytest.mark.slow
def test_accelerate_loop_trains_a_patched_model(monkeypatch, fallback):
    want = _accelerate_losses(patch=False)
    fused = OpCalls(monkeypatch, "fused_linear_cross_entropy")
    got = _accelerate_losses(patch=True)
    assert fused.n == 2 and len(got) == 2
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


@pytest.mark.slow
def test_torch_compile_of_a_patched_model_trains_like_eager(monkeypatch, fallback):
    """torch.compile(backend="aot_eager") of a patched Qwen3 with the fused loss: the loss and every
    gradient equal the unpatched eager model's (inductor compiles too, but takes a minute on CPU)."""
    from liger_rt.tools.parity import make_inputs
    base, model = build_model("qwen3-tiny"), build_model("qwen3-tiny")
    liger_rt.patch(model, fused_linear_cross_entropy=True)
    inputs = make_inputs(base)
    want = base(**inputs).loss
    want.backward()
    fused = OpCalls(monkeypatch, "fused_linear_cross_entropy")
    loss = torch.compile(model, backend="aot_eager")(**inputs).loss
    loss.backward()
    assert fused.n == 1 and abs(loss.item() - want.item()) < 1e-6
    grads = dict(base.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
