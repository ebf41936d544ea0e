"""LFM2 short conv against the Hugging Face path and torch.compile (cases: liger_rt/tools/bench/lfm2_ops.py).

    python benchmarks/bench_lfm2_ops.py [--quick] [--where seq=65536] [--no-compile] [--reverse-arms]

`liger-tune bench kernels --op lfm2_ops`, appending one row per measurement to benchmarks/data/kernels.csv
(`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
from pathlib import Path

from liger_rt.tools.bench import script

script(["kernels", "--op", "lfm2_ops"], Path(__file__).resolve().parent / "data")
