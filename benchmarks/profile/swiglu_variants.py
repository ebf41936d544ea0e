"""SwiGLU fwd+bwd kernel variants beside Liger-Kernel's: ms, GB/s and the fraction of a copy's bandwidth (GPU).

    python benchmarks/profile/swiglu_variants.py [--shapes 16384x8192,8192x12288,4096x14336] [--rep 200]

bf16 gate and up (M, N) and a fixed dy; fwd+bwd is y = f(gate, up) and torch.autograd.grad(y, (gate, up), dy), timed by
triton.testing.do_bench (median; the L2 flushed before each call).  Every arm is first checked against an fp64
reference at the timed shape (liger_rt.numerics.validation_report, bf16 tolerance); an arm that fails is reported
and not timed.  Arms:

  ours heuristic      liger_rt's kernels (kernels/swiglu.py) at this arch's heuristic config
  ours best           the same kernels at the fastest of the op's sweep candidates for this arch (--no-sweep: skipped)
  ours dispatched     liger_rt.ops.swiglu as dispatch decides here (a DB row or the heuristic)
  liger_kernel        Liger-Kernel's LigerSiLUMulFunction: one row per program (BLOCK = next_pow2(N)), its warps rule,
                      dgate/dup written into the saved gate/up buffers, silu recomputed in the backward
  row                 variant: Liger's layout (one row per program, the row's base pointers advanced once as a scalar,
                      N a constexpr) with our rounding (silu rounded to the gate dtype before both multiplies, as the
                      eager module does) and fresh gradient buffers
  row inplace         `row` whose backward writes dgate/dup into the saved gate/up: sound only when the caller says
                      they are temporaries (the outputs of the gate/up projections, read by nothing else), since the
                      write bypasses autograd's version counter; a second backward would read gradients
  row loop            variant: one row per program looping over the row in BLOCK-wide chunks (no masked lanes at
                      N = 12288 or 14336, where next_pow2(N) wastes a quarter); best of a few BLOCK and warp counts

The ceiling of each pass is a plain copy moving the same bytes (fwd reads gate, up and writes y: 3MN elements; the
backward 5MN; fwd+bwd 8MN): dst.copy_(src) with src of half those bytes.  Arms that write in place clobber gate and up
between timed calls (as Liger-Kernel's does in any benchmark): their values change, their memory traffic does not.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

DEFAULT_SHAPES = "16384x8192,8192x12288,4096x14336"


# -- variant kernels (the shipped ones stay in liger_rt/kernels/swiglu.py) -----------------------------------

@triton.jit
def _fwd_tile(G, U, Y, o, N: tl.constexpr):
    m = o < N
    g = tl.load(G + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + o, mask=m, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + o, (s * u).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _bwd_tile(DY, G, U, DG, DU, o, N: tl.constexpr):
    # DG, DU may be G, U (in place): a tile reads its elements of both before it writes them
    m = o < N
    dy = tl.load(DY + o, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + o, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    s = g * sig
    du = dy * s.to(G.dtype.element_ty).to(tl.float32)
    dg = dy * u * (sig + s * (1.0 - sig))
    tl.store(DG + o, dg.to(DG.dtype.element_ty), mask=m)
    tl.store(DU + o, du.to(DU.dtype.element_ty), mask=m)


@triton.jit
def _fwd(G, U, Y, stride, N: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    """One program per row: the whole row in one tile, or (LOOP) BLOCK columns at a time."""
    row = tl.program_id(0).to(tl.int64)
    G += row * stride
    U += row * stride
    Y += row * N
    if LOOP:
        for start in tl.range(0, N, BLOCK):
            _fwd_tile(G, U, Y, start + tl.arange(0, BLOCK), N)
    else:
        _fwd_tile(G, U, Y, tl.arange(0, BLOCK), N)


@triton.jit
def _bwd(DY, G, U, DG, DU, stride, N: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    DY += row * N
    G += row * stride
    U += row * stride
    DG += row * stride
    DU += row * stride
    if LOOP:
        for start in tl.range(0, N, BLOCK):
            _bwd_tile(DY, G, U, DG, DU, start + tl.arange(0, BLOCK), N)
    else:
        _bwd_tile(DY, G, U, DG, DU, tl.arange(0, BLOCK), N)


def liger_warps(block: int) -> int:
    """Liger-Kernel's calculate_settings rule (NVIDIA): 4 warps, 8 from 2048 elements, 16 from 8192, 32 from 32768."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


