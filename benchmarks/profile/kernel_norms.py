"""Kernel time against wall time of one norm fwd+bwd (torch.profiler tables), to see where the time goes (GPU).

    python benchmarks/profile/kernel_norms.py [--rows 12]
"""
import argparse

import torch

import liger_rt
from liger_rt.tools.bench.harness import profiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=12, help="table rows per profile")
    rows = ap.parse_args().rows
    if not torch.cuda.is_available():
        raise SystemExit("kernel_norms.py needs a GPU")
    for name, (m, n) in (("rms_norm", (16384, 4096)), ("layer_norm", (4096, 1152))):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def step():
            y = liger_rt.ops.rms_norm(x, w) if name == "rms_norm" else liger_rt.ops.layer_norm(x, w, b)
            ins = (x, w) if name == "rms_norm" else (x, w, b)
            return torch.autograd.grad(y, ins, dy)
        prof = profiled(step, warmup=5, calls=10, cpu=True)
        print(f"== {name} {m}x{n} (10 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
