"""MoE experts on the GPU (bf16): ours (fused Triton, grouped MM, dispatched) beside transformers'
grouped_mm experts and Liger-Kernel 0.8.5's fused MoE, fwd and fwd+bwd, from one run.

    python benchmarks/bench_moe_experts.py            # E32 K4 H2048 I1792 and E64 K4 H2048 I1536 x
                                                      # T {512, 2048, 4096, 16384} x {uniform, skewed}
    python benchmarks/bench_moe_experts.py --quick    # T {512, 4096}, uniform routing only
    python benchmarks/bench_moe_experts.py --tune     # every candidate config of the fused path per shape,
                                                      # and each GEMM family timed over its own space

Arms: `hf_grouped_mm` (an Lfm2MoeExperts module with config._experts_implementation="grouped_mm",
transformers' grouped_mm_experts_forward), `liger_kernel` (liger_kernel.ops.fused_moe
LigerFusedMoEFunction; skipped when Liger-Kernel is absent), `grouped_mm` (ours:
torch grouped MM, torch autograd), `triton` (our fused path forced: LIGER_RT_IMPL_MOE_EXPERTS=triton,
DB config if any, else the heuristic) and `liger_rt` (liger_rt.ops.moe_experts, whatever dispatch
picks). fwd+bwd takes the gradients of x, both weights and the routing weights with
torch.autograd.grad (no .grad accumulation kernels in any arm).

FLOPs: fwd = 2*T*k*(H*2I + I*H) (the two expert GEMMs), fwd+bwd = 3x fwd. TFLOP/s are reported
against the 722 TFLOP/s bf16 matmul ceiling measured on this H200 (benchmarks/_harness.py).
Targets (issue 7): the fused path beats the better of hf_grouped_mm and liger_kernel by >= 15% at
half the points or more; >= 450 TFLOP/s fwd+bwd at T=16384; the dispatched arm within 3% of the
fastest arm at every point. The measured triton/grouped_mm crossover per static shape is derived
with dispatch.derive_crossover and written as shippable JSON lines (moe_experts_<arch>_crossover.jsonl).
Results: benchmarks/results/moe_experts_h200.csv (and $OUT when the device tool runs this).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import forced_decision, rel_err  # noqa: E402

DEVICE = "cuda"
STATICS = [(32, 4, 2048, 1792), (64, 4, 2048, 1536)]      # LFM2-8B-A1B, LFM2-24B-A2B experts
TOKENS = (512, 2048, 4096, 16384)
QUICK_TOKENS = (512, 4096)
TAGS = ("uniform", "skewed")
# fwd+bwd ms of the anchor run on this H200 (shared/anchors/h200-anchor.json, uniform-ish routing)
ANCHOR_FWDBWD = {
    (32, 512): {"grouped_mm": 2.031, "liger": 2.252}, (32, 2048): {"grouped_mm": 2.898, "liger": 3.110},
    (32, 4096): {"grouped_mm": 4.499, "liger": 4.367}, (32, 16384): {"grouped_mm": 13.970, "liger": 14.508},
    (64, 512): {"grouped_mm": 2.519, "liger": 4.042}, (64, 2048): {"grouped_mm": 3.650, "liger": 3.818},
    (64, 4096): {"grouped_mm": 4.836, "liger": 4.812}, (64, 16384): {"grouped_mm": 13.373, "liger": 13.894},
}
PEERS = ("hf_grouped_mm", "liger_kernel")
OURS = ("grouped_mm", "triton", "liger_rt")


def fwd_flops(T, E, K, H, I) -> float:
    return 2.0 * T * K * (H * 2 * I + I * H)


def _dims(T, E, K, H, I) -> dict:
    return dict(tokens=T, experts=E, top_k=K, hidden=H, intermediate=I)


def _forced(x, dims):
    return forced_decision("moe_experts", x, **dims)


_rel = rel_err


def _liger_fused():
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        return LigerFusedMoEFunction
    except Exception as exc:  # absent, or a version without the fused MoE op
        print(f"liger_kernel fused MoE not available ({type(exc).__name__}: {exc}); skipping that arm")
        return None


def _hf_module(E, K, H, I, case):
    """transformers' Lfm2MoeExperts holding the case's weights (shared storage), grouped_mm experts."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts
    cfg = Lfm2MoeConfig(num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I)
    with torch.device("meta"):
        mod = Lfm2MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(case["gate_up"].detach())
    mod.down_proj = torch.nn.Parameter(case["down"].detach())
    cfg._experts_implementation = "grouped_mm"
    return mod


