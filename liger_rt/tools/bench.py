"""`liger-tune bench`: kernel benchmarks against the measured ceilings, and model training steps.

    liger-tune bench kernels [--op OP ...] [--quick] [--out DIR]
    liger-tune bench model --model qwen3 --preset qwen3-1.7b [--batch 4 --seq 2048 ...]
    liger-tune bench ceilings

``kernels`` runs the repository's ``benchmarks/bench_*.py`` scripts (they are not part of the
installed package), one subprocess each, measures this device's copy and bf16 matmul ceilings in
the same run and prints one table: effective GB/s or TFLOP/s and the fraction of the ceiling.

``model`` times one SFT training step (random tokens, labels = input_ids, AdamW, sdpa attention)
of a model built from a preset with random weights, baseline against ``liger_rt.patch`` (and
Liger-Kernel's own patch where it is installed and knows the model type), counterbalanced:
baseline, liger_rt, [liger_kernel, liger_kernel,] liger_rt, baseline.  Each run builds a fresh
model from the same seed, so the loss curves of all runs must overlap.  Python API::

    from liger_rt.tools.bench import run_model_bench
    rows = run_model_bench("qwen3", "qwen3-tiny", batch=2, seq=16, steps=3, warmup=1, device="cpu")

LFM2-VL is benchmarked text-only: the step runs input_ids through the VL model without
pixel_values (the language model, its patched layers and the loss; the vision tower idles).
MoE families (lfm2_moe, qwen3_moe) use transformers' grouped_mm experts in every arm unless told
otherwise (the anchors' baseline); liger_rt.patch then swaps in its own experts where enabled.

Method (seed 004, shared/anchors/anchor_probe*.py): bf16 weights, fused AdamW (CUDA), the same
random batch every step, a torch.cuda.synchronize() on both sides of each timed step, warm-up
steps excluded, median step time per run, tokens/s = batch * seq / median, an arm's tokens/s
the mean over its runs, peak = torch.cuda.max_memory_allocated() over the measured steps (reset
after warm-up, so weights, grads and optimizer state are in it, as in the anchors).  Model
TFLOP/s is an estimate (6 * active matmul params * tokens + causal attention) and mfu its
fraction of the bf16 matmul ceiling measured in the same process.

On the H200: ``python benchmarks/bench_model.py --which all`` (the issue's three targets, about
3-5 min) and ``liger-tune bench kernels --quick`` (every kernel script, about 5 min; the full
run takes ~10 min: split it with --op, e.g. ``--op norms --op lfm2_ops`` then
``--op losses --op moe_experts``).
"""
from __future__ import annotations

import csv
import datetime
import gc
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import click

# -- shared helpers -------------------------------------------------------------------------------

VERSION_COLS = ("torch", "gpu", "date", "triton", "transformers", "liger_kernel", "liger_rt")


