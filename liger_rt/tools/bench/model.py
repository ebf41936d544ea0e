"""One SFT training step: baseline against liger_rt.patch (and Liger-Kernel's patch), counterbalanced (`arm_order`;
docs/cli.md, "bench").

Each run builds a fresh model from the same seed (random weights, sdpa) and trains on the same random batch (labels =
input_ids, AdamW): median synchronized step time, tokens/s, peak allocated memory and every step's loss (the loss
curves of all runs must overlap).  Model TFLOP/s is an estimate (`train_flops_per_step`), mfu its fraction of the
measured bf16 matmul ceiling.  A compiled arm records dynamo's graph breaks and `compile_s`.

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
from typing import Callable

import torch

from .harness import dataset_arm, dispatch_env, format_table, measure_ceilings

ARMS = ("baseline", "liger_rt", "liger_kernel", "baseline+compile", "liger_rt+compile", "liger_rt+compile+kernels",
        "liger_rt+compile+fuse")
# liger_rt+compile runs under the environment's LIGER_RT_COMPILE_POLICY (default fuse); the +kernels and +fuse arms
# under that policy whatever the environment says, so both policies run counterbalanced in one process
COMPILED = tuple(a for a in ARMS if "+compile" in a)
POLICY_ARMS = {"liger_rt+compile+kernels": "kernels", "liger_rt+compile+fuse": "fuse"}
COMPILE_MODES = ("default", "reduce-overhead")
# What a run row holds (None in the row of a compiled run that failed)
RUN_METRICS = ("median_step_ms", "min_step_ms", "max_step_ms", "tok_per_s", "peak_alloc_GB", "loss_first",
               "loss_last", "losses", "build_s", "params_M", "flops_per_step")
# Columns added with the compiled arms: after the earlier ones in every run row (None where they do not apply)
NEW_COLS = ("peak_reserved_GB", "graph_breaks", "graphs", "graph_break_reasons", "compile_s", "error")
# Largest max |loss difference| / initial loss between two runs that still counts as overlapping: same weights and
# batch, only kernel rounding separates the arms (fp32 tiny models through the interpreter: ~2e-7; the H200 bf16
# qwen3-1.7b baseline vs Liger-Kernel: 4e-5 after 13 steps); a wrong gradient moves a curve by percents.
LOSS_RTOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 1e-2}


def _parts(text: str | None):
    return filter(None, (p.strip() for p in (text or "").split(",")))


def parse_flags(text: str | None) -> dict[str, bool]:
    """'rms_norm=1,fused_linear_cross_entropy=0,swiglu' -> {'rms_norm': True, ...}."""
    out = {}
    for part in _parts(text):
        key, _, val = part.partition("=")
        val = val.strip().lower() or "1"
        if val not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"flag {part!r}: value must be 0/1 (or true/false, yes/no, on/off)")
        out[key.strip()] = val in ("1", "true", "yes", "on")
    return out


def parse_config(text: str | None) -> dict:
    """'tie_word_embeddings=true,rope_theta=1e6' -> {'tie_word_embeddings': True, 'rope_theta': 1000000.0}."""
    out = {}
    for part in _parts(text):
        key, eq, val = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{part!r}: expected key=value")
        try:
            out[key.strip()] = json.loads(val.strip())
        except json.JSONDecodeError:
            out[key.strip()] = val.strip()
    return out


def bench_preset(model_type: str, preset, layers: int | None = None, attention_layers: tuple | None = None):
    """The Preset (a name, `tiny`, PATH.json or a Preset) with the layer count changed."""
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


def resolve_model(model: str, preset=None) -> tuple[str, object]:
    """`--model` as a model type or a preset name: ('qwen3', None) -> ('qwen3', 'tiny'); ('qwen3-1.7b', None) ->
    ('qwen3', 'qwen3-1.7b').  A preset given both ways must agree."""
    from liger_rt.tools.presets import PRESETS, TINY_FOR_MODEL
    if model in TINY_FOR_MODEL or model not in PRESETS:
        return model, "tiny" if preset is None else preset
    if preset not in (None, model):
        raise ValueError(f"--model {model} is a preset; --preset {preset} names another (give one of them)")
    return PRESETS[model].model_type, model


def config_overrides(model_type: str, config: dict | None = None, experts_implementation: str | None = None) -> dict:
    """Every arm's config keywords: `config`; MoE: the experts' implementation (default grouped_mm, transformers'
    grouped-GEMM experts)."""
    overrides = dict(config or {})
    if model_type in ("lfm2_moe", "qwen3_moe"):
        overrides["experts_implementation"] = experts_implementation or "grouped_mm"
    elif experts_implementation:
        raise ValueError(f"experts_implementation applies to MoE models, not {model_type}")
    return overrides


def build(preset, dtype, device, seed: int, overrides: dict):
    from liger_rt.tools.models import build_model
    return build_model(preset, dtype=dtype, device=device, seed=seed, attn_implementation="sdpa", **overrides)


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def random_ids(model, batch: int, seq: int, seed: int, device: str):
    """Random tokens fixed by seed, without the image/video placeholder tokens."""
    vocab = int(_text_config(model).vocab_size)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    for attr in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        tid = getattr(model.config, attr, None)
        if isinstance(tid, int) and 0 <= tid < vocab:
            ids[ids == tid] = (tid + 1) % vocab
    return ids.to(device)


def train_flops_per_step(model, batch: int, seq: int) -> float:
    """6 * active matmul params * tokens + attention (6 * seq * heads * head_dim per token and attention layer).
    Active: weights of >= 2 dims except the input embedding and the vision tower, experts scaled by top_k / experts,
    the LM head once even if tied."""
    tc = _text_config(model)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_w = head.weight if head is not None else None
    experts = getattr(tc, "num_experts", None) or getattr(tc, "num_local_experts", None)
    top_k = getattr(tc, "num_experts_per_tok", None)
    active = 0.0
    for name, p in model.named_parameters():        # a tied weight once
        if p.dim() < 2 or "vision" in name or "multi_modal_projector" in name or (p is emb and p is not head_w):
            continue
        active += p.numel() * (top_k / experts if p.dim() == 3 and experts and top_k and p.shape[0] == experts else 1)
    heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    types = getattr(tc, "layer_types", None)
    n_attn = sum("attention" in str(t) for t in types) if types else int(tc.num_hidden_layers)
    return 6.0 * active * batch * seq + 6.0 * n_attn * seq * heads * head_dim * batch * seq


class LigerKernelPatch:
    """Liger-Kernel's instance patch; `undo` reverts its module-level changes (HF modeling modules, F.cross_entropy)."""

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


