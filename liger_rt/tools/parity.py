"""Parity of a patched model against the unpatched one: same weights, same input, one AdamW step.

    report = compare(lambda: build_model("qwen3-tiny"))            # liger_rt.patch defaults
    report = compare((baseline, my_patched_model), patch=False)    # your own pair, already patched
    report["ok"], report["rows"]["logits"]["linf_over_baseline_max"]

Rows, input and gates: docs/patching.md ("Parity").  The AdamW update is gated on mean |diff| / mean
|baseline|, not L-inf: a first step is about lr * sign(grad), so a near-zero gradient whose sign flips
moves that element by up to 2 lr whatever the precision (labs-molt PR #58 saw 0.89 lr in bf16).
"""
from __future__ import annotations

import copy
import json
import math
from typing import Any, Callable

import click
import torch

# gate per row and dtype (STYLE 8: one table).  fp32 runs compare reassociation-level differences;
# 16-bit ones compare kernels that round once in fp32 against HF's per-op rounding.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(logits=1e-4, action_logprobs=1e-4, entropy=1e-4, optimisation_loss=1e-5,
                        reported_loss=1e-5, gradients=1e-3, adamw_update=1e-3),
    torch.float16: dict(logits=5e-3, action_logprobs=5e-3, entropy=5e-3, optimisation_loss=1e-3,
                        reported_loss=1e-3, gradients=2e-2, adamw_update=2e-2),
    # bf16 logits: 3e-2, measured on the H200 (2026-12-02): random-weight LFM2-VL, 4 layers, with the
    # vision LayerNorm patched, differed by 2.3e-2 L-inf/max; HF's bf16 conv path rounds B*x and the
    # conv output to bf16 where ours rounds once, so part of that gap is HF's own rounding.
    torch.bfloat16: dict(logits=3e-2, action_logprobs=2e-2, entropy=2e-2, optimisation_loss=5e-3,
                         reported_loss=5e-3, gradients=5e-2, adamw_update=5e-2),
}
ROWS = ("logits", "action_logprobs", "entropy", "optimisation_loss", "reported_loss", "gradients", "adamw_update")
LABELS = {name: name.replace("_", " ") for name in ROWS} | {"action_logprobs": "action log-probs",
          "gradients": "gradients, worst tensor", "adamw_update": "AdamW update, worst tensor"}
GATE_STAT = {name: "linf_over_baseline_max" for name in ROWS} | {"adamw_update": "mean_over_baseline_mean"}


