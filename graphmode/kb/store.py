"""The knowledge base file: SQLite (stdlib), one file, shared safely by concurrent processes.

Entities and how they relate (DESIGN.md, "Knowledge base"):

    hardware     one row per target fingerprint (CPU model, ISA, cores, measured bandwidth
                 and peak; or the target file of an accelerator)
    models       one row per architecture fingerprint (family, op histogram, parameter
                 count, layer shapes)
    recipes      one row per content hash: IR hash, graphmode and torch versions, time;
                 `generated_on` -> hardware, `optimized_for` -> model
    performance  one measurement the recipe achieved on a hardware for a model (p50, p99,
                 P99/P50, throughput, peak memory, compile time, numerics error, bucket),
                 from bench, profile, verify, tune or serve; `uid` is a content digest,
                 so importing the same row twice keeps one

What is in the file is typed on the way in and out (kb/rows.py): an imported line with an
unknown field or a wrongly typed value refuses the whole file naming the line and field, and a
row read back with a damaged cell (text in a number column, JSON that does not parse, a
number out of range: a file edited or written by something else) is skipped with one warning
per read, never a traceback; so are rows that refer to a skipped one.

Why it cannot be corrupted by two writers: the file is in WAL mode with a busy timeout,
and every write is one `BEGIN IMMEDIATE` transaction, so writers queue instead of
interleaving. A file SQLite cannot read (garbage, truncated) is a `KbError` naming it and
the fix; graphmode never rewrites, deletes or "repairs" it, so nothing in it is lost by us.
The schema version is SQLite's `user_version`; `MIGRATIONS[i]` brings version i to i + 1.
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from graphmode.errors import GraphmodeError
from graphmode.kb.rows import JSON_COLUMNS, REAL_COLUMNS, decode, entity_problem, row_problem
from graphmode.untrusted import file_kind

log = logging.getLogger("graphmode.kb")

BUSY_TIMEOUT_S = 60.0

MIGRATIONS: list[str] = [
    """
    CREATE TABLE hardware (
        id INTEGER PRIMARY KEY,
        fingerprint TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        cpu_model TEXT,
        isa TEXT,
        arch TEXT,
        cores INTEGER,
        simd TEXT NOT NULL,
        bandwidth_gbps REAL,
        peak_f32_gflops REAL,
        target TEXT NOT NULL,
        created REAL NOT NULL);
    CREATE TABLE models (
        id INTEGER PRIMARY KEY,
        fingerprint TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        family TEXT NOT NULL,
        params INTEGER NOT NULL,
        op_histogram TEXT NOT NULL,
        layer_shapes TEXT NOT NULL,
        inputs TEXT NOT NULL,
        created REAL NOT NULL);
    CREATE TABLE recipes (
        id INTEGER PRIMARY KEY,
        hash TEXT NOT NULL UNIQUE,
        name TEXT NOT NULL,
        body TEXT NOT NULL,
        ir_hash TEXT,
        graphmode_version TEXT NOT NULL,
        torch_version TEXT NOT NULL,
        generated_on INTEGER REFERENCES hardware(id),
        optimized_for INTEGER REFERENCES models(id),
        origin TEXT NOT NULL,
        parent TEXT,
        created REAL NOT NULL);
    CREATE TABLE performance (
        id INTEGER PRIMARY KEY,
        uid TEXT NOT NULL UNIQUE,
        recipe INTEGER NOT NULL REFERENCES recipes(id),
        hardware INTEGER NOT NULL REFERENCES hardware(id),
        model INTEGER NOT NULL REFERENCES models(id),
        source TEXT NOT NULL,
        status TEXT NOT NULL,
        reason TEXT,
        bucket TEXT,
        p50_ms REAL,
        p99_ms REAL,
        p99_over_p50 REAL,
        throughput REAL,
        peak_memory_mb REAL,
        compile_s REAL,
        numerics_err REAL,
        threads INTEGER,
        graphmode_version TEXT,
        torch_version TEXT,
        extra TEXT NOT NULL,
        created REAL NOT NULL);
    CREATE INDEX performance_recipe ON performance(recipe);
    CREATE INDEX performance_model ON performance(model);
    CREATE INDEX recipes_model ON recipes(optimized_for);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

