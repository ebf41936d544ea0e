"""Host microseconds per layer of a norm call (GPU): `liger-tune bench host [ARGS]` (liger_rt/tools/bench/host_overhead.py)."""
from liger_rt.tools.bench import host_overhead

host_overhead.main()
