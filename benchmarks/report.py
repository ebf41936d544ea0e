"""docs/perf.md, its plots, README.md's performance table and docs/patching.md's parity cells, from the dataset.

    python benchmarks/report.py            # write them
    python benchmarks/report.py --check    # exit 1 where one differs from what benchmarks/data gives

The current figure of a benchmark (kind, name, shape, dtype, arm, metric, GPU) is the median of its rows of the
latest date, with their min-max and count.  The text needs only the standard library; the plots need matplotlib
(the `plot` extra) and are written, or checked, only where it imports.  A plot carries the digest of the numbers it
draws (PNG text `Source-Digest`), so checking one needs no redrawing.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import re
import statistics
import sys
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ("kernels", "models", "host")
KERNEL_KINDS = {"norms": "RMSNorm and LayerNorm", "gated_mlp": "Gated MLP (SwiGLU, GeGLU)",
                "losses": "Cross-entropy and fused linear cross-entropy", "logprobs": "Fused linear log-probs",
                "lfm2_ops": "LFM2 gated short convolution", "moe_router": "LFM2-MoE router",
                "moe_experts": "MoE experts"}
MODEL_KINDS = {"model": "Training steps", "model_compiled": "Compiled training steps",
               "max_seq": "Longest trainable sequence"}
ARM_ORDER = ("liger_rt", "triton", "grouped_mm", "liger_rt+torch_compile", "liger_rt+torch_compile+fuse",
             "liger_rt+torch_compile+kernels", "eager", "torch_compile", "liger_kernel", "trl", "liger_rt+ckpt",
             "eager+ckpt", "liger_kernel+ckpt")
# the longest-sequence table's columns: each arm beside its activation-checkpointed run
MAX_SEQ_ORDER = ("liger_rt", "liger_rt+ckpt", "eager", "eager+ckpt", "torch_compile", "liger_kernel",
                 "liger_kernel+ckpt", "liger_rt+torch_compile")
PEERS = ("eager", "torch_compile", "liger_kernel", "trl")
PEER_NAMES = {"liger_kernel": "Liger-Kernel", "trl": "TRL"}
MARGIN_KINDS, MARGIN = ("moe_experts",), 1.15      # kernel tables that count their shapes liger_rt leads by MARGIN
NOT_MEASURED = ("AMD Instinct MI300X", "AMD Instinct MI325X")
README_MARKERS = ("<!-- perf-table:begin (benchmarks/report.py) -->", "<!-- perf-table:end -->")
PARITY_MARKERS = ("<!-- parity:begin (benchmarks/report.py) -->", "<!-- parity:end -->")


# -- data ---------------------------------------------------------------------------------------------------

def measurement_rows(data: Path) -> list[dict]:
    rows = []
    for table in MEASUREMENTS:
        path = data / f"{table}.csv"
        if path.exists():
            with path.open(newline="") as fh:
                rows += list(csv.DictReader(fh))
    return rows


def retired(data: Path) -> list[dict]:
    """retired.csv: (run_id, name, shape, arm) of rows that no longer measure the shipped code (a blank field
    matches every value in the run), with the reason; they stay in the dataset and leave the current figures."""
    path = data / "retired.csv"
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def is_retired(row: dict, marks: list[dict]) -> bool:
    return any(m["run_id"] == row["run_id"] and all(m[k] in ("", row[k]) for k in ("name", "shape", "arm"))
               for m in marks)


def load(data: Path, raw: list[dict] | None = None, marks: list[dict] | None = None) -> list[dict]:
    """Every measurement row (`raw`: those already read) not retired (retired.csv; `marks`: its lines already
    read), plus a derived `frac_ceiling` row for each kernel rate that has none but whose run recorded its
    ceiling."""
    marks = retired(data) if marks is None else marks
    rows = [r for r in (measurement_rows(data) if raw is None else raw)
            if r["value"] not in ("", "nan") and not is_retired(r, marks)]
    ceilings = {(r["run_id"], r["kind"], r["metric"]): float(r["value"]) for r in rows if r["name"] == "ceiling"}
    has_frac = {_ident(r) for r in rows if r["metric"] == "frac_ceiling"}
    for r in list(rows):
        c = ceilings.get((r["run_id"], r["kind"], f"ceiling_{r['metric']}"))
        if r["metric"] in ("gbps", "tflops") and c and _ident(r) not in has_frac:
            rows.append({**r, "metric": "frac_ceiling", "unit": "", "value": str(float(r["value"]) / c)})
    return max_seq_searches([r for r in rows if r["name"] != "ceiling"])


def unmatched_retired(raw: list[dict], marks: list[dict]) -> list[dict]:
    """The retired.csv lines that match no measurement row (a mistyped run id retires nothing)."""
    return [m for m in marks if not any(is_retired(r, [m]) for r in raw)]


def max_seq_searches(rows: list[dict]) -> list[dict]:
    """Of one day's longest-sequence searches of an arm, those that found a length running out of memory; where
    none did, the one that reached furthest (a lower bound pooled with a smaller one would read as a median)."""
    def arm_day(r: dict) -> tuple:
        return r["gpu"], r["name"], r["shape"], r["dtype"], r["arm"], r["date"]

    runs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["kind"] == "max_seq":
            runs[arm_day(r)][r["run_id"]].append(r)
    keep = set()
    for key, by_run in runs.items():
        done = [rid for rid, rs in by_run.items() if any(r["metric"] == "oom_seq" for r in rs)]
        furthest = max(by_run, key=lambda rid: max((float(r["value"]) for r in by_run[rid]
                                                    if r["metric"] == "max_seq"), default=0.0))
        keep |= {(key, rid) for rid in done or [furthest]}
    return [r for r in rows if r["kind"] != "max_seq" or (arm_day(r), r["run_id"]) in keep]


def _ident(r: dict) -> tuple:
    return r["run_id"], r["kind"], r["name"], r["shape"], r["dtype"], r["arm"]


@dataclass(frozen=True)
class Figure:
    """The current figure of one benchmark: its latest date's values and what they ran on."""
    values: tuple[float, ...]
    date: str
    versions: tuple[tuple[str, str], ...]      # (column, value) of torch, triton, transformers, peer_version
    rounds: tuple[float, float, int] | None = None  # one row that is the median of rounds: (min, max, rounds)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def cell(self, fmt) -> str:
        if len(self.values) == 1 and self.rounds and self.rounds[2] > 1:
            lo, hi, n = self.rounds
            return f"{fmt(self.values[0])} ({fmt(lo)}-{fmt(hi)}, n={n})"
        if len(self.values) == 1:
            return fmt(self.values[0])
        return f"{fmt(self.median)} ({fmt(min(self.values))}-{fmt(max(self.values))}, n={len(self.values)})"