def versions() -> dict:
    """torch/triton/transformers/liger_kernel/liger_rt versions, GPU name and date for CSV rows."""
    import torch
    from importlib import metadata
    out = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    for col, dist in (("triton", "triton"), ("transformers", "transformers"), ("liger_kernel", "liger-kernel"),
                      ("liger_rt", "liger-rt")):
        try:
            out[col] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[col] = ""
    return out


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def format_table(rows: list[dict], cols: list[str], headers: dict | None = None) -> str:
    headers = headers or {}
    if not rows:
        return "(no rows)"
    names = [headers.get(c, c) for c in cols]
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(n), *(len(row[i]) for row in cells)) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_rows_csv(rows: list[dict], path: str | Path) -> Path:
    """Rows (plus version columns) to a CSV; lists/dicts become JSON; None becomes 'n/a'.

    A copy also goes to $OUT when that is set (the device tool brings $OUT back).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = versions()
    rows = [{**r, **{k: v for k, v in info.items() if k not in r}} for r in rows]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict))
                            else "n/a" if v is None else v) for k, v in r.items()})
    _copy_to_out(path)
    return path


def _copy_to_out(path: Path) -> None:
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        dest = Path(out) / path.name
        if dest.resolve() != path.resolve():
            shutil.copyfile(path, dest)


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


# -- ceilings -------------------------------------------------------------------------------------

def measure_ceilings(device: str = "cuda", *, quick: bool = False) -> dict:
    """This device's copy bandwidth (GB/s) and bf16 matmul throughput (TFLOP/s), measured now.

    A copy of a 2 GiB bf16 tensor into another (bytes read + written over time) and an
    8192^3 bf16 matmul, each the median of triton.testing.do_bench — the method of
    shared/anchors/anchor_probe.py (H200: ~4.25 TB/s, ~720-790 TFLOP/s).

    >>> measure_ceilings()    # doctest: +SKIP
    {'copy_GBps': 4251.3, 'bf16_matmul_TFLOPs': 741.0, 'device': 'NVIDIA H200', ...}
    """
    import torch
    if device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("measure_ceilings needs a CUDA/ROCm device; none is available here")
    from triton.testing import do_bench
    rep = 50 if quick else 100
    n = 1 << 30                           # 2 GiB of bf16 per buffer
    free = torch.cuda.mem_get_info()[0]
    while 2 * n * 2 > free * 0.8 and n > (1 << 24):
        n //= 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t_copy = do_bench(lambda: b.copy_(a), warmup=25, rep=rep, return_mode="median")
    copy_gbps = 2 * n * 2 / (t_copy * 1e-3) / 1e9
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    t_mm = do_bench(lambda: x @ y, warmup=25, rep=rep, return_mode="median")
    tflops = 2 * m ** 3 / (t_mm * 1e-3) / 1e12
    del x, y
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbps, "bf16_matmul_TFLOPs": tflops, "device": torch.cuda.get_device_name(),
            "copy_bytes": 2 * n * 2, "matmul_n": m}


def _no_gpu_message(what: str) -> str:
    import torch
    return (f"{what} needs a CUDA/ROCm GPU and this machine has none (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False). Kernel timings and ceilings are device measurements; "
            f"run this on the GPU machine. On CPU, `liger-tune bench model --model qwen3 --preset tiny --device cpu` "
            f"checks the model step plumbing.")


# -- kernels --------------------------------------------------------------------------------------

# benchmark script stem (benchmarks/bench_<stem>.py) -> the ops it covers
KERNEL_SCRIPTS: dict[str, tuple[str, ...]] = {
    "norms": ("rms_norm", "swiglu", "layer_norm"),
    "lfm2_ops": ("short_conv", "moe_router"),
    "moe_experts": ("moe_experts",),
    "losses": ("cross_entropy", "fused_linear_cross_entropy"),
}
NOT_KERNEL_SCRIPTS = ("model",)       # bench_model.py is the model bench, not a kernel bench


def find_benchmarks_dir(explicit: str | None = None) -> Path | None:
    """The repository's benchmarks/ folder: --benchmarks, else the cwd or a parent, else beside the
    package source (editable installs).  None when there is none (installed from a wheel)."""
    cands: list[Path] = []
    if explicit:
        cands.append(Path(explicit))
    cwd = Path.cwd().resolve()
    cands += [p / "benchmarks" for p in (cwd, *cwd.parents)]
    cands.append(Path(__file__).resolve().parents[2] / "benchmarks")
    for c in cands:
        if (c / "_harness.py").is_file():
            return c
    if explicit and Path(explicit).is_dir():
        return Path(explicit)
    return None


def available_scripts(bench_dir: Path) -> dict[str, Path]:
    """stem -> path of each kernel benchmark script present (bench_*.py except bench_model.py)."""
    out = {}
    for p in sorted(bench_dir.glob("bench_*.py")):
        stem = p.stem[len("bench_"):]
        if stem not in NOT_KERNEL_SCRIPTS:
            out[stem] = p
    return out


def known_kernel_names() -> list[str]:
    names = list(KERNEL_SCRIPTS)
    for ops in KERNEL_SCRIPTS.values():
        names += [o for o in ops if o not in names]
    try:
        from liger_rt import dispatch
        names += [o for o in dispatch.OP_MODULES if o not in names]
    except Exception:
        pass
    return names


def resolve_scripts(ops: list[str], scripts: dict[str, Path]) -> tuple[list[str], dict[str, set[str]]]:
    """Which script stems to run for the requested ops (all present scripts when none), and for
    each stem which ops to keep from its rows (empty set: keep all).  Raises ValueError naming
    what exists when an op has no script."""
    if not ops:
        return list(scripts), {s: set() for s in scripts}
    chosen: dict[str, set[str]] = {}
    for op in ops:
        if op in scripts:                            # a script stem (norms, losses, ...)
            chosen.setdefault(op, set()).clear()
            chosen[op].add("*")
            continue
        stem = next((s for s in (op, *[k for k, v in KERNEL_SCRIPTS.items() if op in v]) if s in scripts), None)
        if stem is None and op not in known_kernel_names():
            raise ValueError(f"unknown op {op!r}; valid --op values: {', '.join(known_kernel_names())}")
        if stem is None:
            want = [k for k, v in KERNEL_SCRIPTS.items() if op in v] or [op]
            raise ValueError(f"no benchmark script for op {op!r} (expected benchmarks/bench_{want[0]}.py); "
                             f"scripts present: {', '.join(scripts) or 'none'}; valid --op values: "
                             f"{', '.join(known_kernel_names())}")
        keep = chosen.setdefault(stem, set())
        if "*" not in keep:
            keep.add(op)
    return list(chosen), {s: (set() if "*" in k else k) for s, k in chosen.items()}


def run_kernel_script(script: Path, *, quick: bool, ops: set[str] | None = None,
                      echo: Callable[[str], None] = click.echo,
                      timeout: float | None = None) -> tuple[int, list[Path], float]:
    """Run one benchmark script in a subprocess (cwd: the repo root), streaming its output.

    `ops` narrows a script that takes `--op` (bench_norms.py) to those ops.  The script's
    _harness.write_csv copies every CSV it writes to $OUT; a private $OUT catches them.
    Returns (exit code, CSV paths, seconds)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"liger_bench_{script.stem}_"))
    root = str(script.resolve().parent.parent)
    env = dict(os.environ, OUT=str(tmp), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")])))
    cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
    if ops and re.search(r"""add_argument\(\s*["']--op["']""", script.read_text()):
        cmd += [a for op in sorted(ops) for a in ("--op", op)]
    t0 = time.time()
    tag = script.stem[len("bench_"):]
    echo(f"[{tag}] $ {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, cwd=str(script.parent.parent), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        echo(f"[{tag}] {line.rstrip()}")
        if timeout and time.time() - t0 > timeout:
            proc.kill()
            echo(f"[{tag}] killed after {timeout:.0f} s")
            break
    rc = proc.wait()
    csvs = sorted(tmp.glob("*.csv"))
    if not csvs:   # a script that writes its CSV without _harness.write_csv: take fresh results
        shutil.rmtree(tmp, ignore_errors=True)
        res = script.parent / "results"
        csvs = sorted(p for p in res.glob("*.csv") if p.stat().st_mtime >= t0 - 1) if res.is_dir() else []
    return rc, csvs, time.time() - t0


def read_csv_rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return [dict(r) for r in csv.DictReader(fh)]


_TIME = re.compile(r"^(?P<p>.*?)_?(ms|time_ms|median_ms)$", re.I)
_GBPS = re.compile(r"^(?P<p>.*?)_?(gbps|gb_s|gb/s|gbytes_s)$", re.I)
_TFLOPS = re.compile(r"^(?P<p>.*?)_?(tflops|tflop_s|tflop/s)$", re.I)
_MEM = re.compile(r"(peak|mem).*_?gb$|_gb$", re.I)
# derived or reference figures, never this run's measurement: the fraction is recomputed here
_SKIP = re.compile(r"(frac|pct|percent|ceiling|speedup|ratio|vs_|err|rmse|target|anchor|^ok$|meets)", re.I)
# columns that describe a row but do not name its case (so every arm of a case shares one label)
_NOT_LABEL = re.compile(r"^(config|origin|error|desc|description|notes?|reason)$|^(max|min)_|empty|count", re.I)
_OP_COLS = ("op", "kind")
_IMPL_COLS = ("impl", "provider", "implementation", "backend", "method", "peer", "arm")
_PASS_COLS = ("pass", "mode", "direction", "variant", "phase")
# the PyTorch / Hugging Face path each case is compared with (vs_baseline = its ms / ms)
_REF_IMPLS = ("eager", "hf_grouped_mm", "hf", "torch", "pytorch", "reference", "ref", "baseline")
OP_ALIASES = {"flce": "fused_linear_cross_entropy", "ce": "cross_entropy", "rmsnorm": "rms_norm",
              "layernorm": "layer_norm", "router": "moe_router", "experts": "moe_experts", "conv": "short_conv"}


def _num(v):
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def normalize_kernel_rows(rows: list[dict], bench: str, ceilings: dict | None) -> list[dict]:
    """Kernel-bench rows of any reasonable layout -> one long row per (case, impl, pass).

    Only comparison rows count: a row needs an implementation column (impl, provider, ...); the
    scripts' tuning tables (one row per launch config, no impl) stay in their own CSVs.  Metric
    columns are recognised by name: `<pass>_ms`, `<pass>_GBps`, `<pass>_TFLOPs` (an empty pass is
    named by a `pass`/`variant` column if there is one); every other integer or short string
    column except config/origin/error is part of the case label.  The fraction of the ceiling is
    recomputed against `ceilings` measured in this run (the larger of the copy and matmul
    fractions when a row reports both: that one binds); the scripts' own fractions, speedups and
    targets are left out."""
    out = []
    for r in rows:
        impl = next((r[c] for c in _IMPL_COLS if r.get(c) not in (None, "")), "")
        if not impl:
            continue
        op = next((r[c] for c in _OP_COLS if r.get(c) not in (None, "")), "")
        op = OP_ALIASES.get(str(op).lower(), op)
        pas = next((r[c] for c in _PASS_COLS if r.get(c) not in (None, "")), "")
        metrics: dict[str, dict] = {}
        label: dict[str, str] = {}
        mem = None
        for k, v in r.items():
            if k is None or k in VERSION_COLS or k in _OP_COLS or k in _IMPL_COLS or k in _PASS_COLS \
                    or _NOT_LABEL.search(k):
                continue
            for kind, rx in (("ms", _TIME), ("GBps", _GBPS), ("TFLOPs", _TFLOPS)):
                m = rx.match(k)
                if m and _num(v) is not None and not _SKIP.search(k):
                    metrics.setdefault(m.group("p").rstrip("_"), {})[kind] = _num(v)
                    break
            else:
                sv = "" if v is None else str(v).strip()
                if _MEM.search(k) and not _SKIP.search(k) and _num(v) is not None:
                    mem = _num(v)
                elif _SKIP.search(k) or sv in ("", "None", "True", "False", "n/a", "nan"):
                    continue
                elif _num(sv) is not None and not re.fullmatch(r"-?\d+", sv):
                    continue                      # a float that is not a metric we know
                elif len(sv) <= 40:
                    label[k] = sv
        case = ",".join(f"{k}={v}" for k, v in label.items())
        extra = {k: r[k] for k in ("config", "origin") if r.get(k) not in (None, "")}
        if not metrics and r.get("error"):
            out.append({"bench": bench, "op": op, "impl": impl, "case": case, "pass": pas, "ms": None,
                        "GBps": None, "TFLOPs": None, "peak_GB": None, "ceiling": "", "frac_ceiling": None,
                        "error": str(r["error"])[:120], **extra})
        for prefix, m in metrics.items():
            row = {"bench": bench, "op": op, "impl": impl, "case": case, "pass": prefix or pas or "",
                   "ms": m.get("ms"), "GBps": m.get("GBps"), "TFLOPs": m.get("TFLOPs"), "peak_GB": mem}
            fr_copy = row["GBps"] / ceilings["copy_GBps"] if ceilings and row["GBps"] else None
            fr_mm = row["TFLOPs"] / ceilings["bf16_matmul_TFLOPs"] if ceilings and row["TFLOPs"] else None
            if fr_copy is not None and (fr_mm is None or fr_copy >= fr_mm):
                row["ceiling"], row["frac_ceiling"] = "copy", fr_copy
            elif fr_mm is not None:
                row["ceiling"], row["frac_ceiling"] = "matmul", fr_mm
            else:
                row["ceiling"], row["frac_ceiling"] = "", None
            row.update(extra)
            out.append(row)
    # speed against the PyTorch / HF path of the same case and pass (the first of _REF_IMPLS present)
    ref: dict = {}
    for row in out:
        name = str(row["impl"]).lower()
        if name in _REF_IMPLS and row["ms"]:
            key = (row["bench"], row["op"], row["case"], row["pass"])
            rank = _REF_IMPLS.index(name)
            if key not in ref or rank < ref[key][0]:
                ref[key] = (rank, row["ms"])
    for row in out:
        base = ref.get((row["bench"], row["op"], row["case"], row["pass"]), (None, None))[1]
        row["vs_baseline"] = base / row["ms"] if base and row["ms"] else None
    return out


def _op_matches(row_op: str, keep: set[str]) -> bool:
    if not keep:
        return True
    canon = str(row_op).lower().replace("-", "_")
    known = {o.replace("_", "") for o in known_kernel_names()}
    if canon.replace("_", "") not in known:
        return True          # an op name we do not recognise: keep rather than drop silently
    return any(canon.replace("_", "") == k.replace("_", "") for k in keep)


KERNEL_COLS = ["bench", "op", "impl", "case", "pass", "ms", "GBps", "TFLOPs", "ceiling", "frac_ceiling",
               "vs_baseline"]


def run_kernel_bench(ops: list[str] | None = None, *, quick: bool = False, out_dir: str | Path | None = None,
                     benchmarks: str | None = None, echo: Callable[[str], None] = click.echo) -> list[dict]:
    """Run the kernel benchmark scripts for `ops` (default: every script present), measure the
    ceilings, and return the combined long rows, also written to OUT_DIR/kernels_combined.csv
    (a subset: kernels_<script>-<script>.csv; --quick adds _quick)."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError(_no_gpu_message("bench kernels"))
    bench_dir = find_benchmarks_dir(benchmarks)
    if bench_dir is None:
        raise FileNotFoundError(
            "kernel benchmark scripts not found: they live in the liger_rt repository's benchmarks/ folder "
            f"(benchmarks/bench_*.py), which an installed wheel does not ship. Looked in {Path.cwd()}/benchmarks, "
            f"its parents and {Path(__file__).resolve().parents[2]}/benchmarks. Run from a checkout or pass "
            "--benchmarks DIR.")
    scripts = available_scripts(bench_dir)
    if not scripts:
        raise FileNotFoundError(f"no kernel benchmark scripts (bench_*.py) in {bench_dir}")
    stems, keep = resolve_scripts(list(ops or []), scripts)
    missing = [s for s in KERNEL_SCRIPTS if s not in scripts]
    if missing and not ops:
        echo(f"note: not present (skipped): {', '.join(f'bench_{s}.py' for s in missing)}")
    echo(f"measuring ceilings on {torch.cuda.get_device_name()} ...")
    ceil = measure_ceilings("cuda", quick=quick)
    echo(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    out_dir = Path(out_dir) if out_dir else bench_dir / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    combined, status = [], []
    for stem in stems:
        rc, csvs, secs = run_kernel_script(scripts[stem], quick=quick, ops=keep[stem], echo=echo)
        n = 0
        for path in csvs:
            dest = out_dir / path.name
            if dest.resolve() != path.resolve():
                shutil.copyfile(path, dest)
            _copy_to_out(dest)
            rows = normalize_kernel_rows(read_csv_rows(path), stem, ceil)
            rows = [r for r in rows if _op_matches(r["op"], keep[stem])]
            combined += rows
            n += len(rows)
        if csvs and csvs[0].parent.name.startswith("liger_bench_"):
            shutil.rmtree(csvs[0].parent, ignore_errors=True)
        status.append({"bench": stem, "rc": rc, "csv": ",".join(p.name for p in csvs), "rows": n,
                       "seconds": round(secs, 1)})
    for r in combined:
        r["copy_ceiling_GBps"] = ceil["copy_GBps"]
        r["matmul_ceiling_TFLOPs"] = ceil["bf16_matmul_TFLOPs"]
        r["quick"] = quick
    echo("")
    echo(format_table(status, ["bench", "rc", "rows", "seconds", "csv"]))
    echo("")
    echo(f"kernels on {ceil['device']} (ceilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s, "
         f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s; frac = fraction of the binding ceiling; "
         f"vs_base = ms of the PyTorch/HF arm (eager, hf_grouped_mm) / ms)")
    cols = KERNEL_COLS + (["peak_GB"] if any(r.get("peak_GB") is not None for r in combined) else [])
    cols += ["error"] if any(r.get("error") for r in combined) else []
    shown = sorted(combined, key=lambda r: (stems.index(r["bench"]), r["op"], r["case"], r["pass"]))
    echo(format_table(shown, cols, {"frac_ceiling": "frac", "GBps": "GB/s", "TFLOPs": "TFLOP/s",
                                    "peak_GB": "peak GB", "vs_baseline": "vs_base"}))
    if combined:
        what = "combined" if not ops else "-".join(stems)
        path = write_rows_csv(combined, out_dir / f"kernels_{what}{'_quick' if quick else ''}.csv")
        echo(f"wrote {path}")
    failed = [f"{s['bench']} (exit {s['rc']})" if s["rc"] else f"{s['bench']} (wrote no CSV)"
              for s in status if s["rc"] != 0 or not s["csv"]]
    if failed:
        raise RuntimeError(f"benchmark script(s) failed: {', '.join(failed)}; their output is above")
    return combined


# -- model ----------------------------------------------------------------------------------------

ARMS = ("baseline", "liger_rt", "liger_kernel")


def parse_flags(text: str | None) -> dict[str, bool]:
    """'rms_norm=1,fused_linear_cross_entropy=0,swiglu' -> {'rms_norm': True, ...}."""
    out: dict[str, bool] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, _, val = part.partition("=")
        key, val = key.strip(), (val.strip().lower() or "1")
        if val in ("1", "true", "yes", "on"):
            out[key] = True
        elif val in ("0", "false", "no", "off"):
            out[key] = False
        else:
            raise ValueError(f"flag {part!r}: value must be 0/1 (or true/false, yes/no, on/off)")
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


def resolve_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA/ROCm GPU is available here (use --device cpu with a tiny preset)")
    return device


def _bench_preset(model_type: str, preset, layers: int | None, attention_layers: tuple[int, ...] | None):
    """The Preset to build: by name/`tiny`/PATH.json, with the layer count cut or grown."""
    import dataclasses
    from liger_rt.tools.presets import TINY_FOR_MODEL, get_preset
    if model_type not in TINY_FOR_MODEL:
        raise ValueError(f"unknown model type {model_type!r}; valid: {', '.join(TINY_FOR_MODEL)}")
    p = preset if not isinstance(preset, str) else get_preset(preset, model_type)
    if p.model_type != model_type:
        raise ValueError(f"preset {p.name!r} is a {p.model_type} preset, not {model_type}; "
                         f"presets for {model_type}: {', '.join(_preset_names(model_type))}")
    changes = {}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1 (got {layers})")
        changes["layers"] = layers
        if p.attention_layers and attention_layers is None:
            kept = tuple(i for i in p.attention_layers if i < layers)
            changes["attention_layers"] = kept
        if p.dense_layers and p.dense_layers > layers:
            changes["dense_layers"] = layers
    if attention_layers is not None:
        n = changes.get("layers", p.layers)
        bad = [i for i in attention_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"attention layers {bad} outside 0..{n - 1}")
        changes["attention_layers"] = tuple(attention_layers)
    if changes:
        suffix = f"-{changes['layers']}L" if "layers" in changes else "-custom"
        p = dataclasses.replace(p, name=p.name + suffix, **changes)
    return p


def _preset_names(model_type: str) -> list[str]:
    from liger_rt.tools.presets import presets_for
    return [p.name for p in presets_for(model_type)] + ["tiny"]


def _models_module():
    try:
        from liger_rt.tools import models
    except ImportError as exc:
        raise RuntimeError(f"liger_rt.tools.models (build_model/build_config) is not importable: {exc}") from exc
    return models


def _patch_module():
    try:
        import liger_rt.patch as P
    except ImportError as exc:
        raise RuntimeError(f"liger_rt.patch is not importable: {exc}") from exc
    if not hasattr(P, "patch"):
        raise RuntimeError("liger_rt.patch has no patch() (the patchers are not installed in this checkout)")
    return P


def check_patch_flags(preset, config_overrides: dict, flags: dict) -> None:
    """Fail before any timing when liger_rt.patch rejects the flags or the model: a dry patch of the
    same model built on the meta device (no memory, no init).  Other errors are left to the run."""
    import torch
    P = _patch_module()
    try:
        model = _build(preset, torch.float32, "meta", 0, config_overrides)
    except Exception:
        return
    try:
        P.patch(model, **flags)
    except (TypeError, ValueError, NotImplementedError, ImportError) as exc:
        raise ValueError(f"liger_rt.patch(model, {', '.join(f'{k}={v}' for k, v in flags.items())}): {exc}") from None
    except Exception:
        return
    try:
        P.unpatch(model)
    except Exception:
        pass


def _build(preset, dtype, device, seed, config_overrides: dict):
    """A fresh model from the preset (random weights from `seed`) with the config overrides."""
    models = _models_module()
    return models.build_model(preset, dtype=dtype, device=device, seed=seed, attn_implementation="sdpa",
                              **config_overrides)


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _random_ids(model, batch: int, seq: int, seed: int, device: str):
    """Uniform random tokens, fixed by seed, avoiding the model's image/video placeholder tokens
    (a text-only step through a VL model must not contain them)."""
    import torch
    vocab = int(_text_config(model).vocab_size)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    for attr in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        tid = getattr(model.config, attr, None)
        if isinstance(tid, int) and 0 <= tid < vocab:
            ids[ids == tid] = (tid + 1) % vocab
    return ids.to(device)


def train_flops_per_step(model, batch: int, seq: int) -> float:
    """Estimated training FLOPs of one step: 6 * active matmul params * tokens + causal attention.

    Active params: every weight of >= 2 dims except the input embedding and the vision tower
    (text-only step), experts scaled by top_k / experts, the LM head counted once even if tied.
    Attention: 3 * 2 * seq * heads * head_dim per token per attention layer (QK^T and PV,
    causal halves, forward + 2x backward)."""
    tc = _text_config(model)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_w = head.weight if head is not None else None
    experts, top_k = getattr(tc, "num_experts", None) or getattr(tc, "num_local_experts", None), \
        getattr(tc, "num_experts_per_tok", None)
    active = 0.0
    seen = set()
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in seen or "vision" in name or "multi_modal_projector" in name:
            continue
        seen.add(id(p))
        if p is emb and p is not head_w:
            continue
        n = float(p.numel())
        if p.dim() == 3 and experts and top_k and p.shape[0] == experts:
            n *= top_k / experts
        active += n
    if head_w is not None and id(head_w) not in seen:
        active += float(head_w.numel())
    tokens = batch * seq
    heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    types = getattr(tc, "layer_types", None)
    n_attn = sum(1 for t in types if "attention" in str(t)) if types else int(tc.num_hidden_layers)
    return 6.0 * active * tokens + 3.0 * n_attn * 2.0 * seq * heads * head_dim * tokens


class _LigerKernelPatch:
    """Liger-Kernel's instance patch, with the module-level mutations it makes (RMSNorm/MLP
    classes and rope functions swapped in the HF modeling module, F.cross_entropy) undone after
    the run, so later baseline runs build and run unpatched models."""

    def __init__(self):
        self.saved: list[tuple[object, dict, bool]] = []   # (module or class, snapshot, whole dict?)

    @staticmethod
    def supported(model_type: str) -> tuple[bool, str]:
        try:
            import liger_kernel  # noqa: F401
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except Exception as exc:
            return False, f"liger_kernel not importable ({type(exc).__name__}: {exc}); pip install liger-kernel"
        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            return False, f"Liger-Kernel has no patch for model type {model_type!r}"
        return True, ""

    def apply(self, model) -> None:
        import importlib
        import torch.nn.functional as F
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
        names = {type(model).__module__} | {type(m).__module__ for m in model.modules()}
        for mod in [importlib.import_module(n) for n in sorted(names) if n.startswith("transformers.")]:
            self.saved.append((mod, dict(vars(mod)), True))
            for obj in list(vars(mod).values()):
                if isinstance(obj, type) and obj.__module__ == mod.__name__:
                    self.saved.append((obj, dict(vars(obj)), True))
        self.saved.append((F, {"cross_entropy": F.cross_entropy}, False))
        _apply_liger_kernel_to_instance(model=model)

    def undo(self) -> None:
        for obj, snap, whole in reversed(self.saved):
            now = vars(obj)
            for k, v in snap.items():
                if now.get(k, _MISSING) is not v:
                    try:
                        setattr(obj, k, v)
                    except (AttributeError, TypeError):
                        pass
            if whole:
                for k in [k for k in list(now) if k not in snap]:
                    try:
                        delattr(obj, k)
                    except (AttributeError, TypeError):
                        pass
        self.saved.clear()


_MISSING = object()


def _run_arm(arm: str, *, preset, dtype, device, seed, overrides, flags, batch, seq, ids, steps, warmup,
             lr) -> dict:
    """One run: a fresh model, the arm's patch, warmup + steps timed steps; `ids` None on the first
    run (drawn from the model's vocab here and returned for the later runs)."""
    import torch
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    t_build = time.perf_counter()
    model = _build(preset, dtype, device, seed, overrides)
    model.train()
    undo = None
    try:
        if arm == "liger_rt":
            P = _patch_module()
            try:
                P.patch(model, **flags)
            except (TypeError, ValueError) as exc:      # unknown flag / model type: the patcher says which
                raise ValueError(f"liger_rt.patch(model, {flags}): {exc}") from exc
            undo = (lambda: P.unpatch(model)) if hasattr(P, "unpatch") else None
        elif arm == "liger_kernel":
            lk = _LigerKernelPatch()
            undo = lk.undo
            lk.apply(model)
        build_s = time.perf_counter() - t_build
        if ids is None:
            ids = _random_ids(model, batch, seq, seed, device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=(device == "cuda"))
        mem0 = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else None

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        losses, times = [], []
        for i in range(warmup + steps):
            if i == warmup and device == "cuda":     # peak of steady-state steps, as the anchors
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            t0 = time.perf_counter()
            loss = step()
            _sync(device)
            t = time.perf_counter() - t0
            losses.append(float(loss))
            if i >= warmup:
                times.append(t)
        med = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
        flops = train_flops_per_step(model, ids.shape[0], ids.shape[1])
        params = sum(p.numel() for p in model.parameters()) / 1e6
    finally:
        if undo is not None:
            undo()
        del model
        opt = None  # noqa: F841
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3, "max_step_ms": max(times) * 1e3,
            "tok_per_s": ids.numel() / med, "peak_alloc_GB": peak, "mem_after_build_GB": mem0,
            "loss_first": losses[0], "loss_last": losses[-1], "losses": losses, "build_s": build_s,
            "params_M": params, "flops_per_step": flops, "ids": ids}


# Largest max |loss difference| / initial loss between two runs' curves that still counts as
# overlapping.  Same weights, same batch: only kernel rounding separates the arms, compounded over a
# few AdamW steps.  Seen here: fp32 tiny models through the interpreter differ by ~2e-7 relative;
# the H200 anchor's bf16 qwen3-1.7b baseline vs Liger-Kernel differed by 4e-5 after 13 steps.  The
# bounds leave headroom for that and still flag a wrong gradient, which moves a curve by percents.
LOSS_RTOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 1e-2}


