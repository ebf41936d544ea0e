"""RMSNorm, residual add + RMSNorm and LayerNorm against eager, torch.compile and Liger-Kernel (cases:
liger_rt/tools/bench/norms.py).

    python benchmarks/bench_norms.py [--quick] [--where op=rms_norm] [--where hidden=64,128] [--reverse-arms]
    python benchmarks/bench_norms.py --where op=fused_add_rms_norm     # fused vs the add then rms_norm vs eager

`liger-tune bench kernels --op norms`, appending one row per measurement to benchmarks/data/kernels.csv
(`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
from pathlib import Path

from liger_rt.tools.bench import script

script(["kernels", "--op", "norms"], Path(__file__).resolve().parent / "data")
