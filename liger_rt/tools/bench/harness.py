"""What every benchmark shares: versions, CSV and dataset rows, ceilings, timers and the kernel-case loop.

A kernel family (norms, gated_mlp, losses, lfm2_ops, moe) lists its cases as SPECS (op, the op's dims, `quick`) and
`build`s a `Case` per spec; `measure_case` times its arms (`_arms`), each on its own copy of the inputs, fwd+bwd
taking every input's gradient with autograd.grad.  GB/s and TFLOP/s count what an op cannot avoid moving or
computing, against this device's copy and bf16 matmul ceilings measured in the same run (docs/cli.md, "bench").

Two outputs: `write_csv` (one wide row per arm and pass, what `--csv PATH` writes) and the long-format dataset
(`dataset_rows` + `append_dataset`: one row per measurement, DATASET_COLUMNS, for collecting runs over time).
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import gc
import importlib
import json
import os
import re
import secrets
import statistics
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from liger_rt.autotune.timing import error_line

FAMILIES = ("norms", "gated_mlp", "losses", "lfm2_ops", "moe")   # modules of this package, each with SPECS and build
SPEC_KEYS = ("op", "dtype", "routing", "quick")                   # spec fields that are not the op's dims
FORCED = ("triton", "grouped_mm")          # our implementations forced by env: not peers
PEERS = {"liger_kernel": "liger-kernel", "trl": "trl"}           # peer arm -> its distribution


# -- versions, CSV, tables ------------------------------------------------------------------------

def dist_version(dist: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(dist)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def versions(gpu: str | None = None) -> dict:
    """Device (`gpu` where the caller knows it: a process that must not touch the GPU), date and the installed
    version (package metadata) of torch and of every peer."""
    cuda = torch.version.cuda or (f"hip {torch.version.hip}" if torch.version.hip else "")
    out = {"gpu": gpu or device_name(), "cuda": cuda, "date": datetime.date.today().isoformat()}
    for dist in ("torch", "triton", "transformers", "liger-kernel"):
        out[dist.replace("-", "_")] = dist_version(dist) or "not installed"
    return {**out, "liger_rt": dist_version("liger-rt") or source_version()}


def git_commit() -> tuple[str, bool]:
    """(short commit of the checkout liger_rt runs from, whether liger_rt/ differs from it); ("", False) when
    liger_rt is not run from a git checkout."""
    import liger_rt
    git = ["git", "-C", str(Path(liger_rt.__file__).resolve().parents[1])]
    try:
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = bool(rev) and subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "liger_rt"],
                                             capture_output=True, timeout=10).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return "", False
    return rev, dirty


def source_version() -> str:
    """liger_rt run from a checkout (not pip-installed): its version and commit, `.dirty` where liger_rt/ differs
    from that commit (a copied working tree, local edits)."""
    import liger_rt
    rev, dirty = git_commit()
    return f"{liger_rt.__version__}+{rev}{'.dirty' if dirty else ''}" if rev else f"{liger_rt.__version__} (source)"


def _cell(v):
    return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else "n/a" if v is None else v


def _row_gpu(rows: list[dict]) -> str | None:
    return next((r["gpu"] for r in rows if r.get("gpu")), None)


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """Rows plus the version columns (lists/dicts as JSON, None as n/a), replacing the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = versions(_row_gpu(rows))
    rows = [{**r, **{k: v for k, v in info.items() if k not in r}} for r in rows]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows({k: _cell(v) for k, v in r.items()} for r in rows)
    return path


def fmt(v, none: str = "n/a") -> str:
    return f"{v:.4g}" if isinstance(v, float) else none if v is None else str(_cell(v))


