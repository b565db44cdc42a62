"""The run directory's tracking journal: every MLflow call a run makes, in order, in an SQLite file
(`tracking/journal.sqlite`, fsynced on every write) before it is sent.

An entry is `pending`, `attempted` (a send began: the server may hold it), `sent` or `rejected` (the server
answered 4xx: kept for the record, never retried). Files to upload are copied under `tracking/blobs/` when
journaled, so a later checkpoint prune or a replaced plot does not change what is sent. The journal outlives
the process: a resumed run sends what an earlier one could not (`outbox.Outbox`).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIR = "tracking"
FILE = "journal.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER,
    payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending'
);
CREATE INDEX IF NOT EXISTS entries_state ON entries (state, seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
UNSENT = ("pending", "attempted")


@dataclass(frozen=True)
class Entry:
    """One journaled call: `kind` is metrics, eval, tags, table, artifact or terminate."""

    seq: int
    run_id: str
    kind: str
    step: int | None
    payload: dict[str, Any]
    state: str


def _plain(value: Any) -> Any:
    """A numpy scalar or array as the Python value JSON can hold (tables carry them)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class Journal:
    """The journal of one run directory (thread-safe: the training thread appends, the outbox sends)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.dir / FILE, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an appended entry survives a crash of the machine
        self._db.executescript(_SCHEMA)

    def append(self, run_id: str, kind: str, payload: dict[str, Any], step: int | None = None) -> int:
        """Journal one call; returns its sequence number (the order it is sent in)."""
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO entries (run_id, kind, step, payload) VALUES (?, ?, ?, ?)",
                (run_id, kind, step, json.dumps(payload, default=_plain)),
            )
            return int(cur.lastrowid or 0)

    def keep_file(self, src: Path, name: str) -> str:
        """A copy of `src` (a file or a directory) under blobs/, made now; returns the copy's path."""
        dest = self.dir / "blobs" / uuid.uuid4().hex / name
        dest.parent.mkdir(parents=True)
        if src.is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copy2(src, dest)
        return str(dest)

    def unsent(self, limit: int = 64) -> list[Entry]:
        """The oldest entries not sent yet, in order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, run_id, kind, step, payload, state FROM entries "
                "WHERE state IN (?, ?) ORDER BY seq LIMIT ?",
                (*UNSENT, limit),
            ).fetchall()
        return [Entry(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in rows]

    def count_unsent(self) -> int:
        """How many entries are not in MLflow yet."""
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM entries WHERE state IN (?, ?)", UNSENT).fetchone()
        return int(n)

    def mark(self, entry: Entry, state: str) -> None:
        """Record an entry's new state (attempted, sent, rejected); a sent entry's file copy and table rows are
        removed (they are in MLflow: the journal stays small)."""
        with self._lock:
            self._db.execute("UPDATE entries SET state = ? WHERE seq = ?", (state, entry.seq))
            if state == "sent" and entry.kind == "table":
                self._db.execute("UPDATE entries SET payload = '{}' WHERE seq = ?", (entry.seq,))
        if (
            state in ("sent", "rejected")
            and "path" in entry.payload
            and (self.dir / "blobs") in Path(entry.payload["path"]).parents
        ):
            shutil.rmtree(Path(entry.payload["path"]).parent, ignore_errors=True)

    def last_step(self, run_id: str, kind: str = "metrics") -> int:
        """The newest step journaled for the run (0 if none)."""
        with self._lock:
            (n,) = self._db.execute(
                "SELECT COALESCE(MAX(step), 0) FROM entries WHERE run_id = ? AND kind = ?", (run_id, kind)
            ).fetchone()
        return int(n)

    def has_step(self, run_id: str, kind: str, step: int) -> bool:
        """Whether an entry of `kind` at `step` was journaled for the run."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM entries WHERE run_id = ? AND kind = ? AND step = ? LIMIT 1", (run_id, kind, step)
            ).fetchone()
        return row is not None

    def points(self, run_id: str, key: str) -> dict[int, float]:
        """(step -> value) of a metric as journaled (the first value per step), sent or not."""
        with self._lock:
            rows = self._db.execute(
                "SELECT payload FROM entries WHERE run_id = ? AND kind IN ('metrics', 'eval') ORDER BY seq", (run_id,)
            ).fetchall()
        seen: dict[int, float] = {}
        for (payload,) in rows:
            for k, value, _, step in json.loads(payload)["metrics"]:
                if k == key:
                    seen.setdefault(int(step), float(value))
        return seen

    def get(self, key: str) -> str | None:
        """A remembered value (e.g. the run's experiment id, whether the journal holds the run from its start)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, key: str, value: str) -> None:
        """Remember a value (see `get`)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def close(self) -> None:
        """Close the database (the file stays: it is the run's record of what was sent)."""
        with self._lock:
            self._db.close()
