"""The tuning store on sqlite-utils, and the user DB layered over the shipped defaults (docs/architecture.md,
"The DB" and "Failure modes").  Tables (columns in rows.py): ``tuning`` (the best config per op, variant, arch,
device class, dtype, static key, bucket and implementation), ``measurements`` (raw candidate timings),
``crossover`` and ``meta`` (the DB schema version; an older schema migrates when opened for writing).

Reading never writes: a reader opens the file read-only, and immutable where SQLite would otherwise have to
create its side files in a place it may not write.  Writers use WAL, a busy timeout and one explicit
``BEGIN IMMEDIATE`` transaction per logical write (sqlite-utils' own writes nest in it as savepoints; the deferred
``BEGIN`` of its ``atomic()`` takes the write lock only at the first write, and a transaction that has read by
then fails with SQLITE_BUSY, without waiting, when another writer committed meanwhile), so concurrent writers
lose nothing and a killed writer leaves no half-written case."""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sqlite3
import stat
import threading
import urllib.parse
import warnings
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from .. import backend, env
from ..freshness import source_hash
from . import rows as R
from .rows import CROSSOVER_PK, DB_SCHEMA, FINGERPRINT, METHODS, STALE_FIELDS, TUNING_PK, RowError, printable

if TYPE_CHECKING:
    import sqlite_utils

_STATIC = "op = ? AND variant = ? AND arch = ? AND dtype = ? AND static_key = ?"
_PKS = {"tuning": TUNING_PK, "crossover": CROSSOVER_PK, "meta": ("key",)}
# index name -> (table, columns, unique)
_INDEXES = {"tuning_static": ("tuning", ("op", "variant", "arch", "dtype", "static_key"), False),
            "meas_static": ("measurements", ("op", "arch", "dtype", "static_key"), False),
            "meas_unique": ("measurements", R.MEASUREMENT_KEY, True)}
# a tuning row replaces the stored one of its key when that one is not comparable (other method, config
# schema or fingerprint) or slower: a conditional upsert, which sqlite-utils' upsert (always replaces) cannot say
_COLS = list(R.TUNING_COLUMNS)
_UPSERT_TUNING = (
    f"INSERT INTO tuning ({', '.join(_COLS)}) VALUES ({', '.join('?' for _ in _COLS)}) "
    f"ON CONFLICT({', '.join(TUNING_PK)}) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _COLS if c not in TUNING_PK)
    + " WHERE NOT (" + " AND ".join(f"tuning.{c} IS excluded.{c}" for c in ("method", "config_schema", *FINGERPRINT))
    + ") OR excluded.median_ms < tuning.median_ms")


def row_name(row: dict) -> str:
    """The row's key fields that are set, space-separated, control characters escaped (for messages)."""
    name = " ".join(str(row.get(k)) for k in ("op", "arch", "dtype", "static_key", "bucket", "impl") if row.get(k))
    return printable(name + (f" on {row['device']}" if row.get("device") else ""))


def op_arch_where(op: str | None, arch: str | None) -> tuple[str | None, list]:
    """(WHERE clause, args) selecting the rows of `op` and/or `arch` (None, []: every row)."""
    conds = {"op = ?": op, "arch = ?": arch}
    return " AND ".join(c for c, v in conds.items() if v) or None, [v for v in conds.values() if v]


class TuningDBError(RuntimeError):
    """The tuning DB file cannot be used (corrupt, not ours, newer schema, locked, read-only, not a file) or a
    record cannot enter it; the one-line message names which."""


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
        arch = R.arch_for(arch) if arch in backend.ARCH_NAMES else None
    return {"device_name": arch.device_name if arch else "", "sm_count": arch.sm_count if arch else 0,
            **_versions(), "runtime_version": backend.runtime_version() if arch and arch.vendor != "cpu" else "",
            "source_hash": source_hash}


_LABELS = {"torch_version": "torch", "triton_version": "triton", "runtime_version": "runtime",
           "source_hash": "kernel"}