def format_table(rows: list[dict], cols: list[str], headers: dict | None = None, *, none: str = "n/a",
                 empty: str = "(no rows)") -> str:
    if not rows:
        return empty
    names = [(headers or {}).get(c, c) for c in cols]
    cells = [[fmt(r.get(c), none) for c in cols] for r in rows]
    widths = [max(len(n), *(len(row[i]) for row in cells)) for i, n in enumerate(names)]
    lines = [names, ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def no_gpu_message(what: str) -> str:
    return (f"{what} needs a CUDA/ROCm GPU and this machine has none (torch {torch.__version__}); run it on "
            f"the GPU machine. On CPU, `liger-tune bench model --model qwen3 --preset tiny --device cpu` "
            f"checks the model step plumbing and `liger-tune bench dispatch` times a dispatch decision.")


# -- the dataset: one row per measurement ---------------------------------------------------------

DATASET_COLUMNS = ("kind", "name", "shape", "arm", "metric", "value", "unit", "gpu", "dtype", "method", "torch",
                   "triton", "transformers", "liger_rt", "peer_version", "commit", "date", "run_id", "notes")
# what a measurement record carries; dataset_rows adds the rest (device, versions, commit, date, run id)
RECORD_KEYS = ("kind", "name", "shape", "arm", "metric", "value", "unit", "dtype", "method", "notes")


def new_run_id() -> str:
    """One id per benchmark invocation: UTC time and 4 random hex digits, e.g. 20261206T171300Z-3fa2."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"


def shape_text(shape: dict | str) -> str:
    """{'rows': 4096, 'hidden': 2048} -> 'rows=4096;hidden=2048'."""
    return shape if isinstance(shape, str) else ";".join(f"{k}={v}" for k, v in shape.items())


def dataset_rows(records: list[dict], run_id: str, gpu: str | None = None) -> list[dict]:
    """Records (RECORD_KEYS; `shape` a dict or text) as DATASET_COLUMNS rows: this device, the installed versions
    (a peer arm's, its `+` variants too, from its package metadata), the checkout's commit (`-dirty` where liger_rt/
    differs from it), today's UTC date and `run_id`; `gpu`: the device's name where the caller knows it."""
    import liger_rt
    info, (commit, dirty) = versions(gpu), git_commit()
    fixed = {"gpu": info["gpu"], "torch": info["torch"], "triton": info["triton"], "transformers": info["transformers"],
             "liger_rt": liger_rt.__version__, "commit": commit + ("-dirty" if dirty else ""), "run_id": run_id,
             "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat()}
    out = []
    for r in records:
        unknown = set(r) - set(RECORD_KEYS)
        if unknown:
            raise ValueError(f"dataset record keys {sorted(unknown)}: valid keys are {', '.join(RECORD_KEYS)}")
        peer = PEERS.get(r["arm"].split("+")[0])         # liger_kernel+ckpt: Liger-Kernel's version too
        out.append({**dict.fromkeys(DATASET_COLUMNS, ""), **r, **fixed, "shape": shape_text(r["shape"]),
                    "peer_version": (peer and dist_version(peer)) or ""})
    return out


def append_dataset(path: str | Path, rows: list[dict]) -> Path:
    """Append DATASET_COLUMNS rows to the CSV at `path` (created with its header if missing).  A file with another
    header is an error: the dataset's columns are fixed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as fh:
            header = next(csv.reader(fh), [])
        if tuple(header) != DATASET_COLUMNS:
            raise ValueError(f"{path}: its header is not the dataset's columns ({','.join(DATASET_COLUMNS)})")
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=DATASET_COLUMNS, extrasaction="raise")
        if new:
            w.writeheader()
        w.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    return path


# -- measuring -------------------------------------------------------------------------------------

def measure_ceilings(*, quick: bool = False) -> dict:
    """This GPU's copy bandwidth (GB/s: a 2 GiB bf16 copy, bytes read + written) and bf16 matmul throughput
    (TFLOP/s: 8192^3), medians of do_bench (liger_rt.autotune.timing; H200: ~4250 GB/s, ~720-790)."""
    if not torch.cuda.is_available():
        raise RuntimeError(no_gpu_message("measuring the ceilings"))
    from liger_rt.autotune.timing import do_bench
    rep = 50 if quick else 100
    n = 1 << 30
    while 4 * n > torch.cuda.mem_get_info()[0] * 0.8 and n > (1 << 24):
        n //= 2
    a, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    copy = 4 * n / (do_bench(lambda: b.copy_(a), warmup=25, rep=rep) * 1e-3) / 1e9
    del a, b
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / (do_bench(lambda: x @ x, warmup=25, rep=rep) * 1e-3) / 1e12
    del x
    return {"copy_GBps": copy, "bf16_matmul_TFLOPs": mm, "device": torch.cuda.get_device_name()}


_UNCAPTURABLE: dict[tuple, str] = {}   # (op, arm) -> why its CUDA-graph capture failed, for this process


def time_fn(fn: Callable, device: str, quick: bool = False,
            arm: tuple | None = None) -> tuple[float, float | None, str]:
    """(wall ms, device ms or None, how the device time was taken or why there is none).  torch (2.11 included)
    never gives a failed CUDA-graph capture's private memory pool back (CUDAGraph::reset releases it only after a
    capture that ended; pytorch/pytorch#190348): what the capture allocated stays reserved, out of empty_cache's
    reach, until the process ends (Liger-Kernel's fused MoE and losses fail theirs: 137 GB held on an H200, 60 GiB
    on an H100, then OOM).  So fn is captured only where one call under torch's sync debug mode makes no
    synchronizing call (`autotune.host_syncs`: .item(), a copy to the host), and an `arm` whose capture failed
    anyway is not captured again in this process."""
    from liger_rt import autotune
    if device != "cuda":
        return autotune.measure(fn, device, quick=quick), None, "none: cpu"
    from liger_rt.autotune.timing import do_bench
    wall = do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100)
    if arm in _UNCAPTURABLE:
        return wall, None, f"none: capture failed earlier ({_UNCAPTURABLE[arm]})"
    try:
        try:
            syncs = autotune.host_syncs(fn)
        except Exception as exc:    # it ran under do_bench: keep that time, capture nothing
            return wall, None, f"none: sync check failed ({type(exc).__name__})"
        if syncs:
            return wall, None, "none: synchronizes with the host, not captured"
        try:
            return wall, autotune.graph_ms(fn), "cuda-graph"
        except Exception as exc:    # an arm that cannot be captured keeps its wall time
            if arm is not None:
                _UNCAPTURABLE[arm] = type(exc).__name__
            return wall, None, f"none: capture failed ({type(exc).__name__})"
    finally:
        release(device)


