"""Every LIGER_* environment variable, parsed and validated in one place.

Each function reads ``os.environ`` when called: nothing is read at import time.  The dispatcher
calls these only when it makes a new decision (a memo miss), so a changed variable applies to
decisions made afterwards; ``liger_rt.dispatch.reset()`` forgets earlier decisions.
docs/env.md documents each variable.
"""
from __future__ import annotations

import os
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A LIGER_* variable holds a value that is not accepted."""


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(f"{name}={raw!r} is not valid; accepted values: 0 or 1 (also true/false, yes/no, on/off)")


def tuning_db_path() -> Path:
    """LIGER_RT_TUNING_DB: the writable tuning DB (default: $XDG_CACHE_HOME/liger_rt/tuning.db)."""
    raw = os.environ.get("LIGER_RT_TUNING_DB", "").strip()
    if raw:
        return Path(raw).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(cache) / "liger_rt" / "tuning.db"


def arch_override() -> str | None:
    """LIGER_RT_ARCH: force an arch profile by name."""
    raw = os.environ.get("LIGER_RT_ARCH", "").strip().lower()
    if not raw:
        return None
    from .backend import ARCH_NAMES
    if raw not in ARCH_NAMES:
        raise EnvError(f"LIGER_RT_ARCH={raw!r} is not a known arch; accepted values: {', '.join(ARCH_NAMES)}")
    return raw


def autotune() -> bool:
    """LIGER_RT_AUTOTUNE: 1 tunes on a DB miss and persists the winner; default 0."""
    return _flag("LIGER_RT_AUTOTUNE", False)


LOG_CHOICES = ("decisions",)


def log_decisions() -> bool:
    """LIGER_RT_LOG=decisions: log each new dispatch decision once."""
    raw = os.environ.get("LIGER_RT_LOG", "").strip().lower()
    if not raw or raw in _FALSE:
        return False
    if raw not in LOG_CHOICES:
        raise EnvError(f"LIGER_RT_LOG={raw!r} is not valid; accepted values: {', '.join(LOG_CHOICES)} (or unset)")
    return True


def impl_override(op: str, valid: tuple[str, ...] | None = None) -> str | None:
    """LIGER_RT_IMPL_<OP>: force an implementation of one op (e.g. LIGER_RT_IMPL_RMS_NORM=torch)."""
    name = f"LIGER_RT_IMPL_{op.upper()}"
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if valid is not None and raw not in valid:
        raise EnvError(f"{name}={raw!r} is not an implementation of {op}; accepted values: {', '.join(valid)}")
    return raw


def disabled() -> bool:
    """LIGER_RT_DISABLE: 1 makes every op use its torch reference."""
    return _flag("LIGER_RT_DISABLE", False)


def fused_moe_autotune() -> bool:
    """LIGER_FUSED_MOE_AUTOTUNE: 0 pins MoE kernels to fixed configs (HIP-safe on AMD); default 1."""
    return _flag("LIGER_FUSED_MOE_AUTOTUNE", True)


def db_timeout() -> float:
    """LIGER_RT_DB_TIMEOUT: seconds to wait for a locked tuning DB before falling back (default 10)."""
    raw = os.environ.get("LIGER_RT_DB_TIMEOUT", "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise EnvError(f"LIGER_RT_DB_TIMEOUT={raw!r} is not valid; accepted values: a number of seconds >= 0")
    return value


def snapshot() -> dict:
    """Every LIGER_* variable set now (for `liger-tune doctor`), raw, plus what was parsed."""
    raw = {k: v for k, v in sorted(os.environ.items()) if k.startswith("LIGER_")}
    parsed = {}
    for key, fn in (("tuning_db", lambda: str(tuning_db_path())), ("arch", arch_override),
                    ("autotune", autotune), ("log_decisions", log_decisions), ("disable", disabled),
                    ("fused_moe_autotune", fused_moe_autotune), ("db_timeout", db_timeout)):
        try:
            parsed[key] = fn()
        except EnvError as exc:
            parsed[key] = f"error: {exc}"
    return {"set": raw, "parsed": parsed}
