"""One SFT training step: baseline against liger_rt.patch (and Liger-Kernel's patch), counterbalanced.

Order: baseline, liger_rt, [liger_kernel, liger_kernel,] liger_rt, baseline.  Each run builds a
fresh model from the same seed (random weights, no hub download), runs warm-up + measured steps
on the same random batch (labels = input_ids, AdamW, sdpa), and records the median of the
synchronized step times, tokens/s = batch*seq/median, the peak allocated memory of the measured
steps (reset after warm-up: weights, grads and optimizer state included) and every step's loss,
so the loss curves of all runs must overlap.  An arm's tokens/s is the mean over its runs.  Model
TFLOP/s is an estimate (6 * active matmul params * tokens + causal attention); mfu is its
fraction of the bf16 matmul ceiling measured in the same process.  LFM2-VL runs text-only (the
vision tower idles); MoE families use transformers' grouped_mm experts in every arm unless told
otherwise.  `TARGETS` are issue 9's model runs (`liger-tune bench model --target all`).

    from liger_rt.tools.bench.model import run_model_bench
    rows = run_model_bench("qwen3", "tiny", batch=2, seq=16, steps=3, warmup=1, device="cpu")
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from .harness import fmt, format_table, measure_ceilings

ARMS = ("baseline", "liger_rt", "liger_kernel")
# Largest max |loss difference| / initial loss between two runs that still counts as overlapping:
# same weights and batch, only kernel rounding separates the arms (fp32 tiny models through the
# interpreter: ~2e-7; the H200 bf16 qwen3-1.7b baseline vs Liger-Kernel: 4e-5 after 13 steps); a
# wrong gradient moves a curve by percents.
LOSS_RTOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 1e-2}
# Issue 9's runs: anchors are the baseline / Liger-Kernel figures of the anchor runs (one H200),
# targets what liger_rt must reach (tokens/s, peak GB).  qwen3rope: rope=True, ops.rope in place
# of HF's apply_rotary_pos_emb (Liger-Kernel's patch always swaps it); lfm2moe: 8 layers, attention at 2, 5.
_QWEN3 = dict(model_type="qwen3", preset="qwen3-1.7b", config={"tie_word_embeddings": True},
              anchor_tok_per_s=29192.0, anchor_peak_GB=51.34, liger_kernel_tok_per_s=34579.0,
              liger_kernel_peak_GB=31.10, target_tok_per_s=38000.0, target_peak_GB=31.0)
TARGETS = {
    "qwen3": _QWEN3,
    "lfm2": dict(model_type="lfm2", preset="lfm2-1.2b", anchor_tok_per_s=50461.0, anchor_peak_GB=29.84,
                 target_tok_per_s=63000.0, target_peak_GB=22.0),
    "qwen3rope": dict(_QWEN3, flags={"rope": True}, liger_kernel=False),
    "lfm2moe": dict(model_type="lfm2_moe", preset="lfm2-8b-a1b", layers=8, attention_layers=(2, 5),
                    anchor_tok_per_s=67832.0, anchor_peak_GB=30.55, target_tok_per_s=78000.0, target_peak_GB=26.0),
}
RUN_KEYS = ("model_type", "preset", "layers", "attention_layers", "config", "flags", "liger_kernel")


def parse_flags(text: str | None) -> dict[str, bool]:
    """'rms_norm=1,fused_linear_cross_entropy=0,swiglu' -> {'rms_norm': True, ...}."""
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, _, val = part.partition("=")
        val = val.strip().lower() or "1"
        if val not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"flag {part!r}: value must be 0/1 (or true/false, yes/no, on/off)")
        out[key.strip()] = val in ("1", "true", "yes", "on")
    return out


def parse_config(text: str | None) -> dict:
    """'tie_word_embeddings=true,rope_theta=1e6' -> {'tie_word_embeddings': True, 'rope_theta': 1000000.0}."""
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, val = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{part!r}: expected key=value")
        try:
            out[key.strip()] = json.loads(val.strip())
        except json.JSONDecodeError:
            out[key.strip()] = val.strip()
    return out


def bench_preset(model_type: str, preset, layers: int | None = None, attention_layers: tuple | None = None):
    """The Preset to build (a name, `tiny`, PATH.json or a Preset), with the layer count changed."""
    from liger_rt.tools.presets import TINY_FOR_MODEL, get_preset, presets_for
    if model_type not in TINY_FOR_MODEL:
        raise ValueError(f"unknown model type {model_type!r}; valid: {', '.join(TINY_FOR_MODEL)}")
    p = get_preset(preset, model_type) if isinstance(preset, str) else preset
    if p.model_type != model_type:
        names = [q.name for q in presets_for(model_type)] + ["tiny"]
        raise ValueError(f"preset {p.name!r} is a {p.model_type} preset, not {model_type}; "
                         f"presets for {model_type}: {', '.join(names)}")
    changes = {}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1 (got {layers})")
        changes["layers"] = layers
        if p.attention_layers and attention_layers is None:
            changes["attention_layers"] = tuple(i for i in p.attention_layers if i < layers)
        if p.dense_layers > layers:
            changes["dense_layers"] = layers
    if attention_layers is not None:
        n = changes.get("layers", p.layers)
        bad = [i for i in attention_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"attention layers {bad} outside 0..{n - 1}")
        changes["attention_layers"] = tuple(attention_layers)
    if changes:
        p = dataclasses.replace(p, name=p.name + (f"-{layers}L" if layers is not None else "-custom"), **changes)
    return p


def build(preset, dtype, device, seed: int, overrides: dict):
    """A fresh model from the preset (random weights from `seed`, sdpa attention)."""
    from liger_rt.tools.models import build_model
    return build_model(preset, dtype=dtype, device=device, seed=seed, attn_implementation="sdpa", **overrides)


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def random_ids(model, batch: int, seq: int, seed: int, device: str):
    """Random tokens fixed by seed, without the model's image/video placeholder tokens."""
    vocab = int(_text_config(model).vocab_size)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    for attr in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        tid = getattr(model.config, attr, None)
        if isinstance(tid, int) and 0 <= tid < vocab:
            ids[ids == tid] = (tid + 1) % vocab
    return ids.to(device)