HARDWARE_COLS = ("fingerprint", "name", "kind", "cpu_model", "isa", "arch", "cores", "simd", "bandwidth_gbps",
                 "peak_f32_gflops", "target", "created")
MODEL_COLS = ("fingerprint", "name", "family", "params", "op_histogram", "layer_shapes", "inputs", "created")
RECIPE_COLS = ("hash", "name", "body", "ir_hash", "graphmode_version", "torch_version", "origin", "parent",
               "created")
PERF_COLS = ("uid", "source", "status", "reason", "bucket", "p50_ms", "p99_ms", "p99_over_p50", "throughput",
             "peak_memory_mb", "compile_s", "numerics_err", "threads", "graphmode_version", "torch_version",
             "extra", "created")
METRICS = ("p50_ms", "p99_ms", "p99_over_p50", "throughput", "peak_memory_mb", "compile_s", "numerics_err")
JSON_COLS = JSON_COLUMNS


class KbError(GraphmodeError):
    """The knowledge base file cannot be used (corrupt, locked for too long, unwritable, newer)."""


def _fix_corrupt(path: Path) -> str:
    return (f"move it aside (mv {path} {path}.corrupt) and run again: a new file is created; "
            f"`sqlite3 {path}.corrupt .recover` may salvage its rows, and `graphmode kb import` "
            "merges an export from another machine")


