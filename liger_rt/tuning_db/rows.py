"""What a tuning-DB row may hold: the columns of each table and the validation (against the op's
declaration) every row passes where it enters (import, sweep, online tuning) and where it is read
(lookups, `doctor`, `show`).  A failure is a :class:`RowError` with a one-line reason."""
from __future__ import annotations

import json
import math
import re
import time

from .. import backend, env
from ..config import config_dict
from ..dtypes import DTYPES
from ..freshness import source_hash
from ..registry import REGISTRY

DB_SCHEMA = 3

# How a row's times were taken, in a lookup's order of preference.  Rows of different methods are never compared.
# "wall-clock": the wall time per call of back-to-back calls on a GPU, host cost included (ops that declare
# wall_clock: a sweep ranks their implementations so).
METHODS = ("wall-clock", "cuda-graph", "do_bench", "cpu-wall", "unrecorded")
# Which tool made a row.
ORIGINS = ("sweep", "bench", "online", "published")
GENERIC_ARCHES = ("generic-nvidia", "generic-amd")
# What a row was measured on.  The device (its class keys the row, beside the arch) and its SM count say where;
# the versions and the kernel hash say what ran: a row whose software or kernel differs from this process's is
# "stale" (STALE_FIELDS; versions judged only for this machine's arch and cpu).
FINGERPRINT = ("device_name", "sm_count", "torch_version", "triton_version", "runtime_version", "source_hash")
STALE_FIELDS = ("torch_version", "triton_version", "runtime_version", "source_hash")

CROSSOVER_PK = ("op", "variant", "arch", "device", "dtype", "static_key")
TUNING_PK = (*CROSSOVER_PK, "bucket", "impl")
# a measurement's key is a unique index (not a primary key: the table has none), so imports are idempotent
MEASUREMENT_KEY = (*CROSSOVER_PK, "dims", "tag", "impl", "config", "created")
_HEAD = dict.fromkeys(CROSSOVER_PK, str)
_TAIL = {**{col: int if col == "sm_count" else str for col in FINGERPRINT}, "origin": str, "created": float}
TUNING_COLUMNS = {**_HEAD, "bucket": str, "impl": str, "config": str, "median_ms": float, "baseline_ms": float,
                  "host_ms": float, "method": str, "config_schema": int, **_TAIL}
MEASUREMENT_COLUMNS = {**_HEAD, "dims": str, "axis": float, "tag": str, "impl": str, "config": str,
                       "median_ms": float, "ok": int, "error": str, "method": str, **_TAIL}
CROSSOVER_COLUMNS = {**_HEAD, "axis_name": str, "segments": str, "margin": float, "method": str, **_TAIL}
COLUMNS = {"tuning": TUNING_COLUMNS, "measurements": MEASUREMENT_COLUMNS, "crossover": CROSSOVER_COLUMNS}
KEYS = {"tuning": TUNING_PK, "crossover": CROSSOVER_PK, "measurements": MEASUREMENT_KEY}
# The columns each older schema has (what a DB must have to be ours).  Schema 2 added the method, the host
# time, the SM count and runtime version, and where missing the rest of the fingerprint and the origin;
# schema 3 the device class (in the keys).
_NOT_IN_V1 = {"method", "host_ms", "sm_count", "runtime_version", "device"}
SCHEMA_COLUMNS = {
    1: {"tuning": set(TUNING_COLUMNS) - _NOT_IN_V1,
        "measurements": set(MEASUREMENT_COLUMNS) - _NOT_IN_V1 - {"origin", "torch_version", "triton_version"},
        "crossover": set(CROSSOVER_COLUMNS) - _NOT_IN_V1 - {"device_name", "torch_version", "triton_version"}},
    2: {table: set(cols) - {"device"} for table, cols in COLUMNS.items()},
    3: {table: set(cols) for table, cols in COLUMNS.items()},
}
DEFAULTS = {"method": "unrecorded", "sm_count": 0, "runtime_version": "", "torch_version": "",
            "triton_version": "", "device_name": "", "source_hash": "", "origin": "sweep", "error": "",
            "tag": "", "config_schema": 0, "ok": 0, "variant": "fwdbwd", "axis_name": ""}
_MAX_TEXT = 4096
_DEVICE = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}")


