"""RMSNorm, SwiGLU and LayerNorm on the GPU: ours vs PyTorch eager, torch.compile, Liger-Kernel.

    python benchmarks/bench_norms.py             # full run (~3 min on the H200, torch.compile included)
    python benchmarks/bench_norms.py --quick     # one shape per op, no torch.compile
    python benchmarks/bench_norms.py --tune      # time every candidate config per shape, print the best
    python benchmarks/bench_norms.py --regs      # no GPU: sm_90 registers/spills of every candidate

Implementations: `liger_rt` (liger_rt.ops, whatever dispatch picks: DB, else the heuristic),
`triton` (our Function with the decision LIGER_RT_IMPL_<OP>=triton gives: DB config, else the
heuristic), `eager` (HF LlamaRMSNorm / F.silu(g) * u / F.layer_norm), `compile` (torch.compile
of the eager function, one static compile per shape) and `liger_kernel` (Liger-Kernel's
LigerRMSNorm, LigerSiLUMulFunction, LigerLayerNorm, when importable; it writes its backward in
place into its inputs, so it gets its own copies).  fwd+bwd takes gradients of every input with
torch.autograd.grad: no .grad accumulation kernels in any arm (the anchors' y.backward(dy) loops
included one accumulation per input, so their fwd+bwd times are higher than these).

Effective bandwidth counts the bytes an op cannot avoid moving (M rows, N columns, s bytes per
element; weights and per-row statistics are O(N + M), left out):
  RMSNorm, LayerNorm  fwd: read x, write y = 2MNs;  fwd+bwd: + read dy, x, write dx = 5MNs
  SwiGLU              fwd: read g, u, write y = 3MNs;  fwd+bwd: + read dy, g, u, write dg, du = 8MNs
The fraction is against the 4.25 TB/s copy ceiling measured on this H200 (benchmarks/_harness.py).
Results: benchmarks/results/norms_h200.csv (--tune: norms_tune_h200.csv), also under $OUT.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import forced_decision, rel_err  # noqa: E402

DEVICE = "cuda"
RMS_SHAPES = [(16384, 4096), (65536, 2048)]
SWIGLU_SHAPES = [(16384, 8192), (8192, 12288)]
LN_SHAPES = [(16384, 4096), (65536, 2048), (4096, 1152), (23328, 1152)]   # the last two: SigLIP2
# issue 4's targets in GB/s (fwd, fwd+bwd); LayerNorm's apply at the LLM widths, SigLIP is reported
TARGETS = {("rms_norm", 16384, 4096): (3800, 2600), ("rms_norm", 65536, 2048): (3800, 2600),
           ("swiglu", 16384, 8192): (4000, 3400), ("swiglu", 8192, 12288): (4000, 3400),
           ("layer_norm", 16384, 4096): (3600, 2400), ("layer_norm", 65536, 2048): (3600, 2400)}
# Liger-Kernel 0.8.5 fwd+bwd on this H200 (shared/anchors, measured with .grad accumulation)
ANCHOR_LIGER_GBPS = {("rms_norm", 16384, 4096): 1342, ("rms_norm", 65536, 2048): 1672,
                     ("swiglu", 16384, 8192): 2764, ("swiglu", 8192, 12288): 2731,
                     ("layer_norm", 16384, 4096): 1164, ("layer_norm", 65536, 2048): 1430,
                     ("layer_norm", 4096, 1152): 78, ("layer_norm", 23328, 1152): 276}
BYTES = {"rms_norm": (2, 5), "layer_norm": (2, 5), "swiglu": (3, 8)}   # elements per (row, col)


# -- the baselines ----------------------------------------------------------------------------------

def hf_rms_norm(x, w, eps=1e-6):
    """LlamaRMSNorm.forward."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def eager_swiglu(g, u):
    return F.silu(g) * u


def eager_layer_norm(x, w, b, eps=1e-6):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


_forced = forced_decision


_rel = rel_err


def _liger(name: str):
    """Liger-Kernel's implementation, or None (with the reason printed once) when not importable."""
    try:
        if name == "rms_norm":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm
            return LigerRMSNorm
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            return LigerSiLUMulFunction
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
        return LigerLayerNorm
    except Exception as exc:
        if name not in _liger.warned:
            _liger.warned.add(name)
            print(f"  (liger_kernel {name} skipped: {type(exc).__name__}: {exc}; pip install liger-kernel==0.8.5)")
        return None