def loss_tolerance(dtype) -> float:
    from liger_rt.kernels._common import dtype_name
    return LOSS_RTOL[dtype if isinstance(dtype, str) else dtype_name(dtype)]


def run_model_bench(model_type: str, preset="tiny", *, batch: int = 4, seq: int = 2048, steps: int = 20,
                    warmup: int = 5, dtype="bf16", layers: int | None = None,
                    attention_layers: tuple[int, ...] | None = None, liger_kernel: bool = True,
                    flags: dict[str, bool] | None = None, device: str = "auto", seed: int = 0, lr: float = 1e-4,
                    experts_implementation: str | None = None, config: dict | None = None,
                    ceilings: dict | None = None,
                    echo: Callable[[str], None] | None = print) -> list[dict]:
    """Time one SFT training step, baseline against liger_rt.patch (and Liger-Kernel), counterbalanced.

    Order: baseline, liger_rt, [liger_kernel, liger_kernel,] liger_rt, baseline; each run builds a
    fresh model from `seed` (same weights), runs `warmup` + `steps` steps on the same random
    batch (labels = input_ids), and records the median synchronized step time of the measured
    steps, tokens/s = batch*seq/median, peak allocated memory of the measured steps (CUDA; None on
    CPU) and the loss of every step.  `flags` go to liger_rt.patch on top of
    {fused_linear_cross_entropy: True}.  lfm2_moe defaults to transformers' grouped_mm experts
    (the anchor's baseline); `experts_implementation` overrides it.  `config` holds further
    transformers config overrides for every arm (e.g. {"tie_word_embeddings": True}).

    Returns one row per run (kind="run", with run_index and the order) followed by one row per
    arm (kind="summary": mean tokens/s of its runs, max peak, speedup and memory against
    baseline, max loss-curve difference against the first baseline run).

    >>> rows = run_model_bench("qwen3", "tiny", batch=2, seq=16, steps=3, warmup=1, device="cpu")  # doctest: +SKIP
    """
    import torch
    from liger_rt.kernels._common import dtype_name, parse_dtype
    echo = echo or (lambda s: None)
    dt = parse_dtype(dtype)
    device = resolve_device(device)
    if steps < 1 or warmup < 0 or batch < 1 or seq < 2:
        raise ValueError("need steps >= 1, warmup >= 0, batch >= 1, seq >= 2")
    p = _bench_preset(model_type, preset, layers, attention_layers)
    overrides = dict(config or {})
    if model_type in ("lfm2_moe", "qwen3_moe"):
        overrides["experts_implementation"] = experts_implementation or "grouped_mm"
    elif experts_implementation:
        raise ValueError(f"experts_implementation applies to MoE models, not {model_type}")
    patch_flags = {"fused_linear_cross_entropy": True, **(flags or {})}

    check_patch_flags(p, overrides, patch_flags)
    arms = ["liger_rt"]
    lk_note = ""
    if liger_kernel:
        ok, lk_note = _LigerKernelPatch.supported(model_type)
        if ok:
            arms.append("liger_kernel")
    order = ["baseline", *arms, *reversed(arms), "baseline"]
    if device == "cuda" and ceilings is None:
        ceilings = measure_ceilings("cuda", quick=True)
    ids = None
    header = (f"bench model {model_type} preset {p.name} ({p.layers} layers), batch {batch} x seq {seq}, "
              f"{dtype_name(dt)}, {device}, warmup {warmup} + {steps} steps, lr {lr}, order {' > '.join(order)}")
    echo(header)
    if lk_note and liger_kernel:
        echo(f"  Liger-Kernel arm skipped: {lk_note}")
    if overrides:
        echo(f"  config overrides (all arms): {overrides}")
    echo(f"  liger_rt.patch flags: {patch_flags} (the family's defaults for the rest)")
    if device == "cpu":
        interp = os.environ.get("TRITON_INTERPRET", "")
        how = ("kernels run in the Triton interpreter" if interp == "1"
               else "liger_rt ops fall back to their torch references")
        echo(f"  CPU run: memory n/a; TRITON_INTERPRET={interp or 'unset'} ({how})")
    if ceilings:
        echo(f"  ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s")

    runs = []
    lk_error = ""
    for idx, arm in enumerate(order):
        if arm == "liger_kernel" and lk_error:
            continue
        t0 = time.time()
        try:
            res = _run_arm(arm, preset=p, dtype=dt, device=device, seed=seed, overrides=overrides,
                           flags=patch_flags, batch=batch, seq=seq, ids=ids, steps=steps, warmup=warmup, lr=lr)
        except Exception as exc:
            if arm != "liger_kernel":
                raise
            # the peer failing must not hide our numbers: note it, drop its runs, keep the order
            lk_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            echo(f"  [{idx + 1}/{len(order)}] liger_kernel FAILED ({lk_error}); continuing without it")
            continue
        ids = res.pop("ids")
        mem = f"{res['peak_alloc_GB']:.2f} GB" if res["peak_alloc_GB"] is not None else "n/a"
        echo(f"  [{idx + 1}/{len(order)}] {arm:12s} {res['median_step_ms']:9.2f} ms/step  "
             f"{res['tok_per_s']:10.0f} tok/s  peak {mem}  loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}"
             f"  ({time.time() - t0:.1f} s, build {res['build_s']:.1f} s)")
        runs.append({"arm": arm, "run_index": len(runs), **res})
    order = [r["arm"] for r in runs]
    if not lk_note and lk_error:
        lk_note = f"failed: {lk_error}"

    base_curve = runs[0]["losses"]
    common = dict(model_type=model_type, preset=p.name, layers=p.layers, batch=batch, seq=seq, steps=steps,
                  warmup=warmup, dtype=dtype_name(dt), device=device, lr=lr, seed=seed, order=">".join(order),
                  flags=",".join(f"{k}={int(v)}" for k, v in patch_flags.items()),
                  experts_implementation=overrides.get("experts_implementation", ""),
                  config=",".join(f"{k}={v}" for k, v in overrides.items()),
                  liger_kernel_note=lk_note if liger_kernel else "not requested",
                  copy_ceiling_GBps=ceilings["copy_GBps"] if ceilings else None,
                  matmul_ceiling_TFLOPs=ceilings["bf16_matmul_TFLOPs"] if ceilings else None)
    rows = []
    for r in runs:
        diff = max(abs(a - b) for a, b in zip(r["losses"], base_curve))
        tflops = r["flops_per_step"] / (r["median_step_ms"] * 1e-3) / 1e12
        rows.append({"kind": "run", **common, "arm": r["arm"], "run_index": r["run_index"],
                     "median_step_ms": r["median_step_ms"], "min_step_ms": r["min_step_ms"],
                     "max_step_ms": r["max_step_ms"], "tok_per_s": r["tok_per_s"],
                     "peak_alloc_GB": r["peak_alloc_GB"], "mem_after_build_GB": r["mem_after_build_GB"],
                     "model_TFLOPs": tflops,
                     "mfu": tflops / ceilings["bf16_matmul_TFLOPs"] if ceilings else None,
                     "params_M": r["params_M"], "loss_first": r["loss_first"], "loss_last": r["loss_last"],
                     "max_loss_diff": diff, "losses": [round(x, 6) for x in r["losses"]], "build_s": r["build_s"]})
    rows += summarize_runs(rows, dt)
    return rows


