"""SQLite tuning store (sqlite-utils) and the layering of user DB over shipped defaults.

Tables
- ``tuning``: the best config per (op, variant, arch, dtype, static key, bucket, impl), with its
  median time, the torch baseline time, the kernel source hash and config schema it was measured
  on, versions, device name, origin (sweep/online/heuristic/published) and creation time.
  The upsert keeps the faster entry, and always replaces an entry measured on other code.
- ``measurements``: every raw candidate measurement (what crossovers are derived from).
- ``crossover``: per (op, variant, arch, dtype, static key) the segments on the deciding axis.
- ``meta``: the DB schema version.

Concurrency: WAL journal, a busy timeout, and single-statement upserts, so several processes
writing at once lose nothing.
"""
from __future__ import annotations

import json
import math
import sqlite3
import time
import warnings
from importlib import resources
from pathlib import Path
from typing import Iterable

import sqlite_utils

from .. import env

DB_SCHEMA = 1
TUNING_PK = ("op", "variant", "arch", "dtype", "static_key", "bucket", "impl")
CROSSOVER_PK = ("op", "variant", "arch", "dtype", "static_key")
TUNING_COLUMNS = {
    "op": str, "variant": str, "arch": str, "device_name": str, "dtype": str, "static_key": str,
    "bucket": str, "impl": str, "config": str, "median_ms": float, "baseline_ms": float,
    "source_hash": str, "config_schema": int, "triton_version": str, "torch_version": str,
    "origin": str, "created": float,
}
MEASUREMENT_COLUMNS = {
    "op": str, "variant": str, "arch": str, "device_name": str, "dtype": str, "static_key": str,
    "dims": str, "axis": float, "tag": str, "impl": str, "config": str, "median_ms": float,
    "ok": int, "error": str, "source_hash": str, "created": float,
}
CROSSOVER_COLUMNS = {
    "op": str, "variant": str, "arch": str, "dtype": str, "static_key": str, "axis_name": str,
    "segments": str, "margin": float, "origin": str, "source_hash": str, "created": float,
}


class TuningDBError(RuntimeError):
    """The tuning DB file cannot be used (corrupt, not SQLite, newer schema, locked)."""


def _versions() -> tuple[str, str]:
    import torch
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = ""
    return tv, torch.__version__


