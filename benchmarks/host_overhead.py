"""Where the host time of one norm call goes (GPU): microseconds of Python per layer of the path.

    python benchmarks/host_overhead.py

Host time is measured on a small shape (256 x 4096: the kernels take a few microseconds, so the
GPU never holds the host back), as the mean over many calls between two synchronisations. Device
time of the real shape (16384 x 4096) comes from a CUDA-graph replay. When host time exceeds
device time, `do_bench` (the anchors' timer, L2 flushed before each call) measures the host.
Writes benchmarks/results/host_overhead_h200.csv.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graph_us(fn) -> float:
    return H.graph_ms(fn) * 1e3


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _single_thread(fn):
    with torch.autograd.set_multithreading_enabled(False):
        return fn()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead needs a GPU")
    import triton

    import liger_rt
    from liger_rt.kernels import rms_norm as rn
    dev, dt = "cuda", torch.bfloat16
    rows = []

    def probe(shape_m: int):
        x = torch.randn(shape_m, 4096, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(4096, device=dev, dtype=dt, requires_grad=True)
        dy = torch.randn_like(x)
        cfg = rn.OP.select(x.detach(), rows=shape_m, hidden=4096).config
        y0, rstd = rn.rms_norm_fwd(x.detach(), w.detach(), 1e-6, 0.0, cfg)
        xd, wd = x.detach(), w.detach()
        yb = torch.empty_like(xd)
        r = torch.empty(shape_m, device=dev, dtype=torch.float32)
        ck = rn._rms_norm_fwd_kernel[(shape_m,)](xd, wd, yb, r, xd.stride(0), yb.stride(0), shape_m, 4096, 1e-6, 0.0,
                                                 BLOCK_N=4096, ROWS=1, RNE_BF16=False, num_warps=cfg["num_warps"])
        from triton.runtime import driver
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        cases = {
            "torch.empty (m, n)": lambda: torch.empty((shape_m, 4096), device=dev, dtype=dt),
            "OP.select (memo hit)": lambda: rn.OP.select(xd, rows=shape_m, hidden=4096),
            "triton launch: kernel[grid](...)": lambda: rn._rms_norm_fwd_kernel[(shape_m,)](
                xd, wd, yb, r, xd.stride(0), yb.stride(0), shape_m, 4096, 1e-6, 0.0,
                BLOCK_N=4096, ROWS=1, RNE_BF16=False, num_warps=cfg["num_warps"]),
            "triton launch: CompiledKernel.run": lambda: ck.run(
                shape_m, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None,
                xd, wd, yb, r, xd.stride(0), yb.stride(0), shape_m, 4096, 1e-6, 0.0, 4096, 1, False),
            "rms_norm_fwd launcher": lambda: rn.rms_norm_fwd(xd, wd, 1e-6, 0.0, cfg),
            "rms_norm_bwd launcher (2 kernels)": lambda: rn.rms_norm_bwd(dy, xd, wd, rstd, 0.0, cfg),
            "RMSNormFunction.apply fwd": lambda: rn.RMSNormFunction.apply(x, w, 1e-6, 0.0, cfg),
            "ops.rms_norm fwd": lambda: liger_rt.ops.rms_norm(x, w),
            "ops.rms_norm fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(liger_rt.ops.rms_norm(x, w), (x, w), dy),
            "eager x*2 fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(x * 2, (x,), dy),
            "identity Function fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(_Identity.apply(x), (x,), dy),
            "identity Function fwd+bwd, engine on the caller's thread": lambda: _single_thread(
                lambda: torch.autograd.grad(_Identity.apply(x), (x,), dy)),
            "ops.rms_norm fwd+bwd, engine on the caller's thread": lambda: _single_thread(
                lambda: torch.autograd.grad(liger_rt.ops.rms_norm(x, w), (x, w), dy)),
            "ops.rms_norm fwd + y.backward(dy)": lambda: liger_rt.ops.rms_norm(x, w).backward(dy),
        }
        if H.liger_kernel() is not None:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            xl = x.detach().clone().requires_grad_()
            cases["Liger fwd"] = lambda: LigerRMSNormFunction.apply(xl, w, 1e-6)
            cases["Liger fwd+bwd (autograd.grad)"] = lambda: torch.autograd.grad(
                LigerRMSNormFunction.apply(xl, w, 1e-6), (xl, w), dy.clone())
        return cases

    for name, fn in probe(256).items():
        try:
            us = host_us(fn)
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            continue
        print(f"host  {name:45s} {us:8.1f} us")
        rows.append({"what": f"host: {name}", "us": us, "shape": "256x4096"})

    m = 16384
    x = torch.randn(m, 4096, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(4096, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    full = {"ops.rms_norm fwd": lambda: liger_rt.ops.rms_norm(x, w),
            "ops.rms_norm fwd+bwd": lambda: torch.autograd.grad(liger_rt.ops.rms_norm(x, w), (x, w), dy)}
    from liger_rt import dispatch
    case = rn.OP.new_case({"rows": m, "hidden": 4096}, dt, dev, "")
    cfg = rn.OP.select(x.detach(), rows=m, hidden=4096).config
    full["sweep case: _run_triton"] = lambda: rn._run_triton(case, cfg)
    for name, fn in full.items():
        for how, timer in (("graph", graph_us), ("do_bench", lambda f: H.bench_ms(f) * 1e3)):
            try:
                us = timer(fn)
            except Exception as exc:
                print(f"{how} {name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                continue
            print(f"{how:8s} {name:45s} {us:8.1f} us  (16384x4096)")
            rows.append({"what": f"{how}: {name}", "us": us, "shape": "16384x4096"})
    try:
        from liger_rt import autotune
        us = autotune.measure(full["sweep case: _run_triton"], "cuda") * 1e3
        print(f"autotune.measure sweep case {us:.1f} us")
        rows.append({"what": "autotune.measure: sweep case", "us": us, "shape": "16384x4096"})
    except Exception:
        traceback.print_exc()
    del dispatch, triton
    H.write_csv("host_overhead_h200.csv", rows)


if __name__ == "__main__":
    main()
