"""The longest sequence a model trains at, per arm, and its tokens/s there (`liger-tune bench model --max-seq`;
docs/cli.md, "bench").

Per arm, a search over the sequence length at batch 1: doubling from `start` until a step runs out of memory (or
reaches `max_seq`), then bisecting between the longest length that fit and the shortest that did not, down to a
granularity (default: 1/16 of that bracket, at least 1024 tokens).  A probe builds the model afresh (random weights,
sdpa), patches it for its arm, creates the AdamW state (fused on CUDA) before any step, runs a short warm-up step
(eager arms: kernels compiled), then `steps` full training steps at the length: forward, backward, AdamW step.  A
length fits when none of them runs out of memory; its peak is the most memory allocated over those steps (the
optimizer state exists from the start, so the first step's peak is a steady step's), its tokens/s the last step's.

On a GPU each probe runs in a fresh process by default (`isolate`): one that ran out of memory leaves nothing behind
(no cached blocks, no fragmented allocator), and each length starts from the state a training run starts from.  In
process, everything a probe held is freed after it, and what stays allocated is reported on the probe's line.

    result = search_max_seq(probe, start=4096, max_seq=1 << 20)   # probe(seq) -> dict; raises OutOfMemoryError
    rows = run_max_seq("qwen3", "qwen3-1.7b", arms=("baseline", "liger_rt"))
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ... import env
from . import model as M
from .harness import dataset_arm, dist_version, error_line, format_table

# baseline: the unpatched model; +compile: torch.compile of it; +ckpt: activation checkpointing of every decoder
# layer (transformers' gradient_checkpointing_enable, non-reentrant); liger_rt: its patch with the run's flags
ARMS = ("baseline", "baseline+compile", "liger_kernel", "liger_rt", "liger_rt+ckpt", "baseline+ckpt",
        "liger_kernel+ckpt", "liger_rt+compile")
DEFAULT_ARMS = ARMS[:6]
# liger_rt's flags in this mode, over the family defaults: the fused loss and rope (as Liger-Kernel's patch does)
DEFAULT_FLAGS = {"fused_linear_cross_entropy": True, "rope": True}
RESULT_TAG = "MAX_SEQ_PROBE "          # the line a probe process answers with
MIN_GRANULARITY = 1024


class ProbeOOM(RuntimeError):
    """A probe process ran out of GPU memory."""


class ProbeTimeout(RuntimeError):
    """A probe process ran past its time."""


def is_oom(exc: BaseException) -> bool:
    """Whether an error is running out of device memory: the allocator's OutOfMemoryError, or a library that
    reports it in its message (cuBLAS handle or workspace, a Triton launch)."""
    if isinstance(exc, (torch.OutOfMemoryError, ProbeOOM)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                                                                     "CUDNN_STATUS_ALLOC_FAILED"))


def arm_parts(arm: str) -> tuple[str, bool, bool]:
    """'liger_rt+ckpt' -> ('liger_rt', compiled False, checkpointed True)."""
    parts = arm.split("+")
    return parts[0], "compile" in parts, "ckpt" in parts


def arm_dataset_name(arm: str) -> str:
    """The dataset's arm: baseline -> eager, baseline+compile -> torch_compile, baseline+ckpt -> eager+ckpt."""
    ckpt = arm.endswith("+ckpt")
    return dataset_arm(arm.removesuffix("+ckpt")) + ("+ckpt" if ckpt else "")


