"""Fused linear cross-entropy and cross-entropy: `liger-tune bench kernels --op losses [ARGS]` (liger_rt/tools/bench/losses.py)."""
from liger_rt.tools.bench import losses

losses.main()
