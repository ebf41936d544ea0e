"""Fused linear cross-entropy per chunk size (GPU): forward+backward wall time (do_bench) and peak extra memory beside
torch.compile's, in counterbalanced rounds (forward order, then reversed), then where the time goes (a kernel table
per config).

    python benchmarks/profile/flce_chunks.py [--rounds 3] [--chunks 512,768,1024,2048] [--shapes S1,S2] [--csv PATH]

A chunk entry N is the shipped loop at chunk N; variants of the loop are arms beside it, to measure before they
are built into the kernel: `Ns` runs each chunk's dX GEMM on a second CUDA stream, beside its dW GEMM (both only
read the chunk's logits gradient); `Nk` splits each chunk's dX GEMM over two halves of the vocabulary (one batched
GEMM of twice the output tiles, the halves summed after: a chunk's dX has few tiles for a long reduction); `bN` splits the tokens into equal chunks of at most N rows (multiples of 128)
instead of chunks of N and a short last one; a variant's gradients are checked against the shipped loop's at N
where that arm runs too.  Each config is the heuristic's with only `chunk` replaced, run directly
(`Op.call_impl`), outside the chunk budget the dispatcher applies, so that the budget can be set from these figures.
Peak extra memory: everything one step allocates beyond its inputs, the gradients it hands out included (as
bench_losses.py counts it).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F

from liger_rt import backend
from liger_rt.autograd import call_impl
from liger_rt.kernels import fused_linear_cross_entropy as flce
from liger_rt.kernels.linear_softmax import chunk_grads
from liger_rt.registry import REGISTRY
from liger_rt.tools.bench.harness import counterbalanced, peak_extra_gb, profiled, write_csv

SHAPES = {"BT8192_H2048_V65536": (8192, 2048, 65536), "BT8192_H2560_V151936": (8192, 2560, 151936)}


def make_inputs(t, h, v):
    g = torch.Generator("cuda").manual_seed(0)
    x = (torch.randn(t, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, generator=g, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    return x, w, torch.randint(0, v, (t,), generator=g, device="cuda")


def equal_spans(chunk, tokens, grain=128):
    """Equal chunks of at most `chunk` rows (multiples of `grain`, the last one takes the rest)."""
    n = -(-tokens // chunk)
    grains = -(-tokens // grain)
    sizes = [(grains // n + (i < grains % n)) * grain for i in range(n)]
    ends = [min(sum(sizes[: i + 1]), tokens) for i in range(n)]
    return [(e0, e1) for e0, e1 in zip([0] + ends[:-1], ends) if e1 > e0]


_SIDE = {}


def two_stream_grads(dz, xc, weight, span, gx, gw, gb, first):
    """chunk_grads with dX on a second stream, beside dW on the current one; joined before the next chunk."""
    main = torch.cuda.current_stream()
    side = _SIDE.setdefault(main.device, torch.cuda.Stream(main.device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.matmul(dz, weight, out=gx[span[0]:span[1]])
    chunk_grads(dz, xc, weight, span, None, gw, gb, first)
    main.wait_stream(side)


def split_k_grads(dz, xc, weight, span, gx, gw, gb, first, parts=2):
    """chunk_grads with dX as one batched GEMM over `parts` slices of the vocabulary, summed after (fp32)."""
    vocab, hidden = weight.shape
    if vocab % parts:
        return chunk_grads(dz, xc, weight, span, gx, gw, gb, first)
    partial = torch.bmm(dz.unflatten(1, (parts, vocab // parts)).transpose(0, 1), weight.view(parts, -1, hidden))
    gx[span[0]:span[1]] = torch.sum(partial, 0, dtype=torch.float32)
    chunk_grads(dz, xc, weight, span, None, gw, gb, first)


@contextlib.contextmanager
def variant(balanced, grads):
    saved = flce.chunk_spans, flce.chunk_grads
    if balanced:
        flce.chunk_spans = equal_spans
    if grads is not None:
        flce.chunk_grads = grads
    try:
        yield
    finally:
        flce.chunk_spans, flce.chunk_grads = saved


GRADS = {"s": two_stream_grads, "k": split_k_grads}     # an arm name's suffix -> its chunk_grads


def arm_chunk(name: str) -> str:
    """The chunk of an arm's name ('c1024', 'c1024s', 'c1024k', 'b896', 'b896s' -> '1024' or '896'; 'compile' ->
    '')."""
    digits = name.lstrip("bc").rstrip("sk")
    return digits if digits.isdigit() else ""


def arms(t, h, v, chunks):
    op = REGISTRY.get("fused_linear_cross_entropy")
    base = op.default_config("triton", backend.detect(), {"tokens": t, "hidden": h, "vocab": v}, torch.bfloat16)
    out = {"compile": torch.compile(lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y))}
    for name in chunks:
        balanced, grads = name.startswith("b"), GRADS.get(name[-1])
        cfg = base.replace(chunk=int(arm_chunk(name)))

        def fn(x, w, y, cfg=cfg, balanced=balanced, grads=grads):
            with variant(balanced, grads):
                return call_impl(op, "triton", cfg, x, w, y, None, -100, "mean", 0.0, 0.0, None, None, 3, True)
        out[name if balanced else f"c{name}"] = fn
    return out


def step(fn, x, w, y):
    x.grad = w.grad = None
    fn(x, w, y).backward()


def peak_extra(fn, x, w, y):
    step(fn, x, w, y)                 # warm: compiled, autotuned, workspaces allocated
    x.grad = w.grad = None
    return peak_extra_gb(lambda: step(fn, x, w, y))


def check_variants(table, x, w, y):
    """Each variant's gradients against the shipped loop's at the same chunk (where that arm runs too)."""
    for shipped in [n for n in table if n == f"c{arm_chunk(n)}"]:
        step(table[shipped], x, w, y)
        ref = x.grad.clone(), w.grad.clone()
        for name in [n for n in table if n != shipped and arm_chunk(n) == arm_chunk(shipped)]:
            step(table[name], x, w, y)
            err = max(float((g.float() - r.float()).abs().max() / r.float().abs().max())
                      for g, r in zip((x.grad, w.grad), ref))
            print(f"  {name}: gradients within {err:.1e} of {shipped}'s (max abs difference / max abs)")
        del ref


def kernel_table(fn, x, w, y, rows=8):
    prof = profiled(lambda: step(fn, x, w, y), warmup=1, calls=1)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="512,768,1024,2048")
    ap.add_argument("--profile", default="compile,c512,c1024", help="arms whose kernels to list")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--csv", default=None, help="write every round's row to this CSV")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flce_chunks.py needs a GPU")
    chunks, shapes = a.chunks.split(","), a.shapes.split(",")
    if set(shapes) - set(SHAPES):
        raise SystemExit(f"unknown shape {sorted(set(shapes) - set(SHAPES))[0]}; valid: {', '.join(SHAPES)}")
    meta = {"method": "do_bench wall (warmup 100 ms, rep 400 ms)"}   # versions, device, date: write_csv
    rows = []
    for shape in shapes:
        t, h, v = SHAPES[shape]
        x, w, y = make_inputs(t, h, v)
        table = arms(t, h, v, chunks)
        peaks = {name: peak_extra(fn, x, w, y) for name, fn in table.items()}
        check_variants(table, x, w, y)
        times = counterbalanced({name: (lambda fn=fn: step(fn, x, w, y)) for name, fn in table.items()}, a.rounds,
                                warmup=100, rep=400)
        rows += [{"shape": shape, "arm": name, "round": r, "ms": ms, "peak_extra_GB": peaks[name],
                  "TFLOPs": 6 * t * h * v / ms / 1e9, **meta} for name, ts in times.items() for r, ms in enumerate(ts)]
        print(f"== {shape}: median of {a.rounds} rounds (spread), peak extra GB")
        ref = statistics.median(times["compile"])
        for name in table:
            m = statistics.median(times[name])
            print(f"  {name:10s} {m:8.3f} ms ({min(times[name]):.3f}-{max(times[name]):.3f})  {peaks[name]:6.3f} GB  "
                  f"{m / ref:5.3f}x compile's time  {peaks[name] / peaks['compile']:5.3f}x its memory")
        for name in a.profile.split(","):
            if name in table:
                print(f"-- kernels of {name} at {shape}:\n{kernel_table(table[name], x, w, y)}")
        del x, w, y, table
        torch.cuda.empty_cache()
    if a.csv:
        print(f"wrote {len(rows)} rows to {write_csv(rows, a.csv)}")


if __name__ == "__main__":
    main()
