"""Host cost of a call, layer by layer of the path (GPU), and of a dispatch decision (any machine).

`host`: microseconds of Python per call at 256 x 4096 (the kernels take a few microseconds, so the GPU never holds the
host back), then at 16384 x 4096 the CUDA-graph device time beside do_bench's wall time.  `dispatch`: a decision that
hits the memo, on CPU.  `cpu_stub` (``liger-tune bench host --cpu-stub``): the whole Python path of rms_norm, swiglu
and rope fwd+bwd on CPU tensors with the Triton launches stubbed, beside the autograd floors; no GPU
(docs/architecture.md, "The eager hot path").
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch

from .harness import dispatch_env, peer, time_fn


def per_call_us(fn: Callable, calls: int, sync: bool, clock: Callable = time.perf_counter,
                warmup: int = 1000) -> float:
    """Mean microseconds per fn() over `calls` calls between two synchronisations, after min(calls, warmup)."""
    sync = torch.cuda.synchronize if sync else (lambda: None)
    for _ in range(min(calls, warmup)):
        fn()
    sync()
    t0 = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - t0) / calls * 1e6


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def on_caller_thread(fn: Callable) -> Callable:
    """fn with the autograd engine on the calling thread (no device threads for the backward)."""
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()
    return run


def _probes(m: int, echo) -> dict[str, Callable]:
    import triton
    import triton.language as tl

    from liger_rt import dispatch, ops
    from liger_rt.registry import REGISTRY

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy, xd, buf = torch.randn_like(x), x.detach(), torch.empty(4096, device="cuda")
    op = REGISTRY.get("rms_norm")

    def norm_grads():
        return torch.autograd.grad(ops.rms_norm(x, w), (x, w), dy)
    out = {"torch.empty (m, n)": lambda: torch.empty((m, 4096), device="cuda", dtype=torch.bfloat16),
           "dispatch select (memo hit)": lambda: dispatch.decision(op, xd, rows=m, hidden=4096),
           "triton launch (a 4096-element copy kernel)": lambda: _copy[(1,)](buf, buf, 4096, BLOCK=4096),
           "ops.rms_norm fwd": lambda: ops.rms_norm(x, w), "ops.rms_norm fwd+bwd (autograd.grad)": norm_grads,
           "ops.rms_norm fwd+bwd, engine on the caller's thread": on_caller_thread(norm_grads),
           "eager x*2 fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(x * 2, (x,), dy),
           "identity Function fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(_Identity.apply(x), (x,), dy)}
    lk, xl = peer("liger_kernel.ops.rms_norm", "LigerRMSNormFunction", echo), x.detach().clone().requires_grad_()
    if lk is not None:
        out["Liger-Kernel fwd+bwd (autograd.grad)"] = lambda: torch.autograd.grad(lk.apply(xl, w, 1e-6), (xl, w),
                                                                                 dy.clone())
    return out


def host(echo: Callable = print) -> list[dict]:
    """Rows (what, metric, us, shape, method) of the host probes, then the wall and device times at 16384 x 4096."""
    rows = []
    for name, fn in _probes(256, echo).items():
        try:
            rows.append({"what": name, "metric": "host_us", "us": per_call_us(fn, 2000, sync=True),
                         "shape": "rows=256;hidden=4096", "method": "perf_counter mean of 2000 calls"})
        except Exception as exc:
            echo(f"  {name}: {type(exc).__name__}: {exc}")
    full = _probes(16384, echo)
    for name in ("ops.rms_norm fwd", "ops.rms_norm fwd+bwd (autograd.grad)"):
        wall, dev, how = time_fn(full[name], "cuda")
        rows += [{"what": name, "metric": "wall_us", "us": wall * 1e3, "shape": "rows=16384;hidden=4096",
                  "method": "do_bench"},
                 {"what": name, "metric": "dev_us", "us": dev and dev * 1e3, "shape": "rows=16384;hidden=4096",
                  "method": how}]
    for r in rows:
        echo(f"{r['what']:58s} {r['shape']:>22s} {r['us'] or float('nan'):9.1f} us  {r['metric']}: {r['method']}")
    return rows


def dispatch_overhead(calls: int = 200_000, echo: Callable = print) -> list[dict]:
    """Per-call microseconds of a memo-hit decision beside the floor (a tuple key and dict.get)."""
    from liger_rt import dispatch
    from liger_rt.registry import REGISTRY
    op, x = REGISTRY.get("rms_norm"), torch.empty(8, 4096, dtype=torch.bfloat16)
    dispatch.decision(op, x, rows=8, hidden=4096)           # the miss: decided once
    memo, rows = {("cpu", torch.bfloat16, 8, 4096): 1}, []
    for label, fn in (("select (memo hit)", lambda: dispatch.decision(op, x, rows=8, hidden=4096)),
                      ("floor: x.device.type + dict.get", lambda: memo.get((x.device.type, x.dtype, 8, 4096)))):
        us = per_call_us(fn, calls, sync=False)
        rows.append({"what": label, "metric": "host_us", "us": round(us, 3), "shape": "rows=8;hidden=4096",
                     "calls": calls, "python": platform.python_version(),
                     "cpu": platform.processor() or platform.machine(),
                     "method": f"perf_counter mean of {calls} calls"})
        echo(f"{label:40s} {us:.3f} us/call")
    return rows


# -- the CPU stub: the Python path of a call with every Triton launch a no-op ---------------------------

class StubbedLaunches:
    """Within the block, a launch of every Triton kernel in `modules` only counts itself (`launches`): the kernel's
    own `run` (argument binding, the compiled-kernel cache, the driver call) is replaced on the instance, so
    everything above it is the real code.  The launch memos (they hold bound runs) are cleared on entry and exit."""

    def __init__(self, *modules):
        from triton.runtime.jit import KernelInterface     # JITFunction and the interpreter's InterpretedFunction
        kernels = {id(k): k for m in modules for k in vars(m).values() if isinstance(k, KernelInterface)}
        self.kernels = list(kernels.values())
        self.launches = 0

    def _run(self, *args, grid, warmup, **kwargs):
        self.launches += 1

    def __enter__(self):
        from liger_rt.launch import clear_launch_memos
        clear_launch_memos()           # launchers memoised with the real run bound
        for k in self.kernels:
            k.run = self._run
        return self

    def __exit__(self, *exc):
        from liger_rt.launch import clear_launch_memos
        for k in self.kernels:
            del k.run
        clear_launch_memos()           # ... and with the stub bound


def _stub_probes(rows: int, hidden: int) -> dict[str, tuple[str | None, Callable]]:
    """name -> (the op whose forward this is, or None; the call): rms_norm and swiglu on (rows, hidden) bf16; rope
    as Qwen3-1.7B calls it (16 q / 8 kv heads, head_dim 128; q, k transposed views of (1, S, H, D))."""
    from liger_rt import ops
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    gate, up = torch.randn_like(x, requires_grad=True), torch.randn_like(x, requires_grad=True)
    q = torch.randn(1, rows, 16, 128, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, rows, 8, 128, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, rows, 128, dtype=torch.bfloat16), torch.randn(1, rows, 128, dtype=torch.bfloat16)
    dq, dk = torch.randn(q.shape, dtype=q.dtype), torch.randn(k.shape, dtype=k.dtype)
    grad = torch.autograd.grad
    return {"ops.rms_norm fwd": ("rms_norm", lambda: ops.rms_norm(x, w)),
            "ops.rms_norm fwd+bwd (autograd.grad)": (None, lambda: grad(ops.rms_norm(x, w), (x, w), dy)),
            "ops.swiglu fwd": ("swiglu", lambda: ops.swiglu(gate, up)),
            "ops.swiglu fwd+bwd (autograd.grad)": (None, lambda: grad(ops.swiglu(gate, up), (gate, up), dy)),
            "ops.rope fwd": ("rope", lambda: ops.rope(q, k, cos, sin)),
            "ops.rope fwd+bwd (autograd.grad)": (None, lambda: grad(ops.rope(q, k, cos, sin), (q, k), (dq, dk))),
            "floor: identity Function fwd+bwd": (None, lambda: grad(_Identity.apply(x), (x,), dy)),
            "floor: eager x*2 fwd+bwd": (None, lambda: grad(x * 2, (x,), dy))}


def cpu_stub(repeats: int = 7, calls: int = 2000, rows: int = 16, hidden: int = 1024,
             echo: Callable = print) -> list[dict]:
    """Host microseconds of the `_stub_probes`, launches stubbed: the median over `repeats` of the mean of `calls`
    calls in this thread's CPU time (on CPU tensors autograd runs the backward on the calling thread).
    TRITON_INTERPRET=1 and LIGER_RT_IMPL_<OP>=triton during the run: dispatch takes the Triton path."""
    from liger_rt.kernels import rms_norm, rope, row_norm, swiglu
    rows_out = []
    with dispatch_env(TRITON_INTERPRET="1", LIGER_RT_IMPL_RMS_NORM="triton", LIGER_RT_IMPL_SWIGLU="triton",
                      LIGER_RT_IMPL_ROPE="triton"), StubbedLaunches(rms_norm, row_norm, swiglu, rope) as stub:
        probes = _stub_probes(rows, hidden)
        for op, fn in [probe for probe in probes.values() if probe[0]]:
            before = stub.launches      # each forward launches its one kernel: the triton path
            fn()
            if stub.launches != before + 1:
                raise RuntimeError(f"cpu stub: {op} made {stub.launches - before} stubbed launches; "
                                   "expected 1 (the triton path)")
        for name, (_, fn) in probes.items():
            samples = [per_call_us(fn, calls, sync=False, clock=time.thread_time) for _ in range(repeats)]
            rows_out.append({"what": name, "metric": "stub_us", "us": round(statistics.median(samples), 2),
                             "min_us": round(min(samples), 2),
                             "shape": f"tokens={rows};heads_q=16;heads_k=8;head_dim=128" if "rope" in name
                             else f"rows={rows};hidden={hidden}",
                             "python": platform.python_version(), "torch": torch.__version__,
                             "cpu": platform.processor() or platform.machine(), "method": f"CPU stub (Triton launches "
                             f"no-ops): median of {repeats} means of {calls} calls, this thread's CPU time"})
    for r in rows_out:
        echo(f"{r['what']:45s} {r['shape']:>45s} {r['us']:8.2f} us (min {r['min_us']:.2f})  {r['method']}")
    return rows_out


def host_records(rows: list[dict]) -> list[dict]:
    """host, dispatch_overhead or cpu_stub rows as dataset records (kind `host`): the arm is liger_rt for our
    calls, liger_kernel for the peer's, `floor` for what any call pays (an empty tensor, a launch, autograd)."""
    def arm(what: str) -> str:
        return ("liger_kernel" if "Liger-Kernel" in what else
                "liger_rt" if what.startswith(("ops.", "dispatch", "select")) else "floor")
    return [{"kind": "host", "name": r["what"], "shape": r["shape"], "arm": arm(r["what"]), "metric": r["metric"],
             "value": r["us"], "unit": "us", "dtype": "bf16", "method": r["method"],
             "notes": f"python {r['python']}, {r['cpu']}" if r.get("python") else ""}
            for r in rows if r.get("us") is not None]