# a row that is already the median of a run's rounds names their spread in its notes (log-probs runs before they
# wrote a row per round)
ROUNDS_NOTE = re.compile(r"median of (\d+) rounds \(ms ([-+.\de]+)\.\.([-+.\de]+)")


def rounds_of(row: dict) -> tuple[float, float, int] | None:
    m = ROUNDS_NOTE.search(row.get("notes") or "") if row["metric"] == "ms" else None
    return (float(m.group(2)), float(m.group(3)), int(m.group(1))) if m else None


def current(rows: list[dict]) -> dict[tuple, Figure]:
    """(gpu, kind, name, shape, dtype, arm, metric) -> its Figure."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["gpu"], r["kind"], r["name"], r["shape"], r["dtype"], r["arm"], r["metric"])].append(r)
    out = {}
    for key, rs in groups.items():
        date = max(r["date"] for r in rs)
        latest = [r for r in rs if r["date"] == date]
        versions = tuple(sorted({(c, r[c]) for r in latest for c in ("torch", "triton", "transformers",
                                                                        "peer_version") if r[c]}))
        out[key] = Figure(tuple(float(r["value"]) for r in latest), date, versions,
                          rounds_of(latest[0]) if len(latest) == 1 else None)
    return out


def natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def arm_rank(arm: str) -> tuple:
    return (ARM_ORDER.index(arm), "") if arm in ARM_ORDER else (len(ARM_ORDER), arm)


def sig(v: float) -> str:
    return f"{v:.4g}"


def shape_fields(shape: str) -> dict[str, str]:
    """'batch=1;limit_gib=24' -> {'batch': '1', 'limit_gib': '24'}."""
    return dict(p.split("=", 1) for p in shape.split(";") if p)


def shape_text(shape: str) -> str:
    """'batch=4;seq=2048' -> '4x2048'; 'tokens=8192;hidden=2048;vocab=65536' -> 'T8192 H2048 V65536'."""
    m = re.fullmatch(r"batch=(\d+);seq=(\d+)", shape)
    if m:
        return f"{m.group(1)}x{m.group(2)}"
    short = {"tokens": "T", "experts": "E", "top_k": "top-", "hidden": "H", "intermediate": "I", "vocab": "V",
             "rows": "R", "routing": ""}
    return " ".join(f"{short.get(k, k + '=')}{v}" for k, v in shape_fields(shape).items())


def slug(gpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")


def versions_text(figs: list[Figure], peers: tuple[str, ...] = ()) -> str:
    seen: dict[str, set] = defaultdict(set)
    for f in figs:
        for col, v in f.versions:
            seen[col].add(v)
    names = {"torch": "torch", "triton": "Triton", "transformers": "transformers"}
    parts = [f"{names[c]} {' / '.join(sorted(seen[c]))}" for c in names if seen[c]]
    return ", ".join(parts + [f"{PEER_NAMES[p]} {v}" for p, v in peers])


def peer_versions(figs: dict[str, Figure]) -> tuple[tuple[str, str], ...]:
    return tuple((a, " / ".join(sorted({v for c, v in f.versions if c == "peer_version"})))
                 for a, f in figs.items() if a in PEER_NAMES and any(c == "peer_version" for c, _ in f.versions))


# -- docs/perf.md -------------------------------------------------------------------------------------------

def by_benchmark(cur: dict, gpu: str, kinds) -> dict[tuple, dict[tuple, Figure]]:
    """(kind, name, shape, dtype) -> {(arm, metric): Figure} on this GPU."""
    out: dict[tuple, dict] = defaultdict(dict)
    for (g, kind, name, shape, dtype, arm, metric), fig in cur.items():
        if g == gpu and kind in kinds:
            out[(kind, name, shape, dtype)][(arm, metric)] = fig
    return out


def dates(figs) -> str:
    ds = sorted({f.date for f in figs})
    return ds[0] if len(ds) == 1 else f"{ds[0]} to {ds[-1]}"


def arm_head(arm: str, benches: dict) -> str:
    """The arm's column header: a peer package with its version(s)."""
    vs = sorted({v for figs in benches.values() for (a, _), f in figs.items() if a == arm
                 for c, v in f.versions if c == "peer_version"})
    return f"{arm} {'/'.join(vs)}".strip()