def arms(E, K, H, I, case, dims, liger_fn):
    """name -> (fn() -> y, leaves for autograd.grad, description)."""
    from liger_rt import dispatch, ops
    from liger_rt.kernels import moe_experts as M
    x, gu, dn, idx, w = case["x"], case["gate_up"], case["down"], case["idx"], case["w"]
    d = M.OP.select(x, **dims)
    forced = _forced(x, dims)
    out = {}
    mod = _hf_module(E, K, H, I, case)
    out["hf_grouped_mm"] = (lambda: mod(x, idx, w), (x, mod.gate_up_proj, mod.down_proj, w), "transformers grouped_mm")
    if liger_fn is not None:
        idx32 = idx.to(torch.int32)
        out["liger_kernel"] = (lambda: liger_fn.apply(x, gu, dn, idx32, w), (x, gu, dn, w), "LigerFusedMoEFunction")
    if M._grouped_mm_available(dispatch.current_target("cuda")):
        out["grouped_mm"] = (lambda: M.moe_experts_grouped_mm(x, gu, dn, idx, w), (x, gu, dn, w),
                             "ours, torch grouped MM")
    out["triton"] = (lambda: M.MoEExpertsFunction.apply(x, gu, dn, idx, w, forced.config), (x, gu, dn, w),
                     f"triton {json.dumps(dict(forced.config), sort_keys=True)} ({forced.origin})")
    out["liger_rt"] = (lambda: ops.moe_experts(x, gu, dn, idx, w), (x, gu, dn, w),
                       f"{d.impl} ({d.origin}: {d.reason})")
    return out


def bench(H_, statics, tokens, tags, with_memory: bool, on_point=None):
    """Every arm at every point; on_point(rows) after each point (the CSV is kept current, so a
    run cut short by a time limit keeps what it measured)."""
    from liger_rt.kernels import moe_experts as M
    liger_fn = _liger_fused()
    rows = []
    for (E, K, H, I) in statics:
        for T in tokens:
            for tag in tags:
                dims = _dims(T, E, K, H, I)
                case = M._make_case(dims, torch.bfloat16, DEVICE, tag=tag)
                with torch.no_grad():
                    ref = M.moe_experts_ref(case["x"], case["gate_up"], case["down"], case["idx"], case["w"])
                flops = fwd_flops(T, E, K, H, I)
                counts = torch.bincount(case["idx"].flatten(), minlength=E)
                for name, (fn, leaves, desc) in arms(E, K, H, I, case, dims, liger_fn).items():
                    def fb(fn=fn, leaves=leaves):   # allow_unused: a peer may not differentiate w
                        torch.autograd.grad(fn(), leaves, case["dy"], allow_unused=True)
                    try:
                        t_first = time.perf_counter()
                        err = _rel(fn(), ref)
                        torch.cuda.synchronize()
                        t_first = time.perf_counter() - t_first
                        fwd = H_.bench_ms(fn)
                        fwdbwd = H_.bench_ms(fb)
                        peak = H_.peak_extra_gb(fb) if with_memory else None
                        error = ""
                    except Exception as exc:   # an arm that cannot take the shape: recorded, not fatal
                        err = fwd = fwdbwd = peak = None
                        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                        print(f"  {name} E{E} T{T} {tag}: {error}")
                        t_first = None
                    row = {"op": "moe_experts", "impl": name, "dtype": "bf16", "experts": E, "top_k": K, "hidden": H,
                           "intermediate": I, "tokens": T, "routing": tag,
                           "rows_per_expert": T * K / E, "max_rows_expert": int(counts.max()),
                           "empty_experts": int((counts == 0).sum()),
                           "fwd_ms": fwd, "fwdbwd_ms": fwdbwd,
                           "fwd_TFLOPs": H_.tflops(flops, fwd) if fwd else None,
                           "fwdbwd_TFLOPs": H_.tflops(3 * flops, fwdbwd) if fwdbwd else None,
                           "peak_gb": peak, "relerr_vs_fp32": err, "config": desc, "error": error}
                    row["fwd_frac_ceiling"] = row["fwd_TFLOPs"] / H_.MATMUL_CEILING_TFLOPS if fwd else None
                    row["fwdbwd_frac_ceiling"] = row["fwdbwd_TFLOPs"] / H_.MATMUL_CEILING_TFLOPS if fwdbwd else None
                    anchor = ANCHOR_FWDBWD.get((E, T), {})
                    row["anchor_grouped_mm_fwdbwd"] = anchor.get("grouped_mm")
                    row["anchor_liger_fwdbwd"] = anchor.get("liger")
                    row["first_call_s"] = t_first   # compile (and a peer's autotune) included
                    rows.append(row)
                    print(f"  E{E} T{T} {tag} {name}: fwd+bwd {fwdbwd} ms (first call {t_first} s)", flush=True)
                if on_point is not None:
                    on_point(rows)
                del case, ref
                torch.cuda.empty_cache()
    return rows


