"""A GRPO step on the GPU with liger_rt's log-probs head in TRL's place (docs/integrations.md).

    python -m pytest tests/gpu/test_trl_gpu.py -m gpu -q

Two runs of TRL's GRPOTrainer on a patched qwen3-tiny, fp32, under the trainer's seed: LigerRTCallback() (TRL's
head computes the log-probs and entropy, with its Triton kernel) and LigerRTCallback(logprobs=True)
(liger_rt.ops.fused_linear_logprobs does, through TRL's entry point). The layer kernels are the same in both, so
the sampled completions and rewards are too; the entropy and the loss agree to fp32 accumulation order.
"""
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import liger_rt  # noqa: E402
from liger_rt.integrations import LigerRTCallback, trl_head  # noqa: E402
from liger_rt.tools.models import build_model  # noqa: E402
from routing import OpCalls  # noqa: E402
from test_trl import _grpo  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_mem(gib=4), pytest.mark.slow]


def test_a_grpo_step_on_the_gpu_runs_liger_rts_head_in_trls_place(tmp_path, monkeypatch):
    trl_model = build_model("qwen3-tiny", device="cuda")
    trl_trainer, want = _grpo(trl_model, tmp_path / "trl", [LigerRTCallback()], cpu=False)
    assert trl_head(trl_trainer.model) == "trl"
    liger_rt.unpatch(trl_model)
    calls = OpCalls(monkeypatch, "fused_linear_logprobs")
    model = build_model("qwen3-tiny", device="cuda")
    trainer, got = _grpo(model, tmp_path / "liger_rt", [LigerRTCallback(logprobs=True)], cpu=False)
    assert trl_head(trainer.model) == "liger_rt" and calls.n > 0
    assert got.global_step == want.global_step == 1
    for key in ("reward", "reward_std", "completions/mean_length"):
        assert got.metrics[key] == want.metrics[key], (key, got.metrics, want.metrics)
    assert abs(got.metrics["entropy"] - want.metrics["entropy"]) < 1e-4, (got.metrics, want.metrics)
    assert abs(got.training_loss - want.training_loss) < 1e-4, (got.training_loss, want.training_loss)
    liger_rt.unpatch(model)
    torch.cuda.synchronize()