def stale_reason(row: dict, here: dict, *, versions: bool = True) -> str | None:
    """None when `row` was measured on this code and software (published rows count as such), else what
    differs: "torch 2.11.0 (here 2.13.0), kernel 1234abcd (here 5678ef90)".  Without `versions` (an arch not
    present here, whose machine's software is unknown) only the kernel hash counts; a tuning row without a
    recorded timing method always does.  The device never does: another device's row is a fallback."""
    if row.get("origin") == "published" and not row.get("source_hash"):
        return None
    diff = [f"{_LABELS[k]} {printable(row.get(k) or '?')} (here {here[k] or '-'})"
            for k in (STALE_FIELDS if versions else ("source_hash",)) if (row.get(k) or R.DEFAULTS.get(k)) != here[k]]
    if "bucket" in row and row.get("method", "unrecorded") == "unrecorded":     # its time compares with nothing
        diff.append("no recorded timing method")
    return ", ".join(diff) or None


# -- paths --------------------------------------------------------------------------------------------

_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _shown(path) -> str:
    text = printable(path)
    return text if len(text) <= 160 else f"{text[:80]}...{text[-60:]} ({len(text)} characters)"


def path_problem(path: Path) -> str | None:
    """Why `path` cannot hold a tuning DB (None: a regular file, or nothing yet where a file may go).
    Checked before SQLite opens anything: opening a named pipe would block forever."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return f"{_shown(path)} cannot be a tuning DB: a directory in its path is a file"
    except (OSError, ValueError) as exc:     # too long, permission denied, a symlink loop, a NUL byte
        return f"{_shown(path)} cannot be used as the tuning DB: {getattr(exc, 'strerror', None) or exc}"
    if stat.S_ISDIR(mode):
        return f"{_shown(path)} is a directory, not a tuning DB file"
    kind = next((name for test, name in _KINDS if test(mode)), None)
    if kind:
        return f"{_shown(path)} is {kind}, not a tuning DB file"
    if not os.access(path, os.R_OK):
        return f"{_shown(path)} cannot be read (permission denied)"
    return None


def _readonly_uri(path: Path) -> str:
    """The URI that opens `path` read-only.  A WAL file needs its -shm beside it; where none exists and this
    process may not write there (a read-only file or directory), the file is opened immutable: read as it is,
    creating nothing (no writer can be active then: a WAL writer keeps its -shm while it runs)."""
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            head = f.read(20)
        wal = head[:16] == b"SQLite format 3\0" and head[18:20] == b"\x02\x02"
        writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)
        if wal and not writable and not Path(f"{path}-shm").exists():
            uri += "&immutable=1"
            if Path(f"{path}-wal").exists() and Path(f"{path}-wal").stat().st_size:
                warnings.warn(f"liger_rt: reading {_shown(path)} without its last writes: they are in its -wal file, "
                              "which SQLite cannot read here without creating a -shm file beside it (a writer was "
                              "killed, and the file or directory is read-only now)", RuntimeWarning, stacklevel=4)
    return uri


def _inspect(db: sqlite_utils.Database, path) -> int | None:
    """The liger_rt schema version of an open SQLite file (None: no tables), else TuningDBError saying why not."""
    tables = {name: set(db[name].columns_dict) for name in db.table_names() if not name.startswith("sqlite_")}
    if not tables:
        return None
    ours = {"meta", *R.COLUMNS}
    where = printable(path)
    if set(tables) - ours:
        raise TuningDBError(f"{where} is not a liger_rt DB: an SQLite file of another program (tables "
                            f"{printable(', '.join(sorted(tables)))})")
    if ours - set(tables):
        raise TuningDBError(f"{where} is not a liger_rt DB: tables {', '.join(sorted(ours - set(tables)))} missing")
    if not {"key", "value"} <= tables["meta"]:
        raise TuningDBError(f"{where} is not a liger_rt DB: table meta has columns "
                            f"{printable(sorted(tables['meta']))}")
    row = next(db.query("SELECT value FROM meta WHERE key = 'db_schema'"), None)
    if row is None:
        raise TuningDBError(f"{where} is not a liger_rt DB: meta has no db_schema")
    try:
        found = int(str(row["value"]).strip())
    except ValueError:
        raise TuningDBError(f"{where}: meta db_schema {printable(repr(row['value']))} is not a schema number") from None
    if found > DB_SCHEMA:
        raise TuningDBError(f"{where} has DB schema {found}, newer than this liger_rt ({DB_SCHEMA}); upgrade "
                            "liger_rt or point LIGER_RT_TUNING_DB elsewhere")
    if found < 1:
        raise TuningDBError(f"{where}: meta db_schema {found} is not a liger_rt schema (1 .. {DB_SCHEMA})")
    for table, cols in R.SCHEMA_COLUMNS[found].items():
        if cols - tables[table]:
            raise TuningDBError(f"{where} is not a usable liger_rt DB: table {table} lacks columns "
                                f"{', '.join(sorted(cols - tables[table]))}")
    return found


class Store(contextlib.AbstractContextManager):
    """One SQLite file (or, path None, an in-memory DB) with the liger_rt schema, ``readonly`` for lookups,
    doctor, show and export; writable, a missing file is created (unless ``create=False``).  ``db`` is its
    sqlite_utils.Database."""

    def __init__(self, path: Path | None, *, layer: str, timeout: float | None = None, create: bool = True,
                 readonly: bool = False):
        self.path, self.layer, self.readonly = path, layer, readonly
        self.timeout = timeout if timeout is not None else 0.0 if path is None else env.db_timeout()
        self.conn, self.schema, self._db = None, DB_SCHEMA, None
        if path is not None and (why := path_problem(path)):
            raise TuningDBError(why)
        if path is not None and not path.exists() and (readonly or not create):
            raise TuningDBError(f"{printable(path)} does not exist")
        try:
            if path is None:
                self.conn = self._connect(":memory:")
                self._setup()
            elif readonly:
                self.conn = self._connect(_readonly_uri(path), uri=True)
                if (found := _inspect(self.db, path)) is None:
                    raise TuningDBError(f"{printable(path)} is not a liger_rt DB: " + (
                        "an empty file" if path.stat().st_size == 0 else "an SQLite file without tables"))
                self.schema = found
            else:
                self._open_writable(path)
        except BaseException as exc:
            self.close()
            if isinstance(exc, sqlite3.DatabaseError):
                raise TuningDBError(f"{printable(path)} is unusable: {exc}") from None
            raise

    @property
    def db(self) -> sqlite_utils.Database:
        if self._db is None or self._db.conn is not self.conn:
            # imported here, at the first decision, not with the dispatcher: sqlite_utils imports pandas where
            # it is installed (0.22 s of `import liger_rt.dispatch`'s 2.5 s on this repository's CPU machine)
            import sqlite_utils
            self._db = sqlite_utils.Database(self.conn, execute_plugins=False, recursive_triggers=False)
        return self._db

    def _connect(self, target: str, uri: bool = False) -> sqlite3.Connection:
        # isolation_level None: no implicit transactions; each write is in an explicit one (transaction())
        conn = sqlite3.connect(target, timeout=self.timeout, check_same_thread=False, isolation_level=None, uri=uri)
        conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        return conn

    def _open_writable(self, path: Path) -> None:
        where = printable(path)
        if not path.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TuningDBError(f"cannot create the directory of {where}: {exc.strerror or exc}") from None
        elif not os.access(path, os.W_OK):
            raise TuningDBError(f"{where} is read-only (file permissions); choose a writable --db or "
                                "LIGER_RT_TUNING_DB")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise TuningDBError(f"the directory {printable(path.parent)} is not writable (SQLite needs to create "
                                "its journal there); choose a writable --db or LIGER_RT_TUNING_DB")
        self.conn = self._connect(str(path))
        with self._write_errors("open"):
            found = _inspect(self.db, path)
            # WAL for a new file or a current one; an older schema migrates first (switching takes a lock of its own)
            if found in (None, DB_SCHEMA):
                self.db.enable_wal()
            if found != DB_SCHEMA:
                self._setup()

    def _setup(self) -> None:
        """Create the schema in an empty DB, or migrate an older one, in one transaction."""
        db = self.db
        with self.transaction():
            found = _inspect(db, self.path)      # again: another process may have done it meanwhile
            if found == DB_SCHEMA:
                return
            if found is None:
                for table, columns in {"meta": {"key": str, "value": str}, **R.COLUMNS}.items():
                    db[table].create(columns, pk=_PKS.get(table))
                db["meta"].insert({"key": "db_schema", "value": str(DB_SCHEMA)})
            else:
                self._migrate(found)
            for name, (table, cols, unique) in _INDEXES.items():
                db[table].create_index(cols, index_name=name, unique=unique, if_not_exists=True)

    def _migrate(self, found: int) -> None:
        """Schema 1 or 2 -> 3 (inside _setup's transaction): the columns of the later schemas (old rows: method
        "unrecorded", so they count as stale until re-measured), the device class from the device name, keys
        and the measurements' unique index that include it; duplicate measurements dropped (schema 1 let a
        second import duplicate them)."""
        db = self.db
        for table, columns in R.COLUMNS.items():
            for col, typ in columns.items():
                if col not in db[table].columns_dict:
                    db[table].add_column(col, typ)
                    if (default := R.DEFAULTS.get(col)) is not None:
                        db.execute(f"UPDATE {table} SET {col} = ?", [default])
            db[table].convert("device_name", backend.device_class, output="device",
                              where="device IS NULL OR device = ''")
            if table in _PKS and db[table].pks != list(_PKS[table]):
                db[table].transform(pk=_PKS[table])
        db["measurements"].drop_index("meas_unique", ignore=True)
        key = ", ".join(R.MEASUREMENT_KEY)
        db.execute(f"DELETE FROM measurements WHERE rowid NOT IN (SELECT min(rowid) FROM measurements GROUP BY {key})")
        db["meta"].update("db_schema", {"value": str(DB_SCHEMA)})

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _write_errors(self, what: str):
        where = printable(self.path)
        try:
            yield
        except sqlite3.DatabaseError as exc:
            msg = str(exc)
            if "locked" in msg or "busy" in msg:
                raise TuningDBError(f"{where} is locked by another process (waited {self.timeout:g} s; "
                                    "LIGER_RT_DB_TIMEOUT sets how long)") from None
            if "readonly" in msg or "read-only" in msg:
                raise TuningDBError(f"{where} is read-only ({msg}); choose a writable --db or "
                                    "LIGER_RT_TUNING_DB") from None
            raise TuningDBError(f"{where}: {what} failed: {msg}") from None

    @contextlib.contextmanager
    def transaction(self):
        """One write transaction (nested uses join the outer one)."""
        if self.readonly:
            raise TuningDBError(f"{printable(self.path)} was opened read-only")
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
        comparable (other method, fingerprint or config schema) or slower; a crossover row replaces its key's;
        a measurement already stored is kept as it is."""
        rows = [rows] if isinstance(rows, Mapping) else rows
        rows = [r if checked else R.check(table, self._here(r)) for r in rows]
        if not rows:
            return
        with self.transaction():
            if table == "tuning":
                self.conn.executemany(_UPSERT_TUNING, [[r[c] for c in _COLS] for r in rows])
            else:
                self.db[table].insert_all(rows, replace=table == "crossover", ignore=table == "measurements")

    put_tuning = functools.partialmethod(put_rows, "tuning")
    put_measurements = functools.partialmethod(put_rows, "measurements")
    put_crossover = functools.partialmethod(put_rows, "crossover")

    def select(self, table: str, where: str | None = None, args: list | None = None, *,
               rowid: bool = False) -> list[dict]:
        """Rows of `table` as dicts with every column (older schemas' rows get the later columns' defaults)."""
        raw = self.db[table].rows_where(where, args or [], select="rowid AS _rowid, *" if rowid else "*")
        return [R.fill_defaults(table, r) | ({"rowid": r["_rowid"]} if rowid else {}) for r in raw]

    all_rows = select

    def crossover_row(self, op: str, variant: str, arch: str, dtype: str, static_key: str) -> dict | None:
        return next(iter(self.select("crossover", _STATIC, [op, variant, arch, dtype, static_key])), None)

    def counts(self) -> dict:
        return {t: self.db[t].count for t in R.COLUMNS}

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
    """("ok" | "stale" | "bad", why).  Bad: fails validation (a tuning config that cannot launch included).
    Stale: measured on other kernel code or config schema (any arch), without a recorded timing method, or
    (rows of this machine's arch, and cpu rows) under other software versions.  Another device is neither."""
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
    versions = checked["arch"] in (backend.detect_hardware().name, "cpu")
    why = stale_reason(checked, fingerprint(checked["arch"], source_hash(op)), versions=versions)
    return ("stale", why) if why else ("ok", "")


