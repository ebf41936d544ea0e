"""The LFM2 short conv at a model step's shape (GPU): does the packed-sequence path (seq_idx) cost device time, and
which candidate config is fastest there?

    python benchmarks/profile/short_conv_step.py [--batch 4 --seq 2048 --hidden 2048]

Device time (CUDA-graph replay, `autotune.graph_ms`) of forward+backward through `torch.autograd.grad`, bf16:
the dispatched config without seq_idx, with an all-zero seq_idx (one sequence per row, the step's case: LFM2's
decoder layers pass the position ids, so the conv gets sequence ids), then every candidate config with seq_idx.
Each time's fraction of the copy bytes (forward: read bcx, write y; backward: read bcx and dy, write dbcx).
"""
import argparse

import torch

from liger_rt import dispatch, ops
from liger_rt.autograd import call_impl
from liger_rt.autotune import graph_ms
from liger_rt.registry import REGISTRY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    B, T, H = args.batch, args.seq, args.hidden
    g = torch.Generator("cuda").manual_seed(0)
    bcx = torch.randn(B, T, 3 * H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(H, 3, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    dy = torch.randn(B, T, H, device="cuda", generator=g).bfloat16()
    seq = torch.zeros(B, T, device="cuda", dtype=torch.int32)
    op = REGISTRY.get("short_conv")
    moved = (3 * H + H + 3 * H + H + 3 * H) * B * T * 2      # fwd: bcx, y; bwd: bcx, dy, dbcx

    def step(config=None, seq_idx=None):
        def fn():
            y = (ops.short_conv(bcx, w, None, seq_idx=seq_idx) if config is None
                 else call_impl(op, "triton", config, bcx, w, None, seq_idx))
            return torch.autograd.grad(y, (bcx, w), dy)
        return fn

    d = dispatch.decision(op, bcx, **op.dims(bcx, w, None, seq))
    print(f"B{B} T{T} H{H} bf16; dispatched: {d.impl} {d.config} ({d.origin}: {d.reason[:120]})")
    for name, fn in (("dispatched, no seq_idx", step()), ("dispatched, seq_idx", step(seq_idx=seq))):
        ms = graph_ms(fn)
        print(f"  {name:28s} {ms * 1e3:8.1f} us  {moved / ms / 1e6:6.0f} GB/s", flush=True)
    target = dispatch.current_target("cuda", bcx.device)
    for cfg in op.candidates_for(op.impl("triton"), target.arch, op.dims(bcx, w, None, seq), torch.bfloat16):
        try:
            ms = graph_ms(step(cfg, seq))
        except Exception as exc:  # noqa: BLE001 - a candidate that does not compile here is a row, not the end
            print(f"  {str(cfg)[:110]:110s} failed: {str(exc)[:80]}")
            continue
        print(f"  {str(cfg)[:110]:110s} {ms * 1e3:8.1f} us  {moved / ms / 1e6:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
