"""The op registry and the decision path.

An op (rms_norm, swiglu, ...) registers its implementations (``triton``, ``torch``, ...) in
one place, each with an availability predicate, a candidate-config generator and a heuristic
default.  ``Op.select(x, **dims)`` answers "which implementation and config for this call" by
the path of DESIGN.md:

1. memo: key (device type, dtype, dims) -> Decision.  A hit costs one dict lookup.
2. env overrides: LIGER_RT_DISABLE, LIGER_RT_IMPL_<OP>, LIGER_FUSED_MOE_AUTOTUNE=0 (pinned).
3. the tuning DB at the exact bucket (fastest fresh row among available implementations),
4. the crossover table (ops with competing implementations), else the nearest bucket in log2,
5. a miss: LIGER_RT_AUTOTUNE=1 tunes now and persists; otherwise the arch heuristic.

Every decision carries its origin and a reason, which `liger-tune explain` and
``LIGER_RT_LOG=decisions`` print.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import logging
import math
import threading
import types
from typing import Any, Callable, Mapping

import torch

from . import backend, env
from .kernels._common import dtype_name, interpreter_on

log = logging.getLogger("liger_rt.dispatch")

# op name -> module under liger_rt.kernels that registers it (imported on first use)
OP_MODULES = {
    "rms_norm": "rms_norm",
    "swiglu": "swiglu",
    "layer_norm": "layer_norm",
    "short_conv": "short_conv",
    "moe_router": "moe_router",
    "moe_experts": "moe_experts",
    "cross_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
    "rope": "rope",
}
ORIGINS = ("env", "pinned", "db", "crossover", "db-nearest", "online", "heuristic")


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
    config: Mapping[str, Any]
    origin: str               # one of ORIGINS
    reason: str
    arch: str
    dtype: str
    dims: Mapping[str, int]

    def to_dict(self) -> dict:
        return {"op": self.op, "impl": self.impl, "config": dict(self.config), "origin": self.origin,
                "reason": self.reason, "arch": self.arch, "dtype": self.dtype, "dims": dict(self.dims)}


def _always(target: Target) -> bool:
    return True


def _no_configs(arch, dims, dtype) -> list[dict]:
    return [{}]


def _empty_config(arch, dims, dtype) -> dict:
    return {}


@dataclasses.dataclass
class Impl:
    """One implementation of an op.

    run(case, config) -> list of tensors (forward output and gradients) for tuning and validation.
    configs(arch, dims, dtype) -> candidate configs (pruned by the arch afterwards).
    heuristic(arch, dims, dtype) -> the default config when nothing was measured.
    pinned(arch, dims, dtype) -> fixed, known-safe config for LIGER_FUSED_MOE_AUTOTUNE=0.
    supports(dims, dtype) -> None, or why this implementation cannot take the shape.
    smem(config, dims, dtype) -> shared memory bytes one program needs (for pruning).
    """
    name: str
    run: Callable[[Any, Mapping], list]
    available: Callable[[Target], bool] = _always
    configs: Callable[[backend.Arch, dict, torch.dtype], list[dict]] = _no_configs
    heuristic: Callable[[backend.Arch, dict, torch.dtype], dict] = _empty_config
    pinned: Callable[[backend.Arch, dict, torch.dtype], dict] | None = None
    supports: Callable[[dict, torch.dtype], str | None] | None = None
    smem: Callable[[Mapping, dict, torch.dtype], int] | None = None


def bucket(value: int) -> int:
    """Dynamic dims are bucketed to the next power of two (1, 2, 4, ...)."""
    value = int(value)
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


@dataclasses.dataclass
class Op:
    """An op's registration: its dims, implementations and how to build a tuning case.

    static dims key tuning exactly (hidden, vocab, experts...); dynamic dims (rows, tokens,
    seq) are bucketed.  make_case(dims, dtype, device) builds fresh random inputs; plan(preset,
    arch, quick) lists the dims a sweep measures; reduce_len(dims) sizes the validation tolerance.
    crossover_axis(dims) is the quantity that decides between competing implementations.
    """

    def new_case(self, dims: dict, dtype: torch.dtype, device: str, tag: str = ""):
        if self.tags != ("",):
            return self.make_case(dims, dtype, device, tag=tag or self.tags[0])
        return self.make_case(dims, dtype, device)
    name: str
    static: tuple[str, ...]
    dynamic: tuple[str, ...]
    impls: list[Impl]
    make_case: Callable[[dict, torch.dtype, str], Any]
    plan: Callable[[Any, backend.Arch, bool], list[dict]]
    reduce_len: Callable[[dict], int] = lambda dims: 1
    heuristic_impl: Callable[[Target, dict, torch.dtype, list[str]], str] | None = None
    crossover_axis: Callable[[dict], float] | None = None
    crossover_axis_name: str = ""
    pinned_by_fused_moe_env: bool = False
    schema_version: int = 1
    variant: str = "fwdbwd"
    module: str = ""
    tags: tuple[str, ...] = ("",)   # input variants a sweep measures (e.g. uniform/skewed routing);
                                    # when set, make_case takes tag= as a fourth argument
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")

    def __post_init__(self) -> None:
        self._by_name = {i.name: i for i in self.impls}
        self._memo: dict = {}
        self._hash: str | None = None
        if "torch" not in self._by_name:
            raise ValueError(f"op {self.name} must register a 'torch' reference implementation")

    # -- identity -------------------------------------------------------------------------
    @property
    def impl_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def impl(self, name: str) -> Impl:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"{self.name} has no implementation {name!r}; valid: {', '.join(self._by_name)}") from None

    @property
    def source_hash(self) -> str:
        """Hash of the op's kernel file: DB rows measured on other code are stale."""
        if self._hash is None:
            mod = importlib.import_module(self.module) if self.module else None
            src = inspect.getsource(mod) if mod else self.name
            self._hash = hashlib.sha256(src.encode()).hexdigest()[:16]
        return self._hash

    def check_dims(self, dims: Mapping[str, int]) -> dict:
        names = self.static + self.dynamic
        missing = [d for d in names if d not in dims]
        extra = [d for d in dims if d not in names]
        if missing or extra:
            raise ValueError(f"{self.name} takes dims {','.join(names)}; missing {missing or 'none'}, "
                             f"unknown {extra or 'none'}")
        return {d: int(dims[d]) for d in names}

    def static_key(self, dims: Mapping[str, int]) -> str:
        return json.dumps({d: int(dims[d]) for d in self.static}, sort_keys=True, separators=(",", ":"))

    def bucket_key(self, dims: Mapping[str, int]) -> str:
        return json.dumps({d: bucket(dims[d]) for d in self.dynamic}, sort_keys=True, separators=(",", ":"))

    # -- configs ----------------------------------------------------------------------------
    def candidates(self, impl: Impl, arch: backend.Arch, dims: dict, dtype: torch.dtype) -> list[dict]:
        return prune_configs(impl.configs(arch, dims, dtype), arch, impl, dims, dtype)

    def available_impls(self, target: Target, dims: dict, dtype: torch.dtype) -> list[str]:
        out = []
        for impl in self.impls:
            if not impl.available(target):
                continue
            if impl.supports is not None and impl.supports(dims, dtype) is not None:
                continue
            out.append(impl.name)
        return out

    # -- the hot path -------------------------------------------------------------------------
    def select(self, x: torch.Tensor, **dims: int) -> Decision:
        """Decide for a call on tensor `x` (its device and dtype) with these dims."""
        key = (x.device.type, x.dtype, *dims.values())
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        return self._select_slow(key, x, dims)

    @torch.compiler.disable  # a decision is made eagerly (locks, SQL), then memoised for compiled graphs
    def _select_slow(self, key, x: torch.Tensor, dims: dict) -> Decision:
        with _LOCK:
            device_type = "cpu" if x.device.type == "cpu" else "cuda"
            target = current_target(device_type, x.device)
            decision = decide(self, target, x.dtype, dims)
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = decision
        if env.log_decisions():
            log.warning("liger_rt decision: %s", _describe(decision))
        return decision