def load_jsonl(store: Store, lines: Iterable[str], *, strict: bool = True) -> dict:
    """Merge an export (JSON lines {"table": ..., **row}) into `store`, all or nothing: the first bad line
    raises TuningDBError("line N: why") with nothing written.  Importing again changes nothing, whatever
    optional field the records lack (a missing creation time is 0, "unknown").  Schema-1 rows enter with
    method "unrecorded", so they count as stale.  strict=False (the shipped defaults) stores rows unvalidated:
    lookups validate them when they are read."""
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
                raise TuningDBError(f"line {n}: db_schema {printable(repr(schema))} is not a schema number")
            if schema > DB_SCHEMA:
                raise TuningDBError(f"line {n}: an export of DB schema {schema}, newer than this liger_rt "
                                    f"({DB_SCHEMA}); upgrade liger_rt to import it")
            continue
        if table not in R.COLUMNS:
            raise TuningDBError(f"line {n}: unknown table {printable(repr(table))}; valid: {', '.join(R.COLUMNS)}")
        try:
            batches[table].append(R.check(table, rec, created=0.0) if strict else _coerce(table, rec))
        except RowError as exc:
            raise TuningDBError(f"line {n}: {table} record {row_name(rec)}: {printable(exc)}") from None
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
    if out.get("created") is None:
        out["created"] = 0.0
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
                key = tuple(row[c] for c in R.KEYS[table])
                if key in seen or (keep is not None and not keep(table, row)):
                    continue
                seen.add(key)
                yield json.dumps({"table": table, **row}, sort_keys=True)


