"""The decision path and the call path (docs/architecture.md).

    y = call(OP, x, weight, 1e-6, 0.0)          # a kernel file's functional: decide (memoised), then run
    d = decision(OP, x, rows=4096, hidden=4096)  # the memoised Decision that call() runs for x
    d = select("rms_norm", dtype="bf16", arch="hopper", rows=4096, hidden=4096)    # planning, by name

A decision answers "which implementation and config for this call": the memo, else env overrides
(LIGER_RT_DISABLE, LIGER_RT_IMPL_<OP>, LIGER_FUSED_MOE_AUTOTUNE=0), the tuning DB's exact bucket, the
crossover table, the DB's nearest bucket in log2, and on a miss online tuning (LIGER_RT_AUTOTUNE=1) or the
arch heuristic.  Every decision carries its origin and a reason (`liger-tune explain`,
``LIGER_RT_LOG=decisions``).  Under torch.compile the same memoised decision is taken once at trace time
and baked into the graph as the generated ops' config (`custom_ops`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import types
import warnings
from typing import Any, Mapping

import torch

from . import backend, env, tuning_db
from .autograd import apply_kernel
from .autotune import tune_online
from .backend import interpreter_on
from .config import config_dict
from .custom_ops import traced_function
from .dtypes import dtype_name, parse_dtype
from .launch import clear_launch_memos
from .op import Op, bucket
from .registry import REGISTRY
from .tuning_db.crossover import crossover_pick
from .tuning_db.rows import TUNING_PK, printable
from .tuning_db.store import row_name

log = logging.getLogger("liger_rt.dispatch")

DECISION_ORIGINS = ("env", "pinned", "db", "crossover", "db-nearest", "stale", "online", "heuristic")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a call runs: the arch profile, the tensor's device type, interpreter or not."""
    arch: backend.Arch
    device_type: str          # "cuda" (also ROCm) or "cpu"
    interpret: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    op: str
    impl: str
    config: Any               # the op's Config (a frozen dataclass)
    origin: str               # one of DECISION_ORIGINS, or "arch:<device>" (a row of another device of the arch)
    reason: str
    arch: str
    dtype: str
    dims: Mapping[str, int]
    # a config from a tuning-DB row: what call() runs instead when a launch with it raises (RowFallback)
    launch_fallback: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        return {"op": self.op, "impl": self.impl, "config": config_dict(self.config), "origin": self.origin,
                "reason": self.reason, "arch": self.arch, "dtype": self.dtype, "dims": dict(self.dims)}


@dataclasses.dataclass(frozen=True, eq=False)
class RowFallback:
    """The way out of a decision whose config came from a tuning-DB row, when a launch with that config raises
    (autograd.Fallback): the arch's heuristic config of the same implementation runs instead; once it has, `failed`
    marks the row bad until `reset()` (lookups skip it), warns once naming op, shape, row and error, and forgets
    the op's decisions, so the next call decides without the row."""
    op: Op
    impl: str
    target: Target
    dtype: torch.dtype
    dims: Mapping[str, int]
    row: Mapping[str, Any]          # the row's key fields, its config as JSON text and its layer

    def config(self):
        return self.op.default_config(self.impl, self.target.arch, dict(self.dims), self.dtype)

    def failed(self, exc: BaseException) -> None:
        if tuning_db.get_store().mark_launch_failed(self.row, f"{type(exc).__name__}: {exc}"):
            shape = ",".join(f"{k}={v}" for k, v in self.dims.items())
            error = " ".join(f"{type(exc).__name__}: {exc}".split())
            warnings.warn(f"liger_rt: {self.op.name} {shape} ({self.target.arch.name}, {dtype_name(self.dtype)}): "
                          f"the config of the {self.row['layer']} DB row {row_name(self.row)} raised "
                          f"at launch ({printable(error[:300])}); ran the {self.target.arch.name} heuristic config "
                          f"instead, and the row is skipped from now on (`liger-tune show --op {self.op.name}` "
                          "lists it)", RuntimeWarning, stacklevel=2)
        with _LOCK:
            _MEMOS[self.op].clear()


# op -> {(device, dtype, *dims): Decision}; the key uses x.device, not x.device.type (a new string per call)
_MEMOS: dict[Op, dict] = {}
_LOCK = threading.RLock()