def summarize(rows) -> list[str]:
    """The issue's targets, point by point; returns the TARGET MISSED lines."""
    points = {}
    for r in rows:
        if r["fwdbwd_ms"]:
            points.setdefault((r["experts"], r["tokens"], r["routing"]), {})[r["impl"]] = r
    misses, wins, total = [], 0, 0
    print("\nper point (fwd+bwd): fused triton vs the better peer, dispatched vs the fastest arm")
    for (E, T, tag), by in sorted(points.items()):
        peers = [by[p]["fwdbwd_ms"] for p in PEERS if p in by]
        fastest = min(r["fwdbwd_ms"] for r in by.values())
        tri = by.get("triton")
        line = f"  E{E} T{T:<6} {tag:<8}"
        if tri and peers:
            sp = min(peers) / tri["fwdbwd_ms"]
            total += 1
            wins += sp >= 1.15
            line += f" triton {tri['fwdbwd_TFLOPs']:6.1f} TFLOP/s, {sp:5.2f}x the better peer"
            if T == 16384 and tri["fwdbwd_TFLOPs"] < 450:
                misses.append(f"E{E} T{T} {tag}: fused fwd+bwd {tri['fwdbwd_TFLOPs']:.0f} TFLOP/s < 450")
        if "liger_rt" in by:
            ratio = by["liger_rt"]["fwdbwd_ms"] / fastest
            line += f"; dispatched {ratio:5.3f}x the fastest ({by['liger_rt']['config'].split(' ')[0]})"
            if ratio > 1.03:
                best = min(by.values(), key=lambda r: r["fwdbwd_ms"])["impl"]
                misses.append(f"E{E} T{T} {tag}: dispatched {ratio:.3f}x the fastest ({best})")
        print(line)
    if total:
        print(f"fused >= 1.15x the better peer at {wins}/{total} points (target: at least half)")
        if wins * 2 < total:
            misses.append(f"fused beats the better peer by >= 15% at only {wins}/{total} points")
    return misses


def crossovers(rows, arch_name: str) -> list[dict]:
    """Measured triton/grouped_mm crossover per static shape (uniform routing), export format."""
    from liger_rt import dispatch
    from liger_rt.kernels import moe_experts as M
    by_static: dict = {}
    for r in rows:
        if r["routing"] != "uniform" or r["impl"] not in ("triton", "grouped_mm") or not r["fwdbwd_ms"]:
            continue
        key = (r["experts"], r["top_k"], r["hidden"], r["intermediate"])
        by_static.setdefault(key, {}).setdefault(r["rows_per_expert"], {})[r["impl"]] = r["fwdbwd_ms"]
    out = []
    for (E, K, H, I), pts in sorted(by_static.items()):
        pts = {a: t for a, t in pts.items() if len(t) == 2}
        if len(pts) < 2:
            continue
        seg = dispatch.derive_crossover(sorted(pts.items()), margin=0.05)
        out.append({"table": "crossover", "op": "moe_experts", "variant": "fwdbwd", "arch": arch_name,
                    "dtype": "bf16", "static_key": M.OP.static_key(dict(experts=E, top_k=K, hidden=H, intermediate=I)),
                    "axis_name": "rows_per_expert", "segments": json.dumps(seg), "margin": 0.05,
                    "origin": "sweep", "source_hash": M.OP.source_hash, "created": time.time()})
        print(f"crossover E{E} K{K} H{H} I{I}: {seg}  (points {sorted(pts.items())})")
    return out


# -- --tune ------------------------------------------------------------------------------------------