def train_flops_per_step(model, batch: int, seq: int) -> float:
    """6 * active matmul params * tokens + causal attention (3 * 2 * seq * heads * head_dim per token
    and attention layer).  Active: weights of >= 2 dims except the input embedding and the vision
    tower, experts scaled by top_k / experts, the LM head once even if tied."""
    tc = _text_config(model)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_w = head.weight if head is not None else None
    experts = getattr(tc, "num_experts", None) or getattr(tc, "num_local_experts", None)
    top_k = getattr(tc, "num_experts_per_tok", None)
    active, seen = 0.0, set()
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in seen or "vision" in name or "multi_modal_projector" in name:
            continue
        seen.add(id(p))
        if p is emb and p is not head_w:
            continue
        active += p.numel() * (top_k / experts if p.dim() == 3 and experts and top_k and p.shape[0] == experts else 1)
    if head_w is not None and id(head_w) not in seen:
        active += head_w.numel()
    heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    types = getattr(tc, "layer_types", None)
    n_attn = sum("attention" in str(t) for t in types) if types else int(tc.num_hidden_layers)
    return 6.0 * active * batch * seq + 6.0 * n_attn * seq * heads * head_dim * batch * seq


class LigerKernelPatch:
    """Liger-Kernel's instance patch, with the module-level changes it makes (classes and rope
    functions of the HF modeling modules, F.cross_entropy) undone after the run."""

    def __init__(self):
        self.saved: list[tuple[object, dict]] = []

    @staticmethod
    def supported(model_type: str) -> tuple[bool, str]:
        try:
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except Exception as exc:
            return False, f"liger_kernel not importable ({type(exc).__name__}: {exc}); pip install liger-kernel"
        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            return False, f"Liger-Kernel has no patch for model type {model_type!r}"
        return True, ""

    def apply(self, model) -> None:
        import torch.nn.functional as F
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
        names = {type(m).__module__ for m in model.modules()} | {type(model).__module__}
        for mod in [importlib.import_module(n) for n in sorted(names) if n.startswith("transformers.")]:
            self.saved.append((mod, dict(vars(mod))))
            self.saved += [(c, dict(vars(c))) for c in list(vars(mod).values())
                           if isinstance(c, type) and c.__module__ == mod.__name__]
        self.saved.append((F, {"cross_entropy": F.cross_entropy}))
        _apply_liger_kernel_to_instance(model=model)

    def undo(self) -> None:
        for obj, snap in reversed(self.saved):
            now = vars(obj)
            for k in [k for k in now if k not in snap and obj is not torch.nn.functional]:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(obj, k)
            for k, v in [(k, v) for k, v in snap.items() if now.get(k, snap) is not v]:   # snap: "missing"
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(obj, k, v)
        self.saved.clear()