def register(op: Op) -> Op:
    """Register an op (the last statement of its kernel file): the registry records it and hashes its
    kernels, its memo starts empty and its torch.compile ops are defined now (dynamo cannot trace a
    registration)."""
    REGISTRY.register(op)
    _MEMOS.setdefault(op, {})
    if op.schema:
        traced_function(op)
    return op


# -- the call path ---------------------------------------------------------------------------------

def call(op: Op, *args):
    """The functional's body: the prologue (`op.dims`), decide, run the chosen implementation.  fp64 (a dtype
    no kernel takes, op.REFERENCE_DTYPES) or an empty input runs the reference; any other dtype raises."""
    dims = op.dims(*args)
    x = args[0]
    if x.dtype not in op.torch_dtypes or x.numel() == 0:
        if x.dtype not in op.accepted_dtypes:
            raise TypeError(f"{op.name}: unsupported dtype {x.dtype}; accepted: "
                            f"{', '.join(map(str, op.accepted_dtypes))} (float64 runs the torch reference)")
        return op.reference(*args)
    if torch.compiler.is_compiling():
        return _traced_call(op, dims, args)
    key = (x.device, x.dtype, *dims.values())
    d = _MEMOS[op].get(key) or _decide_memo(op, x, dims, key)     # a Decision is always truthy
    impl = op.by_name[d.impl]
    if impl.fn is not None:
        return impl.fn(*args)
    return apply_kernel(impl, d.config, d.launch_fallback, *args)


def decision(op: Op, x: torch.Tensor, **dims: int) -> Decision:
    """The decision for a call of `op` on tensor `x` (its device and dtype) with these dims (memoised)."""
    key = (x.device, x.dtype, *dims.values())
    return _MEMOS[op].get(key) or _decide_memo(op, x, dims, key)


def _decide_memo(op: Op, x: torch.Tensor, dims: dict, key) -> Decision:
    """A memo miss: decide (locks, SQL), remember, log when asked."""
    with _LOCK:
        memo = _MEMOS[op]
        found = decide(op, current_target("cpu" if x.device.type == "cpu" else "cuda", x.device), x.dtype, dims)
        if len(memo) > 4096:
            memo.clear()
        memo[key] = found
    if env.log_decisions():
        log.warning("liger_rt decision: %s", _describe(found))
    return found


def memo(op: Op) -> dict:
    """The memoised decisions of `op`, by (device, dtype, *dims) (what `reset` clears)."""
    return _MEMOS[op]


def decisions() -> list[Decision]:
    """Every memoised decision of every registered op."""
    with _LOCK:
        return [d for m in _MEMOS.values() for d in m.values()]


def reset() -> None:
    """Forget every memoised decision and launch constant, the arch cache and the open DB (re-read env and DB)."""
    with _LOCK:
        for m in _MEMOS.values():
            m.clear()
        clear_launch_memos()
        backend.reset()
        tuning_db.reset()


# -- torch.compile: the decision taken at trace time -------------------------------------------------

def _traced_call(op: Op, dims: dict, args: tuple):
    # A static dim is pinned down by comparisons (dynamo guards on its exact value). A dynamic dim (a token
    # count) is not read at all: under dynamic shapes any comparison on it would guard, and the graph would
    # recompile whenever the count left its bucket (dynamo does not let traced code tell a symbolic int from
    # a plain one). The decision is taken at TRACED_TOKENS for every dynamic dim instead, so one graph
    # serves every count (the launchers take any). The decision below sees plain ints: constants.
    key = tuple(TRACED_DIMS.get(d, TRACED_TOKENS) if d in op.dynamic else _traced_exact(dims[d])
                for d in op.static + op.dynamic)
    impl_name, config_json = _decide_constant(op.name, args[0].device.type, args[0].dtype, *key)
    impl = op.by_name[impl_name]
    if impl.fn is not None:
        return impl.fn(*args)
    out = traced_function(op).apply(config_json, impl.keep, impl.traced_backward, *args)
    return out[0] if op.outputs == 1 else out


