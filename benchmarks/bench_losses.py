"""Loss benchmarks on the H200: fused linear cross-entropy and plain cross-entropy, bf16, fwd+bwd.

    python benchmarks/bench_losses.py [--quick] [--skip-compile] [--skip-chunks]

In one run, per shape: eager `F.cross_entropy((x @ W.t()).float(), y)`, torch.compile of the same,
Liger-Kernel's LigerFusedLinearCrossEntropyLoss (when importable) and liger_rt dispatched.
  FLCE shapes  BT8192 H2048 V65536    targets <= 10.4 ms, <= 0.5 GB extra  (compile: 10.43 ms, 1.64 GB)
               BT8192 H2560 V151936   targets <= 31.4 ms, <= 1.0 GB extra  (compile: 31.44 ms, 3.58 GB)
  CE shape     rows 8192 x vocab 151936 bf16 logits (eager / compile / Liger / ours / ours in place)
Each timed call is a training step's loss: grads set to None (optimizer.zero_grad(set_to_none=True)),
forward, backward; median of triton.testing.do_bench. Peak extra memory (harness.peak_extra_gb)
counts everything the step allocates, the dX/dW it hands out included. TFLOP/s counts the three
GEMMs (2*BT*H*V flops each) against the 722 TFLOP/s measured bf16 matmul ceiling; CE GB/s counts
reading the logits and writing their gradient once against the 4250 GB/s copy ceiling.

Also the chunk-size table at both FLCE shapes (each chunk in the dispatch candidate space, plus a
few above the memory budget for reference: time and peak memory) and the cross-entropy launch
configs at the CE shape.
Writes benchmarks/results/losses_h200.csv, flce_chunks_h200.csv, ce_configs_h200.csv (--quick:
*_quick.csv). Expected wall time on an H200: about 2-3 min (--quick about 1 min), mostly compiles.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

try:
    import liger_rt
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import liger_rt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _harness import (COPY_CEILING_GBPS, MATMUL_CEILING_TFLOPS, bench_ms, gbps, peak_extra_gb,  # noqa: E402
                      print_table, tflops, write_csv)

FLCE_SHAPES = [  # (tokens, hidden, vocab, target ms, target GB); targets from shared/anchors (compile)
    (8192, 2048, 65536, 10.4, 0.5),
    (8192, 2560, 151936, 31.4, 1.0),
]
CE_SHAPE = (8192, 151936)
DEVICE = "cuda"
OVER_BUDGET_CHUNKS = (1024, 2048, 4096, 0)   # measured for reference, outside the candidate space


def _relerr(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _liger_flce():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        return LigerFusedLinearCrossEntropyLoss()
    except Exception as exc:
        print(f"Liger-Kernel FLCE not importable ({type(exc).__name__}: {exc}); skipping that peer")
        return None


def _liger_ce():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
        return LigerCrossEntropyLoss()
    except Exception as exc:
        print(f"Liger-Kernel CE not importable ({type(exc).__name__}: {exc}); skipping that peer")
        return None


def _step(loss_fn, params):
    def step():
        for p in params:
            p.grad = None
        loss = loss_fn()
        loss.backward()
        return loss
    return step


def _measure(step, params, *, rep: int):
    for p in params:
        p.grad = None
    step()
    torch.cuda.synchronize()
    ms = bench_ms(step, warmup=max(50, rep // 5), rep=rep)
    for p in params:
        p.grad = None
    peak = peak_extra_gb(step)
    return ms, peak


def bench_flce(args, rows, chunk_rows):
    from liger_rt.kernels import fused_linear_cross_entropy as flce
    dev, dt = DEVICE, torch.bfloat16
    rep = 200 if args.quick else 500
    shapes = FLCE_SHAPES[:1] if args.quick else FLCE_SHAPES
    liger = _liger_flce()
    for tokens, hidden, vocab, target_ms, target_gb in shapes:
        shape = f"BT{tokens}_H{hidden}_V{vocab}"
        g = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(tokens, hidden, device=dev, dtype=dt, generator=g) * 0.5).requires_grad_()
        w = (torch.randn(vocab, hidden, device=dev, dtype=dt, generator=g) * 0.02).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
        flops = 3 * 2 * tokens * hidden * vocab
        decision = flce.OP.select(x, tokens=tokens, hidden=hidden, vocab=vocab)
        plain = lambda x_, w_, y_: F.cross_entropy((x_ @ w_.t()).float(), y_)  # noqa: E731
        impls = {"eager": lambda: plain(x, w, y)}
        if not args.skip_compile:
            compiled = torch.compile(plain, dynamic=False)
            impls["compile"] = lambda: compiled(x, w, y)
        if liger is not None:
            impls["liger_kernel"] = lambda: liger(w, x, y)
        impls["liger_rt"] = lambda: liger_rt.ops.fused_linear_cross_entropy(x, w, y)
        ref = None
        for name, fn in impls.items():
            row = {"kind": "flce", "shape": shape, "impl": name, "dtype": "bf16"}
            try:
                step = _step(fn, (x, w))
                loss = step()
                grads = (x.grad.clone(), w.grad.clone())
                if ref is None:
                    ref = (loss.detach().float(), grads)
                ms, peak = _measure(step, (x, w), rep=rep)
                tf = tflops(flops, ms)
                row.update(ms=ms, peak_extra_GB=peak, TFLOPs=tf, frac_ceiling=tf / MATMUL_CEILING_TFLOPS,
                           loss_relerr=_relerr(loss, ref[0]), dx_relerr=_relerr(grads[0], ref[1][0]),
                           dw_relerr=_relerr(grads[1], ref[1][1]), target_ms=target_ms, target_GB=target_gb)
                if name == "liger_rt":
                    row.update(config=str(dict(decision.config)), origin=decision.origin,
                               meets_target=bool(ms <= target_ms and peak <= target_gb))
            except Exception as exc:  # one failing peer must not lose the others' rows
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
            x.grad = w.grad = None
            torch.cuda.empty_cache()
            rows.append(row)
        if not args.skip_chunks:
            _chunk_sweep(x, w, y, decision, shape, flops, chunk_rows, rep=rep // 2)
        del x, w, y, impls
        torch.cuda.empty_cache()


def _chunk_sweep(x, w, y, decision, shape, flops, chunk_rows, *, rep):
    from liger_rt.kernels import fused_linear_cross_entropy as flce
    tokens, hidden = x.shape
    vocab = w.shape[0]
    arch = liger_rt.backend.detect(x.device)
    dims = {"tokens": tokens, "hidden": hidden, "vocab": vocab}
    space = flce.OP.candidates(flce.OP.impl("triton"), arch, dims, x.dtype)
    ce_cfg = {k: v for k, v in decision.config.items() if k != "chunk"}
    in_space = sorted({c["chunk"] for c in space}, key=lambda c: c or 1 << 30)
    extra = [c for c in OVER_BUDGET_CHUNKS if c not in in_space and (c == 0 or c < tokens)]
    for chunk in [*in_space, *extra]:
        cfg = {**ce_cfg, "chunk": chunk}
        fn = lambda cfg=cfg: flce.FusedLinearCrossEntropyFunction.apply(  # noqa: E731
            x, w, y, None, -100, "mean", 0.0, 0.0, None, None, cfg, True)
        row = {"shape": shape, "chunk": chunk if chunk else tokens, "in_space": chunk in in_space,
               "logits_MiB": (chunk or tokens) * vocab * x.element_size() / 2 ** 20,
               "heuristic": chunk == flce._heuristic(arch, dims, x.dtype)["chunk"], "config": str(cfg)}
        try:
            ms, peak = _measure(_step(fn, (x, w)), (x, w), rep=rep)
            row.update(ms=ms, peak_extra_GB=peak, TFLOPs=tflops(flops, ms))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        x.grad = w.grad = None
        torch.cuda.empty_cache()
        chunk_rows.append(row)


def bench_ce(args, rows, cfg_rows):
    from liger_rt.kernels import cross_entropy as ce
    dev, dt = DEVICE, torch.bfloat16
    n_rows, vocab = CE_SHAPE
    rep = 100 if args.quick else 300
    g = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(n_rows, vocab, device=dev, dtype=dt, generator=g) * 2.0
    y = torch.randint(0, vocab, (n_rows,), device=dev, generator=g)
    nbytes = 2 * n_rows * vocab * base.element_size()    # read logits once, write dlogits once
    shape = f"R{n_rows}_V{vocab}"
    decision = ce.OP.select(base, rows=n_rows, vocab=vocab)
    plain = lambda l_, y_: F.cross_entropy(l_.float(), y_)  # noqa: E731
    liger = _liger_ce()
    impls = {"eager": (lambda l_: plain(l_, y), False)}
    if not args.skip_compile:
        compiled = torch.compile(plain, dynamic=False)
        impls["compile"] = (lambda l_: compiled(l_, y), False)
    impls["liger_rt"] = (lambda l_: liger_rt.ops.cross_entropy(l_, y), False)
    # in place: the logits are a non-leaf view (as an lm_head output is); the buffer is clobbered
    impls["liger_rt_inplace"] = (lambda l_: liger_rt.ops.cross_entropy(l_.view_as(l_), y, inplace_backward=True),
                                 True)
    if liger is not None:
        impls["liger_kernel"] = (lambda l_: liger(l_.view_as(l_), y), True)   # writes dlogits into the input
    ref_loss = None
    for name, (fn, clobbers) in impls.items():
        row = {"kind": "ce", "shape": shape, "impl": name, "dtype": "bf16"}
        try:
            logits = (base.clone() if clobbers else base.detach()).requires_grad_()
            loss = fn(logits).detach().float()   # before the first step overwrites anything
            if ref_loss is None:
                ref_loss = loss
            step = _step(lambda: fn(logits), (logits,))
            ms, peak = _measure(step, (logits,), rep=rep)
            bw = gbps(nbytes, ms)
            row.update(ms=ms, peak_extra_GB=peak, GBps=bw, frac_ceiling=bw / COPY_CEILING_GBPS,
                       loss_relerr=_relerr(loss, ref_loss))
            if name.startswith("liger_rt"):
                row.update(config=str(dict(decision.config)), origin=decision.origin)
            del logits
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        torch.cuda.empty_cache()
        rows.append(row)
    # every launch config in the candidate space (the sweep's view of this shape)
    arch = liger_rt.backend.detect(base.device)
    logits = base.detach().requires_grad_()
    for cfg in ce.OP.candidates(ce.OP.impl("triton"), arch, {"rows": n_rows, "vocab": vocab}, dt):
        fn = lambda cfg=cfg: ce.CrossEntropyFunction.apply(  # noqa: E731
            logits, y, -100, "mean", 0.0, 0.0, None, None, False, cfg)
        row = {"shape": shape, **cfg, "heuristic": cfg == ce._heuristic(arch, {"rows": n_rows, "vocab": vocab}, dt)}
        try:
            ms = bench_ms(_step(fn, (logits,)), warmup=25, rep=rep // 3)
            bw = gbps(nbytes, ms)
            row.update(ms=ms, GBps=bw, frac_ceiling=bw / COPY_CEILING_GBPS)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        cfg_rows.append(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first FLCE shape only, shorter timing")
    ap.add_argument("--skip-compile", action="store_true", help="leave torch.compile out (saves the compiles)")
    ap.add_argument("--skip-chunks", action="store_true", help="leave the chunk-size table out")
    ap.add_argument("--only", choices=["flce", "ce"], default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_losses.py needs a CUDA/ROCm GPU and found none; run it on the H200 "
                         "(python benchmarks/bench_losses.py [--quick])")
    rows, chunk_rows, cfg_rows = [], [], []
    if args.only in (None, "flce"):
        bench_flce(args, rows, chunk_rows)
    if args.only in (None, "ce"):
        bench_ce(args, rows, cfg_rows)
    suffix = "_quick" if args.quick else ""
    print_table(rows, ["kind", "shape", "impl", "ms", "peak_extra_GB", "TFLOPs", "GBps", "frac_ceiling",
                       "loss_relerr", "dw_relerr", "meets_target", "config", "error"])
    print(f"-> {write_csv(f'losses_h200{suffix}.csv', rows)}")
    if chunk_rows:
        print_table(chunk_rows, ["shape", "chunk", "in_space", "heuristic", "logits_MiB", "ms", "peak_extra_GB",
                                 "TFLOPs", "error"])
        print(f"-> {write_csv(f'flce_chunks_h200{suffix}.csv', chunk_rows)}")
    if cfg_rows:
        print_table(cfg_rows, ["shape", "BLOCK_V", "num_warps", "heuristic", "ms", "GBps", "frac_ceiling", "error"])
        print(f"-> {write_csv(f'ce_configs_h200{suffix}.csv', cfg_rows)}")
    for r in rows:
        if r.get("impl") == "liger_rt" and r.get("kind") == "flce" and "ms" in r:
            verdict = "meets" if r["meets_target"] else "MISSES"
            print(f"{r['shape']}: liger_rt {r['ms']:.2f} ms {r['peak_extra_GB']:.3f} GB {verdict} the target "
                  f"(<= {r['target_ms']} ms, <= {r['target_GB']} GB)")


if __name__ == "__main__":
    main()
