"""Every LIGER_* environment variable, parsed and validated in one place (docs/env.md lists them).

Nothing is read at import time.  Every accessor first runs :func:`check`, which validates *all* the variables
set, so a bad value raises :class:`EnvError` whichever variable a path needs; an unknown ``LIGER_RT_*`` name
warns once, naming the nearest valid one.  ``LIGER_RT_IMPL_<OP>`` is checked against the implementations of the
ops imported so far: a decision first imports each op such a variable names (:func:`unchecked_impl_ops`).  This
module imports nothing from liger_rt (its importers are).
"""
from __future__ import annotations

import difflib
import functools
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# LIGER_RT_ARCH's values: liger_rt.backend checks at import that its arch profiles have these names
ARCH_CHOICES = ("hopper", "blackwell", "ampere", "mi300x", "mi325x", "mi355x", "cpu")
MAX_DB_TIMEOUT = 86400.0     # seconds; SQLite's busy timeout is an int of milliseconds
IMPL_PREFIX = "LIGER_RT_IMPL_"


class EnvError(ValueError):
    """A LIGER_* variable holds a value that is not accepted."""


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise EnvError(f"{name}={raw!r} is not valid; accepted values: 0 or 1 (also true/false, yes/no, on/off)")


def _path(name: str, raw: str) -> Path:
    try:
        return Path(raw).expanduser()
    except RuntimeError as exc:   # "~nosuchuser/...", or "~" with neither HOME nor a passwd entry
        raise EnvError(f"{name}={raw!r}: cannot expand '~' ({exc}); accepted values: an absolute path, "
                       "a relative one, or ~/... where the home directory is known") from None


def _tuning_db_path() -> Path:
    if raw := _raw("LIGER_RT_TUNING_DB"):
        return _path("LIGER_RT_TUNING_DB", raw)
    if cache := _raw("XDG_CACHE_HOME"):
        return _path("XDG_CACHE_HOME", cache) / "liger_rt" / "tuning.db"
    try:
        home = Path.home()
    except RuntimeError:
        raise EnvError("the home directory is unknown (HOME unset, no passwd entry); "
                       "set LIGER_RT_TUNING_DB to the tuning DB path") from None
    return home / ".cache" / "liger_rt" / "tuning.db"


def _choice(name: str, choices, what: str) -> str | None:
    """The lower-cased value of `name` (None when unset), one of `choices` (None: anything)."""
    raw = _raw(name).lower()
    if raw and choices is not None and raw not in choices:
        raise EnvError(f"{name}={raw!r} is {what}; accepted values: {', '.join(choices)}")
    return raw or None


def _timeout() -> float:
    raw = _raw("LIGER_RT_DB_TIMEOUT")
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0.0 <= value <= MAX_DB_TIMEOUT):   # also refuses nan and inf
        raise EnvError(f"LIGER_RT_DB_TIMEOUT={raw!r} is not valid; accepted values: a number of seconds "
                       f"from 0 to {MAX_DB_TIMEOUT:g}")
    return value


def _impl(op: str, valid) -> str | None:
    return _choice(IMPL_PREFIX + op.upper(), valid, f"not an implementation of {op}")


# variable -> (its key in `snapshot`, parser)
_PARSERS = {
    "LIGER_RT_TUNING_DB": ("tuning_db", _tuning_db_path),
    "LIGER_RT_ARCH": ("arch", lambda: _choice("LIGER_RT_ARCH", ARCH_CHOICES, "not a known arch")),
    "LIGER_RT_AUTOTUNE": ("autotune", lambda: _flag("LIGER_RT_AUTOTUNE", False)),
    "LIGER_RT_LOG": ("log_decisions",
                     lambda: _choice("LIGER_RT_LOG", ("decisions", *_FALSE), "not valid") == "decisions"),
    "LIGER_RT_DISABLE": ("disable", lambda: _flag("LIGER_RT_DISABLE", False)),
    "LIGER_FUSED_MOE_AUTOTUNE": ("fused_moe_autotune", lambda: _flag("LIGER_FUSED_MOE_AUTOTUNE", True)),
    "LIGER_RT_DB_TIMEOUT": ("db_timeout", _timeout),
    "LIGER_RT_RECOMPUTE_SWIGLU": ("recompute_swiglu", lambda: _flag("LIGER_RT_RECOMPUTE_SWIGLU", False)),
    "LIGER_RT_COMPILE_POLICY": ("compile_policy", lambda: _choice("LIGER_RT_COMPILE_POLICY", ("kernels", "fuse"),
                                                                  "not a compile policy") or "fuse"),
}


