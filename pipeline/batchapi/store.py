"""The service's state in SQLite under `--data`: the files' metadata and the batches, with each
status change and its time. File contents live on disk beside it (files.py).

One database file in WAL mode with `synchronous=FULL`: a transaction that returned is on disk,
so a SIGKILL of the server at any moment leaves the last committed state, and the worker and the
request threads read and write it at once (each thread its own connection). Every status change
is a conditional update from the status the caller saw, so a cancel and the worker never
overwrite each other; the change and its event row are one transaction.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

DB_NAME = "batchgen.sqlite3"
# the statuses a batch is still worked on in (the worker takes the oldest), and the ones it ends in
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
# each status's timestamp field in OpenAI's batch object ("validating" is created_at)
STAMP = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
         "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at"}

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: the lists' order and cursor
    id TEXT NOT NULL UNIQUE,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,                 -- the uploaded name: data only, never a path
    purpose TEXT NOT NULL,
    path TEXT NOT NULL                      -- the content, relative to the data directory
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: the worker runs batches in it
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    model TEXT,
    status TEXT NOT NULL,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    usage TEXT
);
CREATE TABLE IF NOT EXISTS batch_events (
    batch_id TEXT NOT NULL,
    status TEXT NOT NULL,
    at REAL NOT NULL
);
"""


def new_id(prefix: str) -> str:
    """An unguessable id: 128 random bits from the operating system's generator."""
    return prefix + secrets.token_hex(16)


class Store:
    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, DB_NAME)
        self._local = threading.local()
        self._db().executescript(SCHEMA)  # (its own transaction: executescript commits first)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # a committed transaction survives a power loss too
            self._local.db = db
        return db

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction, taking the write lock at once (no upgrade deadlocks between threads)."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def read(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db().execute(sql, args).fetchall()]

    # files

    def add_file(self, file_id: str, size: int, filename: str, purpose: str, path: str,
                 created_at: int, db: sqlite3.Connection | None = None) -> dict[str, Any]:
        sql = "INSERT INTO files (id, bytes, created_at, filename, purpose, path) VALUES (?, ?, ?, ?, ?, ?)"
        args = (file_id, size, created_at, filename, purpose, path)
        if db is not None:
            db.execute(sql, args)
        else:
            with self.tx() as own:
                own.execute(sql, args)
        return {"id": file_id, "bytes": size, "created_at": created_at, "filename": filename, "purpose": purpose,
                "path": path}

    def file(self, file_id: str) -> dict[str, Any] | None:
        rows = self.read("SELECT * FROM files WHERE id = ?", (file_id,))
        return rows[0] if rows else None

    def files(self, purpose: str | None, limit: int, after: str | None, ascending: bool) -> tuple[list, bool]:
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        return self._page("files", where, args, limit, after, ascending)

    def delete_file(self, file_id: str) -> dict[str, Any] | None:
        with self.tx() as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
            if row is not None:
                db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return dict(row) if row is not None else None

    def file_paths(self) -> set[str]:
        return {r["path"] for r in self.read("SELECT path FROM files")}

    # batches

    def add_batch(self, batch_id: str, endpoint: str, input_file_id: str, window: str, metadata: Any,
                  created_at: int, expires_at: int) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, metadata, status, "
                       "created_at, expires_at) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?)",
                       (batch_id, endpoint, input_file_id, window, json.dumps(metadata), created_at, expires_at))
            db.execute("INSERT INTO batch_events VALUES (?, 'validating', ?)", (batch_id, time.time()))

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        rows = self.read("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return rows[0] if rows else None

    def batches(self, limit: int, after: str | None) -> tuple[list, bool]:
        return self._page("batches", [], [], limit, after, ascending=False)

    def next_open(self) -> dict[str, Any] | None:
        """The oldest batch still to be worked on."""
        marks = ", ".join("?" * len(OPEN))
        rows = self.read(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq LIMIT 1", OPEN)
        return rows[0] if rows else None

    def events(self, batch_id: str) -> list[dict[str, Any]]:
        return self.read("SELECT status, at FROM batch_events WHERE batch_id = ? ORDER BY rowid", (batch_id,))

    def move(self, batch_id: str, frm: tuple[str, ...], to: str, at: int, db: sqlite3.Connection | None = None,
             **fields: Any) -> bool:
        """Batch `batch_id` from one of the statuses `frm` to `to`, stamped `at`, with `fields`
        set; False (nothing changed) when it is no longer in one of `frm`."""
        if db is None:
            with self.tx() as own:
                return self.move(batch_id, frm, to, at, own, **fields)
        sets = {"status": to, **({STAMP[to]: at} if to in STAMP else {}), **fields}
        assignments = ", ".join(f"{k} = ?" for k in sets)
        marks = ", ".join("?" * len(frm))
        cur = db.execute(f"UPDATE batches SET {assignments} WHERE id = ? AND status IN ({marks})",
                         (*sets.values(), batch_id, *frm))
        if cur.rowcount:
            db.execute("INSERT INTO batch_events VALUES (?, ?, ?)", (batch_id, to, time.time()))
        return bool(cur.rowcount)

    def set_counts(self, batch_id: str, total: int, completed: int, failed: int) -> None:
        with self.tx() as db:
            db.execute("UPDATE batches SET total = ?, completed = ?, failed = ? WHERE id = ?",
                       (total, completed, failed, batch_id))

    def _page(self, table: str, where: list[str], args: list, limit: int, after: str | None,
              ascending: bool) -> tuple[list[dict[str, Any]], bool]:
        """Up to `limit` rows in creation order (newest first unless `ascending`) after the row
        `after`, and whether more follow. An unknown `after` is a KeyError."""
        if after is not None:
            found = self.read(f"SELECT seq FROM {table} WHERE id = ?", (after,))
            if not found:
                raise KeyError(after)
            where.append("seq > ?" if ascending else "seq < ?")
            args.append(found[0]["seq"])
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self.read(f"SELECT * FROM {table} {clause} ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?",
                         (*args, limit + 1))
        return rows[:limit], len(rows) > limit
