"""MoE experts grid (E32/E64 x tokens x routing): `liger-tune bench kernels --op moe_experts [ARGS]` (liger_rt/tools/bench/moe_experts.py)."""
from liger_rt.tools.bench import moe_experts

moe_experts.main()