# The size every dynamic dim is decided at under torch.compile: the token count the sweeps' quick plans
# measure (4096 rows), so a compiled graph runs the config tuned for a typical training batch; a batch dim
# beside a sequence dim (short_conv) is 1, so their product is that count.
TRACED_TOKENS = 4096
TRACED_DIMS = {"batch": 1}


def _traced_exact(value) -> int:
    """A (possibly symbolic) positive int as a plain int, by bisection between powers of two."""
    lo, hi = 0, bucket(value)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if value <= mid else (mid, hi)
    return hi


@torch.compiler.assume_constant_result
def _decide_constant(op_name: str, device_type: str, dtype: torch.dtype, *key: int) -> tuple[str, str]:
    op = REGISTRY.get(op_name)
    dims = dict(zip(op.static + op.dynamic, key))
    if compiler_takes(op):
        if env.log_decisions():
            log.warning("liger_rt decision: %s under torch.compile -> torch (LIGER_RT_COMPILE_POLICY=fuse: the "
                        "compiler fuses it)", op.name)
        return "torch", json.dumps({"impl": "torch", "config": {}}, sort_keys=True)
    d = decision(op, _probe(device_type, dtype), **dims)
    return d.impl, json.dumps({"impl": d.impl, "config": config_dict(d.config)}, sort_keys=True)


def compiler_takes(op: Op) -> bool:
    """Whether a torch.compile trace hands `op` to the compiler (its torch implementation): the op says
    compiler_fuses, LIGER_RT_COMPILE_POLICY=fuse, and neither LIGER_RT_DISABLE nor LIGER_RT_IMPL_<OP> decides."""
    return (op.compiler_fuses and env.compile_policy() == "fuse" and not env.disabled()
            and env.impl_override(op.name, op.impl_names) is None)


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device_type)


# -- targets ---------------------------------------------------------------------------------------

def current_target(device_type: str, device=None) -> Target:
    if device_type == "cpu":
        return Target(backend.detect("cpu"), "cpu", interpreter_on())
    return Target(backend.detect(device), "cuda")


def target_for_arch(arch_name: str) -> Target:
    """A planning target for an arch by name (explain, dry runs): cpu means the interpreter."""
    arch = backend.profile(arch_name)
    if arch.name == "cpu":
        return Target(arch, "cpu", interpreter_on())
    if backend.gpu_present() and (real := backend.detect()).name == arch.name:
        arch = real
    return Target(arch, "cuda")


def select(op: str, *, dtype="bf16", arch: str | None = None, **dims: int) -> Decision:
    """Decide for an op by name without a tensor (CLI, planning): no memo."""
    the_op = REGISTRY.get(op)
    dims = the_op.check_dims(dims)
    target = current_target("cuda" if backend.gpu_present() else "cpu") if arch is None else target_for_arch(arch)
    return decide(the_op, target, parse_dtype(dtype), dims)


# -- the decision path ---------------------------------------------------------------------------