def release(device: str, *, compiled: bool = False, echo: Callable = print) -> None:
    """Give back what a finished arm or case leaves: unreachable objects (a failed arm's tensors, held by its
    traceback's frames), with `compiled` torch.compile's caches (torch._dynamo.reset: compiled code and any CUDA-graph
    trees), then on CUDA the caching allocator's free blocks.  Never raises: it runs outside the arms' guards, and a
    broken CUDA context shows in the next arm's own error."""
    gc.collect()
    try:
        if compiled:
            torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    except Exception as exc:
        echo(f"  (releasing memory failed: {error_line(exc)})")


def peak_extra_gb(fn: Callable) -> float | None:
    """Peak memory fn() allocates beyond what is live before it (GB); None off CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def profiled(step: Callable, *, warmup: int, calls: int, cpu: bool = False):
    """torch.profiler (CUDA, and with `cpu` the host) over `calls` calls of step() after `warmup` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if cpu else [])]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return prof


def counterbalanced(fns: dict[str, Callable], rounds: int, **do_bench_kw) -> dict[str, list[float]]:
    """triton.testing.do_bench ms (its default: the mean over the calls) of each fn per round over `rounds` rounds,
    the order reversed every other round.  GPU profiling of Triton kernels only (benchmarks/profile)."""
    from triton.testing import do_bench
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            times[k].append(do_bench(fns[k], **do_bench_kw))
    return times


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@contextlib.contextmanager
def dispatch_env(**values: str):
    """Run with these environment variables set (restored after), dispatch decisions re-made."""
    from liger_rt import dispatch
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    dispatch.reset()
    try:
        yield
    finally:
        for k in [k for k, v in old.items() if v is None]:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in old.items() if v is not None})
        dispatch.reset()


