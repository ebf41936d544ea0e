"""SFT training steps of the repository's model runs: baseline against liger_rt.patch, Liger-Kernel's patch and (with
--compile) torch.compile, counterbalanced (`liger-tune bench model`, liger_rt/tools/bench/model.py).

    python benchmarks/bench_models.py                          # the default runs at B4 x T2048
    python benchmarks/bench_models.py --run qwen3,lfm2moe --compile --shape 4x2048,1x512
    python benchmarks/bench_models.py --run families           # gemma3, mistral, mixtral, qwen2 (rope patched)
    python benchmarks/bench_models.py --max-seq --run qwen3 --arms baseline,liger_rt   # longest trainable sequence
    python benchmarks/bench_models.py --run qwen3 --fused-add-norm   # + the residual add fused into the norm
    python benchmarks/bench_models.py --run qwen3rope --recompute-swiglu   # + LIGER_RT_RECOMPUTE_SWIGLU=1

Appends one row per arm and metric to benchmarks/data/models.csv after every run (kind `model`, or `model_compiled`
where a compiled arm ran; `--data DIR`: that folder instead; `--no-data`: nowhere).  A run's batch is halved until
its measured peak fits the card (the H200 figures below; an H100 80GB runs lfm2-8b-a1b at batch 2).  With
`--max-seq` (its own options: `--max-seq --help`), each arm's longest trainable sequence at batch 1 and its tok/s
there (`liger-tune bench model --max-seq`), kind `max_seq`, appended after each arm.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from liger_rt.tools.bench import harness as H, model as M

# name -> bench_model arguments, and `peak_gb`: the largest arm's peak allocated memory at that batch x 2048 on an
# H200, bf16 (what the batch is fitted by).  rope: ops.rope in place of transformers' apply_rotary_pos_emb, as
# Liger-Kernel's patch always does (so qwen3rope leaves its Liger-Kernel arm to qwen3).
RUNS = {
    "qwen3": dict(model_type="qwen3", preset="qwen3-1.7b", config={"tie_word_embeddings": True}, peak_gb=51.3),
    "qwen3rope": dict(model_type="qwen3", preset="qwen3-1.7b", config={"tie_word_embeddings": True},
                      flags={"rope": True}, liger_kernel=False, peak_gb=51.3),
    "lfm2": dict(model_type="lfm2", preset="lfm2-1.2b", peak_gb=29.8),
    "lfm2rope": dict(model_type="lfm2", preset="lfm2-1.2b", flags={"rope": True}, peak_gb=29.8),
    "lfm2moe": dict(model_type="lfm2_moe", preset="lfm2-8b-a1b", layers=8, attention_layers=(2, 5), peak_gb=30.6),
    "lfm2moerope": dict(model_type="lfm2_moe", preset="lfm2-8b-a1b", layers=8, attention_layers=(2, 5),
                        flags={"rope": True}, peak_gb=30.6),
    "gemma3": dict(model_type="gemma3_text", preset="gemma3-4b", batch=2, flags={"rope": True}, peak_gb=66.7),
    "mistral": dict(model_type="mistral", preset="mistral-7b-16L", flags={"rope": True}, peak_gb=52.4),
    # Liger-Kernel's fused MoE autotunes on its first call (past 4 minutes at this shape): its arm is left out
    "mixtral": dict(model_type="mixtral", preset="mixtral-8x7b-2L", flags={"rope": True}, liger_kernel=False,
                    peak_gb=28.2),
    "qwen2": dict(model_type="qwen2", preset="qwen2.5-7b-14L", batch=2, flags={"rope": True}, peak_gb=46.8),
    "lfm2-a1b": dict(model_type="lfm2_moe", preset="lfm2-8b-a1b", peak_gb=85.2),
}
GROUPS = {"default": ["qwen3", "qwen3rope", "lfm2", "lfm2rope", "lfm2moe", "lfm2moerope"],
          "families": ["gemma3", "mistral", "mixtral", "qwen2"], "all": list(RUNS)}


def run_names(texts: list[str]) -> list[str]:
    names = [n.strip() for t in texts for n in t.split(",") if n.strip()] or ["default"]
    out = [r for n in names for r in GROUPS.get(n, [n])]
    bad = [n for n in out if n not in RUNS]
    if bad:
        raise SystemExit(f"bench_models.py: unknown run {bad[0]!r}; valid: {', '.join([*RUNS, *GROUPS])}")
    return list(dict.fromkeys(out))


def run_setup(name: str) -> tuple:
    """A run as the profile scripts build it: (preset, liger_rt.patch flags, config overrides)."""
    r = RUNS[name]
    return (M.bench_preset(r["model_type"], r["preset"], r.get("layers"), r.get("attention_layers")),
            {"fused_linear_cross_entropy": True, **r.get("flags", {})},
            M.config_overrides(r["model_type"], r.get("config")))


def bench_spec(name: str) -> dict:
    """A run's `run_model_bench` arguments (its batch and peak are the caller's to fit)."""
    return {k: v for k, v in RUNS[name].items() if k not in ("batch", "peak_gb")}


def fitted_batch(name: str, batch: int, card_gb: float) -> int:
    """`batch` halved while the run's peak, scaled by the batch, exceeds 90% of the card's memory."""
    run = RUNS[name]
    while batch > 1 and run["peak_gb"] * batch / run.get("batch", 4) > 0.9 * card_gb:
        batch //= 2
    return batch


def main() -> int:
    if "--max-seq" in sys.argv[1:]:
        return max_seq_main([a for a in sys.argv[1:] if a != "--max-seq"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run", action="append", default=[], help=f"runs or groups, comma-separated: "
                    f"{', '.join(RUNS)}; {', '.join(f'{g} ({len(v)})' for g, v in GROUPS.items())} [default]")
    ap.add_argument("--shape", action="append", default=[], help="BATCHxSEQ, repeatable or comma-separated "
                    "(default: each run's batch x 2048)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run [20; --quick 8]")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per run [5; --quick 3]")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--compile", action="store_true", help="also baseline+compile and liger_rt+compile")
    ap.add_argument("--compile-mode", default="default", choices=M.COMPILE_MODES)
    ap.add_argument("--arms", default=None, help=f"only these arms, baseline among them: {', '.join(M.ARMS)}")
    ap.add_argument("--no-liger-kernel", action="store_true", help="leave Liger-Kernel's arm out")
    ap.add_argument("--fused-add-norm", action="store_true", help="liger_rt's arms also fuse the decoder layers' "
                    "residual add into the post-attention norm (patch flag fused_add_norm; rows named <preset>"
                    "+fused_add_norm)")
    ap.add_argument("--recompute-swiglu", action="store_true", help="LIGER_RT_RECOMPUTE_SWIGLU=1 for the whole run "
                    "(liger_rt's SwiGLU MLPs recompute the product in the backward; the other arms run no liger_rt "
                    "MLP; rows named <preset>+recompute_swiglu)")
    ap.add_argument("--csv", default=None, help="also write every row to this CSV")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent / "data"), help="dataset folder")
    ap.add_argument("--no-data", action="store_true", help="append to no dataset")
    ap.add_argument("--max-seq", action="store_true", help="each arm's longest trainable sequence instead "
                    "(options: --max-seq --help)")
    a = ap.parse_args()
    names = run_names(a.run)
    try:
        shapes = M.parse_shapes(a.shape)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit(H.no_gpu_message("bench_models.py"))
    steps, warmup = a.steps or (8 if a.quick else 20), (3 if a.quick else 5) if a.warmup is None else a.warmup
    arms = tuple(x.strip() for x in a.arms.split(",") if x.strip()) if a.arms else None
    card_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    if a.recompute_swiglu:
        os.environ["LIGER_RT_RECOMPUTE_SWIGLU"] = "1"
    run_id, ceilings, rows, failed = H.new_run_id(), H.measure_ceilings(quick=True), [], []
    for name in names:
        spec = bench_spec(name)
        spec["liger_kernel"] = spec.get("liger_kernel", True) and not a.no_liger_kernel
        if a.fused_add_norm:
            spec["flags"] = {**spec.get("flags", {}), "fused_add_norm": True}
        for batch, seq in shapes or [(RUNS[name].get("batch", 4), 2048)]:
            fit = fitted_batch(name, batch, card_gb)
            label = f"{name}@{fit}x{seq}"
            if fit != batch:
                print(f"{label}: batch {batch} -> {fit} to fit {card_gb:.0f} GB", flush=True)
            try:
                got = M.run_model_bench(**spec, batch=fit, seq=seq, steps=steps, warmup=warmup, dtype="bf16",
                                        device="cuda", ceilings=ceilings, compile=a.compile,
                                        compile_mode=a.compile_mode, arms=arms)
            except Exception as exc:        # one model failing must not hide the others' numbers
                print(f"{label}: FAILED: {H.error_line(exc, 300)}", flush=True)
                failed.append(label)
                continue
            rows += [{"run": label, **r} for r in got]
            if not a.no_data:
                records = tagged(M.model_records(got), "+recompute_swiglu" if a.recompute_swiglu else "")
                path = H.append_dataset(Path(a.data) / "models.csv", H.dataset_rows(records, run_id))
                print(f"appended to {path}", flush=True)
            if a.csv:
                H.write_csv(rows, a.csv)
    for label in dict.fromkeys(r["run"] for r in rows):     # qwen3 and qwen3rope share a preset: one table each
        print(f"\n== {label}\n" + M.format_summary([r for r in rows if r["run"] == label]))
    if failed:
        print(f"failed: {', '.join(failed)} (errors above)")
    return 1 if failed else 0


def tagged(records: list[dict], suffix: str) -> list[dict]:
    """Dataset records with `suffix` added to their names (a run's setting that is no patch flag)."""
    return [{**r, "name": r["name"] + suffix} for r in records]


# --max-seq: the models of the longest-sequence table (cut to leave room for activations where the full model's
# weights, gradients and AdamW state would take most of an 80 GB card)
MAX_SEQ_RUNS = {
    "qwen3": dict(model_type="qwen3", preset="qwen3-1.7b"),
    "qwen3-8b": dict(model_type="qwen3", preset="qwen3-8b-18L"),
    "lfm2": dict(model_type="lfm2", preset="lfm2-1.2b"),
    "gemma3": dict(model_type="gemma3_text", preset="gemma3-4b"),
}


def max_seq_main(argv: list[str]) -> int:
    """`--max-seq`: per run and arm, the longest sequence a training step fits at (max_seq.run_max_seq)."""
    from liger_rt.tools.bench import max_seq as S
    ap = argparse.ArgumentParser(prog="bench_models.py --max-seq", description=max_seq_main.__doc__)
    ap.add_argument("--run", action="append", default=[], help=f"runs, comma-separated: {', '.join(MAX_SEQ_RUNS)}, "
                    "all [default: all]")
    ap.add_argument("--arms", default=None, help=f"comma-separated, of {', '.join(S.ARMS)} "
                    f"[default: {','.join(S.DEFAULT_ARMS)}]")
    ap.add_argument("--start", type=int, default=4096, help="first length probed [4096]")
    ap.add_argument("--max", type=int, default=1 << 20, help="longest length probed [1048576]")
    ap.add_argument("--granularity", type=int, default=None, help="bisect to this many tokens [1/16 of the bracket, "
                    f">= {S.MIN_GRANULARITY}]")
    ap.add_argument("--limit-gib", type=float, default=None, help="cap each probe's GPU memory (a smaller card)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per arm")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each probe in a fresh process [default: on]")
    ap.add_argument("--steps", type=int, default=1, help="full steps per probe [1]")
    ap.add_argument("--flags", default=None, help="liger_rt.patch flags over fused_linear_cross_entropy=1,rope=1")
    ap.add_argument("--no-liger-kernel", action="store_true", help="leave the Liger-Kernel arms out")
    ap.add_argument("--csv", default=None, help="also write every arm's row to this CSV")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent / "data"), help="dataset folder")
    ap.add_argument("--no-data", action="store_true", help="append to no dataset")
    a = ap.parse_args(argv)
    names = [n.strip() for t in a.run for n in t.split(",") if n.strip()] or ["all"]
    names = list(dict.fromkeys(r for n in names for r in (MAX_SEQ_RUNS if n == "all" else [n])))
    bad = [n for n in names if n not in MAX_SEQ_RUNS]
    if bad:
        ap.error(f"unknown run {bad[0]!r}; valid: {', '.join(MAX_SEQ_RUNS)}, all")
    try:
        S.parse_arms(a.arms)
        flags = M.parse_flags(a.flags)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit(H.no_gpu_message("bench_models.py --max-seq"))
    run_id, rows, failed = H.new_run_id(), [], []

    def save(row: dict) -> None:
        rows.append(row)
        if not a.no_data:
            path = H.append_dataset(Path(a.data) / "models.csv",
                                    H.dataset_rows(S.max_seq_records([row]), run_id, gpu=row["gpu"]))
            print(f"appended to {path}", flush=True)
        if a.csv:
            H.write_csv(rows, a.csv)
    for name in names:
        try:
            S.run_max_seq(**MAX_SEQ_RUNS[name], arms=a.arms, start=a.start, max_seq=a.max, granularity=a.granularity,
                          limit_gib=a.limit_gib, time_limit=a.time_limit, isolate=a.isolate, steps=a.steps,
                          flags=flags, liger_kernel=not a.no_liger_kernel, device="cuda", on_arm=save)
        except Exception as exc:        # one model failing must not hide the others' numbers
            print(f"{name}: FAILED: {H.error_line(exc, 300)}", flush=True)
            failed.append(name)
    for preset in dict.fromkeys(r["preset"] for r in rows):
        print(f"\n== {preset}\n" + S.format_max_seq([r for r in rows if r["preset"] == preset]))
    failed += [f"{r['preset']} {r['arm']}" for r in rows if r["error"]]
    if failed:
        print(f"failed: {', '.join(failed)} (errors above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