_liger.warned = set()


def _add_peer(arms: dict, build) -> None:
    try:
        arms["liger_kernel"] = build()
    except Exception as exc:   # another Liger-Kernel version with another module signature
        print(f"  (liger_kernel arm skipped: {type(exc).__name__}: {exc})")


# -- one shape: build every arm ----------------------------------------------------------------------

def _arms(op: str, M: int, N: int, dtype, use_compile: bool):
    """{name: (fn() -> y, inputs to differentiate, dy, description)} plus the fp32 reference outputs."""
    from liger_rt import ops
    from liger_rt.kernels import layer_norm as ln
    from liger_rt.kernels import rms_norm as rn
    from liger_rt.kernels import swiglu as sw
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rand = lambda *s, scale=1.0, shift=0.0: (shift + scale * torch.randn(*s, device=DEVICE, generator=g)).to(dtype)  # noqa: E731
    arms = {}
    if op == "rms_norm":
        x, w, dy = rand(M, N, scale=2.0).requires_grad_(), rand(N, scale=0.3, shift=1.0).requires_grad_(), rand(M, N)
        d = rn.OP.select(x, rows=M, hidden=N)
        forced = _forced(op, x, rows=M, hidden=N)
        arms["liger_rt"] = (lambda: ops.rms_norm(x, w), (x, w), dy, f"{d.impl} {dict(d.config)} ({d.origin})")
        arms["triton"] = (lambda: rn.RMSNormFunction.apply(x, w, 1e-6, 0.0, forced.config), (x, w), dy,
                          f"triton {dict(forced.config)} ({forced.origin})")
        arms["eager"] = (lambda: hf_rms_norm(x, w), (x, w), dy, "LlamaRMSNorm.forward")
        if use_compile:
            comp = torch.compile(hf_rms_norm, dynamic=False)
            arms["compile"] = (lambda: comp(x, w), (x, w), dy, "torch.compile(LlamaRMSNorm.forward)")
        cls = _liger(op)
        if cls is not None:
            def build():
                lig = cls(N, eps=1e-6).to(DEVICE, dtype)
                with torch.no_grad():
                    lig.weight.copy_(w)
                xl = x.detach().clone().requires_grad_()
                return lambda: lig(xl), (xl, lig.weight), dy.clone(), "LigerRMSNorm"
            _add_peer(arms, build)
        ref_in = (x.detach().float().requires_grad_(), w.detach().float().requires_grad_())
        y = rn.rms_norm_ref(*ref_in)
        refs = [y, *torch.autograd.grad(y, ref_in, dy.float())]
    elif op == "swiglu":
        gate, up, dy = rand(M, N, scale=3.0).requires_grad_(), rand(M, N).requires_grad_(), rand(M, N)
        d = sw.OP.select(gate, rows=M, cols=N)
        forced = _forced(op, gate, rows=M, cols=N)
        arms["liger_rt"] = (lambda: ops.swiglu(gate, up), (gate, up), dy, f"{d.impl} {dict(d.config)} ({d.origin})")
        arms["triton"] = (lambda: sw.SwiGLUFunction.apply(gate, up, forced.config), (gate, up), dy,
                          f"triton {dict(forced.config)} ({forced.origin})")
        arms["eager"] = (lambda: eager_swiglu(gate, up), (gate, up), dy, "F.silu(g) * u")
        if use_compile:
            comp = torch.compile(eager_swiglu, dynamic=False)
            arms["compile"] = (lambda: comp(gate, up), (gate, up), dy, "torch.compile(F.silu(g) * u)")
        fn = _liger(op)
        if fn is not None:
            def build():
                gl, ul = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
                return lambda: fn.apply(gl, ul), (gl, ul), dy.clone(), "LigerSiLUMulFunction"
            _add_peer(arms, build)
        ref_in = (gate.detach().float().requires_grad_(), up.detach().float().requires_grad_())
        y = sw.swiglu_ref(*ref_in)
        refs = [y, *torch.autograd.grad(y, ref_in, dy.float())]
    else:
        x, dy = rand(M, N, scale=2.0, shift=1.5).requires_grad_(), rand(M, N)
        w, b = rand(N, scale=0.5, shift=1.0).requires_grad_(), rand(N, scale=0.5).requires_grad_()
        d = ln.OP.select(x, rows=M, hidden=N)
        forced = _forced(op, x, rows=M, hidden=N)
        arms["liger_rt"] = (lambda: ops.layer_norm(x, w, b, 1e-6), (x, w, b), dy,
                            f"{d.impl} {dict(d.config)} ({d.origin})")
        arms["triton"] = (lambda: ln.LayerNormFunction.apply(x, w, b, 1e-6, forced.config), (x, w, b), dy,
                          f"triton {dict(forced.config)} ({forced.origin})")
        arms["eager"] = (lambda: eager_layer_norm(x, w, b), (x, w, b), dy, "F.layer_norm")
        if use_compile:
            comp = torch.compile(eager_layer_norm, dynamic=False)
            arms["compile"] = (lambda: comp(x, w, b), (x, w, b), dy, "torch.compile(F.layer_norm)")
        cls = _liger(op)
        if cls is not None:
            def build():
                lig = cls(N, eps=1e-6).to(DEVICE, dtype)
                with torch.no_grad():
                    lig.weight.copy_(w)
                    lig.bias.copy_(b)
                xl = x.detach().clone().requires_grad_()
                return lambda: lig(xl), (xl, lig.weight, lig.bias), dy.clone(), "LigerLayerNorm"
            _add_peer(arms, build)
        ref_in = tuple(t.detach().float().requires_grad_() for t in (x, w, b))
        y = F.layer_norm(ref_in[0], (N,), ref_in[1], ref_in[2], 1e-6)
        refs = [y, *torch.autograd.grad(y, ref_in, dy.float())]
    return arms, refs


