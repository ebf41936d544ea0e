"""Fused linear log-probs and entropy (RL's per-token log p(action) and entropy from hidden states).

    liger-tune bench logprobs [--quick] [--no-compile] [--tokens 8192] [--rounds 3] [--csv PATH]

Cases: bf16 (tokens, hidden, vocab) = (16384, 2560, 151936) and (8192, 2048, 65536), 10% ignored targets.  Passes:
`fwdbwd` (log-probs and entropy, then autograd.grad of sum(lp * g_lp + H * g_H) into x and W, as a PPO/GRPO loss does)
and `fwd_nograd` (old-policy and reference-model log-probs).  Arms: `liger_rt` (as dispatched), `eager` (the
materialised path: bf16 logits, log_softmax in fp32) and `compile` of it, `trl` (trl.kernels.ChunkedLogProbFunction as
add_fused_lm_head calls it) and `liger_kernel` (fused_selective_log_softmax on materialised logits, no-grad
only).  Columns: `ms` (do_bench median), `dev_ms` (CUDA-graph device time; none where the arm cannot be captured),
`peak_GB` (what the call allocates beyond what is live before it, returned gradients included),
`err_lp`/`err_ent` (max abs against an fp64 formula), `err_dx`/`err_dw` (relative L2), the peers' versions.
"""
from __future__ import annotations

import gc
import importlib
from typing import Callable

import click
import torch

from .harness import (dataset_arm, dataset_sink, decision_text, dist_version, error_line, format_table,
                      no_gpu_message, peak_extra_gb, peer, time_fn, versions, write_csv)

OP = "fused_linear_logprobs"
SPECS = [dict(op=OP, tokens=8192, hidden=2048, vocab=65536, quick=True),
         dict(op=OP, tokens=16384, hidden=2560, vocab=151936)]
TEMPERATURE = 1.0
PASSES = ("fwdbwd", "fwd_nograd")
PEERS = {"trl": "trl", "liger_kernel": "liger-kernel"}        # CSV column -> distribution

