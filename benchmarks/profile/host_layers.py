"""Where the host time of one eager op call goes on a GPU, layer by layer, and cProfile's top functions.

    python benchmarks/profile/host_layers.py [--op rms_norm|swiglu|rope] [--calls 2000]

Times (perf_counter mean of `calls` calls between two synchronisations, 256 rows: the kernels take
a few microseconds, so the host is what is measured) each layer of the call from the bottom up:
the allocations, the launcher (its allocations and the kernel launch), the op under
no_grad (dispatch, no autograd node), the op with an autograd node, and forward+backward with the
autograd engine on the caller's thread; then cProfile's top functions by own time over the
forward+backward on the caller's thread (cProfile sees one thread), which name the Python that
the layers above cannot split.

Without a GPU (TRITON_INTERPRET=1) it compares ops.rms_norm forward + backward, its kernel launches replaced by
no-ops, with the floor of any Python autograd.Function: one that only allocates the same outputs.
"""
import argparse
import cProfile
import pstats

import torch

from liger_rt import dispatch, ops
from liger_rt.registry import REGISTRY
from liger_rt.tools.bench.host_overhead import on_caller_thread, per_call_us


def layers(op_name: str):
    dev, bf = "cuda", torch.bfloat16
    if op_name == "rms_norm":
        from liger_rt.kernels import rms_norm as k
        x = torch.randn(256, 4096, device=dev, dtype=bf, requires_grad=True)
        w = torch.randn(4096, device=dev, dtype=bf, requires_grad=True)
        dy, xd, wd = torch.randn_like(x), x.detach(), w.detach()
        cfg = dispatch.decision(REGISTRY.get("rms_norm"), xd, rows=256, hidden=4096).config
        _, rstd = k.rms_norm_fwd(xd, wd, 1e-6, 0.0, cfg)
        return {"torch.empty_like x2 (y, rstd)": lambda: (torch.empty_like(xd), torch.empty(256, device=dev)),
                "launcher rms_norm_fwd": lambda: k.rms_norm_fwd(xd, wd, 1e-6, 0.0, cfg),
                "launcher rms_norm_bwd (2 kernels)": lambda: k.rms_norm_bwd(dy, xd, wd, rstd, 0.0, cfg),
                "ops.rms_norm fwd, no_grad": torch.no_grad()(lambda: ops.rms_norm(x, w)),
                "ops.rms_norm fwd": lambda: ops.rms_norm(x, w),
                "ops.rms_norm fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(ops.rms_norm(x, w), (x, w), dy),
                "ops.rms_norm fwd+bwd, engine on the caller's thread": on_caller_thread(
                    lambda: torch.autograd.grad(ops.rms_norm(x, w), (x, w), dy)),
                "eager x*2 fwd+bwd, caller's thread": on_caller_thread(lambda: torch.autograd.grad(x * 2, (x,), dy))}
    if op_name == "swiglu":
        g = torch.randn(256, 8192, device=dev, dtype=bf, requires_grad=True)
        u = torch.randn_like(g, requires_grad=True)
        dy = torch.randn_like(g)
        return {"ops.swiglu fwd": lambda: ops.swiglu(g, u),
                "ops.swiglu fwd+bwd, engine on the caller's thread": on_caller_thread(
                    lambda: torch.autograd.grad(ops.swiglu(g, u), (g, u), dy))}
    q = torch.randn(1, 256, 16, 128, device=dev, dtype=bf).transpose(1, 2).requires_grad_()
    kk = torch.randn(1, 256, 8, 128, device=dev, dtype=bf).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, 256, 128, device=dev, dtype=bf), torch.randn(1, 256, 128, device=dev, dtype=bf)
    dq, dk = torch.randn(q.shape, device=dev, dtype=bf), torch.randn(kk.shape, device=dev, dtype=bf)
    return {"ops.rope fwd": lambda: ops.rope(q, kk, cos, sin),
            "ops.rope fwd+bwd, engine on the caller's thread": on_caller_thread(
                lambda: torch.autograd.grad(ops.rope(q, kk, cos, sin), (q, kk), (dq, dk)))}


def cpu_floor(calls: int) -> None:
    """Host cost of ops.rms_norm forward + backward beside an autograd.Function that only allocates (CPU, launches
    stubbed: what liger_rt's own Python adds over the floor every Python autograd op pays)."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *a, **k: None       # no kernel runs: host time only
    try:
        _floor_vs_ours(calls)
    finally:
        InterpretedFunction.run = run


def _floor_vs_ours(calls: int) -> None:
    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w, torch.empty(x.shape[0]))
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, dy):
            x, w, _ = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(w)

    x, w = torch.randn(256, 4096, requires_grad=True), torch.randn(4096, requires_grad=True)
    dy = torch.randn_like(x)
    probes = {"autograd.Function floor fwd+bwd": lambda: torch.autograd.grad(Floor.apply(x, w), (x, w), dy),
              "ops.rms_norm fwd+bwd, launches stubbed": lambda: torch.autograd.grad(ops.rms_norm(x, w), (x, w), dy)}
    for name, fn in probes.items():
        print(f"cpu {name:45s} {per_call_us(fn, calls, sync=False, warmup=200):8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="rms_norm,swiglu,rope")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=22)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        return cpu_floor(args.calls)
    for op_name in args.op.split(","):
        probes = layers(op_name)
        for name, fn in probes.items():
            print(f"{op_name:9s} {name:55s} {per_call_us(fn, args.calls, sync=True, warmup=200):8.1f} us")
        last = probes[f"ops.{op_name} fwd+bwd, engine on the caller's thread"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls // 4):
            last()
        torch.cuda.synchronize()
        prof.disable()
        print(f"-- cProfile, {op_name} fwd+bwd on the caller's thread, {args.calls // 4} calls, by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
