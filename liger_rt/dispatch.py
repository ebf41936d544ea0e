"""The op registry and the decision path (docs/architecture.md).  ``Op.select(x, **dims)`` answers
"which implementation and config for this call": the memo, else env overrides (LIGER_RT_DISABLE,
LIGER_RT_IMPL_<OP>, LIGER_FUSED_MOE_AUTOTUNE=0), the tuning DB's exact bucket, the crossover table, the
DB's nearest bucket in log2, and on a miss online tuning (LIGER_RT_AUTOTUNE=1) or the arch heuristic.
Every decision carries its origin and a reason (`liger-tune explain`, ``LIGER_RT_LOG=decisions``).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import types
from typing import Any, Mapping

import torch

from . import backend, env, opspec, tuning_db
from .kernels._common import clear_launch_memos, dtype_name, interpreter_on, parse_dtype
from .tuning_db.crossover import crossover_pick, derive_crossover  # noqa: F401  (the one copy)
from .opspec import Case, Config, ConfigError, Impl, NoConfig, Op, bucket, config_dict, knob  # noqa: F401

log = logging.getLogger("liger_rt.dispatch")

# op name -> module under liger_rt.kernels that registers it (imported on first use)
OP_MODULES = {name: name for name in (
    "rms_norm", "swiglu", "layer_norm", "short_conv", "moe_router", "moe_experts", "cross_entropy",
    "fused_linear_cross_entropy", "fused_linear_logprobs", "rope", "geglu")}
ORIGINS = ("env", "pinned", "db", "crossover", "db-nearest", "stale", "online", "heuristic")


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
    origin: str               # one of ORIGINS, or "arch:<device>" (a row of another device of the arch)
    reason: str
    arch: str
    dtype: str
    dims: Mapping[str, int]

    def to_dict(self) -> dict:
        return {"op": self.op, "impl": self.impl, "config": config_dict(self.config), "origin": self.origin,
                "reason": self.reason, "arch": self.arch, "dtype": self.dtype, "dims": dict(self.dims)}


def _decide_memo(op: Op, x: torch.Tensor, dims: dict, key) -> Decision:
    """A memo miss: decide (locks, SQL), remember, log when asked."""
    with _LOCK:
        decision = decide(op, current_target("cpu" if x.device.type == "cpu" else "cuda", x.device), x.dtype, dims)
        if len(op._memo) > 4096:
            op._memo.clear()
        op._memo[key] = decision
    if env.log_decisions():
        log.warning("liger_rt decision: %s", _describe(decision))
    return decision


_LOCK = threading.RLock()
_REGISTRY: dict[str, Op] = opspec.REGISTERED


def register(op: Op) -> Op:
    """Register an op (called at the bottom of each kernel file)."""
    op._decide = _decide_memo
    op.source_hash            # from the launchers as defined (a later monkeypatch of a global cannot change it)
    if op.schema:
        op._custom_ops        # registered now: dynamo cannot trace a registration
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
    """Every op, its kernel module imported."""
    return [get_op(name).name for name in OP_MODULES]


def reset() -> None:
    """Forget every memoised decision and launch constant, the arch cache and the open DB (re-read env and DB)."""
    with _LOCK:
        for op in _REGISTRY.values():
            op._memo.clear()
        clear_launch_memos()
        backend.reset()
        tuning_db.reset()


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
    the_op = get_op(op)
    dims = the_op.check_dims(dims)
    target = current_target("cuda" if backend.gpu_present() else "cpu") if arch is None else target_for_arch(arch)
    return decide(the_op, target, parse_dtype(dtype), dims)


# -- the decision path ---------------------------------------------------------------------------

def decide(op: Op, target: Target, dtype: torch.dtype, dims: dict) -> Decision:
    dims = op.check_dims(dims)
    arch = target.arch
    dname = dtype_name(dtype)
    avail = op.available_impls(target, dims, dtype) or ["torch"]   # torch runs even shapes the kernels cannot take

    def made(impl: str, config, origin: str, reason: str) -> Decision:
        return Decision(op.name, impl, op.parse_config(config, impl), origin, reason, arch.name, dname,
                        types.MappingProxyType(dict(dims)))

    def db_row(impls: list[str], nearest: bool) -> dict | None:
        return tuning_db.get_store().lookup(op, arch, dname, dims, impls=impls, nearest=nearest)

    def from_row(row: dict, origin: str, where: str) -> Decision:
        speed = f", torch {row['baseline_ms']:.4g} ms" if row.get("baseline_ms") else ""
        return made(row["impl"], row["config"], "stale" if row.get("stale") else row.get("fallback") or origin,
                    f"{where}: {row['median_ms']:.4g} ms{speed} ({row.get('db_origin', 'sweep')}, {row['layer']} DB)")

    def nearest_config(impl: str) -> tuple[Any, str]:
        if row := db_row([impl], nearest=True):
            return row["config"], "; config from DB"
        return op.default_config(impl, arch, dims, dtype), "; heuristic config"

    # 2. explicit overrides
    if env.disabled():
        return made("torch", {}, "env", "LIGER_RT_DISABLE=1")
    forced = env.impl_override(op.name, op.impl_names)
    if forced is not None:
        if forced not in avail:
            raise RuntimeError(f"LIGER_RT_IMPL_{op.name.upper()}={forced} but {forced} cannot run here "
                               f"(arch {arch.name}, device {target.device_type}, dims {dims}); "
                               f"available: {', '.join(avail)}")
        return made(forced, nearest_config(forced)[0], "env", f"LIGER_RT_IMPL_{op.name.upper()}={forced}")
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
        config, source = nearest_config(impl)
        return made(impl, config, origin, reason + source)
    if (row := db_row(avail, nearest=True)) is not None:
        return from_row(row, "db-nearest", f"nearest bucket {row['bucket']}")

    # 5. a miss
    if env.autotune() and (len(avail) > 1 or avail[0] != "torch"):
        from . import autotune
        result = autotune.tune_online(op, target, dtype, dims)
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
