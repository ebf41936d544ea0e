"""MoE experts (E32/E64 x tokens x routing) and router against transformers and Liger-Kernel (cases:
liger_rt/tools/bench/moe.py).

    python benchmarks/bench_moe.py [--quick] [--where op=moe_experts] [--where tokens=16384] [--reverse-arms]

`liger-tune bench kernels --op moe`, appending one row per measurement to benchmarks/data/kernels.csv
(`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
from pathlib import Path

from liger_rt.tools.bench import script

script(["kernels", "--op", "moe"], Path(__file__).resolve().parent / "data")