def parse_arms(text, liger_kernel: bool = True) -> tuple[str, ...]:
    """'baseline,liger_rt' (or a sequence; None: DEFAULT_ARMS) -> the arms, validated; without `liger_kernel`
    the Liger-Kernel arms are left out."""
    arms = [a.strip() for a in (text.split(",") if isinstance(text, str) else text or DEFAULT_ARMS) if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm {bad[0]!r}; valid: {', '.join(ARMS)}")
    if not arms:
        raise ValueError(f"no arm given; valid: {', '.join(ARMS)}")
    return tuple(dict.fromkeys(a for a in arms if liger_kernel or not a.startswith("liger_kernel")))


def rate_text(tok_s: float) -> str:
    """23400.0 -> '23.4k', 37.4 -> '37.4'."""
    return f"{tok_s / 1e3:.1f}k" if tok_s >= 1e3 else f"{tok_s:.3g}"


def token_text(n: int | None) -> str:
    """32768 -> '32K', 36864 -> '36K', 33280 -> '32.5K', 1000 -> '1000'."""
    if n is None:
        return "-"
    if n >= 1024 and n % 512 == 0:
        k = n / 1024
        return f"{k:.0f}K" if k == int(k) else f"{k:.1f}K"
    return str(n)


# -- the search ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Search:
    max_seq: int                 # the longest length that fit (0: none did)
    oom_seq: int | None          # the shortest length that ran out of memory (None: none did)
    best: dict | None            # the probe's result at max_seq
    probes: list[dict]           # every probe in order: seq, status (fits, oom, timeout, error), seconds, ...
    stop: str                    # why the search ended: granularity, max, none fits, time limit, error
    granularity: int | None      # the bisection's granularity (None: no bisection ran)
    error: str = ""

    @property
    def lower_bound(self) -> bool:
        """max_seq is only a lower bound: no length ran out of memory."""
        return self.oom_seq is None


def _round_down(n: int, align: int) -> int:
    return n // align * align


def auto_granularity(lo: int, hi: int, align: int) -> int:
    """1/16 of the bracket, at least MIN_GRANULARITY tokens, a multiple of `align`."""
    g = max(MIN_GRANULARITY, (hi - lo) // 16)
    return -(-g // align) * align


def search_max_seq(probe: Callable[[int], dict], *, start: int, max_seq: int, granularity: int | None = None,
                   align: int | None = None, time_limit: float | None = None, label: str = "",
                   echo: Callable[[str], None] | None = print, cleanup: Callable[[], str] | None = None,
                   clock: Callable[[], float] = time.monotonic) -> Search:
    """The longest length in [align, max_seq] that `probe(seq)` runs at without running out of memory.

    Doubling from `start` (halving when `start` already runs out) finds a bracket [fits, out of memory); bisection
    narrows it to `granularity` tokens (None: `auto_granularity`).  Every length probed is a multiple of `align`
    (default gcd(start, 128)) except `max_seq` itself.  `probe` returns a dict (tok_s, peak_gb, ...) or raises:
    out of memory (`is_oom`) bounds the search, ProbeTimeout (the time limit reached inside a probe) or any other
    error ends it.  `cleanup()` runs after every probe (free what it held) and may return a note for the probe's
    line; `time_limit` (seconds) stops the search before a probe that would start past it.

        search_max_seq(lambda s: {"tok_s": 1.0}, start=1024, max_seq=8192).max_seq   # 8192
    """
    if start < 2 or max_seq < start:
        raise ValueError(f"need 2 <= start <= max (got start {start}, max {max_seq})")
    if granularity is not None and granularity < 1:
        raise ValueError(f"granularity must be >= 1 token (got {granularity})")
    align = align or math.gcd(start, 128)
    echo = echo or (lambda s: None)
    t0, lo, hi, best, probes = clock(), 0, None, None, []

    def attempt(seq: int) -> str:
        """Probe one length: 'fits', 'oom', 'timeout', 'error' or 'time limit' (not run)."""
        nonlocal lo, hi, best
        if time_limit is not None and clock() - t0 >= time_limit:
            return "time limit"
        t, res, err = clock(), None, ""
        try:
            res = probe(seq)
            status = "fits"
        except ProbeTimeout as exc:
            status, err = "timeout", str(exc)
        except Exception as exc:       # noqa: BLE001 - out of memory bounds the search, anything else ends it
            status, err = ("oom" if is_oom(exc) else "error"), error_line(exc, 300)
        note = cleanup() if cleanup else ""     # after the except block: the traceback (and its frames) is gone
        if status == "fits":           # every length probed lies above the longest that fit so far
            lo, best = seq, res
        elif status == "oom":
            hi = seq if hi is None else min(hi, seq)
        probes.append({"seq": seq, "status": status, "seconds": clock() - t, **(res or {}), "error": err})
        echo(_probe_line(label, seq, status, res, err, clock() - t, lo, hi, note))
        return status

    status, stop = attempt(start), ""
    seq = start
    while not stop:                    # doubling (halving while nothing fits)
        if status == "fits":
            if hi is not None:
                break
            if seq >= max_seq:
                stop = "max"
                break
            seq = min(seq * 2, max_seq)
        elif status == "oom":
            if lo:
                break
            seq = _round_down(seq // 2, align)
            if seq < align:
                stop = "none fits"
                break
        else:
            stop = status
            break
        status = attempt(seq)
    g = None
    if not stop and lo and hi is not None:
        g = granularity or auto_granularity(lo, hi, align)
        while hi - lo > g:             # bisection of [lo, hi)
            mid = _round_down(lo + (hi - lo) // 2, align)
            if mid <= lo:
                break
            status = attempt(mid)
            if status not in ("fits", "oom"):
                stop = status
                break
        stop = stop or "granularity"
    error = next((p["error"] for p in reversed(probes) if p["status"] == "error"), "") if stop == "error" else ""
    stop = "time limit" if stop == "timeout" else stop        # a probe process stopped at the arm's time limit
    return Search(lo, hi, best, probes, stop or "granularity", g, error)


def _probe_line(label, seq, status, res, err, seconds, lo, hi, note) -> str:
    head = f"  {label:18s} {seq:>8d} tokens: "
    if status == "fits":
        peak = res.get("peak_gb")
        body = (f"fits  {rate_text(res['tok_s']):>7s} tok/s  step {res['step_s']:.2f} s"
                + (f"  peak {peak:.2f} GB" if peak is not None else ""))
    elif status == "oom":
        body = f"out of memory ({err.split(': ', 1)[-1][:90]})"
    else:
        body = f"{status.upper()}: {err[:200]}"
    bracket = f"[{lo}, {hi if hi is not None else '?'})"
    return f"{head}{body}  ({seconds:.1f} s)  {bracket}" + (f"  {note}" if note else "")


# -- one probe -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """What a probe builds and runs; JSON-able (a probe process gets it on its command line)."""
    model_type: str
    preset: dict                       # the Preset's fields
    arm: str
    flags: dict                        # liger_rt.patch flags of the liger_rt arms
    overrides: dict                    # transformers config overrides of every arm
    dtype: str = "bf16"
    device: str = "cuda"
    batch: int = 1
    steps: int = 1                     # full steps at the length (compiled arms: at least 2, the first compiles)
    warmup_seq: int = 256              # eager arms: one step this long first (kernels compiled)
    seed: int = 0
    lr: float = 1e-4
    limit_gib: float | None = None     # cap on this process's GPU memory (set_per_process_memory_fraction)
    compile_backend: str = "inductor"


def spec_preset(spec: ProbeSpec):
    from liger_rt.tools.presets import Preset
    return Preset(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.preset.items()})


def limit_memory(limit_gib: float | None) -> None:
    """Cap this process's share of the GPU at `limit_gib` GiB (an emulated smaller card)."""
    if not limit_gib:
        return
    total = torch.cuda.get_device_properties(0).total_memory
    if limit_gib * 2 ** 30 > total:
        raise ValueError(f"--limit-gib {limit_gib:g} exceeds this GPU's {total / 2 ** 30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(limit_gib * 2 ** 30 / total)


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every decoder layer, non-reentrant (transformers' default since v5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):      # transformers >= 5.25; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prime_optimizer(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (AdamW: exp_avg, exp_avg_sq) before the first step: a step on zero gradients
    at learning rate 0 leaves the weights as they are."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def train_step(model, opt, ids) -> torch.Tensor:
    """One full step on `ids` (labels = input ids): forward, backward, AdamW; no KV cache."""
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def build_arm(spec: ProbeSpec):
    """(model, step_model, optimizer, undo) of `spec`'s arm: the model built and patched (checkpointing enabled,
    compiled where the arm says), AdamW with its state already created.  `undo()` reverts the patch."""
    from liger_rt.dtypes import parse_dtype
    base, compiled, ckpt = arm_parts(spec.arm)
    model = M.build(spec_preset(spec), parse_dtype(spec.dtype), spec.device, spec.seed, spec.overrides)
    undo = M.apply_arm(model, base, spec.flags) or (lambda: None)
    try:
        if ckpt:
            enable_checkpointing(model)
        step_model = torch.compile(model, backend=spec.compile_backend) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, fused=spec.device == "cuda")
        prime_optimizer(opt)
    except BaseException:
        undo()                  # Liger-Kernel's patch changes modules: nothing of it may outlive the arm
        raise
    return model, step_model, opt, undo


def run_probe(spec: ProbeSpec, seq: int) -> dict:
    """Build, patch and train `spec`'s arm at `seq` tokens: {seq, tok_s, step_s, first_step_s, peak_gb,
    reserved_gb, loss, setup_s}.  Raises what the steps raise (out of memory among them)."""
    cuda, compiled = spec.device == "cuda", arm_parts(spec.arm)[1]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    model = undo = step_model = opt = ids = loss = None
    try:
        if cuda:
            limit_memory(spec.limit_gib)
        model, step_model, opt, undo = build_arm(spec)
        if not compiled and 2 <= spec.warmup_seq < seq:
            train_step(step_model, opt, M.random_ids(model, spec.batch, spec.warmup_seq, spec.seed, spec.device))
        ids = M.random_ids(model, spec.batch, seq, spec.seed, spec.device)
        sync()
        setup_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(max(spec.steps, 2 if compiled else 1)):
            t = time.perf_counter()
            loss = train_step(step_model, opt, ids)
            sync()
            times.append(time.perf_counter() - t)
        return {"seq": seq, "tok_s": ids.numel() / times[-1], "step_s": times[-1], "first_step_s": times[0],
                "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                "reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
                "loss": float(loss.detach()), "setup_s": setup_s}
    finally:
        if undo is not None:
            undo()
        del model, undo, step_model, opt, ids, loss    # the frame keeps nothing for a traceback to hold
        if compiled:
            torch._dynamo.reset()


def free_memory(cuda: bool) -> str:
    """What an in-process probe leaves: collect, give cached blocks back; a note when memory stays allocated."""
    gc.collect()
    if not cuda:
        return ""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() / 1e9
    return f"(left allocated after the probe: {left:.2f} GB)" if left > 0.01 else ""


def gpu_info(isolate: bool) -> tuple[str, float]:
    """(name, GiB) of the GPU; asked of a child process where the probes are isolated, so that this one never
    holds a CUDA context (hundreds of MB the probes would lose)."""
    if not isolate:
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory / 2 ** 30
    code = "import torch; p = torch.cuda.get_device_properties(0); print(p.total_memory, p.name)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    total, _, name = done.stdout.strip().rpartition("\n")[-1].partition(" ")
    if done.returncode or not total.isdigit():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not read the GPU's name and memory in a child process: {tail[:200]}")
    return name, int(total) / 2 ** 30


def probe_command() -> list[str]:
    return [sys.executable, "-m", __name__]


def subprocess_probe(spec: ProbeSpec, seq: int, timeout: float | None = None) -> dict:
    """run_probe in a fresh Python process (this checkout's liger_rt first on its path); its out-of-memory error
    raised here as ProbeOOM, its other errors as RuntimeError, a probe past `timeout` seconds as ProbeTimeout."""
    import liger_rt
    env = dict(os.environ)
    root = str(Path(liger_rt.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [*probe_command(), json.dumps({"spec": dataclasses.asdict(spec), "seq": seq})]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise ProbeTimeout(f"the probe at {seq} tokens ran past {timeout:.0f} s (the arm's time limit)") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if not lines:
        tail = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
        raise RuntimeError(f"the probe process at {seq} tokens exited {done.returncode} without a result"
                           + (f": {tail[-1][:300]}" if tail else ""))
    answer = json.loads(lines[-1][len(RESULT_TAG):])
    if answer["status"] == "oom":
        raise ProbeOOM(answer["error"])
    if answer["status"] != "fits":
        raise RuntimeError(answer["error"])
    return answer["result"]


def _die_with_parent() -> None:
    """A probe process ends with the search that started it (a killed benchmark leaves no GPU memory held)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def probe_main(argv: list[str]) -> int:
    """The probe process: `python -m liger_rt.tools.bench.max_seq '{"spec": {...}, "seq": N}'` prints one line,
    RESULT_TAG + {"status": "fits"|"oom"|"error", "result": {...}, "error": "..."}."""
    _die_with_parent()
    job = json.loads(argv[0])
    spec = ProbeSpec(**job["spec"])
    if spec.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        answer = {"status": "fits", "result": run_probe(spec, int(job["seq"]))}
    except Exception as exc:   # noqa: BLE001 - the parent decides what an error means
        answer = {"status": "oom" if is_oom(exc) else "error", "error": error_line(exc, 300)}
    print(RESULT_TAG + json.dumps(answer), flush=True)
    return 0


# -- the arms ----------------------------------------------------------------------------------------------------

def run_max_seq(model_type: str, preset="tiny", *, arms=None, start: int = 4096, max_seq: int = 1 << 20,
                granularity: int | None = None, time_limit: float | None = None, limit_gib: float | None = None,
                isolate: bool | None = None, steps: int = 1, batch: int = 1, dtype: str = "bf16",
                layers: int | None = None, attention_layers: tuple | None = None, flags: dict | None = None,
                config: dict | None = None, experts_implementation: str | None = None, device: str = "auto",
                seed: int = 0, lr: float = 1e-4, compile_backend: str = "inductor", liger_kernel: bool = True,
                echo: Callable[[str], None] | None = print,
                on_arm: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per arm (kind "max_seq"): the longest length it trains at (`max_seq`, `lower_bound` when no length
    ran out of memory), the shortest that ran out (`oom_seq`), tokens/s and peak GB at `max_seq`, the probes.
    `flags` go to liger_rt.patch over DEFAULT_FLAGS; `isolate` (default: on a GPU) runs each probe in a fresh
    process; `time_limit` is per arm (seconds); `on_arm(row)` gets each arm's row when it is done."""
    from liger_rt.dtypes import dtype_name, parse_dtype
    echo = echo or (lambda s: None)
    dt = parse_dtype(dtype)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA/ROCm GPU is available here (use --device cpu with a tiny preset)")
    if start < 2 or max_seq < start:
        raise ValueError(f"need 2 <= --start <= --max (got --start {start}, --max {max_seq})")
    if steps < 1 or batch < 1:
        raise ValueError("need --steps >= 1 and --batch >= 1")
    if limit_gib is not None and (limit_gib <= 0 or device != "cuda"):
        raise ValueError("--limit-gib needs a GPU and a positive size in GiB")
    if time_limit is not None and time_limit <= 0:
        raise ValueError(f"--time-limit must be > 0 seconds (got {time_limit})")
    arms = parse_arms(arms, liger_kernel)
    if any(arm_parts(a)[1] for a in arms) and compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"unknown compile backend {compile_backend!r}; valid: "
                         f"{', '.join(torch._dynamo.list_backends())}")
    isolate = device == "cuda" if isolate is None else isolate
    p = M.bench_preset(model_type, preset, layers, attention_layers)
    overrides = M.config_overrides(model_type, config, experts_implementation)
    flags = {**DEFAULT_FLAGS, **(flags or {})}
    if any(a.startswith("liger_rt") for a in arms):
        M._dry_patch(p, overrides, flags)          # a rejected flag fails before any probe
    lk_ok, lk_note = (M.LigerKernelPatch.supported(model_type) if any(a.startswith("liger_kernel") for a in arms)
                      else (False, "not requested"))
    gpu, total = gpu_info(isolate) if device == "cuda" else ("cpu", None)
    if limit_gib and limit_gib > total:
        raise ValueError(f"--limit-gib {limit_gib:g} exceeds this GPU's {total:.1f} GiB")
    where = f"{gpu}, {total:.1f} GiB" + (f", capped at {limit_gib:g} GiB" if limit_gib else "") if total else "cpu"
    echo(f"bench model --max-seq {model_type} preset {p.name} ({p.layers} layers), batch {batch}, {dtype_name(dt)}, "
         f"{device} ({where}); lengths {start}..{max_seq}, granularity "
         f"{granularity or f'1/16 of the bracket, >= {MIN_GRANULARITY}'}, {steps} step(s) per probe, "
         f"{'each probe in a fresh process' if isolate else 'probes in this process'}"
         + (f", {time_limit:g} s per arm" if time_limit else ""))
    lk_version = dist_version("liger-kernel") if lk_ok else None
    echo(f"  liger_rt.patch flags: {flags}; config overrides (all arms): {overrides or 'none'}"
         + ("; LIGER_RT_RECOMPUTE_SWIGLU=1 (rows named +recompute_swiglu)" if env.recompute_swiglu() else "")
         + (f"; Liger-Kernel {lk_version}" if lk_ok else "")
         + (f"; Liger-Kernel arms skipped: {lk_note}" if not lk_ok and lk_note != "not requested" else ""))
    common = dict(model_type=model_type, preset=p.name, layers=p.layers, batch=batch, dtype=dtype_name(dt),
                  device=device, gpu=gpu, gpu_GiB=total, limit_gib=limit_gib, start=start, max=max_seq,
                  isolate=isolate, steps=steps, flags=",".join(f"{k}={int(v)}" for k, v in flags.items()),
                  config=",".join(f"{k}={v}" for k, v in overrides.items()), liger_kernel_note=lk_note,
                  alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), recompute_swiglu=env.recompute_swiglu())
    rows = []
    for arm in arms:
        if arm.startswith("liger_kernel") and not lk_ok:
            continue
        spec = ProbeSpec(model_type=model_type, preset=dataclasses.asdict(p), arm=arm,
                         flags=flags if arm.startswith("liger_rt") else {}, overrides=overrides,
                         dtype=dtype_name(dt), device=device, batch=batch, steps=steps, seed=seed, lr=lr,
                         limit_gib=limit_gib, compile_backend=compile_backend)
        t0 = time.monotonic()
        deadline = None if time_limit is None else t0 + time_limit
        if isolate:
            def probe(seq, spec=spec, deadline=deadline):
                left = None if deadline is None else max(1.0, deadline - time.monotonic())
                return subprocess_probe(spec, seq, timeout=left)
            cleanup = None
        else:
            if device == "cuda":
                limit_memory(limit_gib)
            def probe(seq, spec=spec):
                return run_probe(spec, seq)
            def cleanup():
                return free_memory(device == "cuda")
        res = search_max_seq(probe, start=start, max_seq=max_seq, granularity=granularity, time_limit=time_limit,
                             label=arm, echo=echo, cleanup=cleanup)
        best = res.best or {}
        row = {"kind": "max_seq", "arm": arm, **common,
               "peer_version": lk_version if arm.startswith("liger_kernel") else None, "max_seq": res.max_seq,
               "oom_seq": res.oom_seq,
               "lower_bound": res.lower_bound, "tok_per_s": best.get("tok_s"), "step_s": best.get("step_s"),
               "peak_alloc_GB": best.get("peak_gb"), "peak_reserved_GB": best.get("reserved_gb"),
               "granularity": res.granularity, "stop": res.stop, "n_probes": len(res.probes),
               "probes": [{k: v for k, v in pr.items() if k in ("seq", "status", "seconds", "tok_s", "peak_gb")}
                          for pr in res.probes],
               "seconds": time.monotonic() - t0, "error": res.error}
        echo(f"  {arm}: {summary_text(row)}")
        rows.append(row)
        if on_arm:
            on_arm(row)
    return rows


def summary_text(row: dict) -> str:
    """'32K (23.4k tok/s, 77.9 GB peak); 33K runs out of memory' and the like."""
    if row["error"]:
        return f"FAILED: {row['error']}"
    if not row["max_seq"]:
        return f"runs out of memory at every length tried (down to {row['oom_seq']} tokens)"
    peak = f", {row['peak_alloc_GB']:.1f} GB peak" if row["peak_alloc_GB"] is not None else ""
    text = f"{token_text(row['max_seq'])} ({row['max_seq']} tokens, {rate_text(row['tok_per_s'])} tok/s{peak})"
    if row["lower_bound"]:
        return text + f"; at least that: {'reached --max' if row['stop'] == 'max' else row['stop']}, no length " \
                      f"ran out of memory"
    return text + f"; {row['oom_seq']} tokens run out of memory" + \
        (f" (search stopped: {row['stop']})" if row["stop"] != "granularity" else "")


COLS = ["preset", "arm", "max_seq", "oom_seq", "tok_per_s", "step_s", "peak_alloc_GB", "n_probes", "stop", "seconds"]
HEADERS = {"max_seq": "max seq", "oom_seq": "OOM at", "tok_per_s": "tok/s at max", "step_s": "step s",
           "peak_alloc_GB": "peak GB", "n_probes": "probes", "seconds": "search s"}


def format_max_seq(rows: list[dict]) -> str:
    """The arms' table, then each arm against the baseline without checkpointing."""
    lines = [format_table(rows, COLS, HEADERS)]
    base = next((r for r in rows if r["arm"] == "baseline" and r["max_seq"]), None)
    for r in rows:
        if r["error"]:
            lines.append(f"{r['arm']} FAILED: {r['error']}")
        elif base and r is not base and r["max_seq"]:
            lines.append(f"{r['arm']}: {r['max_seq'] / base['max_seq']:.2f}x the baseline's longest sequence"
                         + (" (at least)" if r["lower_bound"] else ""))
    if rows and rows[0]["liger_kernel_note"] not in ("", "not requested", None):
        lines.append(f"no Liger-Kernel arm: {rows[0]['liger_kernel_note']}")
    return "\n".join(lines)


def max_seq_records(rows: list[dict]) -> list[dict]:
    """run_max_seq rows as dataset records (kind `max_seq`), per arm that found a length: `max_seq` (tokens),
    `tok_s` and `peak_gb` at it, and `oom_seq` (the shortest length that ran out of memory; none: max_seq is a
    lower bound).  The name is the preset plus liger_rt's flags beyond the fused loss (qwen3-1.7b+rope), and
    +recompute_swiglu where LIGER_RT_RECOMPUTE_SWIGLU was set (as benchmarks/bench_models.py names model steps); the
    shape the batch, and the memory cap of an emulated smaller card (batch=1;limit_gib=24)."""
    out = []
    for r in rows:
        if r["error"] or not r["max_seq"]:
            continue
        extra = [f for f in r["flags"].split(",") if f and f != "fused_linear_cross_entropy=1"]
        how = (f"doubling from {r['start']} then bisection to {r['granularity'] or '-'} tokens, "
               f"{'a fresh process per probe' if r['isolate'] else 'probes in one process'}")
        notes = [f"{r['layers']} layers", f"{r['n_probes']} probes, stopped: {r['stop']}",
                 f"search up to {r['max']} tokens", f"config {r['config']}" if r["config"] else "",
                 f"PYTORCH_CUDA_ALLOC_CONF={r['alloc_conf']}" if r.get("alloc_conf") else ""]
        shape = {"batch": r["batch"], **({"limit_gib": f"{r['limit_gib']:g}"} if r["limit_gib"] else {})}
        extra += ["recompute_swiglu"] if r.get("recompute_swiglu") else []
        base = {"kind": "max_seq", "name": r["preset"] + "".join(f"+{f.removesuffix('=1')}" for f in extra),
                "shape": shape, "arm": arm_dataset_name(r["arm"]), "dtype": r["dtype"],
                "notes": "; ".join(filter(None, notes))}
        metrics = [("max_seq", r["max_seq"], "tokens", how),
                   ("tok_s", r["tok_per_s"], "tok/s", f"last of {r['steps']} step(s) at max_seq"),
                   ("peak_gb", r["peak_alloc_GB"], "GB", "max allocated at max_seq"),
                   ("oom_seq", r["oom_seq"], "tokens", "shortest length that ran out of memory")]
        out += [{**base, "metric": m, "value": v, "unit": u, "method": h} for m, v, u, h in metrics if v is not None]
    return out


if __name__ == "__main__":
    sys.exit(probe_main(sys.argv[1:]))