def kernel_section(kind: str, benches: dict) -> list[str]:
    mine = {k: v for k, v in benches.items() if k[0] == kind}
    arms = sorted({a for figs in mine.values() for a, _ in figs if "@" not in a}, key=arm_rank)
    probes = {k: {a: f for (a, m), f in figs.items() if "@" in a and m == "ms"} for k, figs in mine.items()}
    head = [arm_head(a, mine) for a in arms]
    memory = any(m == "extra_gb" for figs in mine.values() for _, m in figs)
    lines = [f"### {KERNEL_KINDS.get(kind, kind)}", "",
             "| op.pass | shape | dtype | timer | " + " | ".join(head) + " | best peer / liger_rt | liger_rt rate "
             "(of ceiling) | " + ("extra GB: liger_rt, least peer | " if memory else "") + "date |",
             "| --- " * (len(arms) + 7 + memory) + "|"]
    trained = {(name, shape, dtype) for _, name, shape, dtype in mine}
    for (_, name, shape, dtype), figs in sorted(mine.items(), key=lambda kv: natural(" ".join(kv[0]))):
        if name.endswith(".fwd") and (f"{name}bwd", shape, dtype) in trained:
            continue                    # the forward alone where forward+backward was measured: in the dataset only
        if superseded((name, shape, dtype), figs, mine):
            continue                    # measured again later under a fuller shape: in the dataset only
        for timer, metric in (("device", "dev_ms"), ("wall", "ms")):
            row = {a: figs[(a, metric)] for a in arms if (a, metric) in figs}
            if not row:
                continue
            peers = [row[a].median for a in PEERS if a in row]
            ours = row.get("liger_rt")
            ratio = f"{min(peers) / ours.median:.2f}x" if peers and ours else "-"
            rate = "-"
            for m, unit in (("gbps", "GB/s"), ("tflops", "TFLOP/s")):
                if timer == "wall" and ("liger_rt", m) in figs:
                    frac = figs.get(("liger_rt", "frac_ceiling"))
                    rate = f"{figs[('liger_rt', m)].cell(sig)} {unit}" + (f" ({frac.median:.2f})" if frac else "")
            gb = "-"
            if memory and timer == "wall" and ("liger_rt", "extra_gb") in figs:
                least = min((figs[(a, "extra_gb")].median for a in PEERS if (a, "extra_gb") in figs), default=None)
                gb = f"{figs[('liger_rt', 'extra_gb')].median:.3g}" + (f", {least:.3g}" if least is not None else "")
            lines.append(f"| {name} | {shape} | {dtype} | {timer} | "
                         + " | ".join(row[a].cell(sig) if a in row else "-" for a in arms)
                         + f" | {ratio} | {rate} | " + (f"{gb} | " if memory else "") + f"{dates(row.values())} |")
    if kind in MARGIN_KINDS and (margin := peer_margin(mine, arms)):
        lines += ["", margin]
    shown = {k: v for k, v in probes.items() if v}
    if shown:
        lines += ["", "Config and variant probes (wall ms; not peers):", ""]
        for (_, name, shape, dtype), figs in sorted(shown.items(), key=lambda kv: natural(" ".join(kv[0]))):
            ranked = sorted(figs.items(), key=lambda af: af[1].median)
            best, worst = ranked[0], ranked[-1]
            lines.append(f"- {name} {shape} {dtype}: {len(ranked)} arms, fastest `{best[0]}` {best[1].cell(sig)}, "
                         f"slowest `{worst[0]}` {worst[1].cell(sig)} ({dates(figs.values())})")
    return lines + [""]


def superseded(key: tuple, figs: dict, mine: dict) -> bool:
    """Whether a later date measured the same benchmark under a fuller shape: the same fields and values and more
    (an MoE shape measured again with its routing named)."""
    name, shape, dtype = key
    fields, date = set(shape.split(";")), max(f.date for f in figs.values())
    return any(n == name and d == dtype and fields < set(s.split(";")) and max(f.date for f in other.values()) > date
               for (_, n, s, d), other in mine.items())


def peer_margin(mine: dict, arms: list[str], bar: float = MARGIN) -> str | None:
    """How many forward+backward shapes liger_rt leads the best peer at by `bar` or more (wall-clock medians),
    counted where every peer of the table ran; None where no shape has them all."""
    peers = [a for a in PEERS if a in arms]
    if not peers:
        return None
    ratios = [min(figs[(a, "ms")].median for a in peers) / figs[("liger_rt", "ms")].median
              for (_, name, _, _), figs in mine.items()
              if name.endswith(".fwdbwd") and ("liger_rt", "ms") in figs and all((a, "ms") in figs for a in peers)]
    if not ratios:
        return None
    return (f"Forward+backward, wall clock (medians), at the {len(ratios)} shapes where every peer "
            f"({', '.join(peers)}) ran: liger_rt at least {bar:.2f}x the best peer at {sum(r >= bar for r in ratios)}, "
            f"ahead of it at {sum(r > 1 for r in ratios)}.")