def peer(module: str, attr: str, echo: Callable = print):
    """module.attr of an optional peer (Liger-Kernel), or None, saying why."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:
        echo(f"  ({module}.{attr} not available: {type(exc).__name__}: {exc}; that arm is skipped)")


# -- kernel cases ----------------------------------------------------------------------------------

@dataclass
class Arm:
    fn: Callable                    # fn(*inputs) -> tensor, or a tuple whose first tensor is differentiated
    desc: str | Callable[[], str] = ""


@dataclass
class Case:
    spec: dict
    inputs: tuple                   # floating inputs with requires_grad are differentiated
    ours: Callable                  # the liger_rt.ops functional, fn(*inputs)
    eager: Arm                      # the PyTorch / Hugging Face path: baseline and (in fp32) reference
    work: tuple[float, float]       # bytes or FLOPs of (fwd, fwd+bwd)
    unit: str = "GBps"              # or "TFLOPs"
    dy: torch.Tensor | None = None  # None: a scalar output (losses)
    peers: dict[str, Arm] = field(default_factory=dict)
    ref: Callable | None = None     # fp32 reference when the eager path cannot run in fp32
    passes: tuple[str, ...] = ("fwd", "fwdbwd")
    forced: tuple[str, ...] = ("triton",)   # implementations timed under LIGER_RT_IMPL_<OP>
    compile: bool = True
    extra: dict = field(default_factory=dict)     # row fields that are not part of the case label

    @property
    def op(self) -> str:
        return self.spec["op"]

    @property
    def dims(self) -> dict:         # the op's dims (what dispatch decides on)
        return {k: v for k, v in self.spec.items() if k not in SPEC_KEYS}


def case_label(spec: dict, dtype: str) -> tuple[dict, dict, str]:
    """(shape: the op's dims and routing, label: shape and dtype, key: the label as text "rows=4,hidden=32,dtype=fp32")
    of a spec run in `dtype` (unless the spec names its own)."""
    shape = {**{k: v for k, v in spec.items() if k not in SPEC_KEYS}, **{k: spec[k] for k in ("routing",) if k in spec}}
    label = {**shape, "dtype": spec.get("dtype", dtype)}
    return shape, label, ",".join(f"{k}={v}" for k, v in label.items())


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _grads(fn, ins, dy):
    """(fn(*ins) detached, the gradients of its differentiated inputs): the output keeps no autograd graph, which
    would hold the inputs alive."""
    out = fn(*ins)
    out = out[0] if isinstance(out, (tuple, list)) else out
    leaves = [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad]
    return out.detach(), torch.autograd.grad(out, leaves, dy, allow_unused=True)


def decision_text(d) -> str:
    """A dispatch decision as the CSV's config column: impl, config as JSON (nested configs too), origin."""
    from liger_rt.config import config_dict
    return f"{d.impl} {json.dumps(config_dict(d.config), sort_keys=True)} ({d.origin})"


def _arms(case: Case, dtype: str, compile_: bool) -> dict[str, tuple[Arm, str | None]]:
    """name -> (arm, the LIGER_RT_IMPL_<OP> value it runs under, or None): `eager` (in fp32 also the reference of
    every error), `compile`, the peers, one per forced implementation and `liger_rt` as dispatched."""
    from liger_rt import dispatch
    arms = {"eager": (case.eager, None)}
    if compile_ and case.compile:
        arms["compile"] = (Arm(torch.compile(case.eager.fn, dynamic=False), f"torch.compile({case.eager.desc})"), None)
    arms |= {k: (a, None) for k, a in case.peers.items()}
    ours = Arm(case.ours, lambda: decision_text(dispatch.select(case.op, dtype=case.spec.get("dtype", dtype),
                                                                **case.dims)))
    return arms | {impl or "liger_rt": (ours, impl) for impl in (*case.forced, None)}


def measure_case(case: Case, *, dtype: str, device: str, quick: bool, compile_: bool, ceilings: dict | None,
                 echo: Callable = print, reverse_arms: bool = False) -> list[dict]:
    """One row per (arm, pass); an arm that fails anywhere (copying its inputs, running, timing, an OOM) gets rows with
    `error` and never stops the run, and what it allocated is given back (`release`) before the next arm.  Where the
    fp32 reference fails the arms are still timed, without errors.  `reverse_arms` times the arms last to first (runs
    alternating it are counterbalanced)."""
    shape, label, key = case_label(case.spec, dtype)
    ceilings = ceilings or {}
    try:
        ref = _reference(case)
    except Exception as exc:            # e.g. an OOM: the arms need no reference to be timed
        echo(f"  {case.op} {key} reference: {error_line(exc)} (no errors against it)")
        ref = None
    release(device, echo=echo)
    rows = []
    arms = list(_arms(case, dtype, compile_).items())
    for name, (arm, impl) in (reversed(arms) if reverse_arms else arms):
        base = {"op": case.op, "case": key, "shape": shape_text(shape), **label, "impl": name, **case.extra,
                "quick": quick, "arm_order": "reversed" if reverse_arms else "listed",
                "copy_ceiling_GBps": ceilings.get("copy_GBps"),
                "matmul_ceiling_TFLOPs": ceilings.get("bf16_matmul_TFLOPs")}
        try:
            rows += _measure_arm(case, arm, impl, base, ref, device=device, quick=quick, ceilings=ceilings)
        except Exception as exc:        # a peer or config that cannot take this case: recorded, not fatal
            echo(f"  {case.op} {key} {name}: {error_line(exc)}")
            rows += [{**base, "pass": p, "error": error_line(exc)} for p in case.passes]
        release(device, echo=echo)
    for p in case.passes:               # vs_eager: eager ms / ms, for both timers
        eager = next((r for r in rows if r["pass"] == p and r["impl"] == "eager" and r.get("ms")), {})
        for r in (r for r in rows if r["pass"] == p and r.get("ms")):
            r["vs_eager"] = eager.get("ms") and eager["ms"] / r["ms"]
            r["dev_vs_eager"] = eager.get("dev_ms") and r.get("dev_ms") and eager["dev_ms"] / r["dev_ms"]
    return rows


def _reference(case: Case) -> tuple:
    """(out, grads) of the fp32 reference (`case.ref`, else the eager path) on fp32 copies of the inputs."""
    ins32 = tuple(t.detach().float().requires_grad_(t.requires_grad) if _floating(t) else t for t in case.inputs)
    return _grads(case.ref or case.eager.fn, ins32, None if case.dy is None else case.dy.float())


def _measure_arm(case: Case, arm: Arm, impl: str | None, base: dict, ref: tuple | None, *, device: str, quick: bool,
                 ceilings: dict) -> list[dict]:
    """One arm's rows (one per pass) on its own copy of the inputs, errors against `ref` (out, grads) where given.
    Every tensor it makes is local to this call: gone when it returns or raises."""
    ceiling = ceilings.get("copy_GBps" if case.unit == "GBps" else "bf16_matmul_TFLOPs")
    scale = 1e9 if case.unit == "GBps" else 1e12
    ins = tuple(t.detach().clone().requires_grad_(t.requires_grad) if _floating(t) else t for t in case.inputs)
    dy = None if case.dy is None else case.dy.clone()
    fns = {"fwd": lambda: arm.fn(*ins), "fwdbwd": lambda: _grads(arm.fn, ins, dy)}
    rows = []
    with dispatch_env(**({f"LIGER_RT_IMPL_{case.op.upper()}": impl} if impl else {})):
        out, grads = fns["fwdbwd"]()
        errs = [rel_err(g, r) for g, r in zip(grads, ref[1]) if g is not None and r is not None] if ref else []
        common = {**base, "config": arm.desc() if callable(arm.desc) else arm.desc,
                  "err_out": ref and rel_err(out, ref[0]), "err_grad": max(errs, default=None)}
        del out, grads
        for p in case.passes:
            ms, dev, how = time_fn(fns[p], device, quick, arm=(case.op, base["impl"]))
            work = case.work[1 if p == "fwdbwd" else 0] / scale
            rate, dev_rate = work / (ms * 1e-3), dev and work / (dev * 1e-3)
            rows.append({**common, "pass": p, "ms": ms, "dev_ms": dev, case.unit: rate,
                         f"dev_{case.unit}": dev_rate, "frac_ceiling": ceiling and rate / ceiling,
                         "dev_frac_ceiling": ceiling and dev_rate and dev_rate / ceiling,
                         "peak_GB": peak_extra_gb(fns["fwdbwd"]) if p == "fwdbwd" else None,
                         "ms_method": "do_bench" if device == "cuda" else "cpu-wall",
                         "dev_ms_method": how, "error": ""})
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """Per case and pass (wall time; over several rounds each arm's median): the dispatched arm against the best
    peer and the fastest arm."""
    lines = []
    for key in dict.fromkeys((r["op"], r["case"], r["pass"]) for r in rows):
        rounds: dict[str, list[dict]] = {}
        for r in rows:
            if (r["op"], r["case"], r["pass"]) == key and r.get("ms"):
                rounds.setdefault(r["impl"], []).append(r)
        by = {n: {**rs[0], "ms": statistics.median(r["ms"] for r in rs)} for n, rs in rounds.items()}
        ours, name = by.get("liger_rt"), " ".join(key)
        if not ours:
            lines.append(f"{name}: liger_rt did not run")
            continue
        fastest = min(by.values(), key=lambda r: r["ms"])
        peers = sorted((r["ms"], n) for n, r in by.items() if not n.startswith("liger_rt") and n not in FORCED)
        lines.append(f"{name}: liger_rt {ours['ms']:.4g} ms ({re.sub(r' {.*}', '', ours['config'])})"
                     + (f", {peers[0][0] / ours['ms']:.2f}x the best peer ({peers[0][1]})" if peers else "")
                     + f", {ours['ms'] / fastest['ms']:.3f}x the fastest arm ({fastest['impl']})")
    return lines


# the dataset's kind of each kernel op, and its arm names where they differ from the rows' `impl`
OP_KINDS = {"rms_norm": "norms", "layer_norm": "norms", "swiglu": "gated_mlp", "cross_entropy": "losses",
            "fused_linear_cross_entropy": "losses", "short_conv": "lfm2_ops", "moe_experts": "moe_experts",
            "moe_router": "moe_router", "fused_linear_logprobs": "logprobs", "fused_add_rms_norm": "norms"}
ARM_NAMES = {"compile": "torch_compile", "baseline": "eager", "baseline+compile": "torch_compile"}


def dataset_arm(arm: str) -> str:
    """A row's arm as the dataset names it: compile -> torch_compile, baseline -> eager, liger_rt+compile ->
    liger_rt+torch_compile."""
    return ARM_NAMES.get(arm) or arm.replace("+compile", "+torch_compile")


def kernel_records(rows: list[dict]) -> list[dict]:
    """measure_case rows as dataset records: per measured arm and pass, `ms` (do_bench: wall), `dev_ms` (cuda-graph:
    device), `gbps` or `tflops` (counted bytes or FLOPs over the do_bench time) and its fraction of the run's
    ceiling, `extra_gb` (peak allocated in fwd+bwd beyond the live inputs); the name is `op.pass`."""
    out = []
    for r in (r for r in rows if r.get("ms")):
        unit = "GBps" if "GBps" in r else "TFLOPs"
        ceiling = r.get("copy_ceiling_GBps" if unit == "GBps" else "matmul_ceiling_TFLOPs")
        base = {"kind": OP_KINDS.get(r["op"], r["op"]), "name": f"{r['op']}.{r['pass']}", "shape": r["shape"],
                "arm": dataset_arm(r["impl"]), "dtype": r["dtype"],
                "notes": "; ".join(filter(None, [f"config {r['config']}" if r["impl"] in ("liger_rt", *FORCED) else "",
                                                 "arms timed last to first" if r["arm_order"] == "reversed" else "",
                                                 r.get("rounds", 1) > 1 and f"round {r['round']} of {r['rounds']}"]))}
        how = r["ms_method"]
        out.append({**base, "metric": "ms", "value": r["ms"], "unit": "ms", "method": how})
        if r.get("dev_ms"):
            out.append({**base, "metric": "dev_ms", "value": r["dev_ms"], "unit": "ms", "method": r["dev_ms_method"]})
        metric = "gbps" if unit == "GBps" else "tflops"
        out.append({**base, "metric": metric, "value": r[unit], "unit": "TFLOP/s" if unit == "TFLOPs" else "GB/s",
                    "method": how})
        if ceiling:
            out.append({**base, "metric": "frac_ceiling", "value": r["frac_ceiling"], "unit": "",
                        "method": f"{metric} / this run's measured {'bf16 matmul' if unit == 'TFLOPs' else 'copy'} "
                                  f"ceiling ({ceiling:.0f} {'TFLOP/s' if unit == 'TFLOPs' else 'GB/s'})"})
        if r.get("peak_GB") is not None:
            out.append({**base, "metric": "extra_gb", "value": r["peak_GB"], "unit": "GB", "method": "peak fwd+bwd"})
    return out


# -- the kernels run -------------------------------------------------------------------------------

def select_specs(names: list[str], where: list[str], quick: bool) -> dict[str, list[dict]]:
    """family -> the specs to run: `names` are families or ops (none: all), `where` field=v[,v...] filters on spec
    fields (AND across fields, OR within one), `quick` keeps the quick specs."""
    specs = {f: importlib.import_module(f"liger_rt.tools.bench.{f}").SPECS for f in FAMILIES}
    valid = list(dict.fromkeys([*FAMILIES, *(s["op"] for v in specs.values() for s in v)]))
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"unknown benchmark {bad[0]!r}; valid: {', '.join(valid)}")
    conds: dict[str, set[str]] = {}
    for text in where:
        k, eq, v = text.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise ValueError(f"--where {text!r}: expected field=value[,value...], e.g. tokens=512,4096")
        conds.setdefault(k.strip(), set()).update(x.strip() for x in v.split(","))
    specs = {f: [s for s in v if (not names or f in names or s["op"] in names) and (s.get("quick") or not quick)]
             for f, v in specs.items()}
    fields = sorted({k for v in specs.values() for s in v for k in s} - {"quick"})
    unknown = [k for k in conds if k not in fields]
    if unknown:
        raise ValueError(f"--where {unknown[0]}: no such field in the selected cases; fields: {', '.join(fields)}")
    out = {f: [s for s in v if all(str(s.get(k)) in c for k, c in conds.items())] for f, v in specs.items()}
    if not any(out.values()):
        raise ValueError("no case matches the --op/--where selection")
    return {f: v for f, v in out.items() if v}


