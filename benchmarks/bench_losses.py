"""Fused linear cross-entropy and cross-entropy: `liger-tune bench kernels --op losses [ARGS]` (liger_rt/tools/bench/losses.py)."""
import sys

from liger_rt.tools.bench import bench

bench.main(["kernels", "--op", "losses", *sys.argv[1:]], prog_name="liger-tune bench")
