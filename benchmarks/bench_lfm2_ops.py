"""LFM2 short conv and MoE router against the HF code paths: `liger-tune bench kernels --op lfm2_ops [ARGS]` (liger_rt/tools/bench/lfm2_ops.py)."""
import sys

from liger_rt.tools.bench import bench

bench.main(["kernels", "--op", "lfm2_ops", *sys.argv[1:]], prog_name="liger-tune bench")