def model_section(kind: str, benches: dict) -> list[str]:
    """Model steps (tok/s) per arm, with peaks and MFU."""
    mine = {k: v for k, v in benches.items() if k[0] == kind}
    metric, unit, fmt = "tok_s", "tok/s", lambda v: f"{v / 1e3:.1f}k"
    arms = sorted({a for figs in mine.values() for a, m in figs if m == metric}, key=arm_rank)
    head = [arm_head(a, mine) for a in arms]
    compiled = kind == "model_compiled"         # there: the compiled patched model against the compiled baseline
    ratio_head = "compiled liger_rt / torch_compile" if compiled else "liger_rt / eager"
    lines = [f"### {MODEL_KINDS.get(kind, kind)} ({unit})", "",
             "| model | shape | dtype | " + " | ".join(head) + f" | {ratio_head} | peak GB | MFU liger_rt | date |",
             "| --- " * (len(arms) + 7) + "|"]
    for (_, name, shape, dtype), figs in sorted(mine.items(), key=lambda kv: natural(" ".join(kv[0]))):
        tok = {a: figs[(a, metric)] for a in arms if (a, metric) in figs}
        if not tok:
            continue
        # compiled: the later-measured of the two arms that run the default compile policy (fuse), +fuse on a tie
        ours = max([a for a in ("liger_rt+torch_compile+fuse", "liger_rt+torch_compile") if a in tok],
                   key=lambda a: tok[a].date, default=None) if compiled else "liger_rt"
        base = "torch_compile" if compiled else "eager"
        ratio = f"{tok[ours].median / tok[base].median:.3f}x" if ours in tok and base in tok else "-"
        peaks = ", ".join(f"{a} {figs[(a, 'peak_gb')].median:.2f}" for a in arms if (a, "peak_gb") in figs)
        mfu = figs.get(("liger_rt", "frac_ceiling"))
        lines.append(f"| {name} | {shape_text(shape)} | {dtype} | "
                     + " | ".join(tok[a].cell(fmt) if a in tok else "-" for a in arms)
                     + f" | {ratio} | {peaks or '-'} | {f'{mfu.median:.3f}' if mfu else '-'} | "
                     f"{dates(tok.values())} |")
    return lines + [""]


def tokens(v: float) -> str:
    """32768 -> '32K', 33280 -> '32.5K', 300 -> '300'."""
    if v >= 1024 and v % 512 == 0:
        k = v / 1024
        return f"{k:.0f}K" if k == int(k) else f"{k:.1f}K"
    return f"{v:.0f}"


def lower_bound(figs: dict, arm: str) -> bool:
    """An arm's longest sequence is only a lower bound: no length of its latest search ran out of memory."""
    oom = figs.get((arm, "oom_seq"))
    return oom is None or oom.date < figs[(arm, "max_seq")].date


def max_seq_cell(figs: dict, arm: str) -> str:
    """'32K, 23.4k tok/s, 77.9 GB' (medians), '>= 256K, ...' for a lower bound."""
    f = figs[(arm, "max_seq")]
    text = ("&ge; " if lower_bound(figs, arm) else "") + f.cell(tokens)
    tok, peak = figs.get((arm, "tok_s")), figs.get((arm, "peak_gb"))
    return text + (f", {tok.median / 1e3:.1f}k tok/s" if tok else "") + (f", {peak.median:.1f} GB" if peak else "")


def max_seq_ratio(figs: dict, num: str, den: str) -> str:
    """num's longest sequence over den's: '4.00x', '&ge; 4.00x' when num's is a lower bound, '-' when both are."""
    if (num, "max_seq") not in figs or (den, "max_seq") not in figs:
        return "-"
    lo_num, lo_den = lower_bound(figs, num), lower_bound(figs, den)
    if lo_num and lo_den:
        return "-"
    ratio = figs[(num, "max_seq")].median / figs[(den, "max_seq")].median
    return ("&ge; " if lo_num else "&le; " if lo_den else "") + f"{ratio:.2f}x"


def max_seq_section(benches: dict) -> list[str]:
    """Per model, each arm's longest trainable sequence (batch 1) with its tok/s and peak there."""
    mine = {k: v for k, v in benches.items() if k[0] == "max_seq"}
    arms = sorted({a for figs in mine.values() for a, m in figs if m == "max_seq"},
                  key=lambda a: (MAX_SEQ_ORDER.index(a), "") if a in MAX_SEQ_ORDER else (len(MAX_SEQ_ORDER), a))
    lines = [f"### {MODEL_KINDS['max_seq']}", "",
             "The longest sequence one full training step (forward, backward, fused AdamW step) fits at, then the "
             "tokens/s and peak allocated GB of a step there; &ge;: no length the search tried ran out of memory.", "",
             "| model | shape | " + " | ".join(arm_head(a, mine) for a in arms)
             + " | liger_rt / eager | liger_rt+ckpt / eager+ckpt | date |",
             "| --- " * (len(arms) + 5) + "|"]
    for (_, name, shape, dtype), figs in sorted(mine.items(), key=lambda kv: natural(" ".join(kv[0]))):
        have = [a for a in arms if (a, "max_seq") in figs]
        if not have:
            continue
        shape_cell = ", ".join(f"{k.replace('limit_gib', 'capped at')} {v}{' GiB' if k == 'limit_gib' else ''}"
                               for k, v in shape_fields(shape).items())
        lines.append(f"| {name} | {shape_cell}, {dtype} | "
                     + " | ".join(max_seq_cell(figs, a) if a in have else "-" for a in arms)
                     + f" | {max_seq_ratio(figs, 'liger_rt', 'eager')} | "
                       f"{max_seq_ratio(figs, 'liger_rt+ckpt', 'eager+ckpt')} | "
                       f"{dates(figs[(a, 'max_seq')] for a in have)} |")
    return lines + [""]


