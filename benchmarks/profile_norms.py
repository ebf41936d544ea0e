"""Kernel time vs wall time of one norm fwd+bwd (torch.profiler), to see where the time goes.

    python benchmarks/profile_norms.py
"""
import torch

import liger_rt
from liger_rt.tools.bench.harness import profiled


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_norms needs a GPU")
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
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