def run_kernels(names: list[str] = (), *, where: list[str] = (), quick: bool = False, compile_: bool = True,
                dtype: str = "bf16", device: str = "cuda", ceilings: dict | None = None, echo: Callable = print,
                reverse_arms: bool = False, csv_path: str | Path | None = None, rounds: int = 1,
                on_case: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every selected case of every family, a table per family.  `rounds` measures each case that many times in
    this process, the arm order reversed every other round (counterbalanced rounds that pay compiles and the
    peers' autotuning once).  After each round its rows go to `on_case` and, with `csv_path`, every row so far is
    written there (a cut run keeps what finished).  A case that cannot be built (its inputs do not fit) is one row
    with `error`; after each case its inputs and torch.compile's caches are released."""
    plan = select_specs(list(names), list(where), quick)
    if device == "cuda" and ceilings is None:
        ceilings = measure_ceilings(quick=quick)
        echo(f"ceilings on {ceilings['device']}: copy {ceilings['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    echo(f"versions: {versions()}")
    every = []
    for fam, specs in plan.items():
        rows, mod = [], importlib.import_module(f"liger_rt.tools.bench.{fam}")
        for spec in specs:
            echo(f"[{fam}] " + ", ".join(f"{k}={v}" for k, v in spec.items() if k != "quick"))
            try:
                case, failed = mod.build(spec, spec.get("dtype", dtype), device, echo), None
            except Exception as exc:    # inputs that do not fit: a row saying so, and on to the next case
                shape, label, key = case_label(spec, dtype)
                echo(f"  {spec['op']} {key}: the case could not be built: {error_line(exc)}")
                case, failed = None, [{"op": spec["op"], "case": key, "shape": shape_text(shape), **label,
                                       "impl": "(case)", "pass": "build", "error": error_line(exc)}]
            for rnd in range(1 if failed else rounds):
                got = failed or measure_case(case, dtype=dtype, device=device, quick=quick,
                                             compile_=compile_ and not quick, ceilings=ceilings, echo=echo,
                                             reverse_arms=reverse_arms != (rnd % 2 == 1))
                if rounds > 1 and not failed:
                    got = [{**r, "round": rnd + 1, "rounds": rounds} for r in got]
                rows += got
                if on_case:
                    on_case(got)
                if csv_path:
                    write_csv(every + rows, csv_path)
            del case
            release(device, compiled=compile_ and not quick, echo=echo)
        unit = [u for u in ("GBps", "TFLOPs") if any(u in r for r in rows)]
        echo(format_table(rows, ["op", "case", "impl", "pass", "ms", "dev_ms", *unit, *[f"dev_{u}" for u in unit],
                                 "dev_frac_ceiling", "vs_eager", "err_out", "err_grad", "peak_GB"],
                          {"dev_frac_ceiling": "dev_frac", "err_out": "err_y", "err_grad": "err_dx"}))
        echo("\n".join(verdicts(rows)))
        every += rows
    if csv_path:
        echo(f"wrote {csv_path}")
    return every


def dataset_sink(data_dir: str | None, name: str, records):
    """fn(rows) appending `records(rows)` to DATA_DIR/name under one run id, or None without a folder."""
    if not data_dir:
        return None
    run_id = new_run_id()
    return lambda rows: append_dataset(Path(data_dir) / name, dataset_rows(records(rows), run_id, _row_gpu(rows)))