def summarize_runs(run_rows: list[dict], dtype=None) -> list[dict]:
    """One summary row per arm of one model: tokens/s = mean of its runs' batch*seq/median (the
    seed-004 method), median ms = batch*seq / that, peak = max of its runs, against baseline."""
    arms = [a for a in ARMS if any(r["arm"] == a for r in run_rows)]
    out = []
    base = None
    tol = loss_tolerance(dtype if dtype is not None else run_rows[0]["dtype"])
    for arm in arms:
        rs = [r for r in run_rows if r["arm"] == arm]
        tok = statistics.mean(r["tok_per_s"] for r in rs)
        peaks = [r["peak_alloc_GB"] for r in rs if r["peak_alloc_GB"] is not None]
        mfu = [r["mfu"] for r in rs if r["mfu"] is not None]
        row = {k: v for k, v in rs[0].items() if k not in ("run_index", "min_step_ms", "max_step_ms", "losses",
                                                          "build_s", "mem_after_build_GB")}
        loss_ref = abs(run_rows[0]["loss_first"]) or 1.0
        row.update(kind="summary", runs=len(rs), tok_per_s=tok,
                   median_step_ms=rs[0]["batch"] * rs[0]["seq"] / tok * 1e3,
                   tok_per_s_spread=(max(r["tok_per_s"] for r in rs) - min(r["tok_per_s"] for r in rs)) / tok,
                   peak_alloc_GB=max(peaks) if peaks else None,
                   model_TFLOPs=statistics.mean(r["model_TFLOPs"] for r in rs),
                   mfu=statistics.mean(mfu) if mfu else None,
                   max_loss_diff=max(r["max_loss_diff"] for r in rs),
                   loss_last=statistics.mean(r["loss_last"] for r in rs))
        row["loss_rel_diff"] = row["max_loss_diff"] / loss_ref
        row["loss_curves_overlap"] = row["loss_rel_diff"] <= tol
        if arm == "baseline":
            base = row
        row["speedup"] = tok / base["tok_per_s"] if base else None
        row["mem_ratio"] = (row["peak_alloc_GB"] / base["peak_alloc_GB"]
                            if base and row["peak_alloc_GB"] and base["peak_alloc_GB"] else None)
        out.append(row)
    return out


