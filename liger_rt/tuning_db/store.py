"""SQLite tuning store, and the user DB layered over the shipped defaults (docs/architecture.md, "The DB"
and "Failure modes").  Tables (columns in rows.py): ``tuning`` (the best config per op, variant, arch, dtype,
static key, bucket and implementation), ``measurements`` (every raw candidate timing), ``crossover`` and
``meta`` (the DB schema version; a schema-1 DB is migrated when opened for writing).  Reading never writes;
writers use WAL, a busy timeout and one transaction per logical write, so concurrent writers lose nothing
and a killed writer leaves no half-written case."""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sqlite3
import time
import urllib.parse
import warnings
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Iterable

from .. import backend, env
from ..freshness import source_hash
from . import rows as R
from .rows import (CROSSOVER_COLUMNS, CROSSOVER_PK, DB_SCHEMA, FINGERPRINT, MEASUREMENT_COLUMNS, METHODS,
                   TUNING_COLUMNS, TUNING_PK, RowError)

MEASUREMENT_KEY = ("op", "variant", "arch", "dtype", "static_key", "dims", "tag", "impl", "config", "created")
_SQL_TYPES = {str: "TEXT", float: "REAL", int: "INTEGER"}
_STATIC = "op = ? AND variant = ? AND arch = ? AND dtype = ? AND static_key = ?"
_KEYS = {"tuning": TUNING_PK, "crossover": CROSSOVER_PK, "measurements": MEASUREMENT_KEY}


def row_name(row: dict) -> str:
    """The row's key fields that are set, space-separated (for messages)."""
    return " ".join(str(row.get(k)) for k in ("op", "arch", "dtype", "static_key", "bucket", "impl") if row.get(k))


def op_arch_where(op: str | None, arch: str | None) -> tuple[str | None, list]:
    """(WHERE clause, args) selecting the rows of `op` and/or `arch` (None, []: every row)."""
    conds = {"op = ?": op, "arch = ?": arch}
    return " AND ".join(c for c, v in conds.items() if v) or None, [v for v in conds.values() if v]


class TuningDBError(RuntimeError):
    """The tuning DB file cannot be used (corrupt, not ours, newer schema, locked, read-only) or a record
    cannot enter it; the one-line message names which."""


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    import torch
    try:
        import triton
        return {"torch_version": torch.__version__, "triton_version": triton.__version__}
    except Exception:
        return {"torch_version": torch.__version__, "triton_version": ""}


def fingerprint(arch, source_hash: str) -> dict:
    """What a row measured now for `arch` (an Arch, or an arch name) would record: the device (the
    real one when it is that arch, else the arch profile's), SM/CU count, versions, kernel hash."""
    if isinstance(arch, str):
        hw = backend.detect_hardware()
        arch = hw if hw.name == arch else backend.profile(arch) if arch in backend.ARCH_NAMES else None
    return {"device_name": arch.device_name if arch else "", "sm_count": arch.sm_count if arch else 0,
            **_versions(), "runtime_version": backend.runtime_version() if arch and arch.vendor != "cpu" else "",
            "source_hash": source_hash}


_LABELS = {"device_name": "device", "sm_count": "SMs", "torch_version": "torch", "triton_version": "triton",
           "runtime_version": "runtime", "source_hash": "kernel"}


def stale_reason(row: dict, here: dict) -> str | None:
    """None when `row` was measured on this fingerprint (published rows count as such), else what
    differs: "torch 2.11.0 (here 2.13.0), kernel 1234abcd (here 5678ef90)"."""
    if row.get("origin") == "published" and not row.get("source_hash"):
        return None
    diff = [f"{_LABELS[k]} {row.get(k) or '?'} (here {here[k] or '-'})"
            for k in FINGERPRINT if (row.get(k) or R.DEFAULTS.get(k)) != here[k]]
    return ", ".join(diff) or None


def _sql_columns(columns: dict) -> str:
    return ", ".join(f"{c} {_SQL_TYPES[t]}" for c, t in columns.items())


_CREATE = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
    f"CREATE TABLE tuning ({_sql_columns(TUNING_COLUMNS)}, PRIMARY KEY ({', '.join(TUNING_PK)}))",
    f"CREATE TABLE measurements ({_sql_columns(MEASUREMENT_COLUMNS)})",
    f"CREATE TABLE crossover ({_sql_columns(CROSSOVER_COLUMNS)}, PRIMARY KEY ({', '.join(CROSSOVER_PK)}))",
]
_INDEXES = [
    "CREATE INDEX IF NOT EXISTS tuning_static ON tuning(op, variant, arch, dtype, static_key)",
    "CREATE INDEX IF NOT EXISTS meas_static ON measurements(op, arch, dtype, static_key)",
    f"CREATE UNIQUE INDEX IF NOT EXISTS meas_unique ON measurements({', '.join(MEASUREMENT_KEY)})",
]