class Store:
    """One SQLite file (or an in-memory DB) with the liger_rt schema."""

    def __init__(self, path: Path | None, *, layer: str, timeout: float | None = None, create: bool = True):
        self.path = path
        self.layer = layer
        timeout = env.db_timeout() if timeout is None else timeout
        try:
            if path is None:
                conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                if not create and not path.exists():
                    raise TuningDBError(f"{path} does not exist")
                conn = sqlite3.connect(str(path), timeout=timeout, check_same_thread=False,
                                       isolation_level=None)
                conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            self.db = sqlite_utils.Database(conn)
            if path is not None:
                mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
                if mode.lower() != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
            self._ensure_schema()
        except sqlite3.DatabaseError as exc:
            raise TuningDBError(f"tuning DB {path} is unusable: {exc}") from exc

    def _ensure_schema(self) -> None:
        db = self.db
        existing = set(db.table_names())
        if "meta" in existing:
            row = db.execute("SELECT value FROM meta WHERE key = 'db_schema'").fetchone()
            found = int(row[0]) if row else 0
            if found > DB_SCHEMA:
                raise TuningDBError(f"tuning DB {self.path} has schema {found}, newer than this liger_rt "
                                    f"({DB_SCHEMA}); upgrade liger_rt or point LIGER_RT_TUNING_DB elsewhere")
        elif existing - {"tuning", "measurements", "crossover", "meta"}:
            raise TuningDBError(f"{self.path} is an SQLite file of another program (tables "
                                f"{sorted(existing)}); point LIGER_RT_TUNING_DB at a liger_rt DB")
        if {"meta", "tuning", "measurements", "crossover"} <= existing:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
            db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('db_schema', ?)", [str(DB_SCHEMA)])
            db["tuning"].create(TUNING_COLUMNS, pk=TUNING_PK, if_not_exists=True)
            db["measurements"].create(MEASUREMENT_COLUMNS, if_not_exists=True)
            db["crossover"].create(CROSSOVER_COLUMNS, pk=CROSSOVER_PK, if_not_exists=True)
            db.execute("CREATE INDEX IF NOT EXISTS tuning_static ON tuning(op, variant, arch, dtype, static_key)")
            db.execute("CREATE INDEX IF NOT EXISTS meas_static ON measurements(op, arch, dtype, static_key)")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        try:
            self.db.conn.close()
        except Exception:
            pass

    # -- writes ---------------------------------------------------------------------------------
    def put_tuning(self, row: dict) -> None:
        """Insert or keep the faster entry (an entry measured on other code is always replaced)."""
        row = _complete(row, TUNING_COLUMNS)
        cols = list(TUNING_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in cols if c not in TUNING_PK)
        sql = (f"INSERT INTO tuning ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)}) "
               f"ON CONFLICT({', '.join(TUNING_PK)}) DO UPDATE SET {updates} "
               "WHERE excluded.median_ms < tuning.median_ms OR tuning.source_hash != excluded.source_hash "
               "OR tuning.config_schema != excluded.config_schema")
        self.db.execute(sql, [row[c] for c in cols])

    def put_measurements(self, rows: Iterable[dict]) -> None:
        rows = [_complete(r, MEASUREMENT_COLUMNS) for r in rows]
        if not rows:
            return
        cols = list(MEASUREMENT_COLUMNS)
        sql = f"INSERT INTO measurements ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(sql, [[r[c] for c in cols] for r in rows])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def put_crossover(self, row: dict) -> None:
        row = _complete(row, CROSSOVER_COLUMNS)
        cols = list(CROSSOVER_COLUMNS)
        sql = f"INSERT OR REPLACE INTO crossover ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
        self.db.execute(sql, [row[c] for c in cols])

    # -- reads ----------------------------------------------------------------------------------
    def tuning_rows(self, op: str, variant: str, arch: str, dtype: str, static_key: str) -> list[dict]:
        return list(self.db["tuning"].rows_where(
            "op = ? AND variant = ? AND arch = ? AND dtype = ? AND static_key = ?",
            [op, variant, arch, dtype, static_key]))

    def crossover_row(self, op: str, variant: str, arch: str, dtype: str, static_key: str) -> dict | None:
        rows = list(self.db["crossover"].rows_where(
            "op = ? AND variant = ? AND arch = ? AND dtype = ? AND static_key = ?",
            [op, variant, arch, dtype, static_key]))
        return rows[0] if rows else None

    def all_rows(self, table: str, where: str | None = None, args: list | None = None) -> list[dict]:
        return list(self.db[table].rows_where(where, args or [])) if table in self.db.table_names() else []

    def delete(self, table: str, rows: list[dict], pk: tuple[str, ...]) -> int:
        n = 0
        for r in rows:
            cond = " AND ".join(f"{c} = ?" for c in pk)
            n += self.db.execute(f"DELETE FROM {table} WHERE {cond}", [r[c] for c in pk]).rowcount
        return n


def _complete(row: dict, columns: dict) -> dict:
    out = {}
    for col, typ in columns.items():
        v = row.get(col)
        if v is None:
            v = {str: "", float: None, int: 0}[typ]
        if col in ("config", "dims", "segments") and not isinstance(v, str):
            v = json.dumps(v, sort_keys=True)
        out[col] = v
    if "created" in columns and not out.get("created"):
        out["created"] = time.time()
    return out


def open_store(path: str | Path | None = None, **kw) -> Store:
    """Open (creating if needed) a writable store: `path` or LIGER_RT_TUNING_DB."""
    return Store(Path(path) if path else env.tuning_db_path(), layer="user", **kw)


def load_jsonl(store: Store, lines: Iterable[str]) -> dict:
    """Merge JSON lines ({"table": ..., **row}) into a store by its rules; returns counts."""
    counts = {"tuning": 0, "measurements": 0, "crossover": 0}
    meas = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            rec = json.loads(line)
            table = rec.pop("table")
        except (ValueError, KeyError) as exc:
            raise TuningDBError(f"line {n}: not a liger_rt export record ({exc})") from None
        if table == "tuning":
            store.put_tuning(rec)
        elif table == "crossover":
            store.put_crossover(rec)
        elif table == "measurements":
            meas.append(rec)
        else:
            raise TuningDBError(f"line {n}: unknown table {table!r}")
        counts[table] += 1
    store.put_measurements(meas)
    return counts


