"""Fused linear log-probs and entropy against the materialised path, torch.compile, TRL and Liger-Kernel
(liger_rt/tools/bench/logprobs.py).

    python benchmarks/bench_logprobs.py [--quick] [--tokens 8192] [--rounds 3] [--no-compile]

`liger-tune bench logprobs`, appending one row per measurement and round to
benchmarks/data/kernels.csv (`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
import contextlib
import importlib.util
import sys
import types
from pathlib import Path

from liger_rt.tools.bench import script


def stand_in_for_trl_utils() -> None:
    """TRL's ChunkedLogProbFunction imports trl.trainer.utils in its backward, which needs accelerate, datasets,
    pandas, ...: where trl's wheel is carried alone (a GPU image without a registry), its one name used there,
    maybe_gather_lm_head_ctx (a null context without DeepSpeed ZeRO-3), stands in for the module."""
    if importlib.util.find_spec("trl") is None:
        return                  # no trl: its arm is skipped
    try:
        import trl.trainer.utils  # noqa: F401
    except Exception as exc:    # trl there, its dependencies not (a missing one is an ImportError too)
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        stub.STAND_IN = True
        sys.modules["trl.trainer.utils"] = stub
        print(f"  (trl.trainer.utils does not import: {type(exc).__name__}: {exc}; its maybe_gather_lm_head_ctx "
              f"stands in for it)")


if __name__ == "__main__":
    stand_in_for_trl_utils()
    script(["logprobs"], Path(__file__).resolve().parent / "data")
