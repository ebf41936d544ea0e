"""Per-call cost of a memo-hit dispatch decision (CPU): `liger-tune bench dispatch [--calls N]`."""
import sys

from liger_rt.tools.bench import bench

bench.main(["dispatch", *sys.argv[1:]], prog_name="liger-tune bench")
