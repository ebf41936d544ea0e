"""Fused linear cross-entropy and cross-entropy against eager, torch.compile and Liger-Kernel (cases:
liger_rt/tools/bench/losses.py).

    python benchmarks/bench_losses.py [--quick] [--where op=fused_linear_cross_entropy] [--reverse-arms]

`liger-tune bench kernels --op losses`, appending one row per measurement to benchmarks/data/kernels.csv
(`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
from pathlib import Path

from liger_rt.tools.bench import script

script(["kernels", "--op", "losses"], Path(__file__).resolve().parent / "data")