def make_inputs(tokens: int, hidden: int, vocab: int, dtype=torch.bfloat16, device="cuda", seed=0):
    """x, W (logits of std ~4, a trained head's spread), targets with 10% ignored, g_lp, g_H."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, device=device, generator=g) * (4.0 / hidden ** 0.5)).to(dtype)
    t = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    t[torch.rand(tokens, device=device, generator=g) < 0.1] = -100
    g_lp, g_h = (torch.randn(tokens, device=device, generator=g) for _ in range(2))
    return x, w, t, g_lp, g_h


def reference(x, w, t, g_lp, g_h, temperature=TEMPERATURE, rows=1024):
    """(lp, H, dx, dW) in fp64, `rows` token rows at a time."""
    w64 = w.detach().double().requires_grad_()
    blocks = []
    for s in range(0, x.shape[0], rows):
        xc = x[s:s + rows].detach().double().requires_grad_()
        z = (xc @ w64.t()) / temperature
        lse = torch.logsumexp(z, -1)
        tc = t[s:s + rows]
        valid = tc != -100
        lp = torch.where(valid, z.gather(-1, tc.clamp(min=0)[:, None])[:, 0] - lse, 0.0)
        ent = torch.where(valid, lse - (torch.softmax(z, -1) * z).sum(-1), 0.0)
        (lp * g_lp[s:s + rows].double() + ent * g_h[s:s + rows].double()).sum().backward()
        blocks.append((lp.detach(), ent.detach(), xc.grad))
        del z, lse, lp, ent, xc
    return (*(torch.cat(b) for b in zip(*blocks)), w64.grad)


# -- arms: fn(x, w, t) -> (lp, entropy or None), both (tokens,) fp32 ---------------------------------------

def materialised(x, w, t, temperature=TEMPERATURE):
    logp = torch.log_softmax((x @ w.t()).float() / temperature, dim=-1)
    valid = t != -100
    lp = logp.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.masked_fill(~valid, 0.0), ent.masked_fill(~valid, 0.0)


def ours(x, w, t):
    from liger_rt import ops
    return ops.fused_linear_logprobs(x, w, t, temperature=TEMPERATURE, return_entropy=True)


def trl_arm(echo=print) -> Callable | None:
    if (fn := peer("trl.kernels", "ChunkedLogProbFunction", echo)) is None:
        return None
    try:        # its backward imports this at call time; it needs accelerate, datasets, pandas, ...
        utils = importlib.import_module("trl.trainer.utils")
    except Exception as exc:
        echo(f"  trl arm skipped: trl.trainer.utils does not import ({type(exc).__name__}: {exc}); "
             f"benchmarks/bench_logprobs.py stands in for it where trl's wheel is carried alone")
        return None
    vocab_tile = getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
    note = "; trl.trainer.utils stood in" if getattr(utils, "STAND_IN", False) else ""

    def arm(x, w, t):
        mask = t != -100
        lp, ent, *_ = fn.apply(x[mask], w, None, t[mask], TEMPERATURE, vocab_tile, None, 1.0, ("entropy",))
        zeros = torch.zeros(t.shape, device=x.device, dtype=torch.float32)
        return zeros.masked_scatter(mask, lp), zeros.masked_scatter(mask, ent)
    arm.desc = f"ChunkedLogProbFunction, valid rows compacted, vocab tiles of {vocab_tile}{note}"
    return arm


def liger_arm(echo=print) -> Callable | None:
    if (fn := peer("liger_kernel.ops.grpo_loss", "fused_selective_log_softmax", echo)) is None:
        return None

    def arm(x, w, t):
        # it scores logits row l against ids[l + 1] (the causal shift) and only rows 0..N-2: ids are
        # the targets shifted right by one, and the last token row goes unscored (1/N of the work)
        ids = torch.cat([t[:1], t[:-1]])[None]
        lp = fn((x @ w.t())[None], ids, TEMPERATURE, (ids != -100).to(torch.int32))[0]
        return torch.cat([lp, lp.new_zeros(1)]), None
    arm.desc = "fused_selective_log_softmax on materialised bf16 logits"
    arm.no_grad_only = "fused_selective_log_softmax is @torch.no_grad (no backward) and has no entropy"
    arm.scored = slice(0, -1)
    return arm


def arms(compile_: bool, echo=print) -> dict[str, Callable | str]:
    """name -> fn (its optional attributes: desc, no_grad_only: why it has no fwdbwd pass, scored: the rows it
    scores), or the reason the arm is skipped."""
    out: dict[str, Callable | str] = {"liger_rt": ours, "eager": materialised}
    if compile_:
        out["compile"] = torch.compile(materialised, dynamic=False)
    out["trl"] = trl_arm(echo) or "trl.kernels.ChunkedLogProbFunction does not import (pip install trl>=1.16)"
    out["liger_kernel"] = liger_arm(echo) or "liger_kernel.ops.grpo_loss does not import (pip install liger-kernel)"
    return out


def _err(a, b, rel: bool = False) -> float:
    """max |a - b|, or with `rel` ||a - b|| / ||b||, against the fp64 `b`."""
    diff = a.double() - b
    return float(diff.norm() / b.norm().clamp_min(1e-30) if rel else diff.abs().max())


def measure(spec: dict, arm_set: dict, *, quick: bool, device: str = "cuda", rnd: int = 0, echo=print) -> list[dict]:
    """Every arm of `arm_set` (from :func:`arms`, shared by the rounds: a compiled arm compiles once) on one case, in
    its order on even rounds and reversed on odd ones."""
    from liger_rt import dispatch
    from liger_rt.dtypes import dtype_name
    dims = {k: spec[k] for k in ("tokens", "hidden", "vocab")}
    x, w, t, g_lp, g_h = make_inputs(**dims, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    ref_lp, ref_ent, ref_dx, ref_dw = reference(x, w, t, g_lp, g_h)
    d = dispatch.select(OP, dtype=dtype_name(x.dtype), arch=None if device == "cuda" else "cpu", **dims)
    label = {"op": OP, **dims, "dtype": d.dtype, "temperature": TEMPERATURE, "quick": quick, "round": rnd}
    rows = []
    order = list(arm_set.items())
    for name, fn in (order[::-1] if rnd % 2 else order):
        if isinstance(fn, str):
            rows += [{**label, "impl": name, "pass": p, "error": f"skipped: {fn}"} for p in PASSES]
            continue
        desc = decision_text(d) if name == "liger_rt" else getattr(fn, "desc", "")
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

        def fwdbwd(fn=fn, xs=xs, ws=ws):
            lp, ent = fn(xs, ws, t)
            return torch.autograd.grad((lp * g_lp + ent * g_h).sum(), (xs, ws))
        fwd_nograd = torch.no_grad()(lambda: fn(xs, ws, t))
        for p, run in (("fwdbwd", fwdbwd), ("fwd_nograd", fwd_nograd)):
            row = {**label, "impl": name, "pass": p, "config": desc, "error": ""}
            if p == "fwdbwd" and hasattr(fn, "no_grad_only"):
                rows.append({**row, "error": f"skipped: {fn.no_grad_only}"})
                continue
            try:
                lp, ent = fwd_nograd()
                scored = getattr(fn, "scored", slice(None))
                row.update(err_lp=_err(lp[scored], ref_lp[scored]), err_ent=None if ent is None else _err(ent, ref_ent))
                del lp, ent
                if p == "fwdbwd":
                    dx, dw = fwdbwd()
                    row.update(err_dx=_err(dx, ref_dx, rel=True), err_dw=_err(dw, ref_dw, rel=True))
                    del dx, dw
                ms, dev, how = time_fn(run, device, quick, arm=(OP, name))
                row.update(ms=ms, dev_ms=dev, dev_ms_method=how, peak_GB=peak_extra_gb(run))
            except Exception as exc:          # an arm that cannot take the case: recorded, never fatal
                row["error"] = error_line(exc)
                echo(f"  {name} {p}: {row['error']}")
            rows.append(row)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        del xs, ws
    _relative(rows)
    return rows


def _relative(rows: list[dict]) -> None:
    """vs_compile (compile ms / ms) and peak_vs_compile per pass, where both ran (rows of one round)."""
    for p in PASSES:
        base = next((r for r in rows if r["impl"] == "compile" and r["pass"] == p and r.get("ms")), None)
        for r in rows:
            if base and r["pass"] == p and r.get("ms"):
                r["vs_compile"] = base["ms"] / r["ms"]
                both = base.get("peak_GB") and r.get("peak_GB")
                r["peak_vs_compile"] = r["peak_GB"] / base["peak_GB"] if both else None


def _median_rows(rows: list[dict]) -> dict[str, dict]:
    """impl -> its row with the median ms over the rounds and the spread (min..max)."""
    out = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        runs = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["ms"])
        out[impl] = {**runs[(len(runs) - 1) // 2], "runs": len(runs),
                     "spread": f"{runs[0]['ms']:.4g}..{runs[-1]['ms']:.4g}"}
    return out


def verdicts(rows: list[dict]) -> list[str]:
    """Each case's liger_rt fwdbwd row (median over the rounds) against torch.compile's and TRL's time ("ok" where
    not slower) and against a quarter of compile's peak memory."""
    lines = []
    for key in dict.fromkeys((r["tokens"], r["hidden"], r["vocab"]) for r in rows):
        by = _median_rows([r for r in rows if (r["tokens"], r["hidden"], r["vocab"]) == key
                           and r["pass"] == "fwdbwd" and r.get("ms")])
        mine, name = by.get("liger_rt"), "T{} H{} V{}".format(*key)
        if mine is None:
            lines.append(f"{name}: liger_rt did not run")
            continue
        parts = [f"{'ok' if mine['ms'] <= by[p]['ms'] else 'MISSED'} time vs {p} ({mine['ms']:.4g} vs "
                 f"{by[p]['ms']:.4g} ms; median of {mine['runs']}, spread {mine['spread']} vs {by[p]['spread']})"
                 for p in ("compile", "trl") if p in by]
        if "compile" in by and by["compile"].get("peak_GB") and mine.get("peak_GB"):
            parts.append(f"{'ok' if mine['peak_GB'] <= by['compile']['peak_GB'] / 4 else 'MISSED'} peak <= 1/4 "
                         f"compile ({mine['peak_GB']:.3g} vs {by['compile']['peak_GB']:.3g} GB)")
        lines.append(f"{name} fwdbwd: " + "; ".join(parts or ["no peer ran"]))
    return lines


