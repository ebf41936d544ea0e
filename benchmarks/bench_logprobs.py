"""Fused linear log-probs and entropy against the materialised path, torch.compile, TRL and Liger-Kernel
(liger_rt/tools/bench/logprobs.py).

    python benchmarks/bench_logprobs.py [--quick] [--tokens 8192] [--rounds 3] [--no-compile]

`liger-tune bench logprobs`, appending one row per measurement (median over the rounds) to
benchmarks/data/kernels.csv (`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
from pathlib import Path

from liger_rt.tools.bench import script

script(["logprobs"], Path(__file__).resolve().parent / "data")
