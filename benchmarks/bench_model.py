"""The issue's model training-step runs (qwen3, lfm2, qwen3rope, lfm2moe): `liger-tune bench model --target all [ARGS]` (liger_rt/tools/bench/model.py)."""
import sys

from liger_rt.tools.bench import bench

bench.main(["model", "--target", "all", *sys.argv[1:]], prog_name="liger-tune bench")