MODEL_COLS = ["model_type", "preset", "arm", "runs", "median_step_ms", "tok_per_s", "tok_per_s_spread", "speedup",
              "peak_alloc_GB", "mem_ratio", "model_TFLOPs", "mfu", "loss_last", "max_loss_diff", "loss_curves_overlap"]
MODEL_HEADERS = {"median_step_ms": "ms/step", "tok_per_s": "tok/s", "tok_per_s_spread": "spread",
                 "peak_alloc_GB": "peak GB", "mem_ratio": "mem x", "model_TFLOPs": "TFLOP/s",
                 "max_loss_diff": "max |dloss|", "loss_curves_overlap": "overlap", "speedup": "speedup x"}


def format_model_summary(rows: list[dict]) -> str:
    summ = [r for r in rows if r.get("kind") == "summary"]
    text = format_table(summ, MODEL_COLS, MODEL_HEADERS)
    notes = []
    for key in dict.fromkeys((r["model_type"], r["preset"]) for r in summ):
        rs = [r for r in rows if r.get("kind") == "run" and (r["model_type"], r["preset"]) == key]
        base = [r for r in rs if r["arm"] == "baseline"]
        if len(base) >= 2:
            notes.append(f"{key[1]}: baseline vs its repeat: max |dloss| {base[-1]['max_loss_diff']:.3g} "
                         f"(the noise floor the other arms compare with)")
        lk = next((r.get("liger_kernel_note") for r in summ if (r["model_type"], r["preset"]) == key), "")
        if lk and lk != "not requested":
            notes.append(f"{key[1]}: no Liger-Kernel arm: {lk}")
        bad = [r["arm"] for r in summ if (r["model_type"], r["preset"]) == key and not r["loss_curves_overlap"]]
        if bad:
            notes.append(f"{key[1]}: WARNING loss curves of {', '.join(bad)} do not overlap the baseline's "
                         f"(relative difference above {loss_tolerance(summ[0]['dtype']):.3g})")
    return text + ("\n" + "\n".join(notes) if notes else "")