def decide(op: Op, target: Target, dtype: torch.dtype, dims: dict) -> Decision:
    # LIGER_RT_IMPL_<OP> of an op not imported yet: import it, so the env check below validates its value now
    for name in env.unchecked_impl_ops():
        REGISTRY.get(name)
    dims = op.check_dims(dims)
    arch = target.arch
    dname = dtype_name(dtype)
    avail = op.available_impls(target, dims, dtype) or ["torch"]   # torch runs even shapes the kernels cannot take

    def made(impl: str, config, origin: str, reason: str, row: dict | None = None) -> Decision:
        config = op.parse_config(config, impl)
        frozen = types.MappingProxyType(dict(dims))
        launch_fallback = None
        if row is not None and op.impl(impl).tuned:      # a DB row's config: the heuristic's if it cannot launch
            launch_fallback = RowFallback(op, impl, target, dtype, frozen, {
                **{k: row[k] for k in TUNING_PK}, "layer": row["layer"],
                "config": json.dumps(config_dict(config), sort_keys=True)})
        return Decision(op.name, impl, config, origin, reason, arch.name, dname, frozen, launch_fallback)

    def db_row(impls: list[str], nearest: bool) -> dict | None:
        return tuning_db.get_store().lookup(op, arch, dname, dims, impls=impls, nearest=nearest)

    def from_row(row: dict, origin: str, where: str) -> Decision:
        speed = f", torch {row['baseline_ms']:.4g} ms" if row.get("baseline_ms") else ""
        return made(row["impl"], row["config"], "stale" if row.get("stale") else row.get("fallback") or origin,
                    f"{where}: {row['median_ms']:.4g} ms{speed} ({row.get('db_origin', 'sweep')}, {row['layer']} DB)",
                    row)

    def nearest_config(impl: str) -> tuple[Any, str, dict | None]:
        if row := db_row([impl], nearest=True):
            return row["config"], "; config from DB", row
        return op.default_config(impl, arch, dims, dtype), "; heuristic config", None

    # 2. explicit overrides
    if env.disabled():
        return made("torch", {}, "env", "LIGER_RT_DISABLE=1")
    forced = env.impl_override(op.name, op.impl_names)
    if forced is not None:
        if forced not in avail:
            raise RuntimeError(f"LIGER_RT_IMPL_{op.name.upper()}={forced} but {forced} cannot run here "
                               f"(arch {arch.name}, device {target.device_type}, dims {dims}); "
                               f"available: {', '.join(avail)}")
        config, _, row = nearest_config(forced)
        return made(forced, config, "env", f"LIGER_RT_IMPL_{op.name.upper()}={forced}", row)
    if op.pinned_by_fused_moe_env and not env.fused_moe_autotune():
        cross = _crossover(op, target, dname, dims)
        impl = cross[0] if cross and cross[0] in avail else _heuristic_impl(op, target, dtype, dims, avail)
        kind = "HIP-safe pinned" if arch.is_hip else "pinned"
        return made(impl, op.default_config(impl, arch, dims, dtype, pinned=True), "pinned",
                    f"LIGER_FUSED_MOE_AUTOTUNE=0: {kind} config")

    # 3. tuning DB, exact bucket (a row of another device of the arch says "arch:<device>", of other code or
    # software "stale")
    if (row := db_row(avail, nearest=False)) is not None:
        return from_row(row, "db", "exact bucket")

    # 4. crossover table, then the nearest bucket
    cross = _crossover(op, target, dname, dims)
    unusable = ""
    if cross is not None and cross[0] not in avail:
        unusable = f"; the crossover picks {cross[0]}, which cannot run here"
    elif cross is not None:
        impl, reason, origin = cross
        config, source, row = nearest_config(impl)
        return made(impl, config, origin, reason + source, row)
    if (row := db_row(avail, nearest=True)) is not None:
        return from_row(row, "db-nearest", f"nearest bucket {row['bucket']}")

    # 5. a miss
    if env.autotune() and (len(avail) > 1 or avail[0] != "torch"):
        result = tune_online(op, target, dtype, dims)
        if result is not None:
            baseline = result.get("baseline_ms") or float("nan")
            return made(result["impl"], result["config"], "online",
                        f"tuned now: {result['median_ms']:.4g} ms (torch {baseline:.4g} ms)")
    impl = _heuristic_impl(op, target, dtype, dims, avail)
    return made(impl, op.default_config(impl, arch, dims, dtype), "heuristic",
                f"no DB entry for {arch.name}/{dname}/{op.static_key(dims)}{unusable}; {arch.name} heuristic")


def _heuristic_impl(op: Op, target: Target, dtype, dims, avail: list[str]) -> str:
    choice = op.heuristic_impl(target, dims, dtype, avail) if op.heuristic_impl is not None else None
    return choice if choice in avail else avail[0]


def _crossover(op: Op, target: Target, dname: str, dims: dict):
    if op.crossover_axis is None:
        return None
    row = tuning_db.get_store().crossover(op, target.arch, dname, dims)
    if row is None:
        return None
    value = float(op.crossover_axis(dims))
    impl = crossover_pick(row["segments"], value)
    return impl, (f"{op.crossover_axis_name or 'axis'}={value:.4g} -> {impl} "
                  f"(segments {row['segments']}, margin {row['margin']:.0%}, {row['origin']})"), \
        "stale" if row.get("stale") else row.get("fallback") or "crossover"


def _describe(d: Decision) -> str:
    dims = ",".join(f"{k}={v}" for k, v in d.dims.items())
    return f"{d.op}[{d.arch},{d.dtype},{dims}] -> {d.impl} {config_dict(d.config)} ({d.origin}: {d.reason})"