def _run_arm(arm: str, preset, *, dtype, device, seed, overrides, flags, batch, seq, ids, steps, warmup, lr) -> dict:
    """One run: a fresh model, the arm's patch, warm-up + measured steps.  `ids` None on the
    first run (drawn from the model's vocab here and returned for the later runs)."""
    import liger_rt.patch as P
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gc.collect()
    t0 = time.perf_counter()
    model = build(preset, dtype, device, seed, overrides)
    model.train()
    undo = None
    try:
        if arm == "liger_rt":
            try:
                P.patch(model, **flags)
            except (TypeError, ValueError) as exc:      # unknown flag or model type: the patcher says which
                raise ValueError(f"liger_rt.patch(model, {flags}): {exc}") from exc
            undo = lambda: P.unpatch(model)  # noqa: E731
        elif arm == "liger_kernel":
            lk = LigerKernelPatch()
            undo = lk.undo
            lk.apply(model)
        build_s = time.perf_counter() - t0
        ids = random_ids(model, batch, seq, seed, device) if ids is None else ids
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device == "cuda")
        losses, times = [], []
        for i in range(warmup + steps):
            if i == warmup and device == "cuda":          # the peak of steady-state steps
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times += [time.perf_counter() - t] if i >= warmup else []
            losses.append(float(loss.detach()))
        med = statistics.median(times)
        return {"median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3, "max_step_ms": max(times) * 1e3,
                "tok_per_s": ids.numel() / med, "peak_alloc_GB": torch.cuda.max_memory_allocated() / 1e9
                if device == "cuda" else None, "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
                "build_s": build_s, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
                "flops_per_step": train_flops_per_step(model, batch, seq), "ids": ids}
    finally:
        if undo is not None:
            undo()
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def run_model_bench(model_type: str, preset="tiny", *, batch: int = 4, seq: int = 2048, steps: int = 20,
                    warmup: int = 5, dtype="bf16", layers: int | None = None, attention_layers: tuple | None = None,
                    liger_kernel: bool = True, flags: dict | None = None, device: str = "auto", seed: int = 0,
                    lr: float = 1e-4, experts_implementation: str | None = None, config: dict | None = None,
                    ceilings: dict | None = None, echo: Callable | None = print) -> list[dict]:
    """Rows of one model: one per run (kind="run", in run order) and one per arm (kind="summary":
    mean tokens/s, max peak, speedup and memory against baseline, loss-curve difference).
    `flags` go to liger_rt.patch on top of {fused_linear_cross_entropy: True}; `config` holds
    transformers config overrides for every arm."""
    from liger_rt.kernels._common import dtype_name, parse_dtype
    echo = echo or (lambda s: None)
    dt, device = parse_dtype(dtype), ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA/ROCm GPU is available here (use --device cpu with a tiny preset)")
    if steps < 1 or warmup < 0 or batch < 1 or seq < 2:
        raise ValueError("need steps >= 1, warmup >= 0, batch >= 1, seq >= 2")
    p = bench_preset(model_type, preset, layers, attention_layers)
    overrides = dict(config or {})
    if model_type in ("lfm2_moe", "qwen3_moe"):
        overrides["experts_implementation"] = experts_implementation or "grouped_mm"
    elif experts_implementation:
        raise ValueError(f"experts_implementation applies to MoE models, not {model_type}")
    flags = {"fused_linear_cross_entropy": True, **(flags or {})}
    _dry_patch(p, overrides, flags)      # fail before any timing when the patcher rejects flags or model
    lk_ok, lk_note = LigerKernelPatch.supported(model_type) if liger_kernel else (False, "not requested")
    order = ["baseline", "liger_rt", *(["liger_kernel"] * 2 if lk_ok else []), "liger_rt", "baseline"]
    if device == "cuda" and ceilings is None:
        ceilings = measure_ceilings(quick=True)
    echo(f"bench model {model_type} preset {p.name} ({p.layers} layers), batch {batch} x seq {seq}, {dtype_name(dt)}, "
         f"{device}, warmup {warmup} + {steps} steps, lr {lr}, order {' > '.join(order)}")
    echo(f"  liger_rt.patch flags: {flags}; config overrides (all arms): {overrides or 'none'}"
         + (f"; Liger-Kernel arm skipped: {lk_note}" if liger_kernel and not lk_ok else ""))
    runs, ids = [], None
    for n, arm in enumerate(order):
        if arm == "liger_kernel" and lk_note.startswith("failed"):
            continue
        t0 = time.time()
        try:
            res = _run_arm(arm, p, dtype=dt, device=device, seed=seed, overrides=overrides, flags=flags, batch=batch,
                           seq=seq, ids=ids, steps=steps, warmup=warmup, lr=lr)
        except Exception as exc:
            if arm != "liger_kernel":
                raise
            lk_note = f"failed: {type(exc).__name__}: {str(exc)[:300]}"   # the peer must not hide our numbers
            echo(f"  [{n + 1}/{len(order)}] liger_kernel FAILED ({lk_note}); continuing without it")
            continue
        ids = res.pop("ids")
        mem = "n/a" if res["peak_alloc_GB"] is None else f"{res['peak_alloc_GB']:.2f} GB"
        echo(f"  [{n + 1}] {arm:12s} {res['median_step_ms']:9.2f} ms/step {res['tok_per_s']:10.0f} tok/s  peak {mem}  "
             f"loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}  ({time.time() - t0:.1f} s)")
        runs.append({"arm": arm, "run_index": len(runs), **res})
    common = dict(model_type=model_type, preset=p.name, layers=p.layers, batch=batch, seq=seq, steps=steps,
                  warmup=warmup, dtype=dtype_name(dt), device=device, lr=lr, seed=seed,
                  order=">".join(r["arm"] for r in runs), flags=",".join(f"{k}={int(v)}" for k, v in flags.items()),
                  experts_implementation=overrides.get("experts_implementation", ""),
                  config=",".join(f"{k}={v}" for k, v in overrides.items()), liger_kernel_note=lk_note,
                  copy_ceiling_GBps=(ceilings or {}).get("copy_GBps"),
                  matmul_ceiling_TFLOPs=(ceilings or {}).get("bf16_matmul_TFLOPs"))
    rows = []
    for r in runs:
        tflops = r.pop("flops_per_step") / (r["median_step_ms"] * 1e-3) / 1e12
        rows.append({"kind": "run", **common, **r, "model_TFLOPs": tflops,
                     "mfu": ceilings and tflops / ceilings["bf16_matmul_TFLOPs"],
                     "max_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], runs[0]["losses"])),
                     "losses": [round(x, 6) for x in r["losses"]]})
    return rows + summarize_runs(rows)