def tune(H_, statics, tokens):
    """Each candidate config fwd+bwd per shape; then each GEMM family over the union of the
    candidates' choices for it, timed kernel by kernel, and the assembled best."""
    from liger_rt import backend
    from liger_rt.kernels import moe_experts as M
    arch = backend.detect()
    impl = M.OP.impl("triton")
    out = []

    def timed(fn):
        try:
            return H_.bench_ms(fn, warmup=5, rep=25)
        except Exception as exc:   # out of resources, compile errors: skip the config
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"

    for (E, K, H, I) in statics:
        for T in tokens:
            dims = _dims(T, E, K, H, I)
            case = M._make_case(dims, torch.bfloat16, DEVICE, tag="uniform")
            x, gu, dn, idx, w, dy = (case[k] for k in ("x", "gate_up", "down", "idx", "w", "dy"))
            leaves = (x, gu, dn, w)
            cands = M.OP.candidates(impl, arch, dims, torch.bfloat16)
            flops3 = 3 * fwd_flops(T, E, K, H, I)
            shape = f"E{E} K{K} H{H} I{I} T{T}"
            base = M.MoEExpertsFunction.apply(x, gu, dn, idx, w, M._heuristic(arch, dims, torch.bfloat16)).detach()
            res = []
            for cfg in cands:
                def fb(cfg=cfg):
                    torch.autograd.grad(M.MoEExpertsFunction.apply(x, gu, dn, idx, w, cfg), leaves, dy)
                try:
                    err = _rel(M.MoEExpertsFunction.apply(x, gu, dn, idx, w, cfg), base)
                except Exception as exc:
                    err = None
                ms = timed(fb)
                if isinstance(ms, float) and (err is None or err > 2e-2):
                    ms = f"wrong result (rel err {err})"
                res.append((ms, cfg))
                out.append({"op": "moe_experts", "half": "fwdbwd", "shape": shape, "family": "all",
                            "config": json.dumps(cfg, sort_keys=True), "ms": ms if isinstance(ms, float) else None,
                            "error": "" if isinstance(ms, float) else ms})
            ok = sorted((r for r in res if isinstance(r[0], float)), key=lambda r: r[0])
            print(f"\nmoe_experts {shape} fwd+bwd: {len(ok)}/{len(res)} candidates ran")
            for ms, cfg in ok:
                print(f"  {ms:8.4f} ms {H_.tflops(flops3, ms):6.1f} TFLOP/s  {json.dumps(cfg, sort_keys=True)}")
            # each family alone: launch only its kernels on buffers prepared once
            S = T * K
            route = M._Routing(idx, E)
            wf = w.detach().reshape(-1).contiguous()
            xd, gud, dnd, dyd = x.detach(), gu.detach(), dn.detach(), dy
            h = torch.empty(S, I, device=DEVICE, dtype=torch.bfloat16)
            g2 = torch.empty(S, 2 * I, device=DEVICE, dtype=torch.bfloat16)
            M.launch_up_fwd(xd, gud, route, M._heuristic(arch, dims, torch.bfloat16)["up"], h, g2)
            dgu = torch.randn(S, 2 * I, device=DEVICE, dtype=torch.bfloat16) * 0.1
            slot = torch.empty(S, H, device=DEVICE, dtype=torch.bfloat16)
            dwp = torch.empty(S, I, device=DEVICE, dtype=torch.float32)
            hw = torch.empty_like(h)
            d1, d2 = torch.empty_like(gud), torch.empty_like(dnd)
            launch = {
                "up": lambda c: M.launch_up_fwd(xd, gud, route, c, h, g2),
                "up_bwd": lambda c: M.launch_up_bwd(dyd, dnd, g2, h, wf, route, c, dgu, dwp, hw),
                "down": lambda c: (M.launch_down(h, dnd, (H * I, 1, I), slot, wf, route, c),
                                   M.launch_down(dgu, gud, (2 * I * H, H, 1), slot, None, route, c)),
                "wgrad": lambda c: (M.launch_wgrad(dgu, xd, d1, route, c, a_gather=False, b_gather=True),
                                    M.launch_wgrad(dyd, hw, d2, route, c, a_gather=True, b_gather=False)),
            }
            best = {}
            for fam, fn in launch.items():
                space = []
                for c in cands:
                    if c[fam] not in space:
                        space.append(c[fam])
                times = [(timed(lambda c=c: fn(c)), c) for c in space]
                for ms, c in times:
                    out.append({"op": "moe_experts", "half": fam, "shape": shape, "family": fam,
                                "config": json.dumps(c, sort_keys=True), "ms": ms if isinstance(ms, float) else None,
                                "error": "" if isinstance(ms, float) else ms})
                good = sorted((t for t in times if isinstance(t[0], float)), key=lambda t: t[0])
                if good:
                    best[fam] = good[0][1]
                    print(f"  {fam:<7} best {good[0][0]:.4f} ms {good[0][1]}  (of {len(times)}; worst "
                          f"{good[-1][0]:.4f} ms)")
            if len(best) == 4:
                combo = M._combo(best["up"], best["up_bwd"], best["down"], best["wgrad"])

                def fbc():
                    torch.autograd.grad(M.MoEExpertsFunction.apply(x, gu, dn, idx, w, combo), leaves, dy)
                ms = timed(fbc)
                if isinstance(ms, float):
                    print(f"  assembled per-family best: {ms:.4f} ms {H_.tflops(flops3, ms):6.1f} TFLOP/s  "
                          f"{json.dumps(combo, sort_keys=True)}")
                    out.append({"op": "moe_experts", "half": "fwdbwd", "shape": shape, "family": "assembled",
                                "config": json.dumps(combo, sort_keys=True), "ms": ms, "error": ""})
            print(f"  heuristic {json.dumps(M._heuristic(arch, dims, torch.bfloat16), sort_keys=True)}")
            del case, route, h, g2, dgu, slot, dwp, hw, d1, d2
            torch.cuda.empty_cache()
    return out


