"""Host cost of a call: per layer of a norm call and device against wall time (GPU), or with --dispatch a dispatch
decision that hits the memo (CPU), or with --cpu-stub the Python path with Triton launches stubbed (CPU).

    python benchmarks/bench_host.py [--cpu-stub]
    python benchmarks/bench_host.py --dispatch [--calls 200000]

`liger-tune bench host` (or `bench dispatch`), appending one row per probe to benchmarks/data/host.csv
(`--data DIR`: that folder instead; `--no-data`: nowhere).
"""
import sys
from pathlib import Path

from liger_rt.tools.bench import script

verb = "dispatch" if "--dispatch" in sys.argv else "host"
sys.argv = [a for a in sys.argv if a != "--dispatch"]
script([verb], Path(__file__).resolve().parent / "data")