def _dry_patch(preset, overrides: dict, flags: dict) -> None:
    """liger_rt.patch on the same model built on the meta device (no memory); other errors are the run's."""
    import liger_rt.patch as P
    try:
        model = build(preset, torch.float32, "meta", 0, overrides)
    except Exception:
        return
    try:
        P.patch(model, **flags)
    except (TypeError, ValueError, NotImplementedError, ImportError) as exc:
        raise ValueError(f"liger_rt.patch(model, {', '.join(f'{k}={v}' for k, v in flags.items())}): {exc}") from None
    except Exception:
        return
    P.unpatch(model)


def summarize_runs(run_rows: list[dict]) -> list[dict]:
    """One row per arm: tokens/s the mean of its runs, median ms = batch*seq / that, peak the max,
    speedup and memory against baseline, loss-curve overlap against the first baseline run."""
    out, base = [], None
    tol = LOSS_RTOL[run_rows[0]["dtype"]]
    for arm in [a for a in ARMS if any(r["arm"] == a for r in run_rows)]:
        rs = [r for r in run_rows if r["arm"] == arm]
        batch_seq = rs[0]["batch"] * rs[0]["seq"]
        tok = statistics.mean(r["tok_per_s"] for r in rs)
        peaks = [r["peak_alloc_GB"] for r in rs if r["peak_alloc_GB"] is not None]
        row = {k: v for k, v in rs[0].items() if k not in ("run_index", "min_step_ms", "max_step_ms", "losses",
                                                          "build_s")}
        row.update(kind="summary", runs=len(rs), tok_per_s=tok, median_step_ms=batch_seq / tok * 1e3,
                   tok_per_s_spread=(max(r["tok_per_s"] for r in rs) - min(r["tok_per_s"] for r in rs)) / tok,
                   peak_alloc_GB=max(peaks) if peaks else None,
                   model_TFLOPs=statistics.mean(r["model_TFLOPs"] for r in rs),
                   mfu=statistics.mean(r["mfu"] for r in rs) if rs[0]["mfu"] is not None else None,
                   max_loss_diff=max(r["max_loss_diff"] for r in rs),
                   loss_last=statistics.mean(r["loss_last"] for r in rs))
        row["loss_rel_diff"] = row["max_loss_diff"] / (abs(run_rows[0]["loss_first"]) or 1.0)
        row["loss_curves_overlap"] = row["loss_rel_diff"] <= tol
        base = base or row
        row["speedup"] = tok / base["tok_per_s"]
        row["mem_ratio"] = row["peak_alloc_GB"] / base["peak_alloc_GB"] if peaks and base["peak_alloc_GB"] else None
        out.append(row)
    return out


