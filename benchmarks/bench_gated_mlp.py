"""SwiGLU against eager, torch.compile and Liger-Kernel (cases: liger_rt/tools/bench/gated_mlp.py).

    python benchmarks/bench_gated_mlp.py [--quick] [--where cols=8192] [--reverse-arms]

`liger-tune bench kernels --op gated_mlp`, appending one row per measurement to benchmarks/data/kernels.csv
(`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
from pathlib import Path

from liger_rt.tools.bench import script

script(["kernels", "--op", "gated_mlp"], Path(__file__).resolve().parent / "data")