def plot_model_rows(rows: list[dict], path: str | Path) -> Path:
    """PNG: per model, the loss curves of every run (left) and tokens/s + peak memory per arm (right)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib "
                           "(or pip install 'liger-rt[plot]')") from None
    keys = []
    for r in rows:
        k = (r["model_type"], r["preset"])
        if k not in keys:
            keys.append(k)
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 3.6 * len(keys)), squeeze=False)
    colors = {"baseline": "tab:gray", "liger_rt": "tab:blue", "liger_kernel": "tab:orange"}
    for i, key in enumerate(keys):
        ax, bx = axes[i]
        runs = [r for r in rows if r.get("kind") == "run" and (r["model_type"], r["preset"]) == key]
        for r in runs:
            losses = r["losses"] if isinstance(r["losses"], list) else json.loads(r["losses"])
            idx = int(r["run_index"])
            ax.plot(range(len(losses)), losses, color=colors.get(r["arm"]), alpha=0.8,
                    linestyle="-" if idx < len(runs) / 2 else "--", label=f"{r['arm']} #{idx + 1}")
        if runs and int(runs[0]["warmup"]):
            ax.axvline(int(runs[0]["warmup"]) - 0.5, color="k", linewidth=0.5, linestyle=":")
        summ = [r for r in rows if r.get("kind") == "summary" and (r["model_type"], r["preset"]) == key]
        diffs = ", ".join(f"{r['arm']} {float(r['max_loss_diff']):.2g}" for r in summ)
        ax.set_title(f"{key[1]}: loss per step (warm-up left of the dotted line)\nmax |dloss| vs baseline: {diffs}",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
        names = [r["arm"] for r in summ]
        bx.bar(names, [float(r["tok_per_s"]) for r in summ], color=[colors.get(n) for n in names])
        bx.set_ylabel("tokens/s")
        peaks = [r["peak_alloc_GB"] for r in summ]
        has_mem = any(isinstance(v, (int, float)) or (isinstance(v, str) and _num(v) is not None) for v in peaks)
        bx.set_title(f"{key[1]}: throughput (bars)" + (" and peak allocated memory (dots)" if has_mem else ""),
                     fontsize=9)
        if has_mem:
            cx = bx.twinx()
            cx.plot(names, [_num(v) if _num(v) is not None else float("nan") for v in peaks], "ko")
            cx.set_ylabel("peak allocated GB")
            cx.set_ylim(bottom=0)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    _copy_to_out(path)
    return path


# -- click ----------------------------------------------------------------------------------------

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench():
    """Kernel and model benchmarks against the measured ceilings, CSV out."""


@bench.command()
@click.option("--op", "ops", multiple=True,
              help="Op or script to run (repeatable): rms_norm, swiglu, layer_norm, short_conv, moe_router, moe_experts, "
                   "cross_entropy, fused_linear_cross_entropy, or a script stem (norms, lfm2_ops, moe_experts, "
                   "losses). Default: every benchmarks/bench_*.py present.")
@click.option("--quick", is_flag=True, help="Pass --quick to each script (fewer shapes, shorter timing).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for the scripts' CSVs and the combined CSV (default: benchmarks/results): "
                   "kernels_combined.csv, kernels_<scripts>.csv for an --op subset, _quick with --quick.")
@click.option("--benchmarks", default=None, type=click.Path(file_okay=False),
              help="The benchmarks/ folder of a liger_rt checkout (default: found from the cwd).")
def kernels(ops, quick, out_dir, benchmarks):
    """Run the kernel benchmark scripts; one table with GB/s or TFLOP/s and fraction of ceiling."""
    import torch
    if not torch.cuda.is_available():
        raise click.ClickException(_no_gpu_message("bench kernels"))
    try:
        run_kernel_bench(list(ops), quick=quick, out_dir=out_dir, benchmarks=benchmarks, echo=click.echo)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--op")
    except (FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc))


@bench.command()
def ceilings():
    """Measure this GPU's copy bandwidth and bf16 matmul throughput."""
    import torch
    if not torch.cuda.is_available():
        raise click.ClickException(_no_gpu_message("bench ceilings"))
    c = measure_ceilings("cuda")
    click.echo(f"{c['device']}: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")