COLS = ["model_type", "preset", "arm", "runs", "median_step_ms", "tok_per_s", "tok_per_s_spread", "speedup",
        "peak_alloc_GB", "mem_ratio", "model_TFLOPs", "mfu", "loss_last", "max_loss_diff", "loss_curves_overlap"]
HEADERS = {"median_step_ms": "ms/step", "tok_per_s": "tok/s", "tok_per_s_spread": "spread", "peak_alloc_GB": "peak GB",
           "mem_ratio": "mem x", "model_TFLOPs": "TFLOP/s", "max_loss_diff": "max |dloss|",
           "loss_curves_overlap": "overlap", "speedup": "speedup x"}


def format_summary(rows: list[dict]) -> str:
    summ = [r for r in rows if r.get("kind") == "summary"]
    notes = []
    for key in dict.fromkeys((r["model_type"], r["preset"]) for r in summ):
        mine = [r for r in summ if (r["model_type"], r["preset"]) == key]
        base = [r for r in rows if r.get("kind") == "run" and (r["model_type"], r["preset"]) == key
                and r["arm"] == "baseline"]
        if len(base) >= 2:
            notes.append(f"{key[1]}: baseline vs its repeat: max |dloss| {float(base[-1]['max_loss_diff']):.3g} "
                         f"(the noise floor the other arms compare with)")
        if mine[0].get("liger_kernel_note") not in ("", "not requested", None):
            notes.append(f"{key[1]}: no Liger-Kernel arm: {mine[0]['liger_kernel_note']}")
        bad = [r["arm"] for r in mine if str(r["loss_curves_overlap"]) != "True"]
        if bad:
            notes.append(f"{key[1]}: WARNING loss curves of {', '.join(bad)} do not overlap the baseline's "
                         f"(relative difference above {LOSS_RTOL[mine[0]['dtype']]:.3g})")
    return "\n".join([format_table(summ, COLS, HEADERS), *notes])


def run_targets(names: list[str], *, out_dir: str = "benchmarks/results", quick: bool = False, steps: int | None = None,
                warmup: int | None = None, batch: int = 4, seq: int = 2048, liger_kernel: bool = True,
                echo: Callable = print) -> list[str]:
    """Issue 9's runs (TARGETS) on the GPU, into model_<device>[_quick].csv (a partial run keeps
    the other targets' rows); anchors and targets ride along in every row, the liger_rt summary
    says whether it meets its target.  Returns the names that failed."""
    from .harness import device_tag, write_csv
    steps, warmup = steps or (8 if quick else 20), (3 if quick else 5) if warmup is None else warmup
    ceilings, rows, failed = measure_ceilings(quick=True), [], []
    for name in names:
        t = TARGETS[name]
        run = {k: t[k] for k in RUN_KEYS if k in t}
        run["liger_kernel"] = run.get("liger_kernel", True) and liger_kernel
        try:
            got = run_model_bench(**run, steps=steps, warmup=warmup, batch=batch, seq=seq, dtype="bf16", device="cuda",
                                  ceilings=ceilings, echo=echo)
        except Exception as exc:      # one model failing must not hide the others' numbers
            echo(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            failed.append(name)
            continue
        for r in got:
            r.update(target=name, **{k: v for k, v in t.items() if k not in RUN_KEYS})
            if r["kind"] == "summary" and r["arm"] == "liger_rt":
                r["meets_target"] = r["tok_per_s"] >= t["target_tok_per_s"] and \
                    r["peak_alloc_GB"] is not None and r["peak_alloc_GB"] <= t["target_peak_GB"]
                echo(f"{name}: liger_rt {r['tok_per_s']:.0f} tok/s (target {t['target_tok_per_s']:.0f}), peak "
                     f"{fmt(r['peak_alloc_GB'])} GB (target {t['target_peak_GB']}): "
                     f"{'meets the target' if r['meets_target'] else 'TARGET MISSED'}")
        rows += got
    echo(format_summary(rows))
    if rows:
        path = Path(out_dir) / f"model_{device_tag()}{'_quick' if quick else ''}.csv"
        echo(f"wrote {write_csv(rows, path, ('target',))}")
    return failed
