"""MoE experts grid (E32/E64 x tokens x routing): `liger-tune bench kernels --op moe_experts [ARGS]` (liger_rt/tools/bench/moe_experts.py)."""
import sys

from liger_rt.tools.bench import bench

bench.main(["kernels", "--op", "moe_experts", *sys.argv[1:]], prog_name="liger-tune bench")