def _parse_layer_list(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated layer indices, e.g. 2,5",
                                 param_hint="--attention-layers") from None


@bench.command()
@click.option("--model", "model_type", required=True,
              help="Model type: qwen3, llama, qwen3_moe, lfm2, lfm2_moe, lfm2_vl (lfm2_vl: text-only step).")
@click.option("--preset", default="tiny", show_default=True,
              help="Preset name (qwen3-1.7b, lfm2-1.2b, lfm2-8b-a1b, ...), 'tiny' for the family's tiny one, "
                   "or a PATH.json of preset fields.")
@click.option("--batch", default=4, show_default=True, type=int)
@click.option("--seq", default=2048, show_default=True, type=int)
@click.option("--steps", default=20, show_default=True, type=int, help="Measured steps per run.")
@click.option("--warmup", default=5, show_default=True, type=int, help="Warm-up steps per run (not timed).")
@click.option("--dtype", default="bf16", show_default=True, help="Weight dtype: bf16, fp16, fp32.")
@click.option("--layers", default=None, type=int,
              help="Override the layer count (LFM2: attention layers beyond it drop).")
@click.option("--attention-layers", default=None, help="LFM2: which layers are attention, e.g. 2,5.")
@click.option("--liger-kernel/--no-liger-kernel", "liger_kernel", default=True, show_default=True,
              help="Also time Liger-Kernel's own patch (where installed and supported for the model type).")
