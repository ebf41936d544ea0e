"""The persisted tuning database: a user SQLite file layered over the shipped defaults.

See store.py for the tables and rows.py for what a row may hold.  `get_store()` opens the
layered store once per process, reading the user DB read-only; a user DB that cannot be used
(corrupt, not a liger_rt DB, newer schema, locked past the timeout) is reported by a one-time
warning and `liger-tune doctor`, and lookups then use the shipped defaults alone.
"""
from __future__ import annotations

import threading

from .rows import DB_SCHEMA, METHODS, ORIGINS, RowError  # noqa: F401
from .store import LayeredStore, Store, TuningDBError, fingerprint, open_store  # noqa: F401

_lock = threading.Lock()
_store: LayeredStore | None = None


def get_store() -> LayeredStore:
    global _store
    if _store is None:
        with _lock:
            if _store is None:
                _store = LayeredStore.open_default()
    return _store


def reset() -> None:
    global _store
    with _lock:
        if _store is not None:
            _store.close()
        _store = None