def _inspect(conn: sqlite3.Connection, path) -> int | None:
    """The liger_rt schema version of an open SQLite file (None: no tables), else TuningDBError saying why not."""
    tables = {n: {r[1] for r in conn.execute(f'PRAGMA table_info("{n}")').fetchall()}
              for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
              if not n.startswith("sqlite_")}
    if not tables:
        return None
    ours = {"meta", *R.COLUMNS}
    if set(tables) - ours:
        raise TuningDBError(f"{path} is not a liger_rt DB: an SQLite file of another program (tables "
                            f"{', '.join(sorted(tables))})")
    if ours - set(tables):
        raise TuningDBError(f"{path} is not a liger_rt DB: tables {', '.join(sorted(ours - set(tables)))} missing")
    if not {"key", "value"} <= tables["meta"]:
        raise TuningDBError(f"{path} is not a liger_rt DB: table meta has columns {sorted(tables['meta'])}")
    row = conn.execute("SELECT value FROM meta WHERE key = 'db_schema'").fetchone()
    if row is None:
        raise TuningDBError(f"{path} is not a liger_rt DB: meta has no db_schema")
    try:
        found = int(str(row[0]).strip())
    except ValueError:
        raise TuningDBError(f"{path}: meta db_schema {row[0]!r} is not a schema number") from None
    if found > DB_SCHEMA:
        raise TuningDBError(f"{path} has DB schema {found}, newer than this liger_rt ({DB_SCHEMA}); upgrade "
                            "liger_rt or point LIGER_RT_TUNING_DB elsewhere")
    if found < 1:
        raise TuningDBError(f"{path}: meta db_schema {found} is not a liger_rt schema (1 .. {DB_SCHEMA})")
    need = R.V1_COLUMNS if found == 1 else {t: set(c) for t, c in R.COLUMNS.items()}
    for table, cols in need.items():
        if cols - tables[table]:
            raise TuningDBError(f"{path} is not a usable liger_rt DB: table {table} lacks columns "
                                f"{', '.join(sorted(cols - tables[table]))}")
    return found