# op name -> its implementation names (None while its module is not imported): what LIGER_RT_IMPL_<OP> may
# name.  The op registry declares them (env imports nothing from liger_rt); none are known before it loads.
_OPS: dict[str, tuple | None] = {}


def declare_ops(ops: Mapping[str, tuple[str, ...] | None]) -> None:
    """Make LIGER_RT_IMPL_<OP> known for each op of `ops` (name -> implementation names, or None: not yet
    known); the registry calls this for its table and for each op it registers."""
    _OPS.update({name: None if impls is None else tuple(impls) for name, impls in ops.items()})


def _ops() -> dict[str, tuple | None]:
    return dict(_OPS)


def unchecked_impl_ops() -> list[str]:
    """The ops named by a LIGER_RT_IMPL_<OP> set now whose implementation names are not known yet (their module
    is not imported): the dispatcher imports them at a decision, so that `check` validates every such value."""
    return [op for key in os.environ if key.startswith(IMPL_PREFIX)
            and (op := key[len(IMPL_PREFIX):].lower()) in _OPS and _OPS[op] is None]


# -- check ------------------------------------------------------------------------------------------

_checked: tuple | None = None
_warned: set[str] = set()


def check() -> None:
    """Validate every LIGER_* variable set now (EnvError for the first bad one) and warn once per
    unknown LIGER_RT_* name.  Cheap when nothing changed: one scan of the environment."""
    global _checked
    items = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("LIGER_")))
    ops = _ops()
    key = (items, len(ops), sum(v is not None for v in ops.values()))   # ops register lazily
    if key == _checked:
        return
    for name, _ in items:
        op = name[len(IMPL_PREFIX):].lower()
        if name in _PARSERS:
            _PARSERS[name][1]()
        elif name.startswith(IMPL_PREFIX) and op in ops:
            _impl(op, ops[op])
        elif name.startswith("LIGER_RT_") and (ops or not name.startswith(IMPL_PREFIX)) and name not in _warned:
            _warned.add(name)
            warnings.warn(f"liger_rt: unknown environment variable {name} is ignored; {_hint(name, ops)}",
                          RuntimeWarning, stacklevel=3)
    _checked = key


def known_names(ops) -> list[str]:
    return [*_PARSERS, *(IMPL_PREFIX + o.upper() for o in ops)]


def _hint(key: str, ops) -> str:
    known = known_names(ops)
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean {near[0]}?" if near else f"known: {', '.join(known)}"


def _get(name: str):
    check()
    return _PARSERS[name][1]()


# The accessors (docs/env.md says what each variable means); each validates the whole environment first.
tuning_db_path = functools.partial(_get, "LIGER_RT_TUNING_DB")                # -> Path
arch_override = functools.partial(_get, "LIGER_RT_ARCH")                      # -> an arch name or None
autotune = functools.partial(_get, "LIGER_RT_AUTOTUNE")                       # -> bool
log_decisions = functools.partial(_get, "LIGER_RT_LOG")                       # -> bool
disabled = functools.partial(_get, "LIGER_RT_DISABLE")                        # -> bool
fused_moe_autotune = functools.partial(_get, "LIGER_FUSED_MOE_AUTOTUNE")      # -> bool
db_timeout = functools.partial(_get, "LIGER_RT_DB_TIMEOUT")                   # -> seconds
compile_policy = functools.partial(_get, "LIGER_RT_COMPILE_POLICY")           # -> "fuse" or "kernels"
recompute_swiglu = functools.partial(_get, "LIGER_RT_RECOMPUTE_SWIGLU")       # -> bool


def impl_override(op: str, valid: tuple[str, ...] | None = None) -> str | None:
    """LIGER_RT_IMPL_<OP>: the implementation forced for one op, if any."""
    check()
    return _impl(op, valid)


def _or_error(fn, *args):
    try:
        return fn(*args)
    except EnvError as exc:
        return f"error: {exc}"


def snapshot() -> dict:
    """Every LIGER_* variable set now (for `liger-tune doctor`), raw, plus what was parsed; a bad
    value shows as "error: ..." instead of raising, and unknown names are listed."""
    raw = {k: v for k, v in sorted(os.environ.items()) if k.startswith("LIGER_")}
    parsed = {key: _or_error(fn) for key, fn in _PARSERS.values()}
    parsed["tuning_db"] = str(parsed["tuning_db"])
    ops = _ops()
    parsed.update({key: _or_error(_impl, op, ops[op]) for key in raw
                   if key.startswith(IMPL_PREFIX) and (op := key[len(IMPL_PREFIX):].lower()) in ops})
    known = set(known_names(ops))
    unknown = {k: _hint(k, ops) for k in raw if k.startswith("LIGER_RT_") and k not in known}
    return {"set": raw, "parsed": parsed, "unknown": unknown}
