"""RMSNorm, SwiGLU and LayerNorm against eager, torch.compile and Liger-Kernel: `liger-tune bench kernels --op norms [ARGS]` (liger_rt/tools/bench/norms.py)."""
from liger_rt.tools.bench import norms

norms.main()
