"""Per-call cost of a memo-hit dispatch decision (CPU): `liger-tune bench dispatch [--calls N]`."""
from liger_rt.tools.bench.harness import script

script(["dispatch"])