def _is_busy(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    low = str(e).lower()
    return "locked" in low or "busy" in low


def kb_error(e: sqlite3.Error, path: Path, doing: str) -> KbError:
    """A sqlite3 exception as a KbError that says which file, what happened and the fix."""
    msg = str(e)
    low = msg.lower()
    if _is_busy(e):
        return KbError(f"the knowledge base stayed locked by another process for {BUSY_TIMEOUT_S:.0f} s while "
                       f"{doing}", where=str(path),
                       fix="let the other graphmode process finish (or stop it), then run again")
    if "readonly" in low or "unable to open" in low or "permission" in low:
        return KbError(f"cannot write the knowledge base while {doing}: {msg}", where=str(path),
                       fix="check the folder exists and is writable, or pass another --kb PATH")
    if isinstance(e, sqlite3.DatabaseError) and ("not a database" in low or "malformed" in low
                                                 or "corrupt" in low or "disk i/o" in low):
        return KbError(f"the knowledge base file is damaged ({msg}) while {doing}; graphmode left it "
                       "untouched", where=str(path), fix=_fix_corrupt(path))
    return KbError(f"knowledge base error while {doing}: {type(e).__name__}: {msg}", where=str(path),
                   fix=_fix_corrupt(path))


class KnowledgeBase:
    """One open knowledge-base file. Use as a context manager; one connection per process
    and thread (sqlite3 connections are not shared across threads here)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.skipped = 0             # damaged rows left out of what was read
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KbError(f"cannot create the folder of the knowledge base: {e.strerror}", where=str(self.path),
                          fix="pass a writable --kb PATH") from None
        if self.path.is_dir():
            raise KbError("the knowledge base path is a folder", where=str(self.path),
                          fix="pass a file path, e.g. --kb team.sqlite")
        try:
            mode = self.path.stat().st_mode
        except OSError:
            mode = None             # not there yet: SQLite creates it
        if mode is not None and not stat.S_ISREG(mode):
            raise KbError(f"the knowledge base path is a {file_kind(mode)}, not a file", where=str(self.path),
                          fix="pass the path of a knowledge-base file (or of one to create), e.g. --kb team.sqlite")
        # a file this process cannot write (a read-only mount of a team's file): read, never migrated or written
        self.readonly = mode is not None and not (os.access(self.path, os.W_OK) and os.access(self.path.parent,
                                                                                             os.W_OK))
        try:
            self.db = self._connect()
        except sqlite3.Error as e:
            raise kb_error(e, self.path, "opening it") from None
        self.db.row_factory = sqlite3.Row
        try:
            self._prepare()
        except BaseException:
            self.db.close()
            raise

    def _connect(self) -> sqlite3.Connection:
        if not self.readonly:
            return sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
        uri = f"{self.path.resolve().as_uri()}?mode=ro"
        db = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            db.execute("PRAGMA user_version").fetchone()
            return db
        except sqlite3.OperationalError:  # a WAL file whose -shm cannot be made there: nobody can write it either
            db.close()
            return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)

    def __enter__(self) -> "KnowledgeBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    # ---- opening: integrity, WAL, migrations ----------------------------------------------------
    def _prepare(self) -> None:
        rows: list = []
        self._retry_busy(lambda: rows.extend(self.db.execute("PRAGMA quick_check").fetchall()),
                         "reading its header")
        if [r[0] for r in rows] != ["ok"]:
            raise KbError(f"the knowledge base file is damaged: {rows[0][0]}; graphmode left it untouched",
                          where=str(self.path), fix=_fix_corrupt(self.path))
        if not self.readonly:
            self._retry_busy(self._use_wal, "switching it to WAL mode")
        with self._guard("turning on foreign keys"):
            self.db.execute("PRAGMA foreign_keys=ON")
        version = self._version()
        if version < 0:
            raise KbError(f"the knowledge base file is damaged: schema version {version}; graphmode left it "
                          "untouched", where=str(self.path), fix=_fix_corrupt(self.path))
        if version > SCHEMA_VERSION:
            raise KbError(f"the knowledge base has schema version {version}, this graphmode reads up to "
                          f"{SCHEMA_VERSION}", where=str(self.path),
                          fix="upgrade graphmode, or pass another --kb PATH")
        if version < SCHEMA_VERSION and self.readonly:
            raise KbError(f"the knowledge base has schema version {version} and cannot be written here to move it to "
                          f"{SCHEMA_VERSION}", where=str(self.path),
                          fix="open it once where it can be written (any graphmode command migrates it), or pass "
                              "another --kb PATH")
        if version < SCHEMA_VERSION:
            with self.transaction("migrating its schema"):
                version = self._version()          # another process may have migrated meanwhile
                for i in range(version, SCHEMA_VERSION):
                    for stmt in MIGRATIONS[i].split(";"):
                        if stmt.strip():
                            self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _use_wal(self) -> None:
        """WAL once per file (it persists): only a file not yet in WAL asks for the switch. A
        busy file raises SQLITE_BUSY; a file system without WAL support keeps the rollback
        journal (SQLite answers with the old mode), which is still safe, only slower."""
        if self.db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            self.db.execute("PRAGMA journal_mode=WAL").fetchone()

    def _retry_busy(self, step: Callable[[], None], doing: str) -> None:
        """Run `step`, retrying while another process holds the file. Switching the journal mode
        (and opening a WAL file another connection is closing) reports SQLITE_BUSY at once,
        without SQLite's busy handler, so we back off ourselves up to the same timeout."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.001
        while True:
            try:
                step()
                return
            except sqlite3.OperationalError as e:
                if not _is_busy(e) or time.monotonic() + pause > deadline:
                    raise kb_error(e, self.path, doing) from None
            except sqlite3.Error as e:
                raise kb_error(e, self.path, doing) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _version(self) -> int:
        with self._guard("reading its schema version"):
            return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def _guard(self, doing: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            raise kb_error(e, self.path, doing) from None

    @contextmanager
    def transaction(self, doing: str = "writing") -> Iterator[sqlite3.Connection]:
        """One write transaction: taken with BEGIN IMMEDIATE (writers queue on the busy timeout),
        committed at the end, rolled back on any error."""
        with self._guard(doing):
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    # ---- writing ------------------------------------------------------------------------------
    def _upsert(self, table: str, key: str, row: dict[str, Any], cols: tuple[str, ...],
                refresh: tuple[str, ...] = ()) -> int:
        """Insert `row` unless `key` is known; then refresh `refresh` columns. Returns the id."""
        cur = self.db.execute(f"SELECT id FROM {table} WHERE {key} = ?", (row[key],)).fetchone()
        if cur is not None:
            if refresh:
                sets = ", ".join(f"{c} = ?" for c in refresh)
                self.db.execute(f"UPDATE {table} SET {sets} WHERE id = ?", [row[c] for c in refresh] + [cur[0]])
            return int(cur[0])
        names = ", ".join(cols)
        marks = ", ".join("?" for _ in cols)
        return int(self.db.execute(f"INSERT INTO {table} ({names}) VALUES ({marks})",
                                   [row[c] for c in cols]).lastrowid)

    def _write_entities(self, hardware: dict, model: dict, recipe: dict) -> tuple[int, int, int]:
        hw = self._upsert("hardware", "fingerprint", _encode(hardware), HARDWARE_COLS,
                          refresh=("bandwidth_gbps", "peak_f32_gflops"))
        md = self._upsert("models", "fingerprint", _encode(model), MODEL_COLS)
        rec = dict(_encode(recipe), generated_on=hw, optimized_for=md)
        rid = self._upsert("recipes", "hash", rec, RECIPE_COLS + ("generated_on", "optimized_for"))
        return hw, md, rid

    def add_recipe(self, hardware: dict, model: dict, recipe: dict) -> int:
        """Record a recipe (and the hardware and model it belongs to) without a measurement."""
        with self.transaction("recording a recipe"):
            return self._write_entities(hardware, model, recipe)[2]

    def add(self, hardware: dict, model: dict, recipe: dict, perf: dict) -> bool:
        """Record one measurement with its entities in one transaction; False when a row with
        the same uid was already there."""
        with self.transaction("recording a measurement"):
            hw, md, rid = self._write_entities(hardware, model, recipe)
            return self._add_perf(_encode(perf), rid, hw, md)

    def _add_perf(self, perf: dict, rid: int, hw: int, md: int) -> bool:
        cols = PERF_COLS + ("recipe", "hardware", "model")
        row = dict(perf, recipe=rid, hardware=hw, model=md)
        cur = self.db.execute(f"INSERT OR IGNORE INTO performance ({', '.join(cols)}) VALUES "
                              f"({', '.join('?' for _ in cols)})", [row[c] for c in cols])
        return cur.rowcount == 1

    # ---- reading ------------------------------------------------------------------------------
    def rows(self, sql: str, args: tuple | list = ()) -> list[dict[str, Any]]:
        """The rows of a query, each cell typed (kb/rows.py); a row with a damaged cell is
        skipped, counted in `skipped` and said once per query as a warning."""
        with self._guard("reading"):
            raw = self.db.execute(sql, args).fetchall()
        out, bad = [], []
        for r in raw:
            row = dict(r)
            why = row_problem(row)
            if why is None:
                out.append(decode(row))
            else:
                bad.append(why)
        if bad:
            self.warn_damaged(len(bad), bad[0])
        return out

    def warn_damaged(self, n: int, first: str) -> None:
        self.skipped += n
        log.warning("knowledge base %s: skipped %d damaged row(s) (first: %s); `graphmode kb export` and import "
                    "into a new file keep the rest", self.path, n, first)

    def counts(self) -> dict[str, int]:
        return {t: self.rows(f"SELECT count(*) AS n FROM {t}")[0]["n"]
                for t in ("hardware", "models", "recipes", "performance")}

    # ---- export / import (JSON lines) -----------------------------------------------------------
    def export_lines(self) -> Iterator[dict[str, Any]]:
        """Every entity as one JSON-able dict, referenced by fingerprint / hash (never by row id),
        so files from several machines merge."""
        yield {"entity": "graphmode-kb", "schema": SCHEMA_VERSION, "exported": time.time()}
        hw = {r["id"]: r for r in self.rows("SELECT * FROM hardware ORDER BY id")}
        md = {r["id"]: r for r in self.rows("SELECT * FROM models ORDER BY id")}
        rc = {r["id"]: r for r in self.rows("SELECT * FROM recipes ORDER BY id")}
        for r in hw.values():
            yield {"entity": "hardware", **{c: r[c] for c in HARDWARE_COLS}}
        for r in md.values():
            yield {"entity": "model", **{c: r[c] for c in MODEL_COLS}}
        for r in list(rc.values()):
            if (r["generated_on"] and r["generated_on"] not in hw) or (r["optimized_for"] and r["optimized_for"] not in md):
                self.warn_damaged(1, f"recipe {r['hash']} refers to a skipped or missing row")
                del rc[r["id"]]
                continue
            yield {"entity": "recipe", **{c: r[c] for c in RECIPE_COLS},
                   "generated_on": hw[r["generated_on"]]["fingerprint"] if r["generated_on"] else None,
                   "optimized_for": md[r["optimized_for"]]["fingerprint"] if r["optimized_for"] else None}
        for r in self.rows("SELECT * FROM performance ORDER BY id"):
            if r["recipe"] not in rc or r["hardware"] not in hw or r["model"] not in md:
                self.warn_damaged(1, f"measurement {r['uid']} refers to a skipped or missing row")
                continue
            yield {"entity": "performance", **{c: r[c] for c in PERF_COLS}, "recipe": rc[r["recipe"]]["hash"],
                   "hardware": hw[r["hardware"]]["fingerprint"], "model": md[r["model"]]["fingerprint"]}

    def import_lines(self, lines: Iterator[dict[str, Any]], source: str) -> dict[str, int]:
        """Merge exported entities; rows already present (same fingerprint, hash or uid) are
        skipped. One transaction: a bad line leaves the knowledge base as it was."""
        added = {"hardware": 0, "model": 0, "recipe": 0, "performance": 0, "skipped": 0}
        with self.transaction(f"importing {source}"):
            for n, item in enumerate(lines, 1):
                kind = item.get("entity") if isinstance(item, dict) else None
                try:
                    if not isinstance(item, dict):
                        raise ValueError(f"a JSON {type(item).__name__}, not an object")
                    if kind == "graphmode-kb":
                        schema = item.get("schema", 0)
                        if isinstance(schema, bool) or not isinstance(schema, int):
                            raise ValueError(f"field 'schema' must be an integer (holds {schema!r:.40})")
                        if schema > SCHEMA_VERSION:
                            raise KbError(f"the export has schema {schema}, this graphmode reads up to "
                                          f"{SCHEMA_VERSION}", where=f"{source}:{n}", fix="upgrade graphmode")
                        continue
                    new = self._import_one(kind, item)
                except (KeyError, TypeError, ValueError, OverflowError, sqlite3.IntegrityError) as e:
                    raise KbError(f"line {n} is not a knowledge-base entry: {e}", where=f"{source}:{n}",
                                  fix="import a file written by `graphmode kb export`; nothing was imported") from None
                if new:
                    added[kind] += 1
                else:
                    added["skipped"] += 1
        return added

    def _import_one(self, kind: Any, item: dict[str, Any]) -> bool:
        table, key, cols = {"hardware": ("hardware", "fingerprint", HARDWARE_COLS),
                            "model": ("models", "fingerprint", MODEL_COLS),
                            "recipe": ("recipes", "hash", RECIPE_COLS)}.get(kind, (None, None, None))
        if kind not in ("hardware", "model", "recipe", "performance"):
            raise ValueError(f"unknown entity {str(kind)[:40]!r} (one of graphmode-kb, hardware, model, recipe, "
                             "performance)")
        why = entity_problem(kind, item, PERF_COLS if kind == "performance" else cols,
                             "uid" if kind == "performance" else key)
        if why is not None:
            raise ValueError(why)
        if kind == "performance":
            ids = [self._id(t, k, item[f]) for t, k, f in
                   (("recipes", "hash", "recipe"), ("hardware", "fingerprint", "hardware"),
                    ("models", "fingerprint", "model"))]
            return self._add_perf(_encode({c: item.get(c) for c in PERF_COLS}), *ids)
        if table is None:
            raise ValueError(f"unknown entity {kind!r}")
        row = _encode({c: item.get(c) for c in cols})
        if not row[key]:
            raise ValueError(f"no {key}")
        exists = self.db.execute(f"SELECT 1 FROM {table} WHERE {key} = ?", (row[key],)).fetchone()
        if kind == "recipe":
            row["generated_on"] = self._id("hardware", "fingerprint", item["generated_on"]) \
                if item.get("generated_on") else None
            row["optimized_for"] = self._id("models", "fingerprint", item["optimized_for"]) \
                if item.get("optimized_for") else None
            cols = cols + ("generated_on", "optimized_for")
        self._upsert(table, key, row, cols)
        return exists is None

    def _id(self, table: str, key: str, value: Any) -> int:
        r = self.db.execute(f"SELECT id FROM {table} WHERE {key} = ?", (value,)).fetchone()
        if r is None:
            raise ValueError(f"refers to {table} {value!r}, which is neither in the file before it nor here")
        return int(r[0])


def _encode(row: dict[str, Any]) -> dict[str, Any]:
    return {k: json.dumps(v, sort_keys=True, allow_nan=False) if k in JSON_COLS and v is not None
            and not isinstance(v, str) else float(v) if k in REAL_COLUMNS and isinstance(v, int)
            and not isinstance(v, bool) else v for k, v in row.items()}


