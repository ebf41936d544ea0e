"""Host microseconds per layer of a norm call (GPU): `liger-tune bench host [ARGS]` (liger_rt/tools/bench/host_overhead.py)."""
import sys

from liger_rt.tools.bench import bench

bench.main(["host", *sys.argv[1:]], prog_name="liger-tune bench")