COLUMNS = ["tokens", "hidden", "vocab", "round", "impl", "pass", "ms", "dev_ms", "dev_ms_method", "peak_GB",
           "vs_compile", "err_lp", "err_ent", "err_dx", "err_dw", "error"]


def run(*, quick: bool = False, compile_: bool = True, tokens: tuple[int, ...] = (), csv_path=None, out_dir=None,
        specs: list[dict] | None = None, device: str = "cuda", echo: Callable = print, rounds: int = 1,
        on_case: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every selected case `rounds` times, the arm order reversed every other round.  After each case its rows go to
    `on_case` and, with `csv_path` (or a folder `out_dir`: logprobs_<device>.csv in it), every row so far is written
    there."""
    specs = [s for s in (specs or SPECS) if (s.get("quick") or not quick) and (not tokens or s["tokens"] in tokens)]
    if not specs:
        raise ValueError(f"no case has tokens in {list(tokens)}; cases: {', '.join(str(s['tokens']) for s in SPECS)}")
    peers = {col: dist_version(dist) or "not installed" for col, dist in PEERS.items()}
    echo(f"versions: {({**versions(), **peers})}")
    path = csv_path or (out_dir and f"{out_dir}/logprobs_{device}.csv")
    rows: list[dict] = []
    for spec in specs:
        arm_set, case = arms(compile_ and not quick, echo), []
        for rnd in range(rounds):
            echo(f"[logprobs] tokens={spec['tokens']} hidden={spec['hidden']} vocab={spec['vocab']} "
                 f"round {rnd + 1}/{rounds}")
            case += [{**r, **peers} for r in measure(spec, arm_set, quick=quick, device=device, rnd=rnd, echo=echo)]
            if path:
                write_csv(rows + case, path)
        rows += case
        if on_case:
            on_case(case)
    echo("\n".join([format_table(rows, COLUMNS), *verdicts(rows), *([f"wrote {path}"] if path else [])]))
    return rows


def logprobs_records(rows: list[dict]) -> list[dict]:
    """run rows as dataset records (kind `logprobs`, name `fused_linear_logprobs.<pass>`): per round, case, arm and
    pass, `ms` (do_bench), `dev_ms` (cuda-graph) and `extra_gb` (peak beyond the live inputs); docs/perf.md takes
    the rounds' median and spread."""
    n = 1 + max((r.get("round", 0) for r in rows), default=0)
    out = []
    for r in (r for r in rows if r.get("ms")):
        rnd = r.get("round", 0)
        order = f"round {rnd + 1} of {n}" + (", arms timed last to first" if rnd % 2 else "") if n > 1 else ""
        base = {"kind": "logprobs", "name": f"{OP}.{r['pass']}",
                "shape": {k: r[k] for k in ("tokens", "hidden", "vocab")}, "arm": dataset_arm(r["impl"]),
                "dtype": r["dtype"],
                "notes": "; ".join(filter(None, [order, f"temperature {r['temperature']}, 10% ignored targets",
                                                 f"config {r['config']}" if r["impl"] == "liger_rt" else ""]))}
        wall = "cpu-wall" if r.get("dev_ms_method") == "none: cpu" else "do_bench"
        peak = "peak fwd+bwd" if r["pass"] == "fwdbwd" else "peak fwd"
        for metric, col, unit, how in (("ms", "ms", "ms", wall), ("dev_ms", "dev_ms", "ms", r.get("dev_ms_method")),
                                       ("extra_gb", "peak_GB", "GB", peak)):
            if r.get(col) is not None:
                out.append({**base, "metric": metric, "value": r[col], "unit": unit, "method": how})
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--quick", is_flag=True, help="The (8192, 2048, 65536) case only, shorter timing, no torch.compile.")
@click.option("--no-compile", is_flag=True, help="Leave the torch.compile arm out.")
@click.option("--tokens", multiple=True, type=int, help="Only the case(s) with these token counts (repeatable).")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 9),
              help="Measure every case this many times, the arm order reversed every other round (medians).")
@click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False),
              help="Also write the rows (versions included) to this CSV.")
@click.option("--data", "data_dir", default=None, type=click.Path(file_okay=False),
              help="Append one row per measurement to kernels.csv in this folder (device, versions, run id).")
def main(quick, no_compile, tokens, rounds, csv_path, data_dir):
    """fused_linear_logprobs fwd+bwd and no-grad forward vs the materialised path, torch.compile, TRL, Liger-Kernel."""
    if not torch.cuda.is_available():
        raise click.ClickException(no_gpu_message("bench logprobs"))
    try:
        run(quick=quick, compile_=not no_compile, tokens=tuple(tokens), csv_path=csv_path, echo=click.echo,
            rounds=rounds, on_case=dataset_sink(data_dir, "kernels.csv", logprobs_records))
    except ValueError as exc:
        raise click.UsageError(str(exc))