class Variant(torch.autograd.Function):
    """A variant's fwd/bwd pair: kind "row" or "rowloop", BLOCK and warps, gradients in place or fresh."""

    @staticmethod
    def forward(ctx, gate, up, kind: str, block: int, warps: int, inplace: bool):
        if not (gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape):
            raise ValueError("the variants take contiguous gate and up of one shape")
        n = gate.shape[-1]
        y = torch.empty_like(gate)
        _fwd[(gate.numel() // n,)](gate, up, y, n, N=n, BLOCK=block, LOOP=kind == "rowloop", num_warps=warps)
        ctx.save_for_backward(gate, up)
        ctx.spec = (kind, block, warps, inplace)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        kind, block, warps, inplace = ctx.spec
        n = gate.shape[-1]
        dy = dy.contiguous()
        dg, du = (gate, up) if inplace else (torch.empty_like(gate), torch.empty_like(up))
        _bwd[(gate.numel() // n,)](dy, gate, up, dg, du, n, N=n, BLOCK=block, LOOP=kind == "rowloop",
                                   num_warps=warps)
        return dg, du, None, None, None, None


def variant(kind: str, block: int, warps: int, inplace: bool = False):
    return lambda g, u: Variant.apply(g, u, kind, block, warps, inplace)


# -- measurement -----------------------------------------------------------------------------------------------

def fp64_reference(g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    y = F.silu(g64) * u64
    return [y.detach(), *torch.autograd.grad(y, (g64, u64), dy.double())]


def check(fn, g, u, dy, ref) -> str | None:
    """None when fn's y, dgate and dup match the fp64 reference (bf16 tolerance), else what differs.  Fresh
    copies of the inputs: an in-place arm overwrites them."""
    from liger_rt.numerics import validation_report
    gc, uc = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    y = fn(gc, uc)
    got = [y.detach(), *torch.autograd.grad(y, (gc, uc), dy)]
    bad = [f"{name}: {msg}" for name, o, r in zip(("y", "dgate", "dup"), got, ref)
           if (msg := validation_report(o.float(), r.float(), torch.bfloat16))]
    return "; ".join(bad) or None


def bench(fn, rep: int) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def passes(fn, g, u, dy, rep: int) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms) of fn(gate, up)."""
    fwd = bench(lambda: fn(g, u), rep)
    both = bench(lambda: torch.autograd.grad(fn(g, u), (g, u), dy), rep)
    return fwd, both


def copy_ms(elements: int, rep: int) -> float:
    """A plain copy moving 2 * elements bf16 values (elements read, elements written)."""
    src = torch.randn(elements, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep)
    del src, dst
    return ms


def arms(m: int, n: int, sweep: bool, rep: int, g, u, dy, echo) -> list[tuple[str, str, object]]:
    """(name, config text, fn(gate, up)) per arm; the config sweeps run here on g, u (fwd+bwd, the fastest kept;
    none of the swept arms writes its inputs)."""
    from liger_rt import backend, dispatch, ops
    from liger_rt.autograd import call_impl
    from liger_rt.config import config_dict
    from liger_rt.kernels.swiglu import OP
    from liger_rt.tools.bench.harness import peer
    arch, dims = backend.detect(), {"rows": m, "cols": n}
    rep = max(20, rep // 4)     # the sweeps rank configs; the chosen arm is timed again at the full rep
    heur = OP.heuristic(arch, dims, torch.bfloat16)
    out = [("ours heuristic", str(config_dict(heur)), lambda a, b, c=heur: call_impl(OP, "triton", c, a, b))]
    if sweep:
        timed = []
        for cfg in OP.candidates_for(OP.impl("triton"), arch, dims, torch.bfloat16):
            fn = (lambda a, b, c=cfg: call_impl(OP, "triton", c, a, b))
            timed.append((bench(lambda: torch.autograd.grad(fn(g, u), (g, u), dy), rep), cfg, fn))
        ms, cfg, fn = min(timed, key=lambda t: t[0])
        echo(f"  ours: {len(timed)} candidates, fwd+bwd {min(t[0] for t in timed):.4f} .. "
             f"{max(t[0] for t in timed):.4f} ms")
        out.append((f"ours best of {len(timed)}", str(config_dict(cfg)), fn))
    d = dispatch.decision(OP, g, rows=m, cols=n)
    out.append(("ours dispatched", f"{d.impl} {config_dict(d.config)} ({d.origin})", ops.swiglu))
    lk = peer("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", echo)
    if lk is not None:
        block = triton.next_power_of_2(n)
        out.append(("liger_kernel", f"BLOCK {block}, {liger_warps(block)} warps, grads in place",
                    lambda a, b: lk.apply(a, b)))
    block = triton.next_power_of_2(n)
    out.append(("row", f"BLOCK {block}, {liger_warps(block)} warps", variant("row", block, liger_warps(block))))
    out.append(("row inplace", f"BLOCK {block}, {liger_warps(block)} warps, grads in place",
                variant("row", block, liger_warps(block), inplace=True)))
    loops = [(b, w) for b in (1024, 2048, 4096) for w in (4, 8) if b <= block]
    if sweep and len(loops) > 1:
        timed = [(bench(lambda fn=variant("rowloop", b, w): torch.autograd.grad(fn(g, u), (g, u), dy), rep), b, w)
                 for b, w in loops]
        _, b, w = min(timed)
    else:
        b, w = min(2048, block), 8
    out.append(("row loop", f"BLOCK {b}, {w} warps", variant("rowloop", b, w)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"MxN,... (default {DEFAULT_SHAPES})")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time per measurement, ms")
    ap.add_argument("--no-sweep", action="store_true", help="skip the config sweeps (ours best, row loop's blocks)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_variants.py needs a GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16 fwd+bwd")
    rows = []
    for m, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        g0 = (2.0 * torch.randn(m, n, device="cuda", generator=gen)).to(torch.bfloat16)
        u0 = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        ref = fp64_reference(g0, u0, dy)

        def fresh():        # the arm's own inputs: an in-place arm overwrites them while it is timed
            return g0.clone().requires_grad_(), u0.clone().requires_grad_()
        mn, size = m * n, 2        # bf16 bytes
        ceiling = {"fwd": copy_ms(3 * mn // 2, args.rep), "fwdbwd": copy_ms(8 * mn // 2, args.rep)}
        work = {"fwd": 3 * mn * size, "fwdbwd": 8 * mn * size}
        print(f"== {m}x{n}: copy ceiling fwd {work['fwd'] / ceiling['fwd'] / 1e6:.0f} GB/s, "
              f"fwd+bwd {work['fwdbwd'] / ceiling['fwdbwd'] / 1e6:.0f} GB/s")
        for name, cfg, fn in arms(m, n, not args.no_sweep, args.rep, *fresh(), dy, print):
            row = {"shape": f"{m}x{n}", "arm": name, "config": cfg}
            try:
                if (why := check(fn, g0, u0, dy, ref)) is not None:
                    row["error"] = f"wrong: {why}"[:160]
                else:
                    fwd, both = passes(fn, *fresh(), dy, args.rep)
                    for p, ms in (("fwd", fwd), ("fwdbwd", both)):
                        row[f"{p}_ms"] = ms
                        row[f"{p}_GBps"] = work[p] / ms / 1e6
                        row[f"{p}_frac"] = ceiling[p] / ms
            except Exception as exc:      # an arm that cannot run here is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}"
            rows.append(row)
            print(_line(row), flush=True)
        del g0, u0, dy, ref
        torch.cuda.empty_cache()
    print("\n== summary (fwd+bwd; vs liger_kernel: its ms / the arm's ms)")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        lk = next((r.get("fwdbwd_ms") for r in rows if r["shape"] == shape and r["arm"] == "liger_kernel"), None)
        for r in (r for r in rows if r["shape"] == shape):
            vs = f"{lk / r['fwdbwd_ms']:.3f}x" if lk and r.get("fwdbwd_ms") else "-"
            print(f"{shape:>11} {r['arm']:18} {r.get('fwdbwd_ms', float('nan')):8.4f} ms  {vs:>7}  "
                  f"{r.get('fwdbwd_frac', float('nan')):6.1%} of copy  {r['config']}")
    best = [min((r for r in rows if r["shape"] == s and r.get("fwdbwd_ms")), key=lambda r: r["fwdbwd_ms"])
            for s in dict.fromkeys(r["shape"] for r in rows)]
    print("fastest per shape: " + "; ".join(f"{r['shape']} {r['arm']} {r['fwdbwd_ms']:.4f} ms" for r in best))
    print(f"median fraction of the copy ceiling over arms and shapes: "
          f"{statistics.median(r['fwdbwd_frac'] for r in rows if r.get('fwdbwd_frac')):.1%}")


def _line(r: dict) -> str:
    if "error" in r:
        return f"  {r['arm']:18} {r['error']}"
    return (f"  {r['arm']:18} fwd {r['fwd_ms']:.4f} ms {r['fwd_GBps']:6.0f} GB/s {r['fwd_frac']:6.1%} | fwd+bwd "
            f"{r['fwdbwd_ms']:.4f} ms {r['fwdbwd_GBps']:6.0f} GB/s {r['fwdbwd_frac']:6.1%}  {r['config']}")


if __name__ == "__main__":
    main()
