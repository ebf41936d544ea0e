"""LFM2 short conv and MoE router against the HF code paths: `liger-tune bench kernels --op lfm2_ops [ARGS]` (liger_rt/tools/bench/lfm2_ops.py)."""
from liger_rt.tools.bench import lfm2_ops

lfm2_ops.main()
