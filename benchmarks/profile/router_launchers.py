"""The MoE router's host path with Triton launches stubbed (CPU): the shipped launchers beside a leaner pair.

    python benchmarks/profile/router_launchers.py [--tokens 64] [--experts 32] [--top-k 4] [--calls 3000]

The router's kernels take microseconds, so a training step waits on its Python path.  This prints the host
microseconds per call of ops.moe_router forward and forward + torch.autograd.grad backward (bf16, expert bias fp32),
with the shipped launchers (liger_rt/kernels/moe_router.py: `_forward`, `_backward`) and with a leaner pair defined
here: launch constants memoised per shape (launch.launch_memo, as rms_norm and swiglu do: grid, block sizes, quant
modes, the bound kernel), no repeated `supports` check on the hot path (the decision made it), no reshape or view of
a 2-D contiguous input, the output shapes allocated directly.  The leaner pair computes the same bits (checked
first, through the interpreter).  The launchers are under the freshness hash, so this file proposes the change; it
does not ship it.  Method: this thread's CPU time per call, the mean of --calls calls, median of --repeats (the two
pairs alternating), each kernel's `run` a no-op (liger_rt.tools.bench.host_overhead.StubbedLaunches).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")    # before any kernel module: CPU tensors through the interpreter

import torch  # noqa: E402

from liger_rt import dispatch, ops  # noqa: E402
from liger_rt._triton import triton  # noqa: E402
from liger_rt.kernels import moe_router as mr  # noqa: E402
from liger_rt.kernels._common import as_rows, next_pow2  # noqa: E402
from liger_rt.launch import bind, launch_memo  # noqa: E402


@launch_memo
def _fwd_launch(config, T, E, k, has_bias, normalize, quant, route_quant, accurate):
    why = mr._supports({"experts": E, "top_k": k}, None)     # once per shape, not per call
    if why:
        raise ValueError(f"the Triton moe_router takes {why}")
    return bind(mr._moe_router_fwd_kernel, (triton.cdiv(T, config.BLOCK_T),), K=k, HAS_BIAS=has_bias,
                NORMALIZE=normalize, QUANT=quant, ROUTE_QUANT=route_quant, ACCURATE=accurate, BLOCK_T=config.BLOCK_T,
                BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(k), num_warps=config.num_warps)


@launch_memo
def _bwd_launch(config, T, E, k, normalize, quant, accurate):
    return bind(mr._moe_router_bwd_kernel, (triton.cdiv(T, config.BLOCK_T),), K=k, NORMALIZE=normalize, QUANT=quant,
                ACCURATE=accurate, BLOCK_T=config.BLOCK_T, BLOCK_E=next_pow2(E), num_warps=config.num_warps)


@launch_memo
def _route_quant(logits_dtype, bias_dtype) -> int:
    return mr._QUANT.get(mr.routing_dtype(logits_dtype, bias_dtype), 0)


def _rows2d(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dim() == 2 and logits.stride(-1) == 1 else as_rows(logits, logits.shape[-1])


def lean_forward(config, logits, top_k, expert_bias, norm_topk_prob, routed_scaling_factor):
    """The shipped `_forward` with its launch constants memoised and the outputs allocated in their final shape."""
    l2 = _rows2d(logits)
    T, E = l2.shape
    shape = (*logits.shape[:-1], top_k)
    weights = torch.empty(shape, device=logits.device, dtype=logits.dtype)
    indices = torch.empty(shape, device=logits.device, dtype=torch.int64)
    saved = torch.empty((T, top_k), device=logits.device, dtype=torch.int32)
    if T:
        has_bias = expert_bias is not None
        bias = expert_bias.contiguous() if has_bias else l2
        run = _fwd_launch(config, T, E, top_k, has_bias, bool(norm_topk_prob), mr._QUANT[logits.dtype],
                          _route_quant(logits.dtype, expert_bias.dtype if has_bias else None), mr._accurate(logits))
        run(l2, bias, weights, indices, saved, T, E, l2.stride(0), float(routed_scaling_factor))
    return (weights, indices), (saved,)


def lean_backward(config, args, saved, needs, dweights, dindices):
    """The shipped `_backward`, memoised likewise; d(logits) allocated in the logits' shape (no view)."""
    logits, top_k, _, norm_topk_prob, routed_scaling_factor = args
    l2 = _rows2d(logits)
    T, E = l2.shape
    dlogits = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    if T:
        dw = dweights.contiguous() if dweights is not None else logits.new_zeros(T, top_k)
        _bwd_launch(config, T, E, top_k, bool(norm_topk_prob), mr._QUANT[logits.dtype], mr._accurate(logits))(
            l2, saved[0], dw, dlogits, T, E, l2.stride(0), E, float(routed_scaling_factor))
    return dlogits, None, None, None, None


def main() -> None:
    from liger_rt.tools.bench.host_overhead import StubbedLaunches, per_call_us
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    T, E, k = args.tokens, args.experts, args.top_k
    os.environ["LIGER_RT_IMPL_MOE_ROUTER"] = "triton"
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, E, generator=g).to(torch.bfloat16).requires_grad_()
    bias = 0.05 * torch.randn(E, generator=g)
    dy = torch.randn(T, k, generator=g).to(torch.bfloat16)
    impl = mr.OP.impl("triton")
    pairs = {"shipped": (impl.forward, impl.backward), "lean": (lean_forward, lean_backward)}

    def fwd():
        return ops.moe_router(x, k, bias)

    def fwd_bwd():
        w, idx = ops.moe_router(x, k, bias)
        return w, idx, *torch.autograd.grad(w, (x,), dy)
    out = {}
    try:
        for name, (f, b) in pairs.items():      # the same bits first (the kernels through the interpreter)
            impl.forward, impl.backward = f, b
            dispatch.reset()
            out[name] = [t.detach().clone() for t in fwd_bwd()]
        assert all(torch.equal(a, b) for a, b in zip(out["shipped"], out["lean"])), "the lean pair differs"
        samples = {name: ([], []) for name in pairs}
        with StubbedLaunches(mr):
            for _ in range(args.repeats):       # the pairs alternate: a slow spell of a shared machine hits both
                for name, (f, b) in pairs.items():
                    impl.forward, impl.backward = f, b
                    dispatch.reset()
                    for fn, into in zip((fwd, fwd_bwd), samples[name]):
                        into.append(per_call_us(fn, args.calls, sync=False, clock=time.thread_time))
        times = {name: [statistics.median(s) for s in both] for name, both in samples.items()}
    finally:
        impl.forward, impl.backward = pairs["shipped"]
        dispatch.reset()
    print(f"ops.moe_router T{T} E{E} k{k} bf16, Triton launches stubbed, us per call (this thread's CPU time)")
    for name, (a, b) in times.items():
        print(f"  {name:8} fwd {a:7.2f}   fwd+bwd {b:7.2f}")
    (sa, sb), (la, lb) = times["shipped"], times["lean"]
    print(f"  saved    fwd {sa - la:7.2f}   fwd+bwd {sb - lb:7.2f} ({(sb - lb) / sb:.0%})")


if __name__ == "__main__":
    main()