class Store(contextlib.AbstractContextManager):
    """One SQLite file (or, path None, an in-memory DB) with the liger_rt schema, ``readonly`` for lookups,
    doctor, show and export; writable, a missing file is created (unless ``create=False``)."""

    def __init__(self, path: Path | None, *, layer: str, timeout: float | None = None, create: bool = True,
                 readonly: bool = False):
        self.path, self.layer, self.readonly = path, layer, readonly
        self.timeout = timeout if timeout is not None else 0.0 if path is None else env.db_timeout()
        self.conn, self.schema = None, DB_SCHEMA
        if path is not None and path.is_dir():
            raise TuningDBError(f"{path} is a directory, not a tuning DB file")
        if path is not None and not path.exists() and (readonly or not create):
            raise TuningDBError(f"{path} does not exist")
        try:
            if path is None:
                self.conn = self._connect(":memory:")
                self._setup()
            elif readonly:
                self._open_readonly(path)
            else:
                self._open_writable(path)
        except BaseException as exc:
            self.close()
            if isinstance(exc, sqlite3.DatabaseError):
                raise TuningDBError(f"{path} is unusable: {exc}") from None
            raise
        self.db = self.conn      # sqlite3.Connection: .execute(sql, args)

    def _connect(self, target: str, **kw) -> sqlite3.Connection:
        conn = sqlite3.connect(target, timeout=self.timeout, check_same_thread=False, isolation_level=None, **kw)
        conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        conn.row_factory = sqlite3.Row
        return conn

    def _open_readonly(self, path: Path) -> None:
        self.conn = self._connect(f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro", uri=True)
        if (found := _inspect(self.conn, path)) is None:
            raise TuningDBError(f"{path} is not a liger_rt DB: " + ("an empty file" if path.stat().st_size == 0
                                                                     else "an SQLite file without tables"))
        self.schema = found

    def _open_writable(self, path: Path) -> None:
        if not path.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TuningDBError(f"cannot create the directory of {path}: {exc.strerror or exc}") from None
        elif not os.access(path, os.W_OK):
            raise TuningDBError(f"{path} is read-only (file permissions); choose a writable --db or "
                                "LIGER_RT_TUNING_DB")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise TuningDBError(f"the directory {path.parent} is not writable (SQLite needs to create its "
                                "journal there); choose a writable --db or LIGER_RT_TUNING_DB")
        self.conn = self._connect(str(path))
        with self._write_errors("open"):
            found = _inspect(self.conn, path)
            # WAL for a new file or a current one; a schema-1 file migrates first (switching takes a lock of its own)
            if found is None or (found == DB_SCHEMA and
                                 self.conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal"):
                self.conn.execute("PRAGMA journal_mode=WAL")
            if found != DB_SCHEMA:
                self._setup()

    def _setup(self) -> None:
        """Create the schema in an empty DB, or migrate schema 1 -> 2: the fingerprint, method and host-time
        columns (old rows: method "unrecorded", so they count as stale until re-measured) and idempotent
        measurements."""
        with self.transaction():
            found = _inspect(self.conn, self.path)      # again: another process may have done it meanwhile
            if found == DB_SCHEMA:
                return
            if found is None:
                for sql in _CREATE:
                    self.conn.execute(sql)
                self.conn.execute("INSERT INTO meta(key, value) VALUES ('db_schema', ?)", [str(DB_SCHEMA)])
            for table, columns in R.COLUMNS.items():
                have = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})").fetchall()}
                for col, typ in columns.items():
                    if col not in have:
                        clause = "" if (default := R.DEFAULTS.get(col)) is None else f" DEFAULT {default!r}"
                        self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {col} {_SQL_TYPES[typ]}{clause}")
            # schema 1 imported duplicates: keep one of each before the unique index
            self.conn.execute(f"DELETE FROM measurements WHERE rowid NOT IN (SELECT min(rowid) FROM measurements "
                              f"GROUP BY {', '.join(MEASUREMENT_KEY)})")
            for sql in _INDEXES:
                self.conn.execute(sql)
            self.conn.execute("UPDATE meta SET value = ? WHERE key = 'db_schema'", [str(DB_SCHEMA)])

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _write_errors(self, what: str):
        try:
            yield
        except sqlite3.DatabaseError as exc:
            msg = str(exc)
            if "locked" in msg or "busy" in msg:
                raise TuningDBError(f"{self.path} is locked by another process (waited {self.timeout:g} s; "
                                    "LIGER_RT_DB_TIMEOUT sets how long)") from None
            if "readonly" in msg or "read-only" in msg:
                raise TuningDBError(f"{self.path} is read-only ({msg}); choose a writable --db or "
                                    "LIGER_RT_TUNING_DB") from None
            raise TuningDBError(f"{self.path}: {what} failed: {msg}") from None

    @contextlib.contextmanager
    def transaction(self):
        """One write transaction (nested uses join the outer one)."""
        if self.readonly:
            raise TuningDBError(f"{self.path} was opened read-only")
        if self.conn.in_transaction:
            yield
            return
        with self._write_errors("write"):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def _here(self, row: dict) -> dict:
        """A row put without a fingerprint was measured by this process: give it this one."""
        if all(k in row for k in FINGERPRINT[:-1]):
            return row
        here = fingerprint(row.get("arch", ""), "")
        return {**{k: here[k] for k in FINGERPRINT[:-1]}, **row}      # the kernel hash is the row's own

    def put_rows(self, table: str, rows: Iterable[dict] | Mapping, *, checked: bool = False) -> None:
        """Validate (a row without fingerprint fields was measured here) and write rows (or one row) of one
        table in one transaction (RowError for a bad one).  A tuning row replaces an entry that is not
        comparable (other method, fingerprint or config schema) or slower."""
        rows = [rows] if isinstance(rows, Mapping) else rows
        rows = [r if checked else R.check(table, self._here(r)) for r in rows]
        if not rows:
            return
        cols = list(R.COLUMNS[table])
        verb = {"tuning": "INSERT", "crossover": "INSERT OR REPLACE", "measurements": "INSERT OR IGNORE"}[table]
        sql = f"{verb} INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
        if table == "tuning":
            comparable = " AND ".join(f"tuning.{c} IS excluded.{c}" for c in ("method", "config_schema", *FINGERPRINT))
            sql += (f" ON CONFLICT({', '.join(TUNING_PK)}) DO UPDATE SET "
                    + ", ".join(f"{c} = excluded.{c}" for c in cols if c not in TUNING_PK)
                    + f" WHERE NOT ({comparable}) OR excluded.median_ms < tuning.median_ms")
        with self.transaction():
            self.conn.executemany(sql, [[r[c] for c in cols] for r in rows])

    put_tuning = functools.partialmethod(put_rows, "tuning")
    put_measurements = functools.partialmethod(put_rows, "measurements")
    put_crossover = functools.partialmethod(put_rows, "crossover")

    def select(self, table: str, where: str | None = None, args: list | None = None, *,
               rowid: bool = False) -> list[dict]:
        """Rows of `table` as dicts with every column (schema-1 rows get the schema-2 defaults)."""
        sql = f"SELECT rowid AS _rowid, * FROM {table}" + (f" WHERE {where}" if where else "")
        return [R.fill_defaults(table, dict(raw)) | ({"rowid": raw["_rowid"]} if rowid else {})
                for raw in self.conn.execute(sql, args or []).fetchall()]

    all_rows = select

    def crossover_row(self, op: str, variant: str, arch: str, dtype: str, static_key: str) -> dict | None:
        return next(iter(self.select("crossover", _STATIC, [op, variant, arch, dtype, static_key])), None)

    def counts(self) -> dict:
        return {t: self.conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in R.COLUMNS}

    def prune(self, *, stale: bool = False, invalid: bool = False, op: str | None = None,
              arch: str | None = None, dry_run: bool = False) -> dict:
        """Remove (or with dry_run only list) rows: of `op` and/or `arch`, and among those the stale
        (`stale`) and/or invalid (`invalid`) ones; with neither flag every row of op/arch.
        Returns {"tuning": [(row, why)], "crossover": [...], "measurements": count}."""
        where, args = op_arch_where(op, arch)
        wanted = {"selected"} | {status for status, on in (("stale", stale), ("bad", invalid)) if on}
        picked: dict[str, list] = {table: [] for table in R.COLUMNS}
        for table, chosen in picked.items():
            for row in self.select(table, where, args, rowid=True):
                status, why = classify(table, row) if stale or invalid else ("selected", "selected")
                if status in wanted:
                    chosen.append((row, why))
        if not dry_run:
            with self.transaction():
                for table, chosen in picked.items():
                    self.conn.executemany(f"DELETE FROM {table} WHERE rowid = ?", [[r["rowid"]] for r, _ in chosen])
        return {**picked, "measurements": len(picked["measurements"])}