def _log2_distance(a: dict, b: dict) -> float:
    return sum(abs(math.log2(max(1, a[k])) - math.log2(max(1, b.get(k, 1)))) for k in a)


class LayeredStore:
    """The user DB over the shipped defaults.  Rows are ranked in tiers: measured on this device class and this
    code and software; on another device of the arch (a fallback: origin ``arch:<device>``); then the same two
    under other code or software ("stale").  Lookups use the best tier any row of the static dims reaches, the
    user DB before the shipped one within it.  A bad row is skipped with one warning and the lookup goes on to
    the next row, layer or source."""

    def __init__(self, user: Store | None, defaults: Store, user_error: str | None = None):
        self.user, self.defaults, self.user_error = user, defaults, user_error
        self._here, self._warned = {}, set()     # targets by (arch, device, kernel hash); bad rows warned about
        self._launch_failed: dict[tuple, str] = {}      # tuning rows whose config raised at launch -> the error
        self._failed_lock = threading.Lock()

    @classmethod
    def open_default(cls) -> "LayeredStore":
        """The shipped defaults plus LIGER_RT_TUNING_DB read-only when it exists (reading changes nothing).
        A path that cannot hold a DB (not a regular file, too long, under a file) is warned about once and
        the shipped defaults serve alone."""
        defaults, path = shipped_defaults(), env.tuning_db_path()
        user, error = None, None
        try:
            if why := path_problem(path):
                raise TuningDBError(why)
            if path.exists():
                user = Store(path, layer="user", readonly=True)
        except (TuningDBError, sqlite3.Error, OSError) as exc:
            error = str(exc)
            warnings.warn(f"liger_rt: ignoring the tuning DB ({printable(exc)}); using shipped defaults and "
                          "heuristics. `liger-tune doctor` shows this.", RuntimeWarning, stacklevel=2)
        return cls(user, defaults, error)

    @staticmethod
    def _launch_key(row: Mapping) -> tuple:
        return tuple(str(row.get(c)) for c in (*TUNING_PK, "config"))

    def mark_launch_failed(self, row: Mapping, why: str) -> bool:
        """From now on (until this store is reopened: dispatch.reset()) lookups skip the tuning row with this key and
        config (JSON text, as rows.check writes it): its config raised at launch with `why`.  True the first time."""
        key = self._launch_key(row)
        with self._failed_lock:
            if key in self._launch_failed:
                return False
            self._launch_failed[key] = why
            return True

    def layers(self) -> list[Store]:
        return [s for s in (self.user, self.defaults) if s is not None]

    def close(self) -> None:
        if self.user is not None:   # the shipped defaults are shared by the process: keep them open
            self.user.close()

    def _target(self, arch, op) -> tuple:
        """(arch name, Arch, device class, fingerprint here, versions judged) of `arch` (an Arch or a name)."""
        hw_name = backend.detect_hardware().name
        if isinstance(arch, str):
            arch = R.arch_for(arch)
        key = (arch.name, arch.device_name, source_hash(op))
        if key not in self._here:
            self._here[key] = (arch.name, arch, backend.device_class(arch.device_name),
                               fingerprint(arch, source_hash(op)), arch.name in (hw_name, "cpu"))
        return self._here[key]

    def _warn_bad(self, store: Store, table: str, row: dict, why: str, key: str) -> None:
        if (k := (store.layer, table, *(str(row.get(c)) for c in TUNING_PK), key)) not in self._warned:
            self._warned.add(k)
            warnings.warn(f"liger_rt: skipping a bad {table} row in the {store.layer} DB ({row_name(row)}): "
                          f"{printable(why)}; `liger-tune doctor` counts them, `liger-tune prune --invalid` "
                          "removes them", RuntimeWarning, stacklevel=5)

    def _usable(self, store: Store, table: str, op, row: dict, arch, dims: dict):
        """(checked row, config or None) when the row may be used for `dims`, else None (a bad one warned once)."""
        try:
            checked = R.check(table, row, op=op)
        except RowError as exc:
            self._warn_bad(store, table, row, str(exc), str(exc))
            return None
        if table == "crossover":
            return checked, None
        if self._launch_failed and self._launch_key(checked) in self._launch_failed:
            return None               # raised at launch in this process (warned about then)
        if checked["config_schema"] != op.schema_version:
            return None               # other config fields: not applicable (stale, prune --stale)
        try:
            config = R.parse_config(op, checked["impl"], checked["config"])
        except RowError:
            return None               # measured on other code whose configs this code does not take
        try:
            R.launchable(op, checked, config, dims, arch)      # a nearer bucket's config at this call's dims
        except RowError as exc:
            self._warn_bad(store, table, row, str(exc), "launch")
            return None
        return checked, config

    def _found(self, table: str, op, arch, dtype: str, dims: dict, keep=None) -> list[tuple]:
        """(store, checked row, config, stale reason or None, tier) of each usable row of the static dims."""
        name, target, device, here, versions = self._target(arch, op)
        args = [op.name, op.variant, name, dtype, op.static_key(dims)]
        found = []      # loops, not comprehensions: the warnings' stacklevel counts these frames
        for store in self.layers():
            try:
                rows = store.select(table, _STATIC, args)
            except sqlite3.Error as exc:  # locked past the timeout, corrupted since opening...
                if store is self.user:
                    warnings.warn(f"liger_rt: tuning DB read failed ({printable(exc)}); using shipped defaults",
                                  RuntimeWarning, stacklevel=3)
                    self.user_error, self.user = str(exc), None
                continue
            for row in rows:
                if usable := (keep is None or keep(row)) and self._usable(store, table, op, row, target, dims):
                    why = stale_reason(usable[0], here, versions=versions)
                    found.append((store, *usable, why, 2 * bool(why) + (usable[0]["device"] != device)))
        return found

    @staticmethod
    def _provenance(row: dict, tier: int, device: str, why: str | None) -> tuple[str | None, str]:
        """(the fallback origin or None, "on h200 (no h100 row), STALE: ..." for the reason)."""
        fallback = f"arch:{row['device'] or 'any'}" if tier % 2 else None
        text = f"on {row['device'] or 'any device'}" + (f" (no {device or 'device-class'} row)" if fallback else "")
        return fallback, text + (f", STALE: {why}" if why else "")

    def lookup(self, op, arch, dtype: str, dims: dict, *, impls: list[str], nearest: bool) -> dict | None:
        """The best usable tuning row of the exact (or with `nearest` the nearest) bucket, for `arch` (an Arch,
        whose device name gives the device class, or an arch name).  Only rows of the best tier the static dims
        reach count (see the class); the user DB before the shipped one; within the bucket one timing method
        (cuda-graph, do_bench, cpu-wall, unrecorded in that order of preference) and its fastest row."""
        found = self._found("tuning", op, arch, dtype, dims, lambda row: row.get("impl") in impls)
        if not found:
            return None
        device = self._target(arch, op)[2]
        tier = min(c[4] for c in found)
        want = {d: dims[d] for d in op.dynamic}
        exact = op.bucket_key(dims)
        for store in self.layers():
            cands = [c for c in found if c[0] is store and c[4] == tier]
            if nearest:
                dist = {c[1]["bucket"]: _log2_distance(want, json.loads(c[1]["bucket"])) for c in cands}
                cands = [c for c in cands if dist[c[1]["bucket"]] == min(dist.values())]
            else:
                cands = [c for c in cands if c[1]["bucket"] == exact]
            if not cands:
                continue
            method = min((c[1]["method"] for c in cands), key=METHODS.index)
            cands = [c for c in cands if c[1]["method"] == method]     # never compare methods
            _, best, config, why, _ = min(cands, key=lambda c: c[1]["median_ms"])
            fallback, where = self._provenance(best, tier, device, why)
            out = {**best, "config": config, "layer": store.layer, "stale": why, "fallback": fallback}
            # another device tier may hold rows of several devices: the baseline is the best row's device's
            torch_rows = [c[1] for c in cands if c[1]["impl"] == "torch" and c[1]["bucket"] == best["bucket"]
                          and c[1]["device"] == best["device"]]
            if torch_rows:      # the same run's torch time, same method: the honest baseline
                out["baseline_ms"] = torch_rows[0]["median_ms"]
            host = f", host {best['host_ms']:.3g} ms/call" if best.get("host_ms") else ""
            out["db_origin"] = f"{best['origin']}, {best['method']}{host}, {where}"
            return out
        return None

    def crossover(self, op, arch, dtype: str, dims: dict) -> dict | None:
        """The crossover row of (op, arch, dtype, static dims) of the best tier (see the class)."""
        found = self._found("crossover", op, arch, dtype, dims)
        if not found:
            return None
        store, row, _, why, tier = min(found, key=lambda c: c[4])
        fallback, where = self._provenance(row, tier, self._target(arch, op)[2], why)
        return {**row, "segments": json.loads(row["segments"]), "layer": store.layer, "stale": why,
                "fallback": fallback, "source": row["origin"], "origin": f"{row['origin']}, {row['method']} {where}"}

    def covered(self, op, arch, dtype: str, dims: dict) -> bool:
        """Whether a row of this device, code and software serves the exact bucket of `dims` (what sweeping
        that shape writes)."""
        exact = op.bucket_key(dims)
        return any(c[4] == 0 and c[1]["bucket"] == exact for c in self._found("tuning", op, arch, dtype, dims))


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