_LOCK = threading.RLock()
_REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Register an op (called at the bottom of each kernel file)."""
    if not op.module:
        frame = inspect.stack()[1]
        op.module = frame.frame.f_globals.get("__name__", "")
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> Op:
    """The registered op by name, importing its kernel module on first use."""
    if name not in _REGISTRY:
        if name not in OP_MODULES:
            raise ValueError(f"unknown op {name!r}; valid ops: {', '.join(OP_MODULES)}")
        importlib.import_module(f"liger_rt.kernels.{OP_MODULES[name]}")
    return _REGISTRY[name]


def available_ops() -> list[str]:
    """Ops whose kernel module imports (all of OP_MODULES once every issue has landed)."""
    out = []
    for name in OP_MODULES:
        try:
            get_op(name)
        except ModuleNotFoundError:
            continue
        out.append(name)
    return out


def reset() -> None:
    """Forget every memoised decision, the arch cache and the open DB (re-read env and DB)."""
    with _LOCK:
        for op in _REGISTRY.values():
            op._memo.clear()
        backend.reset()
        from . import tuning_db
        tuning_db.reset()


def current_target(device_type: str, device=None) -> Target:
    if device_type == "cpu":
        arch = backend.detect("cpu")
        return Target(arch=arch, device_type="cpu", interpret=interpreter_on())
    return Target(arch=backend.detect(device), device_type="cuda")


def target_for_arch(arch_name: str) -> Target:
    """A planning target for an arch by name (explain, dry runs): cpu means the interpreter."""
    arch = backend.profile(arch_name)
    if arch.name == "cpu":
        return Target(arch=arch, device_type="cpu", interpret=interpreter_on())
    if backend.gpu_present():
        real = backend.detect()
        if real.name == arch.name:
            arch = real
    return Target(arch=arch, device_type="cuda")


def select(op: str, *, dtype="bf16", arch: str | None = None, **dims: int) -> Decision:
    """Decide for an op by name without a tensor (CLI, planning): no memo."""
    from .kernels._common import parse_dtype
    the_op = get_op(op)
    dims = the_op.check_dims(dims)
    if arch is None:
        target = current_target("cuda" if backend.gpu_present() else "cpu")
    else:
        target = target_for_arch(arch)
    return decide(the_op, target, parse_dtype(dtype), dims)


# -- the decision path ---------------------------------------------------------------------------

def decide(op: Op, target: Target, dtype: torch.dtype, dims: dict) -> Decision:
    dims = op.check_dims(dims)
    arch = target.arch
    dname = dtype_name(dtype)
    avail = op.available_impls(target, dims, dtype)
    if not avail:  # torch always runs, even for shapes the kernels cannot take
        avail = ["torch"]

    def made(impl: str, config: Mapping, origin: str, reason: str) -> Decision:
        return Decision(op.name, impl, types.MappingProxyType(dict(config)), origin, reason, arch.name, dname,
                        types.MappingProxyType(dict(dims)))

    # 2. explicit overrides
    if env.disabled():
        return made("torch", {}, "env", "LIGER_RT_DISABLE=1")
    forced = env.impl_override(op.name, op.impl_names)
    if forced is not None:
        if forced not in avail:
            raise RuntimeError(
                f"LIGER_RT_IMPL_{op.name.upper()}={forced} but {forced} cannot run here "
                f"(arch {arch.name}, device {target.device_type}, dims {dims}); available: {', '.join(avail)}")
        row = _db_row(op, target, dname, dims, impls=[forced], nearest=True)
        config = row["config"] if row else op.impl(forced).heuristic(arch, dims, dtype)
        return made(forced, config, "env", f"LIGER_RT_IMPL_{op.name.upper()}={forced}")
    if op.pinned_by_fused_moe_env and not env.fused_moe_autotune():
        impl = _crossover_or_heuristic_impl(op, target, dname, dtype, dims, avail)
        pin = op.impl(impl).pinned or op.impl(impl).heuristic
        kind = "HIP-safe pinned" if arch.is_hip else "pinned"
        return made(impl, pin(arch, dims, dtype), "pinned", f"LIGER_FUSED_MOE_AUTOTUNE=0: {kind} config")

    # 3. tuning DB, exact bucket
    row = _db_row(op, target, dname, dims, impls=avail, nearest=False)
    if row is not None:
        return made(row["impl"], row["config"], "db", _row_reason(row, "exact bucket"))

    # 4. crossover table, then the nearest bucket
    cross = _crossover(op, target, dname, dims, avail)
    if cross is not None:
        impl, reason = cross
        row = _db_row(op, target, dname, dims, impls=[impl], nearest=True)
        config = row["config"] if row else op.impl(impl).heuristic(arch, dims, dtype)
        return made(impl, config, "crossover", reason + ("; config from DB" if row else "; heuristic config"))
    row = _db_row(op, target, dname, dims, impls=avail, nearest=True)
    if row is not None:
        return made(row["impl"], row["config"], "db-nearest", _row_reason(row, f"nearest bucket {row['bucket']}"))

    # 5. a miss
    if env.autotune() and (len(avail) > 1 or avail[0] != "torch"):
        from . import autotune
        result = autotune.tune_online(op, target, dtype, dims)
        if result is not None:
            return made(result["impl"], result["config"], "online",
                        f"tuned now: {result['median_ms']:.4g} ms (torch {result.get('baseline_ms') or float('nan'):.4g} ms)")
    impl = _heuristic_impl(op, target, dtype, dims, avail)
    return made(impl, op.impl(impl).heuristic(arch, dims, dtype), "heuristic",
                f"no DB entry for {arch.name}/{dname}/{op.static_key(dims)}; {arch.name} heuristic")


def _heuristic_impl(op: Op, target: Target, dtype, dims, avail: list[str]) -> str:
    if op.heuristic_impl is not None:
        choice = op.heuristic_impl(target, dims, dtype, avail)
        if choice in avail:
            return choice
    return avail[0]


def _crossover_or_heuristic_impl(op, target, dname, dtype, dims, avail) -> str:
    cross = _crossover(op, target, dname, dims, avail)
    return cross[0] if cross else _heuristic_impl(op, target, dtype, dims, avail)


def _row_reason(row: dict, where: str) -> str:
    base = row.get("baseline_ms")
    speed = f", torch {base:.4g} ms" if base else ""
    return f"{where}: {row['median_ms']:.4g} ms{speed} ({row.get('db_origin', 'sweep')}, {row['layer']} DB)"


def _db_row(op: Op, target: Target, dname: str, dims: dict, *, impls: list[str], nearest: bool) -> dict | None:
    from . import tuning_db
    store = tuning_db.get_store()
    return store.lookup(op, target.arch.name, dname, dims, impls=impls, nearest=nearest)


def _crossover(op: Op, target: Target, dname: str, dims: dict, avail: list[str]):
    if op.crossover_axis is None:
        return None
    from . import tuning_db
    row = tuning_db.get_store().crossover(op, target.arch.name, dname, dims)
    if row is None:
        return None
    value = float(op.crossover_axis(dims))
    impl = crossover_pick(row["segments"], value)
    if impl not in avail:
        return None
    return impl, (f"{op.crossover_axis_name or 'axis'}={value:.4g} -> {impl} "
                  f"(segments {row['segments']}, margin {row['margin']:.0%}, {row['origin']})")


def crossover_pick(segments: list, value: float) -> str:
    """segments: [[upper_bound or None, impl], ...] in increasing bound order."""
    for bound, impl in segments:
        if bound is None or value < bound:
            return impl
    return segments[-1][1]


def derive_crossover(points: list[tuple[float, dict[str, float]]], margin: float = 0.05) -> list:
    """Segments from measurements: points are (axis value, {impl: median ms}).

    A challenger takes over only when it beats the incumbent by more than `margin` (hysteresis, so
    noise cannot flip the choice back and forth); boundaries sit at the geometric mean of the two
    neighbouring measured axis values.
    """
    pts = sorted((a, t) for a, t in points if t)
    if not pts:
        raise ValueError("no measurements to derive a crossover from")
    segments: list = []
    incumbent = min(pts[0][1], key=pts[0][1].get)
    prev_axis = pts[0][0]
    for axis, times in pts[1:]:
        best = min(times, key=times.get)
        if best != incumbent and incumbent in times and times[best] < times[incumbent] * (1.0 - margin):
            bound = math.sqrt(max(prev_axis, 1e-12) * max(axis, 1e-12))
            segments.append([round(bound, 6), incumbent])
            incumbent = best
        elif incumbent not in times:
            incumbent = best
        prev_axis = axis
    segments.append([None, incumbent])
    return segments


def _describe(d: Decision) -> str:
    dims = ",".join(f"{k}={v}" for k, v in d.dims.items())
    return f"{d.op}[{d.arch},{d.dtype},{dims}] -> {d.impl} {dict(d.config)} ({d.origin}: {d.reason})"


def prune_configs(configs: list[dict], arch: backend.Arch, impl: Impl | None = None,
                  dims: dict | None = None, dtype: torch.dtype | None = None) -> list[dict]:
    """Drop configs the arch cannot run: warps over its ceiling (wave64 on AMD: 16 at most),
    stages over its safe depth (<= 2 on HIP), shared memory/LDS over its budget. Deduplicates."""
    out, seen = [], set()
    for cfg in configs:
        if cfg.get("num_warps", 1) > arch.max_num_warps:
            continue
        if cfg.get("num_stages", 1) > arch.max_num_stages:
            continue
        if impl is not None and impl.smem is not None and dims is not None:
            if impl.smem(cfg, dims, dtype) > arch.smem_bytes:
                continue
        key = json.dumps(cfg, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(dict(cfg))
    return out
