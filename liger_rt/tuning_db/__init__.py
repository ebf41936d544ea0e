"""The persisted tuning database: a user SQLite file on sqlite-utils (store.py; rows.py: what a row may hold)
layered over the shipped defaults, its rows keyed per arch and device class.  `get_store()` opens it once per
process, the user DB read-only; a user DB that cannot be used (corrupt, not ours, newer schema, locked, not a
regular file) is reported by one warning and `liger-tune doctor`, and lookups then use the shipped defaults
alone."""
from __future__ import annotations

import threading

from .rows import DB_SCHEMA, METHODS, ORIGINS, RowError  # noqa: F401
from .store import LayeredStore, Store, TuningDBError, fingerprint, open_store, path_problem  # noqa: F401

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