def host_section(benches: dict) -> list[str]:
    lines = ["### Host cost of a call (us)", "", "| probe | shape | arm | metric | value | date |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (_, name, shape, _), figs in sorted(benches.items(), key=lambda kv: natural(" ".join(kv[0]))):
        for (arm, metric), f in sorted(figs.items()):
            lines.append(f"| {name} | {shape or '-'} | {arm} | {metric} | {f.cell(sig)} | {f.date} |")
    return lines + [""]


METHOD = """\
## Method

- **Kernels** (`kernels.csv`): each arm gets its own copy of the inputs; forward+backward takes every input's
  gradient through `torch.autograd.grad`. Timer *wall*: the `triton.testing.do_bench` median with the L2 flushed
  before each call, timed from the host, so a launch-bound call pays its host cost. Timer *device*: the median
  replay of a captured CUDA graph of the call, no host cost. Rates count the bytes or FLOPs an op cannot avoid,
  over the wall time; "of ceiling" divides by the copy or bf16 matmul ceiling the same run measured. Where a
  shape was measured forward and backward, the tables show that pass; its forward alone is in the dataset.
- **Arms**: `liger_rt` is the public op through the shipped tuning DB; `triton` and `grouped_mm` force that
  implementation (`LIGER_RT_IMPL_<OP>`); `eager` is the Hugging Face module or plain PyTorch (MoE experts:
  transformers' `grouped_mm` experts); `torch_compile` compiles the eager arm; `liger_kernel` and `trl` are the
  peers at the version in the column header. *best peer / liger_rt* above 1 means liger_rt is faster.
- **Model steps** (`models.csv`): one SFT step (AdamW, random weights and tokens, bf16) per timed step; a run
  builds a fresh model, warms up, then times its steps; its figure is the median step as tokens/s, its peak the
  most memory allocated. Arms run in one process, in a counterbalanced order (baseline first and last).
  `liger_rt` patches the family's defaults and the fused loss, plus the flags after `+` in the model's name; the
  compiled arms compile the whole model (`liger_rt+torch_compile+fuse`: the default compile policy). MFU: model
  FLOPs per step over the step time and the measured bf16 matmul ceiling.
- **Longest trainable sequence** (`models.csv`, kind `max_seq`): per arm, the sequence length at batch 1 is
  doubled until one training step (forward, backward, fused AdamW step, the optimizer state already allocated)
  runs out of GPU memory, then bisected between the longest length that fit and the shortest that did not to 1/16
  of that bracket (at least 1024 tokens); each length runs in a fresh process. `+ckpt`: activation checkpointing
  of every decoder layer (`gradient_checkpointing_enable`, non-reentrant). Of one day's searches, those that found
  a length running out of memory count; where none did, the one that reached furthest (a lower bound, &ge;).
- **Current figure**: per benchmark, the rows of its latest date (from any runs and commits of that date; each row
  keeps its versions, commit and run id): median (min-max, n = measurements; a model run times each arm twice, a
  kernel or log-probs run may measure several rounds, a row each; a single row that is a run's median over its
  rounds shows their range).
"""


def not_measured(cur: dict) -> list[str]:
    gpus = {k[0] for k in cur}
    kinds = {k[1] for k in cur}
    lines = ["## Not measured", ""]
    lines += [f"- {g}: no row in the dataset." for g in NOT_MEASURED if g not in gpus]
    lines += [f"- `{k}` ({t.lower()}): no row in the dataset." for k, t in {**KERNEL_KINDS, **MODEL_KINDS}.items()
              if k not in kinds]
    return lines + [""]


def timed(kind: str, benches: dict) -> bool:
    """Whether the kind's rows are kernel timings (ms, dev_ms) rather than model-level figures."""
    return any(m in ("ms", "dev_ms") for k, figs in benches.items() if k[0] == kind for _, m in figs)


def perf_md(rows: list[dict]) -> tuple[str, dict[str, list]]:
    """The text and, per GPU with model steps, the plot's data."""
    cur = current(rows)
    gpus = sorted({k[0] for k in cur}, key=lambda g: (g == "cpu", g))
    out = ["# Performance", "",
           "Generated by `python benchmarks/report.py` from the dataset in `benchmarks/data/` (its columns: "
           "`benchmarks/data/README.md`); `--check` fails when this file differs from the data. Per GPU, the "
           "current figure of every benchmark; the method and what is not measured follow.", ""]
    plots = {}              # file name -> (GPU, what it draws, its data)
    for gpu in gpus:
        benches = by_benchmark(cur, gpu, {k[1] for k in cur})          # kinds without a title too
        figs = [f for v in benches.values() for f in v.values()]
        title = "CPU (no GPU)" if gpu == "cpu" else gpu
        peers = sorted({(a, ver) for figs_ in benches.values() for (a, _), f in figs_.items() if a in PEER_NAMES
                        for c, ver in f.versions if c == "peer_version"})
        out += [f"## {title}", "", f"Measured {dates(figs)}; {versions_text(figs, tuple(peers))}.", ""]
        steps = {k: v for k, v in benches.items() if k[0] == "model"}
        if steps:
            plots[f"perf_model_{slug(gpu)}.png"] = (gpu, "model", plot_data(steps))
            out += [f"![training steps on {gpu}](perf_model_{slug(gpu)}.png)", ""]
        present = {k[0] for k in benches}
        others = sorted(present - {*KERNEL_KINDS, *MODEL_KINDS, "host"})   # kinds this report has no title for
        for kind in [k for k in MODEL_KINDS if k in present] + [k for k in others if not timed(k, benches)]:
            if kind != "max_seq":
                out += model_section(kind, benches)
                continue
            out += max_seq_section(benches)
            plots[f"perf_max_seq_{slug(gpu)}.png"] = (gpu, "max_seq", max_seq_plot_data(benches))
            out += [f"![longest trainable sequence on {gpu}](perf_max_seq_{slug(gpu)}.png)", ""]
        for kind in [k for k in KERNEL_KINDS if k in present] + [k for k in others if timed(k, benches)]:
            out += kernel_section(kind, benches)
        hosts = {k: v for k, v in benches.items() if k[0] == "host"}
        if hosts:
            out += host_section(hosts)
    return "\n".join(out + [METHOD] + not_measured(cur)).rstrip() + "\n", plots


# -- plots --------------------------------------------------------------------------------------------------

def plot_data(steps: dict) -> list:
    """[label, [(arm, median, min, max)], [(arm, peak GB)]] per model step, sorted: what the plot draws."""
    out = []
    for (_, name, shape, dtype), figs in sorted(steps.items(), key=lambda kv: natural(" ".join(kv[0]))):
        label = f"{name.replace('+', chr(10) + '+', 1)}\n{shape_text(shape)}"
        arms = sorted((a for a, m in figs if m == "tok_s"), key=arm_rank)
        out.append([label, [(a, figs[(a, "tok_s")].median, min(figs[(a, "tok_s")].values),
                             max(figs[(a, "tok_s")].values)) for a in arms],
                    [(a, figs[(a, "peak_gb")].median) for a in arms if (a, "peak_gb") in figs]])
    return json.loads(json.dumps(out))


def max_seq_plot_data(benches: dict) -> list:
    """[label, [(arm, max_seq median, lower bound)]] per model: what the longest-sequence plot draws."""
    out = []
    for (_, name, shape, dtype), figs in sorted(((k, v) for k, v in benches.items() if k[0] == "max_seq"),
                                                key=lambda kv: natural(" ".join(kv[0]))):
        arms = sorted((a for a, m in figs if m == "max_seq"),
                      key=lambda a: (MAX_SEQ_ORDER.index(a), "") if a in MAX_SEQ_ORDER else (len(MAX_SEQ_ORDER), a))
        extra = "".join(f", {p}" for p in shape.split(";") if p and not p.startswith("batch="))
        out.append([f"{name}{extra}", [(a, figs[(a, "max_seq")].median, lower_bound(figs, a)) for a in arms]])
    return json.loads(json.dumps(out))


def draw_max_seq(gpu: str, data: list, path: Path) -> None:
    """Horizontal bars per model, one per arm, on a log2 axis of tokens; a lower bound hatched and marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = [a for a in MAX_SEQ_ORDER if any(a == x for _, bars in data for x, *_ in bars)]
    arms += sorted({x for _, bars in data for x, *_ in bars} - set(arms))
    colors = {"liger_rt": "tab:blue", "liger_rt+ckpt": "tab:cyan", "eager": "tab:gray", "eager+ckpt": "silver",
              "torch_compile": "tab:red", "liger_kernel": "tab:orange", "liger_kernel+ckpt": "navajowhite",
              "liger_rt+torch_compile": "tab:green"}
    height = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.32 * len(arms) * len(data)))
    for i, arm in enumerate(arms):
        for y, (_, bars) in enumerate(data):
            for a, seq, lower in bars:
                if a != arm:
                    continue
                pos = y + (i - (len(arms) - 1) / 2) * height
                ax.barh(pos, seq, height, color=colors.get(arm), hatch="//" if lower else None, edgecolor="black",
                        linewidth=0.3)
                ax.text(seq * 1.03, pos, (">= " if lower else "") + tokens(seq), va="center", fontsize=7)
    ax.set_xscale("log", base=2)
    seqs = [seq for _, bars in data for _, seq, _ in bars]
    lo, hi = 2 ** int(math.log2(min(seqs)) - 1), 2 ** math.ceil(math.log2(max(seqs)) + 1)
    ax.set_xlim(lo, hi)
    ticks = [2 ** k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]
    ax.set_xticks(ticks, [tokens(t) for t in ticks], fontsize=8)
    ax.set_yticks(range(len(data)), [d[0] for d in data], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("longest trainable sequence, tokens (batch 1; hatched: no length tried ran out of memory)")
    ax.set_title(f"Longest trainable sequence on {gpu}", fontsize=10)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(facecolor=colors.get(a), edgecolor="black", linewidth=0.3, label=a) for a in arms],
              fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None, "Source-Digest": digest(data)})
    plt.close(fig)


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def draw(gpu: str, data: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = sorted({a for _, toks, _ in data for a, *_ in toks}, key=arm_rank)
    colors = dict(zip(ARM_ORDER, ("tab:blue", "tab:cyan", "tab:purple", "tab:green", "tab:green", "tab:olive",
                                   "tab:gray", "tab:red", "tab:orange", "tab:brown")))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(data)), 7), sharex=True)
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs, tok, err, peak_x, peak = [], [], [[], []], [], []
        for x, (_, toks, peaks) in enumerate(data):
            for a, med, lo, hi in toks:
                if a == arm:
                    xs.append(x + (i - (len(arms) - 1) / 2) * width)
                    tok.append(med / 1e3)
                    err[0].append((med - lo) / 1e3)
                    err[1].append((hi - med) / 1e3)
            for a, gb in peaks:
                if a == arm:
                    peak_x.append(x + (i - (len(arms) - 1) / 2) * width)
                    peak.append(gb)
        ax.bar(xs, tok, width, yerr=err, label=arm, color=colors.get(arm), capsize=2)
        bx.bar(peak_x, peak, width, color=colors.get(arm))
    ax.set_ylabel("k tokens/s (median, min-max)")
    ax.set_title(f"Training steps on {gpu}: throughput and peak memory per arm", fontsize=10)
    ax.legend(fontsize=8, ncol=len(arms))
    bx.set_ylabel("peak allocated GB")
    bx.set_xticks(range(len(data)), [d[0] for d in data], fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None, "Source-Digest": digest(data)})
    plt.close(fig)


def png_digest(path: Path) -> str | None:
    """The `Source-Digest` text of a PNG written by `draw`, read without matplotlib."""
    blob = path.read_bytes() if path.exists() else b""
    i = 8
    while i + 8 <= len(blob):
        size, kind = int.from_bytes(blob[i:i + 4], "big"), blob[i + 4:i + 8]
        body = blob[i + 8:i + 8 + size]
        if kind == b"tEXt" and body.startswith(b"Source-Digest\0"):
            return body.split(b"\0", 1)[1].decode()
        if kind == b"zTXt" and body.startswith(b"Source-Digest\0"):
            return zlib.decompress(body.split(b"\0", 1)[1][1:]).decode()
        i += 12 + size
    return None


# -- README.md and docs/patching.md ---------------------------------------------------------------------------

def readme_table(rows: list[dict]) -> str:
    """Today's headline figures per GPU: model steps against eager, torch.compile and Liger-Kernel; the fused
    loss and the MoE experts against their peers."""
    cur = current(rows)
    lines = ["| GPU | benchmark | liger_rt | eager | torch.compile | Liger-Kernel | date | versions |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for gpu in sorted({k[0] for k in cur if k[0] != "cpu"}):
        benches = by_benchmark(cur, gpu, {"model", "model_compiled", "losses", "moe_experts", "max_seq"})
        latest = {}                 # per preset, its step (flags, shape) of the latest date, then of the most runs
        for (k, name, shape, dtype), figs in benches.items():
            if k == "model" and ("liger_rt", "tok_s") in figs:
                rank = (figs[("liger_rt", "tok_s")].date, len(figs[("liger_rt", "tok_s")].values))
                preset = name.split("+")[0]
                if preset not in latest or rank > latest[preset][0]:
                    latest[preset] = (rank, name, shape, dtype, figs)
        for _, (_, name, shape, dtype, figs) in sorted(latest.items(), key=lambda kv: natural(kv[0])):
            compiled = benches.get(("model_compiled", name, shape, dtype), {})
            figs = {**figs, **{("torch_compile", m): f for (a, m), f in compiled.items() if a == "torch_compile"}}
            lines.append(_readme_row(gpu, f"{name} train step, {shape_text(shape)} (tok/s, peak GB)", figs,
                                     ["liger_rt", "eager", "torch_compile", "liger_kernel"],
                                     lambda f, g: f"{f.median / 1e3:.1f}k, {g.median:.1f} GB" if g
                                     else f"{f.median / 1e3:.1f}k", ("tok_s", "peak_gb")))
        for (k, name, shape, dtype), figs in sorted(benches.items(), key=lambda kv: natural(" ".join(kv[0]))):
            if k == "losses" and name == "fused_linear_cross_entropy.fwdbwd" and ("liger_rt", "ms") in figs:
                lines.append(_readme_row(gpu, f"fused linear cross-entropy fwd+bwd, {shape_text(shape)} "
                                              "(ms, extra GB)", figs,
                                         ["liger_rt", "eager", "torch_compile", "liger_kernel"],
                                         lambda f, g: f"{f.median:.2f}, {g.median:.2f} GB" if g
                                         else f"{f.median:.2f}", ("ms", "extra_gb")))
            if k == "max_seq" and ("liger_rt", "max_seq") in figs and "limit_gib" not in shape:   # not emulated
                lines.append(max_seq_readme_row(gpu, name, shape, dtype, figs))
            if (k == "moe_experts" and name == "moe_experts.fwdbwd" and "tokens=16384" in shape
                    and "routing=uniform" in shape and ("liger_rt", "tflops") in figs):
                lines.append(_readme_row(gpu, f"MoE experts fwd+bwd, {shape_text(shape)} (TFLOP/s)", figs,
                                         ["liger_rt", "eager", None, "liger_kernel"],
                                         lambda f, g: f"{f.median:.0f}", ("tflops", None)))
    return "\n".join(lines)


def max_seq_readme_row(gpu, name, shape, dtype, figs) -> str:
    """The longest trainable sequence of each arm (liger_rt's with activation checkpointing beside its own)."""
    cols = ["liger_rt", "eager", "torch_compile", "liger_kernel"]
    cells = [max_seq_cell(figs, a) if (a, "max_seq") in figs else "-" for a in cols]
    if ("liger_rt+ckpt", "max_seq") in figs:
        cells[0] += f"; with activation checkpointing {max_seq_cell(figs, 'liger_rt+ckpt')}"
    used = [figs[(a, "max_seq")] for a in [*cols, "liger_rt+ckpt"] if (a, "max_seq") in figs]
    peers = peer_versions({a: figs[(a, "max_seq")] for a in cols if (a, "max_seq") in figs})
    batch = shape_fields(shape).get("batch", "1")
    return (f"| {gpu} | {name} longest trainable sequence, batch {batch} (tokens, tok/s and peak GB there) | "
            + " | ".join(cells) + f" | {dates(used)} | {versions_text(used, peers)} |")


def _readme_row(gpu, what, figs, cols, fmt, metrics) -> str:
    main, extra = metrics
    used = [figs[(a, main)] for a in cols if a and (a, main) in figs]
    cells = [fmt(figs[(a, main)], figs.get((a, extra))) if a and (a, main) in figs else "-" for a in cols]
    peers = peer_versions({a: figs[(a, main)] for a in cols if a and (a, main) in figs})
    return (f"| {gpu} | {what} | " + " | ".join(cells) + f" | {dates(used)} | {versions_text(used, peers)} |")


def parity_cells(data: Path) -> dict[str, tuple[str, str]]:
    """model type -> (CPU parity cell, GPU parity cell) from parity.csv."""
    path = data / "parity.csv"
    if not path.exists():
        return {}
    with path.open(newline="") as fh:
        return {r["model_type"]: (f"`{r['cpu_test']}`",
                                  f"{r['result']} on {r['gpu']}, {r['date']} ({r['gpu_case']}; `{r['gpu_test']}`)")
                for r in csv.DictReader(fh)}


def missing_tests(data: Path, root: Path) -> list[str]:
    """parity.csv's tests that do not exist (file or function) under `root`."""
    out = []
    for cpu, gpu in ((c.strip("`"), g.rsplit("`", 2)[-2]) for c, g in parity_cells(data).values()):
        for ref in (cpu, gpu):
            file, _, func = ref.partition("::")
            if not (root / file).exists() or f"def {func}(" not in (root / file).read_text():
                out.append(ref)
    return sorted(set(out))


def fill_parity(text: str, cells: dict) -> str:
    """Rewrite the last two cells (CPU, GPU parity) of each family row between the parity markers."""
    def row(line: str) -> str:
        m = re.match(r"\|\s*`([\w.]+)`", line)
        if not m or m.group(1) not in cells:
            return line
        parts = line.rstrip().rstrip("|").split(" | ")
        return " | ".join(parts[:-2] + list(cells[m.group(1)])) + " |"
    return replace_block(text, PARITY_MARKERS, lambda block: "\n".join(row(ln) for ln in block.split("\n")))


def replace_block(text: str, markers: tuple[str, str], new) -> str:
    begin, end = markers
    if begin not in text or end not in text:
        raise SystemExit(f"markers {begin!r} ... {end!r} not found")
    head, rest = text.split(begin, 1)
    block, tail = rest.split(end, 1)
    body = new(block.strip("\n")) if callable(new) else new
    return f"{head}{begin}\n{body}\n{end}{tail}"


# -- main ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where a file differs from what the data gives")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    args = ap.parse_args(argv)
    root = args.root
    data, docs = root / "benchmarks" / "data", root / "docs"
    raw, marks = measurement_rows(data), retired(data)
    rows = load(data, raw, marks)
    text, plots = perf_md(rows)
    readme_path, patching_path = root / "README.md", docs / "patching.md"
    want = {docs / "perf.md": text,
            readme_path: replace_block(readme_path.read_text(), README_MARKERS, readme_table(rows))}
    cells = parity_cells(data)
    if cells:
        want[patching_path] = fill_parity(patching_path.read_text(), cells)
    try:
        import matplotlib  # noqa: F401
        can_plot = True
    except ImportError:
        can_plot = False
    pngs = {docs / name: plot for name, plot in plots.items()}
    if args.check:
        stale = [str(p.relative_to(root)) for p, t in want.items() if not p.exists() or p.read_text() != t]
        if can_plot:
            stale += [str(p.relative_to(root)) for p, (_, _, d) in pngs.items() if png_digest(p) != digest(d)]
        stale += [f"parity.csv names a missing test: {t}" for t in missing_tests(data, root)]
        stale += [f"retired.csv names no row: {' '.join(m[k] for k in ('run_id', 'name', 'shape', 'arm'))}".rstrip()
                  for m in unmatched_retired(raw, marks)]
        if stale:
            print("out of date with benchmarks/data (run python benchmarks/report.py):\n  " + "\n  ".join(stale))
            return 1
        print(f"docs match benchmarks/data ({len(rows)} rows){'' if can_plot else '; plots not checked'}")
        return 0
    for path, t in want.items():
        path.write_text(t)
        print(f"wrote {path.relative_to(root)}")
    for path, (gpu, kind, d) in pngs.items():
        if can_plot:
            (draw_max_seq if kind == "max_seq" else draw)(gpu, d, path)
            print(f"wrote {path.relative_to(root)}")
        else:
            print(f"left {path.relative_to(root)} as it is: matplotlib is not installed (pip install 'liger-rt[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
