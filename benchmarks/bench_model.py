"""Model training-step benchmark on the H200: the issue's three target runs.

    python benchmarks/bench_model.py [--which qwen3|lfm2|lfm2moe|all] [--quick]
                                     [--plot benchmarks/results/model_h200.png]

One SFT step (bf16 weights, fused AdamW, sdpa, random tokens, labels = input_ids, batch 4 x seq
2048), baseline vs liger_rt.patch (family defaults + fused_linear_cross_entropy) vs Liger-Kernel
(where it supports the model), counterbalanced baseline/liger_rt/[liger_kernel x2]/liger_rt/baseline,
20 measured steps after 5 warm-up steps per run (--quick: 8 after 3). Writes
benchmarks/results/model_h200.csv (--quick: model_h200_quick.csv); a partial --which replaces only
its own models' rows in an existing file.

Targets (shared/anchors/h200-anchor*.json baselines, one H200):
  qwen3-1.7b         baseline 29.2k tok/s 51.3 GB, Liger-Kernel 34.6k 31.1 GB -> >= 38k tok/s, <= 31 GB
  lfm2-1.2b          baseline 50.5k tok/s 29.8 GB                               -> >= 63k tok/s, <= 22 GB
  lfm2-8b-a1b (8L)   baseline 67.8k tok/s 30.6 GB (grouped_mm experts)          -> >= 78k tok/s, <= 26 GB
`qwen3rope` repeats qwen3-1.7b with rope=True (liger_rt.ops.rope in place of HF's
apply_rotary_pos_emb: the opt-in Liger-Kernel's patch always makes), without a Liger-Kernel arm.
The qwen3 run ties the embeddings (tie_word_embeddings=True), as Qwen3-1.7B and the anchor do.
Expected wall time on an H200: 'all' about 3-4 min (--quick about 2 min), most of it model builds.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
import traceback
from pathlib import Path

try:
    import liger_rt  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, write_csv  # noqa: E402

from liger_rt.tools.bench import (format_model_summary, format_table, measure_ceilings,  # noqa: E402
                                  plot_model_rows, run_model_bench)

TARGETS = {
    "qwen3": dict(model_type="qwen3", preset="qwen3-1.7b", config={"tie_word_embeddings": True},
                  anchor_tok_per_s=29192.0, anchor_peak_GB=51.34, liger_kernel_tok_per_s=34579.0,
                  liger_kernel_peak_GB=31.10, target_tok_per_s=38000.0, target_peak_GB=31.0),
    "lfm2": dict(model_type="lfm2", preset="lfm2-1.2b",
                 anchor_tok_per_s=50461.0, anchor_peak_GB=29.84, target_tok_per_s=63000.0, target_peak_GB=22.0),
    # qwen3 again with rope=True (liger_rt.ops.rope swapped in for HF's apply_rotary_pos_emb), the
    # opt-in Liger-Kernel's own patch always makes; its Liger-Kernel arm is the qwen3 run's
    "qwen3rope": dict(model_type="qwen3", preset="qwen3-1.7b", config={"tie_word_embeddings": True},
                      flags={"rope": True}, liger_kernel=False,
                      anchor_tok_per_s=29192.0, anchor_peak_GB=51.34, liger_kernel_tok_per_s=34579.0,
                      liger_kernel_peak_GB=31.10, target_tok_per_s=38000.0, target_peak_GB=31.0),
    # Lfm2Moe defaults cut to 8 layers with attention at 2 and 5 (h200-anchor2.json notes)
    "lfm2moe": dict(model_type="lfm2_moe", preset="lfm2-8b-a1b", layers=8, attention_layers=(2, 5),
                    experts_implementation="grouped_mm",
                    anchor_tok_per_s=67832.0, anchor_peak_GB=30.55, target_tok_per_s=78000.0, target_peak_GB=26.0),
}
RUN_KEYS = ("model_type", "preset", "layers", "attention_layers", "experts_implementation", "config", "flags",
            "liger_kernel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", choices=[*TARGETS, "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="8 measured steps after 3 warm-up steps per run")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--no-liger-kernel", action="store_true", help="skip Liger-Kernel's arm")
    ap.add_argument("--plot", default=None, help="PNG of loss curves and throughput (needs matplotlib)")
    ap.add_argument("--smoke", action="store_true",
                    help="plumbing check anywhere (CPU too): the families' tiny presets, batch 2 x seq 32, "
                         "2 steps; prints, writes no CSV")
    args = ap.parse_args()
    if args.plot:                 # fail now, not after the run
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("--plot needs matplotlib: pip install matplotlib (or leave --plot out)")
    if args.smoke:
        return smoke(args)
    steps = args.steps or (8 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    names = list(TARGETS) if args.which == "all" else [args.which]

    t0 = time.time()
    ceilings = measure_ceilings("cuda", quick=True)
    print(f"ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    rows, verdicts, failed = [], [], []
    for name in names:
        t = TARGETS[name]
        kw = {k: t[k] for k in RUN_KEYS if k in t and k not in ("model_type", "liger_kernel")}
        t1 = time.time()
        try:
            got = run_model_bench(t["model_type"], batch=args.batch, seq=args.seq, steps=steps, warmup=warmup,
                                  dtype="bf16", liger_kernel=t.get("liger_kernel", True) and not args.no_liger_kernel,
                                  device="cuda",
                                  ceilings=ceilings, echo=lambda s: print(s, flush=True), **kw)
        except Exception:  # one model failing must not hide the others' numbers
            traceback.print_exc()
            failed.append(name)
            continue
        ref = {k: v for k, v in t.items() if k not in RUN_KEYS}
        for r in got:
            r["target"] = name
            r.update(ref)
            if r["kind"] == "summary" and r["arm"] == "liger_rt":
                r["meets_tok_target"] = r["tok_per_s"] >= t["target_tok_per_s"]
                r["meets_mem_target"] = r["peak_alloc_GB"] is not None and r["peak_alloc_GB"] <= t["target_peak_GB"]
        rows += got
        for r in got:
            if r["kind"] == "summary":
                verdicts.append({"target": name, "arm": r["arm"], "tok_per_s": r["tok_per_s"],
                                 "anchor_tok_per_s": t["anchor_tok_per_s"] if r["arm"] == "baseline" else
                                 t.get("liger_kernel_tok_per_s") if r["arm"] == "liger_kernel" else None,
                                 "target_tok_per_s": t["target_tok_per_s"] if r["arm"] == "liger_rt" else None,
                                 "peak_GB": r["peak_alloc_GB"],
                                 "anchor_GB": t["anchor_peak_GB"] if r["arm"] == "baseline" else
                                 t.get("liger_kernel_peak_GB") if r["arm"] == "liger_kernel" else None,
                                 "target_GB": t["target_peak_GB"] if r["arm"] == "liger_rt" else None,
                                 "meets": (r.get("meets_tok_target") and r.get("meets_mem_target"))
                                 if r["arm"] == "liger_rt" else None})
        print(f"{name}: {time.time() - t1:.0f} s\n", flush=True)

    name = "model_h200_quick.csv" if args.quick else "model_h200.csv"
    old = RESULTS / name
    if args.which != "all" and old.exists():        # keep the other models' rows of an earlier run
        with old.open(newline="") as fh:
            kept = [r for r in csv.DictReader(fh) if r.get("target") not in names]
        rows = kept + rows
    path = write_csv(name, rows) if rows else "(nothing written: no rows)"
    print(format_model_summary([r for r in rows if r.get("target") in names]))
    print()
    print(format_table(verdicts, ["target", "arm", "tok_per_s", "anchor_tok_per_s", "target_tok_per_s", "peak_GB",
                                  "anchor_GB", "target_GB", "meets"]))
    print(f"\nwrote {path} ({time.time() - t0:.0f} s in all)")
    if args.plot:
        print(f"wrote {plot_model_rows([r for r in rows if r.get('target') in names], args.plot)}")
    if failed:
        sys.exit(f"FAILED: {', '.join(failed)} (tracebacks above)")


def smoke(args) -> None:
    from liger_rt.tools.presets import TINY_FOR_MODEL
    rows = []
    for name in (list(TARGETS) if args.which == "all" else [args.which]):
        t = TARGETS[name]
        rows += run_model_bench(t["model_type"], TINY_FOR_MODEL[t["model_type"]], batch=2, seq=32, steps=2, warmup=1,
                                dtype="fp32", liger_kernel=t.get("liger_kernel", True) and not args.no_liger_kernel,
                                device="auto", flags=t.get("flags"),
                                config=t.get("config"), experts_implementation=t.get("experts_implementation"),
                                echo=lambda s: print(s, flush=True))
    print(format_model_summary(rows))
    if args.plot:
        print(f"wrote {plot_model_rows(rows, args.plot)}")


if __name__ == "__main__":
    main()