def make_inputs(model, batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> dict[str, torch.Tensor]:
    """Seed 000's input: `batch` samples of `seq` tokens, the last right-padded by 3.  Token ids avoid 0
    (LFM2's pad id) and the image token; a model with a vision tower gets one image in the first sample."""
    config = model.config
    vocab = int((getattr(config, "text_config", None) or config).vocab_size)
    device = device or next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    image_token = getattr(config, "image_token_id", None)
    vision = getattr(config, "vision_config", None)
    n_img, side = 0, 0
    if vision is not None and image_token is not None:
        factor = int(getattr(config, "downsample_factor", 2))
        side = max(factor, min(int(math.isqrt(int(getattr(vision, "num_patches", 16)))), 8))
        side -= side % factor
        n_img = (side // factor) ** 2
    total = seq + n_img
    high = vocab - 1 if image_token is not None else vocab
    ids = torch.randint(1, high, (batch, total), generator=g)
    if image_token is not None:
        ids[ids == image_token] = 1
    mask = torch.ones(batch, total, dtype=torch.long)
    if batch > 1:
        mask[-1, total - 3:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if n_img:
        ids[0, 1:1 + n_img] = image_token
        p, c = int(vision.patch_size), int(getattr(vision, "num_channels", 3))
        out["pixel_values"] = torch.randn(1, side * side, c * p * p, generator=g)
        out["spatial_shapes"] = torch.tensor([[side, side]])
        out["pixel_attention_mask"] = torch.ones(1, side * side, dtype=torch.bool)
    labels = ids.masked_fill(mask == 0, -100)
    if image_token is not None:
        labels = labels.masked_fill(ids == image_token, -100)
    out["labels"] = labels
    dtype = next(model.parameters()).dtype
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in out.items()}


def fused_logprobs(model) -> bool:
    from liger_rt.patch.core import unwrap
    return getattr(unwrap(model), "_liger_rt_logprobs", None) is not None


def _run(model, inputs: dict, lr: float) -> dict[str, Any]:
    """Every row's quantities of one model.  A model patched with ``logprobs=True`` gets log-probs,
    entropy and the losses (-sum(logprobs) / count(labels), as HF's mean cross-entropy) from that forward."""
    model.train()
    labels = inputs["labels"]
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    pair = mask[:, :-1] & mask[:, 1:] & (labels[:, 1:] != -100)
    n_items = (labels[:, 1:] != -100).sum()
    fused = fused_logprobs(model)
    with torch.no_grad():
        logits = model(**no_labels).logits.float()
        res = {"logits": logits[mask]}
        if fused:      # (B, S) with HF's shift
            out = model(**inputs)
            res["action_logprobs"], res["entropy"] = out.logprobs[:, :-1][pair], out.entropy[:, :-1][pair]
            res["reported_loss"] = -out.logprobs.sum() / n_items
        else:
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            res["action_logprobs"] = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)[pair]
            res["entropy"] = -(logp.exp() * logp).sum(-1)[pair]
            res["reported_loss"] = model(**inputs, num_items_in_batch=n_items).loss.detach().float()
    model.zero_grad(set_to_none=True)
    loss = -model(**inputs).logprobs.sum() / n_items if fused else model(**inputs).loss
    return {**res, **adamw_step(model, loss, lr)}


def adamw_step(model, loss: torch.Tensor, lr: float) -> dict[str, Any]:
    """Backpropagate `loss` and take one AdamW(lr) step: optimisation_loss, gradients, before, after."""
    loss.backward()
    # kept in the parameters' dtype and differenced in fp32 one tensor at a time, so a bf16 Qwen3-4B
    # comparison (8 GB per copy) fits one H200 with both models resident
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    res = {"optimisation_loss": loss.detach().float(),
           "gradients": {n: p.grad.detach().clone() for n, p in params if p.grad is not None},
           "before": {n: p.detach().clone() for n, p in params}}
    torch.optim.AdamW([p for _, p in params], lr=lr).step()
    model.zero_grad(set_to_none=True)
    res["after"] = {n: p.detach().clone() for n, p in params}
    return res


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 else (0.0 if x == 0 else math.inf)


def _stats(diff: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    d, b = diff.abs().float(), base.abs().float()
    bmax, bmean = (float(b.max()), float(b.mean())) if b.numel() else (0.0, 0.0)
    dmax, dmean = (float(d.max()), float(d.mean())) if d.numel() else (0.0, 0.0)
    if not (math.isfinite(dmax) and torch.isfinite(diff).all()):
        dmax = dmean = math.inf
    return {"max_abs": dmax, "mean_abs": dmean, "linf_over_baseline_max": _ratio(dmax, bmax),
            "mean_over_baseline_mean": _ratio(dmean, bmean), "baseline_max": bmax}


def _tensor_row(names, base: Callable[[str], torch.Tensor | None], new: Callable[[str], torch.Tensor | None]) -> dict:
    """The worst tensor (by max abs difference) of named tensors, plus the mean over all of them."""
    worst, worst_name, dsum, bsum, count = None, None, 0.0, 0.0, 0
    for name in names:
        b, n = base(name), new(name)
        if n is None:
            return {**_stats(torch.tensor([math.inf]), torch.tensor([1.0])), "tensor": name,
                    "note": "missing in the patched model"}
        diff = n.float() - b.float()
        s = _stats(diff, b)
        dsum += float(diff.abs().sum())
        bsum += float(b.float().abs().sum())
        count += b.numel()
        if worst is None or s["max_abs"] > worst["max_abs"] or math.isnan(s["max_abs"]):
            worst, worst_name = s, name
        del diff
    return {**worst, "tensor": worst_name, "mean_over_baseline_mean": _ratio(dsum, bsum),
            "mean_abs_all": dsum / max(count, 1)}


def _factory(models):
    """(baseline, patched) from a factory, one model (deep-copied) or a pair."""
    what = "compare takes a model factory, a model, or a (baseline, patched) pair"
    if isinstance(models, (tuple, list)):
        if len(models) != 2:
            raise ValueError(what)
        return models[0], models[1]
    if isinstance(models, torch.nn.Module):
        return models, copy.deepcopy(models)
    if not callable(models):
        raise TypeError(f"{what}; got {type(models).__name__}")
    base, new = models(), models()
    new.load_state_dict(base.state_dict())
    return base, new


def compare(models: Callable[[], torch.nn.Module] | torch.nn.Module | tuple, *, patch: bool | dict | Callable = True,
            dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
            inputs: dict | None = None, lr: float = 1e-3, seed: int = 0,
            tolerances: dict[str, float] | None = None) -> dict:
    """Run the baseline and the patched model on the same input and compare.

    models: a zero-argument factory (called twice; the second gets the first's state dict), a model
    (deep-copied), or a (baseline, patched) pair.  patch: True applies ``liger_rt.patch`` with the
    family defaults to the second model, a dict gives its flags, a callable(model) patches it your
    way, False leaves it as given.  Returns ``ok``, ``patched`` and ``rows`` (per quantity: max_abs,
    mean_abs, linf_over_baseline_max, mean_over_baseline_mean, tolerance, gate, ok; worst tensor).
    """
    from liger_rt.dtypes import parse_dtype
    from liger_rt.patch import core
    base, new = _factory(models)
    dtype = parse_dtype(dtype) if dtype is not None else None
    for model in (base, new):
        model.to(device=device, dtype=dtype)
    if patch is True:
        core.patch(new)
    elif isinstance(patch, dict):
        core.patch(new, **patch)
    elif callable(patch):
        patch(new)
    inputs = inputs if inputs is not None else make_inputs(base, seed=seed)
    return {**build_report(base, new, inputs, lr=lr, seed=seed, tolerances=tolerances),
            "fused_logprobs": fused_logprobs(new),
            "softcapped_head": bool(getattr(getattr(new, "config", None), "final_logit_softcapping", None))}


def build_report(base, new, inputs: dict, *, lr: float, seed: int, run: Callable | None = None,
                 tolerances: dict | None = None, full: Callable = lambda t: t, inner=None) -> dict:
    """`run` (default `_run`) on each model from torch.manual_seed(seed), then the gated rows.  `full`
    gathers a sharded tensor whole (a collective: rows go in ROWS order on every rank); `inner` is `new`
    unwrapped."""
    results = []
    for model in (base, new):
        torch.manual_seed(seed)
        results.append((run or _run)(model, inputs, lr))
    rb, rn = results
    dtype = next(base.parameters()).dtype
    tol = {**TOLERANCES.get(dtype, TOLERANCES[torch.float32]), **(tolerances or {})}

    def update(res):
        after, before = res["after"], res["before"]
        return lambda n: full(after[n]).float() - full(before[n]).float() if n in after else None
    rows: dict[str, dict] = {}
    for name in ROWS:
        if name == "gradients":
            row = _tensor_row(rb["gradients"], lambda n: full(rb["gradients"][n]),
                              lambda n: full(rn["gradients"].get(n)))
        elif name == "adamw_update":
            row = _tensor_row(rb["after"], update(rb), update(rn))
        elif name in rb:
            row = _stats(rn[name] - rb[name], rb[name])
        else:
            continue
        gate = GATE_STAT[name]
        row.update(tolerance=tol[name], gate=gate, ok=bool(row[gate] <= tol[name]))
        rows[name] = row
    from liger_rt.patch import describe
    inner = new if inner is None else inner
    return {"ok": all(r["ok"] for r in rows.values()), "dtype": str(dtype).replace("torch.", ""),
            "device": str(next(base.parameters()).device), "lr": lr, "rows": rows,
            "patched": describe(inner), "model_class": type(inner).__name__}


def format_table(report: dict) -> str:
    head = f"{'quantity':<28}{'max abs':>14}{'mean abs':>14}{'L-inf/base max':>16}{'gate':>12}  status"
    lines = [head, "-" * len(head)]
    for name in (n for n in ROWS if n in report["rows"]):   # a run may measure fewer rows
        r = report["rows"][name]
        gate = f"{'mean' if r['gate'] == 'mean_over_baseline_mean' else 'linf'}<={r['tolerance']:.0e}"
        status = "ok" if r["ok"] else f"FAIL ({r[r['gate']]:.3g})"
        lines.append(f"{LABELS[name]:<28}{r['max_abs']:>14.7e}{r['mean_abs']:>14.7e}"
                     f"{r['linf_over_baseline_max']:>16.7e}{gate:>12}  {status}")
        if "tensor" in r:
            lines.append(f"{'':<28}  worst tensor: {r['tensor']}")
    return "\n".join(lines)


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def checked(fn: Callable, *args, param: str):
    """fn(*args), its ValueError turned into a one-line CLI error naming the option `param`."""
    try:
        return fn(*args)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=param) from None


@click.command("parity")
@click.option("--model", "model_type", required=True,
              help="Model type: qwen3, llama, qwen3_moe, lfm2, lfm2_moe, lfm2_vl.")
@click.option("--preset", default="tiny", show_default=True,
              help="tiny (the model type's tiny preset), a preset name (e.g. qwen3-4b) or a PATH.json.")
@click.option("--dtype", "dtype_name", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--flags", "flags_text", default=None, help="liger_rt.patch flags on top of the family defaults, "
              "e.g. fused_linear_cross_entropy=1,layer_norm=1.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float, help="AdamW learning rate of the one step.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def parity(model_type, preset, dtype_name, device, flags_text, seed, lr, as_json):
    """Patched vs unpatched model from a config (random weights, no hub): logits, log-probs, entropy, losses,
    grads, AdamW step."""
    from liger_rt.dtypes import parse_dtype
    from liger_rt.patch import core
    from liger_rt.tools.bench.model import parse_flags
    from liger_rt.tools.models import build_model
    from liger_rt.tools.presets import get_preset
    checked(core._spec, model_type, param="--model")
    p = checked(get_preset, preset, model_type, param="--preset")
    if p.model_type != model_type:
        raise click.BadParameter(f"preset {p.name} is a {p.model_type} model, not {model_type}", param_hint="--preset")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA/ROCm device here", param_hint="--device")
    flags = checked(parse_flags, flags_text, param="--flags")
    dtype = parse_dtype(dtype_name)
    try:
        report = compare(lambda: build_model(p, dtype=dtype, device=device, seed=seed), patch=flags, lr=lr, seed=seed)
    except (ValueError, TypeError, NotImplementedError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    report.update(model_type=model_type, preset=p.name, flags=flags)
    if as_json:
        click.echo(json.dumps(_json_safe(report), indent=1, default=str))
    else:
        what = ", ".join(f"{k} x{v}" for k, v in ((report.get("patched") or {}).get("patched") or {}).items())
        via = ("" if not report["fused_logprobs"] else "; action log-probs and entropy through the chunked "
               "torch path (softcapped head)" if report.get("softcapped_head") else
               "; action log-probs and entropy through fused_linear_logprobs")
        click.echo(f"liger-tune parity: {model_type} ({p.name}), {report['dtype']} on {report['device']}; "
                   f"patched: {what or 'nothing'}{via}")
        click.echo(format_table(report))
        click.echo("PASS" if report["ok"] else
                   "FAIL: " + ", ".join(LABELS[n] for n, r in report["rows"].items() if not r["ok"]))
    if not report["ok"]:
        raise SystemExit(1)
