"""Timing one call: device milliseconds where a GPU is present (a CUDA graph of unrolled calls, else
triton's do_bench), the wall clock on CPU.

    ms, method = time_fn(lambda: op_call(), "cuda")       # method: "cuda-graph", "do_bench" or "cpu-wall"

Without Triton (a CUDA torch on a platform without Triton wheels) `do_bench` is the same recipe on torch's CUDA
events (`event_bench`): the torch implementations are still timed, by the same method.
"""
from __future__ import annotations

import gc
import statistics
import time
import warnings
from typing import Callable

import torch

from .. import _triton


def _event_ms(fn: Callable[[], object]) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def graph_ms(fn: Callable[[], object], *, rep_ms: float = 30.0, replays: int = 10) -> float:
    """Device milliseconds per fn(): median over `replays` replays of one CUDA graph of enough
    unrolled calls to fill ~rep_ms, captured on a side stream after three warm calls there (torch's
    recipe for whole-network capture).  No host launch cost, no L2 flush: the kernels' own time."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        reps = int(min(200, max(3, rep_ms / max(_event_ms(fn), 1e-3))))
    # a one-call probe first: a failed capture keeps its private pool, so an uncapturable candidate
    # must fail holding one call's memory, not `reps` calls' (see host_syncs)
    try:
        probe = torch.cuda.CUDAGraph()
        with torch.cuda.graph(probe, stream=s):
            fn()
        del probe
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    except Exception:
        _release_cuda_rng()
        raise
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    return float(statistics.median_high(_event_ms(g.replay) / reps for _ in range(replays)))


def _release_cuda_rng() -> None:
    """Take the default CUDA generator out of capture mode (a fresh state, same seed and offset) after a
    capture failed in cudaStreamEndCapture, which skips the generator's epilogue: on the H200 (2026-12-03)
    every later draw then raised "Offset increment outside graph capture encountered unexpectedly"."""
    try:
        gen = torch.cuda.default_generators[torch.cuda.current_device()]
        fresh = torch.Generator(device="cuda")
        fresh.set_state(gen.get_state())
        gen.graphsafe_set_state(fresh)
    except Exception as exc:   # never hide the capture's own error behind this one
        warnings.warn(f"liger_rt: could not reset the CUDA generator after a failed capture ({error_line(exc)})",
                      RuntimeWarning)


_GRAPH_FAILURES: set[str] = set()


def host_syncs(fn: Callable[[], object]) -> bool:
    """Whether fn() makes a synchronizing CUDA call (.item(), nonzero, a copy to the host), found by one
    call under torch's sync debug mode instead of a capture that fails: on the H200 (2026-12-03) failed
    captures of such references kept their graph pools, 138 GB after the MoE and loss cases, then OOM."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], device_type: str, *, quick: bool = False,
            method: str | None = None) -> tuple[float, str]:
    """(milliseconds per fn(), method): "cuda-graph" (`graph_ms`) where fn can be captured, else (or with
    method="do_bench") triton's do_bench median, host launch cost included; "cpu-wall" on CPU.  Device time
    is the only fair ranking of a launch-bound op's configs: on the H200 an RMSNorm fwd+bwd at 4096 x 4096
    takes ~50 us of kernels and ~300 us of host time, so wall-clock timing ranks configs by noise."""
    if device_type == "cuda":
        warmup, rep = (10, 30) if quick else (25, 100)
        fn()  # compile and allocate outside the capture: a candidate that cannot run fails here
        torch.cuda.synchronize()
        if method != "do_bench" and host_syncs(fn):
            method = "do_bench"   # never try to capture it: a failed capture keeps its memory pool
        try:
            if method != "do_bench":
                try:
                    return graph_ms(fn, rep_ms=rep), "cuda-graph"
                except Exception as exc:
                    torch.cuda.synchronize()
                    why = error_line(exc)
                    if why not in _GRAPH_FAILURES:
                        _GRAPH_FAILURES.add(why)
                        warnings.warn(f"liger_rt: CUDA-graph timing failed ({why}); timing this case with "
                                      "do_bench (host launch cost included), recorded as such", RuntimeWarning)
            return do_bench(fn, warmup=warmup, rep=rep), "do_bench"
        finally:
            # the graph's private memory pool (every unrolled call's outputs) goes back only once the
            # graph is collected: without this an H200 sweep ran out of its 141 GB at the eighth op
            gc.collect()
            torch.cuda.empty_cache()
    return wall_ms(fn, device_type, 2 if quick else 3), "cpu-wall"


def do_bench(fn: Callable[[], object], *, warmup: float = 25.0, rep: float = 100.0) -> float:
    """Median milliseconds per fn() by triton's do_bench (CUDA events around each call, the L2 flushed before
    it), or by `event_bench`, the same recipe on torch alone, where Triton is not available."""
    if not _triton.available():
        return event_bench(fn, warmup=warmup, rep=rep)
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


_FLUSH_BYTES = 256 << 20      # what triton's do_bench zeroes between calls: beyond any GPU's L2 (H200: 60 MiB)


def event_bench(fn: Callable[[], object], *, warmup: float = 25.0, rep: float = 100.0) -> float:
    """triton.testing.do_bench's recipe on torch's CUDA events: the calls that fill ~`warmup` ms, then the median
    over the calls that fill ~`rep` ms of one event pair around each call, a 256 MiB buffer zeroed before it."""
    fn()
    torch.cuda.synchronize()
    cache = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        cache.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(max(1, int(rep / estimate)))]
    for a, b in pairs:
        cache.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return float(statistics.median(a.elapsed_time(b) for a, b in pairs))


def measure(fn: Callable[[], object], device_type: str, *, quick: bool = False) -> float:
    """Milliseconds per fn() by `time_fn`, without the method (the bench harness's timer)."""
    return time_fn(fn, device_type, quick=quick)[0]


def wall_ms(fn: Callable[[], object], device_type: str, repeats: int, calls: int = 1) -> float:
    """The median over `repeats` of the wall time of `calls` calls and one synchronisation, per call."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device_type)
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(out)


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def error_line(exc: BaseException, limit: int = 200) -> str:
    """"TypeName: the first line of the message" (at most `limit` characters of it): how a skipped candidate,
    case or benchmark arm is reported."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:limit] if str(exc) else ''}"
