"""RMSNorm, SwiGLU and LayerNorm against eager, torch.compile and Liger-Kernel: `liger-tune bench kernels --op norms [ARGS]` (liger_rt/tools/bench/norms.py)."""
import sys

from liger_rt.tools.bench import bench

bench.main(["kernels", "--op", "norms", *sys.argv[1:]], prog_name="liger-tune bench")