@click.option("--flags", default=None, help="liger_rt.patch flags, e.g. rms_norm=1,fused_linear_cross_entropy=0 "
                                            "(default: the family's defaults plus fused_linear_cross_entropy=1).")
@click.option("--experts-implementation", default=None,
              help="MoE models: transformers experts implementation of every arm (default grouped_mm).")
@click.option("--config", "config_text", default=None,
              help="transformers config overrides for every arm, k=v[,k=v...] (values parsed as JSON when they "
                   "parse), e.g. tie_word_embeddings=true.")
@click.option("--lr", default=1e-4, show_default=True, type=float, help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False), help="Write the rows to this CSV.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of loss curves and throughput (needs matplotlib).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of the table.")
def model(model_type, preset, batch, seq, steps, warmup, dtype, layers, attention_layers, liger_kernel, flags,
          experts_implementation, config_text, lr, seed, csv_path, plot_path, device, as_json):
    """Time an SFT training step: baseline vs liger_rt.patch (and Liger-Kernel), counterbalanced."""
    from liger_rt.tools.presets import TINY_FOR_MODEL
    if model_type not in TINY_FOR_MODEL:
        raise click.BadParameter(f"unknown model type {model_type!r}; valid: {', '.join(TINY_FOR_MODEL)}",
                                 param_hint="--model")
    try:
        flag_dict = parse_flags(flags)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--flags")
    attn = _parse_layer_list(attention_layers)
    try:
        config = parse_config(config_text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--config")
    if plot_path:      # fail before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install matplotlib "
                                       "(or pip install 'liger-rt[plot]')")
    try:
        rows = run_model_bench(model_type, preset, batch=batch, seq=seq, steps=steps, warmup=warmup, dtype=dtype,
                               layers=layers, attention_layers=attn, liger_kernel=liger_kernel, flags=flag_dict,
                               device=device, seed=seed, lr=lr, experts_implementation=experts_implementation,
                               config=config, echo=lambda m: click.echo(m, err=as_json))
    except ValueError as exc:
        raise click.UsageError(str(exc))
    except RuntimeError as exc:
        raise click.ClickException(str(exc))
    if as_json:
        click.echo(json.dumps(rows, indent=1, default=str))
    else:
        click.echo("")
        click.echo(format_model_summary(rows))
    if csv_path:
        click.echo(f"wrote {write_rows_csv(rows, csv_path)}")
    if plot_path:
        click.echo(f"wrote {plot_model_rows(rows, plot_path)}")