def compile_stats(arm: str) -> dict:
    """Dynamo's counters since the last reset (graph breaks, graphs, first break reasons) and the arm's policy."""
    from torch._dynamo.utils import counters
    breaks = counters["graph_break"]
    reasons = [str(k).strip().splitlines()[0][:120] for k in list(breaks)[:3]]
    return {"graph_breaks": int(sum(breaks.values())), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_break_reasons": " | ".join(reasons), "compile_policy": arm_policy(arm)}


def arm_policy(arm: str) -> str:
    """The LIGER_RT_COMPILE_POLICY of a compiled arm: its own (POLICY_ARMS), else the environment's."""
    from liger_rt import env
    return POLICY_ARMS.get(arm) or env.compile_policy()


def arm_env(arm: str):
    """The context an arm's steps run in: a compiled arm's compile policy (its traces read it), else nothing."""
    return dispatch_env(LIGER_RT_COMPILE_POLICY=arm_policy(arm)) if arm in COMPILED else contextlib.nullcontext()


def _reset_dynamo() -> None:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def apply_arm(model, base: str, flags: dict) -> Callable[[], None] | None:
    """Patch `model` for an arm's base (liger_rt with `flags`, liger_kernel, baseline as is); returns the undo."""
    from liger_rt.patch import patch, unpatch
    if base == "liger_rt":
        try:
            patch(model, **flags)
        except (TypeError, ValueError) as exc:      # unknown flag or model type: the patcher says which
            raise ValueError(f"liger_rt.patch(model, {flags}): {exc}") from exc
        return lambda: unpatch(model)
    if base == "liger_kernel":
        lk = LigerKernelPatch()
        try:
            lk.apply(model)
        except BaseException:
            lk.undo()                                 # what it changed before it failed
            raise
        return lk.undo
    return None


def step_fn(model, opt, ids) -> Callable[[], torch.Tensor]:
    """One training step on `ids` (labels = input ids); returns the loss."""
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def train_steps(model, opt, ids, warmup: int, steps: int, cuda: bool) -> tuple[dict, float]:
    """warmup + steps steps, each timed between two synchronisations: (the measured steps' median/min/max ms,
    tokens/s, peak allocated and reserved GB, the losses; seconds the warm-up steps took beyond a steady step)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step = step_fn(model, opt, ids)
    losses, times = [], []
    for i in range(warmup + steps):
        sync()
        if i == warmup and cuda:          # the peak of steady-state steps
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    warm, times = times[:warmup], times[warmup:]
    med = statistics.median(times)
    return {"median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3, "max_step_ms": max(times) * 1e3,
            "tok_per_s": ids.numel() / med,
            "peak_alloc_GB": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "peak_reserved_GB": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
            "loss_first": losses[0], "loss_last": losses[-1], "losses": losses}, sum(max(0.0, w - med) for w in warm)


def _run_arm(arm: str, preset, *, dtype, device, seed, overrides, flags, batch, seq, ids, steps, warmup, lr,
             compile_backend="inductor", compile_mode="default") -> dict:
    """One run: a fresh model, the arm's patch (then torch.compile), warm-up + measured steps.  `ids` None on the
    first run (drawn here and returned for the later runs).  A compiled arm that fails returns its error and
    dynamo's counters; any other failure raises."""
    cuda, compiled = device == "cuda", arm in COMPILED
    gc.collect()
    t0 = time.perf_counter()
    model = undo = step_model = None
    try:
        model = build(preset, dtype, device, seed, overrides)      # in train mode
        undo = apply_arm(model, arm.split("+")[0], flags)
        step_model = model
        if compiled:
            _reset_dynamo()
            step_model = torch.compile(model, backend=compile_backend,
                                       **({} if compile_mode == "default" else {"mode": compile_mode}))
        build_s = time.perf_counter() - t0
        ids = random_ids(model, batch, seq, seed, device) if ids is None else ids
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
        with arm_env(arm):
            res, warm_extra_s = train_steps(step_model, opt, ids, warmup, steps, cuda)
        return {**res, "build_s": build_s, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
                "flops_per_step": train_flops_per_step(model, batch, seq), **(compile_stats(arm) if compiled else {}),
                "compile_s": warm_extra_s if compiled else None, "ids": ids, "error": ""}
    except Exception as exc:
        if not compiled:
            raise
        return {**dict.fromkeys(RUN_METRICS), **compile_stats(arm),      # the other NEW_COLS come out None
                "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    finally:
        if undo is not None:
            undo()
        del model, step_model
        if compiled:
            torch._dynamo.reset()        # the compiled graphs (and CUDA-graph pools) go with the model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def arm_order(arms) -> list[str]:
    """Counterbalanced: the eager and compiled arms, Liger-Kernel's two runs, then the first ones in reverse."""
    first = [a for a in ("baseline", "liger_rt", *COMPILED) if a in arms]
    return [*first, *(["liger_kernel"] * 2 if "liger_kernel" in arms else []), *reversed(first)]


def resolve_arms(arms, liger_kernel: bool, compile: bool, compile_backend, compile_mode, warmup: int) -> list[str]:
    if arms is None:
        arms = ["baseline", "liger_rt", *(COMPILED[:2] if compile else ()), *(["liger_kernel"] if liger_kernel else [])]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm {bad[0]!r}; valid: {', '.join(ARMS)}")
    if "baseline" not in arms:
        raise ValueError("the arms must include baseline (the reference of speedups and loss curves)")
    if any(a in COMPILED for a in arms):
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {compile_mode!r}; valid: {', '.join(COMPILE_MODES)}")
        if isinstance(compile_backend, str) and compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"unknown compile backend {compile_backend!r}; valid: "
                             f"{', '.join(torch._dynamo.list_backends())}")
        if warmup < 1:
            raise ValueError("the compiled arms need --warmup >= 1 (the first step compiles; it is not timed)")
    return list(arms)


def run_model_bench(model_type: str, preset="tiny", *, batch: int = 4, seq: int = 2048, steps: int = 20,
                    warmup: int = 5, dtype="bf16", layers: int | None = None, attention_layers: tuple | None = None,
                    liger_kernel: bool = True, flags: dict | None = None, device: str = "auto", seed: int = 0,
                    lr: float = 1e-4, experts_implementation: str | None = None, config: dict | None = None,
                    ceilings: dict | None = None, compile: bool = False, compile_backend="inductor",
                    compile_mode: str = "default", arms: tuple | None = None,
                    echo: Callable | None = print, arm_context: Callable | None = None) -> list[dict]:
    """Rows of one model: one per run (kind="run", in run order) and one per arm (kind="summary").  `flags` go to
    liger_rt.patch over {fused_linear_cross_entropy: True}; `config`: transformers config overrides of every arm.
    `compile` adds baseline+compile and liger_rt+compile (`compile_backend`: a name or a callable); `arms` picks the
    arms outright (baseline among them; the POLICY_ARMS only so).  `arm_context(arm)`, where given, is a context
    manager entered around each run of an arm (a setting that differs per arm, e.g. benchmarks/profile/)."""
    from liger_rt.dtypes import dtype_name, parse_dtype
    echo = echo or (lambda s: None)
    dt, device = parse_dtype(dtype), ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA/ROCm GPU is available here (use --device cpu with a tiny preset)")
    if steps < 1 or warmup < 0 or batch < 1 or seq < 2:
        raise ValueError("need steps >= 1, warmup >= 0, batch >= 1, seq >= 2")
    arms = resolve_arms(arms, liger_kernel, compile, compile_backend, compile_mode, warmup)
    p = bench_preset(model_type, preset, layers, attention_layers)
    overrides = config_overrides(model_type, config, experts_implementation)
    flags = {"fused_linear_cross_entropy": True, **(flags or {})}
    _dry_patch(p, overrides, flags)      # fail before any timing when the patcher rejects flags or model
    lk_ok, lk_note = LigerKernelPatch.supported(model_type) if "liger_kernel" in arms else (False, "not requested")
    order = arm_order([a for a in arms if a != "liger_kernel" or lk_ok])
    compiled = any(a in COMPILED for a in order)
    backend_name = getattr(compile_backend, "__name__", str(compile_backend))
    if device == "cuda" and ceilings is None:
        ceilings = measure_ceilings(quick=True)
    echo(f"bench model {model_type} preset {p.name} ({p.layers} layers), batch {batch} x seq {seq}, {dtype_name(dt)}, "
         f"{device}, warmup {warmup} + {steps} steps, lr {lr}, order {' > '.join(order)}"
         + (f", torch.compile backend {backend_name} mode {compile_mode}" if compiled else ""))
    echo(f"  liger_rt.patch flags: {flags}; config overrides (all arms): {overrides or 'none'}"
         + (f"; Liger-Kernel arm skipped: {lk_note}" if "liger_kernel" in arms and not lk_ok else ""))
    runs, ids, failed = [], None, set()
    for n, arm in enumerate(order):
        if arm in failed:             # a failed arm's repeat is skipped
            continue
        t0 = time.time()
        try:
            with arm_context(arm) if arm_context else contextlib.nullcontext():
                res = _run_arm(arm, p, dtype=dt, device=device, seed=seed, overrides=overrides, flags=flags,
                               batch=batch, seq=seq, ids=ids, steps=steps, warmup=warmup, lr=lr,
                               compile_backend=compile_backend, compile_mode=compile_mode)
        except Exception as exc:
            if arm != "liger_kernel":
                raise
            failed.add(arm)
            lk_note = f"failed: {type(exc).__name__}: {str(exc)[:300]}"   # the peer must not hide our numbers
            echo(f"  [{n + 1}/{len(order)}] liger_kernel FAILED ({lk_note}); continuing without it")
            continue
        ids = res.pop("ids", ids)
        runs.append({"arm": arm, "run_index": len(runs), **res})
        if res["error"]:              # a compiled arm that fails is a row
            failed.add(arm)
            echo(f"  [{n + 1}/{len(order)}] {arm} FAILED ({res['error']}); its repeat is skipped")
            continue
        mem = "n/a" if res["peak_alloc_GB"] is None else f"{res['peak_alloc_GB']:.2f} GB"
        extra = f"  {res['graph_breaks']} graph breaks, compile {res['compile_s']:.1f} s" if arm in COMPILED else ""
        echo(f"  [{n + 1}] {arm:21s} {res['median_step_ms']:9.2f} ms/step {res['tok_per_s']:10.0f} tok/s  peak {mem}  "
             f"loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}{extra}  ({time.time() - t0:.1f} s)")
    common = dict(model_type=model_type, preset=p.name, layers=p.layers, batch=batch, seq=seq, steps=steps,
                  warmup=warmup, dtype=dtype_name(dt), device=device, lr=lr, seed=seed,
                  order=">".join(r["arm"] for r in runs), flags=",".join(f"{k}={int(v)}" for k, v in flags.items()),
                  experts_implementation=overrides.get("experts_implementation", ""),
                  config=",".join(f"{k}={v}" for k, v in overrides.items()), liger_kernel_note=lk_note,
                  copy_ceiling_GBps=(ceilings or {}).get("copy_GBps"),
                  matmul_ceiling_TFLOPs=(ceilings or {}).get("bf16_matmul_TFLOPs"))
    compile_cols = dict(compile_backend=backend_name, compile_mode=compile_mode) if compiled else {}
    rows = []
    for r in runs:
        flops, new = r.pop("flops_per_step"), {k: r.pop(k, None) for k in NEW_COLS}
        derived = dict.fromkeys(("model_TFLOPs", "mfu", "max_loss_diff"))     # a failed run: none
        if not new["error"]:
            tflops = flops / (r["median_step_ms"] * 1e-3) / 1e12
            derived = {"model_TFLOPs": tflops, "mfu": ceilings and tflops / ceilings["bf16_matmul_TFLOPs"],
                       "max_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], runs[0]["losses"])),
                       "losses": [round(x, 6) for x in r["losses"]]}
        rows.append({"kind": "run", **common, **r, **derived, **new, **compile_cols})
    return rows + summarize_runs(rows)


def _dry_patch(preset, overrides: dict, flags: dict) -> None:
    """liger_rt.patch of the model built on the meta device: a rejected flag or model fails before any timing."""
    from liger_rt.patch import patch, unpatch
    try:
        model = build(preset, torch.float32, "meta", 0, overrides)
    except Exception:
        return
    try:
        patch(model, **flags)
    except (TypeError, ValueError, NotImplementedError, ImportError) as exc:
        raise ValueError(f"liger_rt.patch(model, {', '.join(f'{k}={v}' for k, v in flags.items())}): {exc}") from None
    except Exception:
        return
    unpatch(model)


def summarize_runs(run_rows: list[dict]) -> list[dict]:
    """One row per arm: mean tokens/s, median ms = batch*seq / that, max peak, speedup and memory against baseline
    (tokens/s against baseline+compile when it ran), loss-curve overlap against the first baseline run.  Failed runs
    count in no figure; an arm whose every run failed is a row with its error."""
    out, base = [], None
    drop = ("run_index", "min_step_ms", "max_step_ms", "losses", "build_s")
    for arm in [a for a in ARMS if any(r["arm"] == a for r in run_rows)]:
        every = [r for r in run_rows if r["arm"] == arm]
        rs = [r for r in every if not r.get("error")]
        row = {k: v for k, v in (rs or every)[0].items() if k not in drop} | {"kind": "summary", "runs": len(rs)}
        out.append(row)
        if not rs:
            continue
        def mean(key):
            return statistics.mean(r[key] for r in rs)
        def top(key):       # None where no run has it (off CUDA)
            return max((r[key] for r in rs if r.get(key) is not None), default=None)
        tok = mean("tok_per_s")
        row.update(tok_per_s=tok, median_step_ms=row["batch"] * row["seq"] / tok * 1e3,
                   tok_per_s_spread=(max(r["tok_per_s"] for r in rs) - min(r["tok_per_s"] for r in rs)) / tok,
                   peak_alloc_GB=top("peak_alloc_GB"), peak_reserved_GB=top("peak_reserved_GB"),
                   model_TFLOPs=mean("model_TFLOPs"), mfu=mean("mfu") if rs[0]["mfu"] is not None else None,
                   max_loss_diff=top("max_loss_diff"), loss_last=mean("loss_last"),
                   error="; ".join(r["error"] for r in every if r.get("error")))
        if arm in COMPILED:
            row.update(graph_breaks=top("graph_breaks"), compile_s=mean("compile_s"))
        row["loss_rel_diff"] = row["max_loss_diff"] / (abs(run_rows[0]["loss_first"]) or 1.0)
        row["loss_curves_overlap"] = row["loss_rel_diff"] <= LOSS_RTOL[run_rows[0]["dtype"]]
        base = base or row
        row["speedup"] = tok / base["tok_per_s"]
        peak, base_peak = row["peak_alloc_GB"], base["peak_alloc_GB"]
        row["mem_ratio"] = peak / base_peak if peak is not None and base_peak else None
    comp = next((r for r in out if r["arm"] == "baseline+compile" and r["runs"]), None)
    for row in out if comp else ():
        row["vs_baseline_compile"] = row["tok_per_s"] / comp["tok_per_s"] if row["runs"] else None
    return out


COLS = ["model_type", "preset", "batch", "seq", "arm", "runs", "median_step_ms", "tok_per_s", "tok_per_s_spread",
        "speedup", "peak_alloc_GB", "mem_ratio", "model_TFLOPs", "mfu", "loss_last", "max_loss_diff",
        "loss_curves_overlap"]
COMPILE_COLS = ["vs_baseline_compile", "peak_reserved_GB", "graph_breaks", "compile_s",   # when a compiled arm ran
                "compile_policy"]
HEADERS = {"median_step_ms": "ms/step", "tok_per_s": "tok/s", "tok_per_s_spread": "spread", "peak_alloc_GB": "peak GB",
           "mem_ratio": "mem x", "model_TFLOPs": "TFLOP/s", "max_loss_diff": "max |dloss|",
           "loss_curves_overlap": "overlap", "speedup": "speedup x", "vs_baseline_compile": "vs base+compile x",
           "peak_reserved_GB": "reserved GB", "graph_breaks": "breaks", "compile_s": "compile s",
           "compile_policy": "policy"}


def format_summary(rows: list[dict]) -> str:
    summ = [r for r in rows if r.get("kind") == "summary"]
    notes = []
    group = lambda r: (r["model_type"], r["preset"], r["batch"], r["seq"])  # noqa: E731
    for key in dict.fromkeys(map(group, summ)):
        mine = [r for r in summ if group(r) == key]
        base = [r for r in mine if r["arm"] == "baseline"][-1]      # baseline runs first and last, never fails
        name = f"{key[1]} B{key[2]}xT{key[3]}"
        notes.append(f"{name}: baseline vs its repeat: max |dloss| {base['max_loss_diff']:.3g} "
                     f"(the noise floor the other arms compare with)")
        if mine[0].get("liger_kernel_note") not in ("", "not requested", None):
            notes.append(f"{name}: no Liger-Kernel arm: {mine[0]['liger_kernel_note']}")
        notes += [f"{name}: {r['arm']} FAILED: {r['error']}" for r in mine if r.get("error")]
        notes += [f"{name}: {r['arm']}: {r['graph_breaks']} graph breaks ({r['graph_break_reasons']})"
                  for r in mine if r.get("graph_breaks")]
        bad = [r["arm"] for r in mine if r["runs"] and not r["loss_curves_overlap"]]
        if bad:
            notes.append(f"{name}: WARNING loss curves of {', '.join(bad)} do not overlap the baseline's "
                         f"(relative difference above {LOSS_RTOL[mine[0]['dtype']]:.3g})")
    cols = COLS + (COMPILE_COLS if any(r["arm"] in COMPILED for r in summ) else [])
    return "\n".join([format_table(summ, cols, HEADERS), *notes])


def parse_shapes(texts) -> list[tuple[int, int]]:
    """['4x2048', '1x512,2x1024'] -> [(4, 2048), (1, 512), (2, 1024)]: batch x sequence length."""
    out = []
    for part in filter(None, (p.strip().lower() for t in texts for p in t.split(","))):
        b, x, t = part.partition("x")
        if not (x and b.isdigit() and t.isdigit() and int(b) >= 1 and int(t) >= 2):
            raise ValueError(f"shape {part!r}: expected BATCHxSEQ with batch >= 1 and seq >= 2, e.g. 4x2048 or 1x512")
        out.append((int(b), int(t)))
    return list(dict.fromkeys(out))


def model_records(rows: list[dict]) -> list[dict]:
    """run_model_bench rows as dataset records, one per measured run (an arm runs more than once): `tok_s` (its
    median step), `peak_gb` (max allocated), `frac_ceiling` (model FLOPs over the bf16 matmul ceiling), and for a
    compiled arm `compile_s` and `graph_breaks`.  kind `model_compiled` where a compiled arm ran, else `model`; the
    name is the preset plus the patch flags beyond the fused loss (qwen3-1.7b+rope)."""
    runs = [r for r in rows if r.get("kind") == "run" and not r.get("error")]
    kind = "model_compiled" if any(r["arm"] in COMPILED for r in rows) else "model"
    tol = {r["dtype"]: LOSS_RTOL[r["dtype"]] for r in runs}
    out = []
    for r in runs:
        extra = [f for f in r["flags"].split(",") if f and f != "fused_linear_cross_entropy=1"]
        rel = r["max_loss_diff"] / (abs(runs[0]["loss_first"]) or 1.0)
        notes = [f"{r['layers']} layers, {r['warmup']}+{r['steps']} steps, #{r['run_index'] + 1} of order {r['order']}",
                 f"config {r['config']}" if r["config"] else "",
                 f"loss curve {'overlaps' if rel <= tol[r['dtype']] else 'DIFFERS FROM'} the first baseline run's "
                 f"(max relative difference {rel:.2g})",
                 f"compile mode {r.get('compile_mode')}, policy {r.get('compile_policy')}" if r["arm"] in COMPILED
                 else ""]
        base = {"kind": kind, "name": r["preset"] + "".join(f"+{f.removesuffix('=1')}" for f in extra),
                "shape": {"batch": r["batch"], "seq": r["seq"]}, "arm": dataset_arm(r["arm"]), "dtype": r["dtype"],
                "notes": "; ".join(filter(None, notes))}
        metrics = [("tok_s", r["tok_per_s"], "tok/s", "median step"),
                   ("peak_gb", r["peak_alloc_GB"], "GB", "max allocated"),
                   ("frac_ceiling", r["mfu"], "", "model FLOPs / bf16 matmul ceiling")]
        if r["arm"] in COMPILED:
            metrics += [("compile_s", r["compile_s"], "s", "warm-up time beyond steady steps"),
                        ("graph_breaks", r["graph_breaks"], "", "dynamo graph_break counter")]
        out += [{**base, "metric": m, "value": v, "unit": u, "method": how}
                for m, v, u, how in metrics if v is not None]
    return out