def bench_op(op: str, shapes, dtype, use_compile: bool, H_):
    rows = []
    fwd_el, fb_el = BYTES[op]
    for M, N in shapes:
        arms, refs = _arms(op, M, N, dtype, use_compile)
        s = torch.empty((), dtype=dtype).element_size()
        target = TARGETS.get((op, M, N), (None, None))
        eager_fb = None
        first = len(rows)
        for name, (fn, inputs, dy, desc) in arms.items():
            try:
                y = fn()
                grads = torch.autograd.grad(y, inputs, dy)
                err_y, err_dx = _rel(y, refs[0]), _rel(grads[0], refs[1])
                err_dw = _rel(grads[1], refs[2])
                del y, grads

                def fb(fn=fn, inputs=inputs, dy=dy):
                    torch.autograd.grad(fn(), inputs, dy)
                fwd, fwdbwd = H_.bench_ms(fn), H_.bench_ms(fb)
                try:   # the kernels' own time (CUDA graph: no host launch cost, no L2 flush)
                    fwd_dev, fwdbwd_dev = H_.graph_ms(fn), H_.graph_ms(fb)
                except Exception as exc:
                    print(f"  {op} {M}x{N} {name}: no CUDA-graph timing ({type(exc).__name__}: {str(exc)[:120]})")
                    fwd_dev = fwdbwd_dev = None
            except Exception as exc:   # a peer that cannot run this shape: report, keep going
                print(f"  {op} {M}x{N} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
            if name == "eager":
                eager_fb = fwdbwd
            row = {"op": op, "impl": name, "dtype": str(dtype).split(".")[-1], "M": M, "N": N,
                   "fwd_ms": fwd, "fwdbwd_ms": fwdbwd, "bwd_ms_est": fwdbwd - fwd,
                   "fwd_GBps": H_.gbps(fwd_el * M * N * s, fwd), "fwdbwd_GBps": H_.gbps(fb_el * M * N * s, fwdbwd),
                   "fwd_dev_ms": fwd_dev, "fwdbwd_dev_ms": fwdbwd_dev,
                   "fwd_dev_GBps": H_.gbps(fwd_el * M * N * s, fwd_dev) if fwd_dev else None,
                   "fwdbwd_dev_GBps": H_.gbps(fb_el * M * N * s, fwdbwd_dev) if fwdbwd_dev else None,
                   "relerr_y": err_y, "relerr_dx": err_dx, "relerr_dw": err_dw, "config": desc,
                   "target_fwd_GBps": target[0], "target_fwdbwd_GBps": target[1],
                   "anchor_liger_fwdbwd_GBps": ANCHOR_LIGER_GBPS.get((op, M, N))}
            row["fwd_frac_ceiling"] = row["fwd_GBps"] / H_.COPY_CEILING_GBPS
            row["fwdbwd_frac_ceiling"] = row["fwdbwd_GBps"] / H_.COPY_CEILING_GBPS
            rows.append(row)
        for row in rows[first:]:
            row["speedup_vs_eager"] = eager_fb / row["fwdbwd_ms"] if eager_fb else None
        del arms, refs
        torch.cuda.empty_cache()
    return rows


# -- --tune: every candidate config per shape ----------------------------------------------------------

def tune(H_, dtype, quick: bool):
    """Per shape and candidate config: fwd alone, bwd alone (launchers) and fwd+bwd (Function)."""
    from liger_rt import backend, dispatch
    from liger_rt.kernels import layer_norm as ln
    from liger_rt.kernels import rms_norm as rn
    from liger_rt.kernels import swiglu as sw
    arch = backend.detect()
    out = []

    def timed(fn):
        try:
            return H_.bench_ms(fn, warmup=5, rep=30)
        except Exception as exc:   # out of resources, compile errors: skip the config
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"

    plan = [("rms_norm", RMS_SHAPES), ("swiglu", SWIGLU_SHAPES), ("layer_norm", LN_SHAPES)]
    for op, shapes in plan:
        the_op = dispatch.get_op(op)
        impl = the_op.impl("triton")
        fwd_el, fb_el = BYTES[op]
        for M, N in (shapes[:1] if quick else shapes):
            g = torch.Generator(device=DEVICE).manual_seed(0)
            a = torch.randn(M, N, device=DEVICE, generator=g).to(dtype)
            b = torch.randn(M, N, device=DEVICE, generator=g).to(dtype) if op == "swiglu" else None
            w = (1 + 0.3 * torch.randn(N, device=DEVICE, generator=g)).to(dtype)
            bias = (0.3 * torch.randn(N, device=DEVICE, generator=g)).to(dtype)
            dy = torch.randn(M, N, device=DEVICE, generator=g).to(dtype)
            dims = {"rows": M, "cols": N} if op == "swiglu" else {"rows": M, "hidden": N}
            s = a.element_size()
            cands = the_op.candidates(impl, arch, dims, dtype)
            heur = impl.heuristic(arch, dims, dtype)
            if heur not in cands:
                cands = [heur, *cands]
            res = []
            for cfg in cands:
                if op == "rms_norm":
                    _, rstd = rn.rms_norm_fwd(a, w, 1e-6, 0.0, cfg)
                    f = lambda cfg=cfg: rn.rms_norm_fwd(a, w, 1e-6, 0.0, cfg)  # noqa: E731
                    bw = lambda cfg=cfg, rstd=rstd: rn.rms_norm_bwd(dy, a, w, rstd, 0.0, cfg)  # noqa: E731
                elif op == "swiglu":
                    f = lambda cfg=cfg: sw.swiglu_fwd(a, b, cfg)  # noqa: E731
                    bw = lambda cfg=cfg: sw.swiglu_bwd(dy, a, b, cfg)  # noqa: E731
                else:
                    _, mean, rstd = ln.layer_norm_fwd(a, w, bias, 1e-6, cfg)
                    f = lambda cfg=cfg: ln.layer_norm_fwd(a, w, bias, 1e-6, cfg)  # noqa: E731
                    bw = lambda cfg=cfg, mean=mean, rstd=rstd: ln.layer_norm_bwd(dy, a, w, bias, mean, rstd, cfg)  # noqa: E731
                t = {"fwd": timed(f), "bwd": timed(bw)}
                t["fwdbwd"] = t["fwd"] + t["bwd"] if all(isinstance(v, float) for v in t.values()) else None
                res.append((cfg, t))
                out.append({"op": op, "M": M, "N": N, "config": str(cfg), "heuristic": cfg == heur,
                            **{f"{k}_ms": v if isinstance(v, float) else None for k, v in t.items()},
                            "error": "; ".join(v for v in t.values() if isinstance(v, str))})
            bytes_ = {"fwd": fwd_el * M * N * s, "bwd": (fb_el - fwd_el) * M * N * s, "fwdbwd": fb_el * M * N * s}
            print(f"\n{op} {M}x{N} {str(dtype).split('.')[-1]}: {len(cands)} configs")
            for half in ("fwd", "bwd", "fwdbwd"):
                ok = sorted(((t[half], c) for c, t in res if isinstance(t[half], float)), key=lambda r: r[0])
                if not ok:
                    print(f"  {half}: nothing ran")
                    continue
                ht = next((t[half] for c, t in res if c == heur), None)
                hs = f"; heuristic {ht:.4f} ms ({H_.gbps(bytes_[half], ht):.0f} GB/s)" if isinstance(ht, float) else ""
                print(f"  {half}: best {ok[0][0]:.4f} ms ({H_.gbps(bytes_[half], ok[0][0]):.0f} GB/s){hs}")
                for ms, c in ok[:3]:
                    print(f"     {ms:.4f} ms {H_.gbps(bytes_[half], ms):6.0f} GB/s  {c}")
            for c, t in res:
                errs = [v for v in t.values() if isinstance(v, str)]
                if errs:
                    print(f"  FAILED {c}: {errs[0]}")
            del a, b, dy
            torch.cuda.empty_cache()
    return out


# -- --regs: register use per candidate, compiled offline for sm_90 (no GPU needed) ----------------------

def regs(hidden_sizes=(1152, 2048, 4096, 8192), swiglu_cols=(8192, 12288)) -> list[dict]:
    """Compile every hopper candidate with Triton's bundled ptxas and report registers, spills
    (local bytes), shared memory and whether cp.async pipelining happened.  Two 8-warp programs
    per SM need <= 128 registers, three <= 85."""
    import re
    import subprocess
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from liger_rt import backend
    from liger_rt.kernels import layer_norm as ln
    from liger_rt.kernels import rms_norm as rn
    from liger_rt.kernels import swiglu as sw
    target, arch = GPUTarget("cuda", 90, 32), backend.profile("hopper")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    aligned = [["tt.divisibility", 16]]

    def build(fn, sig, consts, num_warps, n):
        # what a launch specializes: 16-aligned pointers, strides and N (when N % 16 == 0); M is
        # do_not_specialize
        sig = {**sig, **{k: "constexpr" for k in consts}}
        attrs = {(fn.arg_names.index(k),): aligned for k, t in sig.items()
                 if t.startswith("*") or k.startswith("stride") or (k == "N" and n % 16 == 0)}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                           options={"num_warps": num_warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
        return {"regs": int(m.group(1)) if m else None, "local": int(m.group(2)) if m else None,
                "smem": k.metadata.shared, "cp_async": "cp.async" in k.asm["ptx"]}

    t, f32 = "*bf16", "*fp32"
    rows = []
    for op, mod in (("rms_norm", rn), ("layer_norm", ln)):
        for n in hidden_sizes:
            e = triton.next_power_of_2(n)
            for cfg in mod.OP.candidates(mod.OP.impl("triton"), arch, {"rows": 16384, "hidden": n}, torch.bfloat16):
                bwd = {"BLOCK_N": e, "PREFETCH": bool(cfg["bwd_prefetch"]), "RNE_BF16": False}
                if op == "rms_norm":
                    fr = build(rn._rms_norm_fwd_kernel, {"X": t, "W": t, "Y": t, "RSTD": f32, "stride_x": "i32",
                               "stride_y": "i32", "M": "i32", "N": "i32", "eps": "fp32", "offset": "fp32"},
                               {"BLOCK_N": e, "ROWS": cfg["ROWS"], "RNE_BF16": False}, cfg["num_warps"], n)
                    br = build(rn._rms_norm_bwd_kernel, {"DY": t, "X": t, "W": t, "RSTD": f32, "DX": t, "DW_PART": f32,
                               "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32", "M": "i32", "N": "i32",
                               "offset": "fp32"}, bwd, cfg["bwd_num_warps"], n)
                else:
                    fr = build(ln._layer_norm_fwd_kernel, {"X": t, "W": t, "B": t, "Y": t, "MEAN": f32, "RSTD": f32,
                               "stride_x": "i32", "stride_y": "i32", "M": "i32", "N": "i32", "eps": "fp32"},
                               {"BLOCK_N": e, "ROWS": cfg["ROWS"], "HAS_BIAS": True, "RNE_BF16": False}, cfg["num_warps"], n)
                    br = build(ln._layer_norm_bwd_kernel, {"DY": t, "X": t, "W": t, "MEAN": f32, "RSTD": f32, "DX": t,
                               "DW_PART": f32, "DB_PART": f32, "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32",
                               "M": "i32", "N": "i32"}, {**bwd, "HAS_BIAS": True},
                               cfg["bwd_num_warps"], n)
                rows.append({"op": op, "N": n, "config": str(cfg), **{f"fwd_{k}": v for k, v in fr.items()},
                             **{f"bwd_{k}": v for k, v in br.items()}})
    for n in swiglu_cols:
        for cfg in sw.OP.candidates(sw.OP.impl("triton"), arch, {"rows": 16384, "cols": n}, torch.bfloat16):
            c = {"BLOCK_N": cfg["BLOCK_N"], "ROWS": cfg["ROWS"], "RNE_BF16": False}
            fr = build(sw._swiglu_fwd_kernel, {"G": t, "U": t, "Y": t, "stride_g": "i32", "stride_u": "i32",
                       "stride_y": "i32", "M": "i32", "N": "i32"}, c, cfg["num_warps"], n)
            br = build(sw._swiglu_bwd_kernel, {"DY": t, "G": t, "U": t, "DG": t, "DU": t, "stride_dy": "i32",
                       "stride_g": "i32", "stride_u": "i32", "stride_dg": "i32", "stride_du": "i32", "M": "i32",
                       "N": "i32"}, c, cfg["bwd_num_warps"], n)
            rows.append({"op": "swiglu", "N": n, "config": str(cfg), **{f"fwd_{k}": v for k, v in fr.items()},
                         **{f"bwd_{k}": v for k, v in br.items()}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one shape per op, no torch.compile")
    ap.add_argument("--tune", action="store_true", help="time every candidate config per shape and print the best")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile arm")
    ap.add_argument("--op", action="append", choices=("rms_norm", "swiglu", "layer_norm"),
                    help="only these ops (repeatable)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--regs", action="store_true",
                    help="no GPU needed: compile every hopper candidate for sm_90, print registers/spills/smem")
    args = ap.parse_args(argv)
    if args.regs:
        os.environ.pop("TRITON_INTERPRET", None)   # read when the kernels are decorated: before the import
        import _harness as H_
        rows = regs()
        H_.print_table(rows, ["op", "N", "fwd_regs", "fwd_local", "bwd_regs", "bwd_local", "bwd_smem",
                              "bwd_cp_async", "config"])
        return 0
    if not torch.cuda.is_available():
        print("bench_norms: no CUDA/ROCm device here; run it on the GPU (the H200): "
              "python benchmarks/bench_norms.py [--quick|--tune]")
        return 0
    import _harness as H_
    from liger_rt.kernels._common import parse_dtype
    dtype = parse_dtype(args.dtype)
    print(f"bench_norms on {torch.cuda.get_device_name()} ({H_.versions()})")
    if args.tune:
        rows = tune(H_, dtype, args.quick)
        print(f"\nwrote {H_.write_csv('norms_tune_h200.csv', rows)}")
        return 0
    use_compile = not (args.quick or args.no_compile)
    plan = {"rms_norm": RMS_SHAPES, "swiglu": SWIGLU_SHAPES, "layer_norm": LN_SHAPES}
    if args.quick:
        plan = {"rms_norm": RMS_SHAPES[:1], "swiglu": SWIGLU_SHAPES[:1], "layer_norm": [LN_SHAPES[0], LN_SHAPES[2]]}
    rows = []
    for op, shapes in plan.items():
        if args.op and op not in args.op:
            continue
        rows += bench_op(op, shapes, dtype, use_compile, H_)
    cols = ["op", "impl", "M", "N", "fwd_ms", "fwdbwd_ms", "fwd_GBps", "fwdbwd_GBps", "fwd_dev_GBps",
            "fwdbwd_dev_GBps", "fwdbwd_frac_ceiling", "speedup_vs_eager", "relerr_y", "relerr_dx", "relerr_dw"]
    H_.print_table(rows, cols)
    print("\nconfigs:")
    for r in rows:
        if r["impl"] in ("liger_rt", "triton"):
            print(f"  {r['op']} {r['M']}x{r['N']} {r['impl']}: {r['config']}")
    for r in rows:
        if r["impl"] not in ("liger_rt", "triton"):
            continue
        for half in ("fwd", "fwdbwd"):
            want = r[f"target_{half}_GBps"]
            if want and r[f"{half}_GBps"] < want:
                print(f"TARGET MISSED: {r['op']} {r['M']}x{r['N']} {r['impl']} {half}: "
                      f"{r[f'{half}_GBps']:.0f} GB/s < {want} GB/s")
    print(f"\nwrote {H_.write_csv('norms_h200.csv', rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