def classify(table: str, row: dict) -> tuple[str, str]:
    """("ok" | "stale" | "bad", why).  Bad: fails validation.  Stale: measured on other kernel code
    or config schema (any arch), or (rows of this machine's arch, and cpu rows) on another device
    or software fingerprint."""
    clean = {k: v for k, v in row.items() if k in R.COLUMNS[table]}
    try:
        checked = R.check(table, clean)
    except RowError as exc:
        return "bad", str(exc)
    op = R.resolve_op(checked["op"])
    if table == "tuning" and checked["config_schema"] != op.schema_version:
        return "stale", f"config schema {checked['config_schema']} (this code: {op.schema_version})"
    if table == "tuning" and not R.current_code(op, checked):
        try:
            R.parse_config(op, checked["impl"], checked["config"])
        except RowError as exc:
            return "stale", f"other kernel code, and {exc}"
    why = None
    if checked["arch"] in (backend.detect_hardware().name, "cpu"):
        why = stale_reason(checked, fingerprint(checked["arch"], source_hash(op)))
    elif checked["source_hash"] not in ("", source_hash(op)):
        why = f"kernel {checked['source_hash']} (here {source_hash(op)})"
    return ("stale", why) if why else ("ok", "")


def load_jsonl(store: Store, lines: Iterable[str], *, strict: bool = True) -> dict:
    """Merge an export (JSON lines {"table": ..., **row}) into `store`, all or nothing: the first bad line
    raises TuningDBError("line N: why") with nothing written; importing twice changes nothing.  Schema-1
    rows enter with method "unrecorded", so they count as stale.  strict=False (the shipped defaults)
    stores rows unvalidated: lookups validate them when they are read."""
    batches: dict[str, list] = {t: [] for t in R.COLUMNS}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise TuningDBError(f"line {n}: not JSON ({exc})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("table"), str):
            raise TuningDBError(f"line {n}: not a liger_rt export record (a JSON object with a \"table\" field)")
        table = rec.pop("table")
        if table == "meta":
            schema = rec.get("db_schema")
            if isinstance(schema, bool) or not isinstance(schema, int) or not 1 <= schema:
                raise TuningDBError(f"line {n}: db_schema {schema!r} is not a schema number")
            if schema > DB_SCHEMA:
                raise TuningDBError(f"line {n}: an export of DB schema {schema}, newer than this liger_rt "
                                    f"({DB_SCHEMA}); upgrade liger_rt to import it")
            continue
        if table not in R.COLUMNS:
            raise TuningDBError(f"line {n}: unknown table {table!r}; valid: {', '.join(R.COLUMNS)}")
        try:
            batches[table].append(R.check(table, rec) if strict else _coerce(table, rec))
        except RowError as exc:
            raise TuningDBError(f"line {n}: {table} record {row_name(rec)}: {exc}") from None
    with store.transaction():
        for table, rows in batches.items():
            store.put_rows(table, rows, checked=True)
    return {t: len(rows) for t, rows in batches.items()}


def _coerce(table: str, rec: dict) -> dict:
    """A shipped row as stored, unvalidated (JSON values as text; nothing is launched from it
    before rows.check passes at read time)."""
    out = R.fill_defaults(table, rec)
    for col in ("config", "dims", "segments", "static_key", "bucket"):
        if col in out and not isinstance(out[col], str):
            out[col] = json.dumps(out[col], sort_keys=col != "segments")
    if not out.get("created"):
        out["created"] = time.time()
    return out


def dump_jsonl(store, arch: str | None = None, keep=None) -> Iterable[str]:
    """An export: a meta line, then every row (of `arch`; for which keep(table, row) holds).
    `store` is a Store or a list of them (the first holding a key wins: user over shipped)."""
    stores = store if isinstance(store, (list, tuple)) else [store]
    where, args = op_arch_where(None, arch)
    yield json.dumps({"table": "meta", "db_schema": DB_SCHEMA})
    for table in R.COLUMNS:
        seen = set()
        for s in stores:
            for row in s.select(table, where, args):
                key = tuple(row[c] for c in _KEYS[table])
                if key in seen or (keep is not None and not keep(table, row)):
                    continue
                seen.add(key)
                yield json.dumps({"table": table, **row}, sort_keys=True)


def _log2_distance(a: dict, b: dict) -> float:
    return sum(abs(math.log2(max(1, a[k])) - math.log2(max(1, b.get(k, 1)))) for k in a)


class LayeredStore:
    """The user DB over the shipped defaults.  Lookups prefer rows measured on this fingerprint
    (user DB first), then same-arch rows of another fingerprint ("stale"); a bad row is skipped with
    one warning and the lookup goes on to the next row, layer or source."""

    def __init__(self, user: Store | None, defaults: Store, user_error: str | None = None):
        self.user, self.defaults, self.user_error = user, defaults, user_error
        self._here, self._warned = {}, set()     # fingerprints by (arch, kernel hash); bad rows warned about

    @classmethod
    def open_default(cls) -> "LayeredStore":
        """The shipped defaults plus LIGER_RT_TUNING_DB read-only when it exists (reading changes nothing)."""
        defaults, path = shipped_defaults(), env.tuning_db_path()
        user, error = None, None
        if path.exists():
            try:
                user = Store(path, layer="user", readonly=True)
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

    def _usable(self, store: Store, table: str, op, row: dict):
        """(checked row, config or None) when the row may be used, else None (a bad one warned once)."""
        try:
            checked = R.check(table, row, op=op)
        except RowError as exc:
            if (key := (store.layer, table, *(str(row.get(c)) for c in TUNING_PK), str(exc))) not in self._warned:
                self._warned.add(key)
                warnings.warn(f"liger_rt: skipping a bad {table} row in the {store.layer} DB ({row_name(row)}): "
                              f"{exc}; `liger-tune doctor` counts them, `liger-tune prune --invalid` removes them",
                              RuntimeWarning, stacklevel=4)
            return None
        if table == "crossover":
            return checked, None
        if checked["config_schema"] != op.schema_version:
            return None               # other config fields: not applicable (stale, prune --stale)
        try:
            return checked, R.parse_config(op, checked["impl"], checked["config"])
        except RowError:
            return None               # measured on other code whose configs this code does not take

    def _found(self, table: str, op, arch: str, dtype: str, dims: dict, keep=None) -> list[tuple]:
        """(store, checked row, config, stale reason or None) of each usable row of the static dims."""
        args = [op.name, op.variant, arch, dtype, op.static_key(dims)]
        if (arch, source_hash(op)) not in self._here:
            self._here[arch, source_hash(op)] = fingerprint(arch, source_hash(op))
        here = self._here[arch, source_hash(op)]
        found = []      # a loop, not a comprehension: the warnings' stacklevel counts these frames
        for store in self.layers():
            try:
                rows = store.select(table, _STATIC, args)
            except sqlite3.Error as exc:  # locked past the timeout, corrupted since opening...
                if store is self.user:
                    warnings.warn(f"liger_rt: tuning DB read failed ({exc}); using shipped defaults",
                                  RuntimeWarning, stacklevel=3)
                    self.user_error, self.user = str(exc), None
                continue
            for row in rows:
                if usable := (keep is None or keep(row)) and self._usable(store, table, op, row):
                    found.append((store, *usable, stale_reason(usable[0], here)))
        return found

    def lookup(self, op, arch, dtype: str, dims: dict, *, impls: list[str], nearest: bool) -> dict | None:
        """The best usable tuning row of the exact (or with `nearest` the nearest) bucket.  Rows of
        another fingerprint ("stale") count only when no row of these static dims was measured on
        this one; the user DB before the shipped one; within the bucket one timing method
        (cuda-graph, do_bench, cpu-wall, unrecorded in that order of preference) and its fastest row."""
        found = self._found("tuning", op, arch, dtype, dims, lambda row: row.get("impl") in impls)
        want = {d: dims[d] for d in op.dynamic}
        exact = op.bucket_key(dims)
        # stale rows only where nothing of these static dims was measured here (in any bucket)
        stale = all(c[3] for c in found)
        for store in self.layers():
            cands = [c for c in found if c[0] is store and bool(c[3]) == stale]
            if nearest:
                dist = {c[1]["bucket"]: _log2_distance(want, json.loads(c[1]["bucket"])) for c in cands}
                cands = [c for c in cands if dist[c[1]["bucket"]] == min(dist.values())]
            else:
                cands = [c for c in cands if c[1]["bucket"] == exact]
            if not cands:
                continue
            method = min((c[1]["method"] for c in cands), key=METHODS.index)
            cands = [c for c in cands if c[1]["method"] == method]     # never compare methods
            _, best, config, why = min(cands, key=lambda c: c[1]["median_ms"])
            out = {**best, "config": config, "layer": store.layer, "stale": why}
            torch_rows = [c[1] for c in cands if c[1]["impl"] == "torch" and c[1]["bucket"] == best["bucket"]]
            if torch_rows:      # the same run's torch time, same method: the honest baseline
                out["baseline_ms"] = torch_rows[0]["median_ms"]
            host = f", host {best['host_ms']:.3g} ms/call" if best.get("host_ms") else ""
            out["db_origin"] = f"{best['origin']}, {best['method']}{host}" + (f", STALE: {why}" if why else "")
            return out
        return None

    def crossover(self, op, arch, dtype: str, dims: dict) -> dict | None:
        """The crossover row of (op, arch, dtype, static dims): exact fingerprint before stale."""
        found = sorted(self._found("crossover", op, arch, dtype, dims), key=lambda c: bool(c[3]))
        if not found:
            return None
        store, row, _, why = found[0]
        return {**row, "segments": json.loads(row["segments"]), "layer": store.layer, "stale": why,
                "origin": f"{row['origin']}, {row['method']}" + (f", STALE: {why}" if why else "")}


_DEFAULTS: Store | None = None


def shipped_defaults() -> Store:
    """The JSON lines in liger_rt/tuning_db/defaults/, loaded into memory (validated when read, like any row)."""
    global _DEFAULTS
    if _DEFAULTS is None:
        store = Store(None, layer="shipped")
        folder = resources.files("liger_rt.tuning_db") / "defaults"
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".jsonl"):
                try:
                    load_jsonl(store, entry.read_text().splitlines(), strict=False)
                except TuningDBError as exc:
                    warnings.warn(f"liger_rt: shipped defaults {entry.name} skipped ({exc})", RuntimeWarning)
        _DEFAULTS = store
    return _DEFAULTS


def open_store(path: str | Path | None = None, **kw) -> Store:
    """Open (creating if needed) a writable store: `path` or LIGER_RT_TUNING_DB."""
    return Store(Path(path).expanduser() if path else env.tuning_db_path(), layer="user", **kw)