class RowError(ValueError):
    """A tuning-DB row that this liger_rt cannot use, with the one-line reason."""


def printable(value) -> str:
    """`value` as text with every control, format and separator character but the space escaped ("\\x1b",
    "\\n", "\\u202e"): text from a DB or an import reaches a terminal as written, never as escape sequences
    or forged lines."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def resolve_op(name: str):
    """The op registered as `name` (its kernel module imported on first use), or None."""
    if not isinstance(name, str):
        return None
    try:
        return REGISTRY.get(name)
    except ValueError:
        return None
    except ImportError as exc:      # registered, but its kernel module does not import here
        raise RowError(f"op {name!r} cannot be loaded ({type(exc).__name__}: {exc})") from None


def op_names() -> list[str]:
    return sorted(REGISTRY.names())


def fill_defaults(table: str, rec: dict) -> dict:
    """The row with every column of `table` (older rows lack the later schemas' ones; a row without a
    device class gets its device name's)."""
    out = {col: DEFAULTS.get(col) if rec.get(col) is None else rec[col] for col in COLUMNS[table]}
    if not out["device"]:
        out["device"] = backend.device_class(out["device_name"]) if isinstance(out["device_name"], str) else ""
    return out


def arch_for(name: str):
    """The Arch a row of arch `name` is judged against: this machine's when it is that arch, else the arch's
    profile (a generic arch: the conservative generic profile)."""
    hw = backend.detect_hardware()
    if hw.name == name:
        return hw
    return backend.profile(name) if name in backend.ARCH_NAMES else backend.generic_profile(name)


def launch_problem(op, impl: str, config, dims: dict, arch, dtype: str) -> str | None:
    """Why `config` of `impl` cannot launch for `dims` on `arch` (None: it can): the implementation does not take
    the shape (its `supports`), more warps or pipeline stages than the arch runs, more shared memory than it has
    (the op's `smem`), or what the op's ``launchable(config, dims, arch, dtype)`` says (Triton's largest block,
    the grid).  Registers are not checked: no register count fails a launch (ptxas spills to local memory, and
    Triton bounds the registers per thread by the block's threads)."""
    the_impl, torch_dtype = op.impl(impl), DTYPES[dtype]
    try:
        if the_impl.supports is not None and (why := the_impl.supports(dims, torch_dtype)):
            return f"{impl} does not take this shape: {why}"
        if not the_impl.tuned:
            return None
        warps, stages = config.limits()
        if warps > arch.max_num_warps:
            return f"num_warps {warps} > {arch.max_num_warps} (the most {arch.name} runs)"
        if stages > arch.max_num_stages:
            return f"num_stages {stages} > {arch.max_num_stages} (the most {arch.name} runs)"
        if op.smem is not None and (need := op.smem(config, dims, torch_dtype)) > arch.smem_bytes:
            return f"needs {need} B of shared memory, {arch.name} has {arch.smem_bytes} B per block"
        hook = getattr(op, "launchable", None)      # an op declared without one (a test double) has none
        reason = hook(config, dims, arch, torch_dtype) if callable(hook) else None
    except Exception as exc:          # the check itself failing says the config is not known to launch
        reason = f"its launch check failed ({type(exc).__name__}: {exc})"
    return str(reason).splitlines()[0] if reason else None


def number(rec: dict, col: str, *, positive: bool = False, optional: bool = False, integer: bool = False,
           low: float | None = None, high: float | None = None):
    v = rec.get(col)
    if v is None and optional:
        return None
    if v is None:
        raise RowError(f"{col} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RowError(f"{col}={v!r} is not a number")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise RowError(f"{col}={v!r} is not an integer")
        if not (0 <= v < 2 ** 31):
            raise RowError(f"{col}={int(v)!r} is out of range (0 .. 2^31)")
        return int(v)
    v = float(v)
    if not math.isfinite(v):
        raise RowError(f"{col}={v!r} is not finite")
    if positive and v <= 0:
        raise RowError(f"{col}={v!r} must be > 0")
    if low is not None and v < low:
        raise RowError(f"{col}={v!r} must be >= {low:g}")
    if high is not None and v >= high:
        raise RowError(f"{col}={v!r} must be < {high:g}")
    return v


def text(rec: dict, col: str, choices=None) -> str:
    v = rec.get(col)
    if not isinstance(v, str):
        raise RowError(f"{col}={v!r} is not a string")
    if len(v) > _MAX_TEXT:
        raise RowError(f"{col} is {len(v)} characters long (at most {_MAX_TEXT})")
    if choices is not None and v not in choices:
        raise RowError(f"{col}={v!r} is not one of {', '.join(choices)}")
    return v


def json_value(rec: dict, col: str, kind: type):
    v = rec.get(col)
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise RowError(f"{col} is not JSON: {rec.get(col)[:80]!r}") from None
    if not isinstance(v, kind):
        raise RowError(f"{col} must be a JSON {'object' if kind is dict else 'list'}, got {type(v).__name__}")
    return v


def _dims(op, obj: dict, names: tuple, col: str, pow2: bool = False) -> dict:
    if set(obj) != set(names):
        raise RowError(f"{col} {json.dumps(obj)[:120]} must have exactly the keys {', '.join(names) or '(none)'} "
                       f"for {op.name}")
    for k, v in obj.items():
        if isinstance(v, bool) or not isinstance(v, int) or not (1 <= v < 2 ** 40):
            raise RowError(f"{col}: {k}={v!r} is not a positive integer")
        if pow2 and v & (v - 1):
            raise RowError(f"{col}: {k}={v} is not a bucket (a power of two)")
    return obj


def parse_config(op, impl: str, data):
    """The config `impl` of `op` accepts for `data` (a dict or JSON text of one), else RowError."""
    try:
        return op.parse_config(data, impl)
    except (ValueError, TypeError) as exc:    # ConfigError is a ValueError
        shown = data if isinstance(data, str) else json.dumps(data, sort_keys=True)
        raise RowError(f"config {shown[:160]} is not valid for {op.name}/{impl}: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def launchable(op, row: dict, config, dims: dict | None = None, arch=None) -> None:
    """RowError when the tuning row's config cannot launch for `dims` (default: its static dims and the top
    of its bucket, the largest call it serves) on `arch` (default: its arch, see arch_for)."""
    if dims is None:
        dims = {**json.loads(row["static_key"]), **json.loads(row["bucket"])}
    if why := launch_problem(op, row["impl"], config, dims, arch or arch_for(row["arch"]), row["dtype"]):
        shape = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise RowError(f"config {row['config'][:160]} cannot launch for {shape} on {row['arch']}: {why}")


def current_code(op, row: dict) -> bool:
    """Measured on this kernel code and config schema (or published, hash-less)."""
    return row["config_schema"] == op.schema_version and row["source_hash"] in ("", source_hash(op))


def check(table: str, rec: dict, *, op=None, created: float | None = None) -> dict:
    """The validated, canonical form of one row of `table` (RowError with the reason if not).  The
    config of a tuning row measured on this code must parse and launch; a stale row's needs to be a JSON
    object.  A row without a creation time gets `created` (default: now, a row measured by this process)."""
    if table not in COLUMNS:
        raise RowError(f"unknown table {table!r}; valid: {', '.join(COLUMNS)}")
    if not isinstance(rec, dict):
        raise RowError(f"a record must be a JSON object, got {type(rec).__name__}")
    if extra := sorted(set(rec) - set(COLUMNS[table])):
        raise RowError(f"unknown field(s) {', '.join(extra)} (a row of a newer liger_rt?)")
    name = text(rec, "op")
    op = resolve_op(name) if op is None else op
    if op is None or op.name != name:
        raise RowError(f"unknown op {name!r}; valid ops: {', '.join(op_names())}")
    rec = fill_defaults(table, rec)
    out = {"op": name, "variant": text(rec, "variant", (op.variant,)),
           "arch": text(rec, "arch", env.ARCH_CHOICES + GENERIC_ARCHES), "device": device(rec),
           "dtype": text(rec, "dtype", DTYPES)}
    out["static_key"] = op.static_key(_dims(op, json_value(rec, "static_key", dict), tuple(op.static), "static_key"))
    for col in FINGERPRINT:
        out[col] = number(rec, col, integer=True) if col == "sm_count" else text(rec, col)
    out["method"] = text(rec, "method", METHODS)
    out["origin"] = text(rec, "origin", ORIGINS)
    if rec.get("created") in (None, ""):
        out["created"] = time.time() if created is None else created
    else:
        out["created"] = number(rec, "created", low=0.0)

    if table == "tuning":
        out["bucket"] = op.bucket_key(_dims(op, json_value(rec, "bucket", dict), tuple(op.dynamic), "bucket", True))
        out["impl"] = text(rec, "impl", tuple(op.impl_names))
        out["config_schema"] = number(rec, "config_schema", integer=True)
        config = json_value(rec, "config", dict)
        parsed = parse_config(op, out["impl"], config) if current_code(op, out) else None
        out["config"] = json.dumps(config if parsed is None else config_dict(parsed), sort_keys=True)
        if parsed is not None:
            launchable(op, out, parsed)
        out["median_ms"] = number(rec, "median_ms", positive=True)
        out["baseline_ms"] = number(rec, "baseline_ms", positive=True, optional=True)
        out["host_ms"] = number(rec, "host_ms", low=0.0, optional=True)
    elif table == "measurements":
        dims = _dims(op, json_value(rec, "dims", dict), tuple(op.static) + tuple(op.dynamic), "dims")
        if op.static_key(dims) != out["static_key"]:
            raise RowError(f"dims {json.dumps(dims)} do not match static_key {out['static_key']}")
        out["dims"] = json.dumps(dims, sort_keys=True)
        out["axis"] = number(rec, "axis", optional=True)
        out["tag"] = text(rec, "tag", tuple(dict.fromkeys(("", *op.tags))))
        out["impl"] = text(rec, "impl", tuple(op.impl_names))
        out["config"] = json.dumps(json_value(rec, "config", dict), sort_keys=True)
        ok = rec.get("ok")
        if ok not in (0, 1) or isinstance(ok, float):
            raise RowError(f"ok={ok!r} is not 0 or 1")
        out["ok"] = int(ok)
        out["median_ms"] = number(rec, "median_ms", positive=True, optional=not ok)
        out["error"] = text(rec, "error")
    else:
        if getattr(op, "crossover_axis", None) is None:
            raise RowError(f"{name} has no crossover axis: a crossover row cannot apply to it")
        axis_name = text(rec, "axis_name")
        if op.crossover_axis_name and axis_name not in ("", op.crossover_axis_name):
            raise RowError(f"axis_name={axis_name!r}; {name} crosses over on {op.crossover_axis_name}")
        out["axis_name"] = axis_name or op.crossover_axis_name
        out["segments"] = json.dumps(segments(op, json_value(rec, "segments", list)))
        out["margin"] = number(rec, "margin", low=0.0, high=1.0)
    return out


def device(rec: dict) -> str:
    """The row's device class: as given (it must be its device name's), else its device name's ("" when
    neither is known: a row of any device of its arch)."""
    name, given = text(rec, "device_name"), text(rec, "device")
    derived = backend.device_class(name)
    if given and not _DEVICE.fullmatch(given):
        raise RowError(f"device={given!r} is not a device class (lower-case letters, digits, '-' and '.': "
                       "e.g. h100, h200, mi325x)")
    if given and name and given != derived:
        raise RowError(f"device={given!r} but device_name={name!r} is a {derived}")
    return given or derived


def segments(op, segs: list) -> list:
    """[[bound, impl], ..., [null, impl]]: bounds finite, positive and increasing; the last null."""
    if not segs:
        raise RowError("segments are empty")
    prev = 0.0
    for i, seg in enumerate(segs):
        if not isinstance(seg, list) or len(seg) != 2:
            raise RowError(f"segment {i} {json.dumps(seg)[:60]} is not a [bound, impl] pair")
        bound, impl = seg
        if impl not in op.impl_names:
            raise RowError(f"segment {i} names {impl!r}, not an implementation of {op.name} "
                           f"({', '.join(op.impl_names)})")
        last = i == len(segs) - 1
        if (bound is None) != last:         # only the last segment is open-ended
            raise RowError("the last segment must have the bound null (open-ended)" if last
                           else f"segment {i} has no bound but is not the last")
        if not last and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound)
                         or bound <= prev):
            raise RowError(f"segment {i} bound {bound!r} is not a finite number above {prev:g}")
        prev = bound
    return segs