def _load_rows(path: Path) -> list[dict]:
    """Rows of an earlier run's CSV with numbers as numbers (empty cells as None)."""
    import csv
    if not path.exists():
        return []
    out = []
    for r in csv.DictReader(path.open()):
        row = {}
        for k, v in r.items():
            if v == "":
                row[k] = None
                continue
            try:
                row[k] = int(v)
            except ValueError:
                try:
                    row[k] = float(v)
                except ValueError:
                    row[k] = v
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T {512, 4096}, uniform routing only, no memory pass")
    ap.add_argument("--tune", action="store_true",
                    help="time every candidate config of the fused path per shape (and each GEMM family), "
                         "print the best")
    ap.add_argument("--experts", type=int, choices=[s[0] for s in STATICS], action="append",
                    help="only this static shape (E32: 8B, E64: 24B); repeatable")
    ap.add_argument("--tokens", type=int, action="append", help="only these token counts (repeatable)")
    ap.add_argument("--routing", choices=TAGS, action="append", help="only this routing (repeatable)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_experts: no CUDA/ROCm device here; run it on the GPU (the H200): "
              "python benchmarks/bench_moe_experts.py [--quick|--tune]")
        return 0
    import _harness as H_
    from liger_rt import backend
    statics = [s for s in STATICS if not args.experts or s[0] in args.experts]
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    tags = args.routing or (TAGS[:1] if args.quick else TAGS)
    csv_name = "moe_experts_h200.csv"
    # a run over part of the grid replaces those points in the CSV and keeps the others
    kept = [] if not (args.experts or args.tokens or args.routing) else [
        r for r in _load_rows(H_.RESULTS / csv_name)
        if not (r["experts"] in [s[0] for s in statics] and r["tokens"] in tokens and r["routing"] in tags)]
    arch = backend.detect()
    print(f"bench_moe_experts on {torch.cuda.get_device_name()} ({arch.name}; {H_.versions()})")
    t0 = time.time()
    if args.tune:
        rows = tune(H_, statics, tokens)
        print(f"\nwrote {H_.write_csv('moe_experts_tune_h200.csv', rows)} ({time.time() - t0:.0f} s)")
        return 0
    rows = kept + bench(H_, statics, tokens, tags, with_memory=not args.quick,
                        on_point=lambda new: H_.write_csv(csv_name, kept + new))
    cols = ["impl", "experts", "tokens", "routing", "fwd_ms", "fwd_TFLOPs", "fwdbwd_ms", "fwdbwd_TFLOPs",
            "fwdbwd_frac_ceiling", "peak_gb", "relerr_vs_fp32"]
    H_.print_table(rows, cols)
    print("\nconfigs:")
    for r in rows:
        if r["impl"] in ("triton", "liger_rt"):
            print(f"  E{r['experts']} T{r['tokens']} {r['routing']} {r['impl']}: {r['config']}")
    misses = summarize(rows)
    cross = crossovers(rows, arch.name)
    if cross:
        text = "".join(json.dumps(c, sort_keys=True) + "\n" for c in cross)
        name = f"moe_experts_{arch.name}_crossover.jsonl"
        path = H_.RESULTS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / name).write_text(text)
        print(f"wrote {path} (ship as liger_rt/tuning_db/defaults/{arch.name}.jsonl lines, or `liger-tune import`)")
    for m in misses:
        print(f"TARGET MISSED: {m}")
    print(f"\nwrote {H_.write_csv(csv_name, rows)} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