def dump_jsonl(store: Store, arch: str | None = None) -> Iterable[str]:
    where, args = ("arch = ?", [arch]) if arch else (None, None)
    for table in ("tuning", "crossover", "measurements"):
        for row in store.all_rows(table, where, args):
            row.pop("rowid", None)
            yield json.dumps({"table": table, **row}, sort_keys=True)


def _fresh(row: dict, op) -> bool:
    """A row counts only if measured on this kernel source and config schema ('' = published)."""
    if row.get("config_schema", 0) != op.schema_version:
        return False
    return row.get("source_hash", "") in ("", op.source_hash)


def _log2_distance(a: dict, b: dict) -> float:
    return sum(abs(math.log2(max(1, a[k])) - math.log2(max(1, b.get(k, 1)))) for k in a)


class LayeredStore:
    """The user DB over the shipped defaults; lookups ask the user layer first."""

    def __init__(self, user: Store | None, defaults: Store, user_error: str | None = None):
        self.user = user
        self.defaults = defaults
        self.user_error = user_error

    @classmethod
    def open_default(cls) -> "LayeredStore":
        defaults = shipped_defaults()
        path = env.tuning_db_path()
        user, error = None, None
        if path.exists():
            try:
                user = Store(path, layer="user", create=False)
            except (TuningDBError, sqlite3.Error, OSError) as exc:
                error = str(exc)
                warnings.warn(f"liger_rt: ignoring the tuning DB ({exc}); using shipped defaults and "
                              "heuristics. `liger-tune doctor` shows this.", RuntimeWarning, stacklevel=2)
        return cls(user, defaults, error)

    def layers(self) -> list[Store]:
        return [s for s in (self.user, self.defaults) if s is not None]

    def close(self) -> None:
        if self.user is not None:   # the shipped defaults are shared by the process: keep them open
            self.user.close()

    def _safe(self, fn, store: Store):
        try:
            return fn(store)
        except sqlite3.Error as exc:  # locked past the timeout, corrupted since opening...
            if store is self.user:
                warnings.warn(f"liger_rt: tuning DB read failed ({exc}); using shipped defaults",
                              RuntimeWarning, stacklevel=3)
                self.user_error = str(exc)
                self.user = None
            return None

    def lookup(self, op, arch: str, dtype: str, dims: dict, *, impls: list[str], nearest: bool) -> dict | None:
        static_key = op.static_key(dims)
        want = {d: dims[d] for d in op.dynamic}
        for store in self.layers():
            rows = self._safe(lambda s: s.tuning_rows(op.name, op.variant, arch, dtype, static_key), store) or []
            rows = [r for r in rows if r["impl"] in impls and _fresh(r, op)]
            if not rows:
                continue
            exact = op.bucket_key(dims)
            if nearest:
                dist = lambda r: _log2_distance(want, json.loads(r["bucket"]))  # noqa: E731
                best_d = min(dist(r) for r in rows)
                rows = [r for r in rows if dist(r) == best_d]
            else:
                rows = [r for r in rows if r["bucket"] == exact]
            if not rows:
                continue
            best = min(rows, key=lambda r: r["median_ms"] if r["median_ms"] is not None else math.inf)
            out = dict(best)
            out["config"] = json.loads(best["config"] or "{}")
            out["layer"] = store.layer
            out["db_origin"] = best.get("origin") or "sweep"
            torch_rows = [r for r in rows if r["impl"] == "torch" and r["bucket"] == best["bucket"]]
            if not out.get("baseline_ms") and torch_rows:
                out["baseline_ms"] = torch_rows[0]["median_ms"]
            return out
        return None

    def crossover(self, op, arch: str, dtype: str, dims: dict) -> dict | None:
        static_key = op.static_key(dims)
        for store in self.layers():
            row = self._safe(lambda s: s.crossover_row(op.name, op.variant, arch, dtype, static_key), store)
            if row is None:
                continue
            if row.get("source_hash", "") not in ("", op.source_hash):
                continue
            out = dict(row)
            out["segments"] = json.loads(row["segments"])
            out["layer"] = store.layer
            return out
        return None


_DEFAULTS: Store | None = None


def shipped_defaults() -> Store:
    """The defaults shipped as JSON lines in liger_rt/tuning_db/defaults/, loaded into memory."""
    global _DEFAULTS
    if _DEFAULTS is None:
        store = Store(None, layer="shipped")
        folder = resources.files("liger_rt.tuning_db") / "defaults"
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".jsonl"):
                load_jsonl(store, entry.read_text().splitlines())
        _DEFAULTS = store
    return _DEFAULTS
