"""The embedded event store: one SQLite file (WAL), full text by FTS5 (bm25-ranked over the caption and the
structured fields), vectors by sqlite-vec (`vec_distance_cosine` over the events the filters keep: exact, no
approximate index).

Python's own sqlite3 here cannot load extensions, so the store uses pysqlite3 (the same DB-API module, built with
extension loading and FTS5). Writes go through one connection under a lock, one transaction an event; reads use
one connection per thread and run beside writes (WAL). `synchronous=NORMAL`: a crash of the process loses no
committed event and leaves no corrupt file (a power cut may lose the last transactions)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pysqlite3 as sqlite3
import sqlite_vec

from memory.connections import Connections
from memory.sql import (
    COLUMNS,
    SELECTED,
    Retention,
    after,
    filters,
    full_event,
    log_trim,
    newest_first,
    page_from_rows,
    scored,
)
from memory.store import (
    Event,
    EventPage,
    EventQuery,
    check_vector,
    query_terms,
    search_fields,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,
  camera_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  start_ts REAL NOT NULL,
  end_ts REAL NOT NULL,
  finished_at REAL NOT NULL,
  caption TEXT NOT NULL,
  structured TEXT,
  fall INTEGER NOT NULL,
  track_id INTEGER,
  person_count INTEGER NOT NULL,
  owner TEXT,
  size INTEGER NOT NULL,
  frame_count INTEGER NOT NULL,
  embedding BLOB
);
CREATE INDEX IF NOT EXISTS events_start ON events (start_ts);
CREATE INDEX IF NOT EXISTS events_camera_start ON events (camera_id, start_ts);
CREATE INDEX IF NOT EXISTS events_finished ON events (finished_at);
CREATE INDEX IF NOT EXISTS events_fall_start ON events (fall, start_ts);
CREATE TABLE IF NOT EXISTS frames (
  seq INTEGER NOT NULL,
  idx INTEGER NOT NULL,
  ts REAL NOT NULL,
  jpeg BLOB NOT NULL,
  PRIMARY KEY (seq, idx)
) WITHOUT ROWID;
CREATE VIRTUAL TABLE IF NOT EXISTS events_text USING fts5(caption, fields, tokenize = 'unicode61');
CREATE TRIGGER IF NOT EXISTS events_gone AFTER DELETE ON events BEGIN
  DELETE FROM frames WHERE seq = old.seq;
  DELETE FROM events_text WHERE rowid = old.seq;
END;
"""


class SQLiteEventStore:
    """`EventStore` over one SQLite file (created with its directory when missing)."""

    def __init__(self, path: str | Path, retention: Retention | None = None) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.retention = retention or Retention()
        self._write_lock = threading.Lock()
        self._connections: Connections[sqlite3.Connection] = Connections(
            self._connect, f"the event store {self.path} is closed")
        self._writer = self._connections.keep(self._connect())
        self._writer.executescript(SCHEMA)

    # -- connections ---------------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False, isolation_level=None)
        conn.enable_load_extension(True)
        sqlite_vec.load(conn)
        conn.enable_load_extension(False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def _reader(self) -> sqlite3.Connection:
        return self._connections.mine()

    def close(self) -> None:
        self._connections.close()

    # -- writing --------------------------------------------------------------------------------------------
    def add(self, event: Event) -> bool:
        vector = None
        if event.embedding is not None:
            vector = sqlite_vec.serialize_float32(check_vector(event.embedding))
        structured = json.dumps(event.structured) if event.structured is not None else None
        fields = search_fields(event)
        with self._write_lock:
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                if conn.execute("SELECT 1 FROM events WHERE id = ?", (event.id,)).fetchone() is not None:
                    conn.execute("ROLLBACK")
                    return False
                cursor = conn.execute(
                    "INSERT INTO events (id, camera_id, kind, start_ts, end_ts, finished_at, caption, "
                    "structured, fall, track_id, person_count, owner, size, frame_count, embedding) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (event.id, event.camera_id, event.kind, event.start_ts, event.end_ts, event.finished_at,
                     event.caption, structured, int(event.fall), event.track_id, event.person_count, event.owner,
                     event.size_bytes, len(event.frames), vector))
                seq = cursor.lastrowid
                conn.executemany("INSERT INTO frames (seq, idx, ts, jpeg) VALUES (?, ?, ?, ?)",
                                 [(seq, i, f.ts, f.jpeg) for i, f in enumerate(event.frames)])
                conn.execute("INSERT INTO events_text (rowid, caption, fields) VALUES (?, ?, ?)",
                             (seq, event.caption, fields))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return True

    def trim(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._write_lock:
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                by_age = conn.execute("DELETE FROM events WHERE finished_at < ?",
                                      (now - self.retention.max_age_s,)).rowcount
                total = conn.execute("SELECT COALESCE(SUM(size), 0) FROM events").fetchone()[0]
                by_size = 0
                if total > self.retention.max_bytes:
                    excess, doomed = total - self.retention.max_bytes, []
                    for seq, size in conn.execute("SELECT seq, size FROM events ORDER BY finished_at, seq"):
                        if excess <= 0:
                            break
                        doomed.append((seq,))
                        excess -= size
                    conn.executemany("DELETE FROM events WHERE seq = ?", doomed)
                    by_size = len(doomed)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            if by_age or by_size:
                kept, kept_bytes = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM events").fetchone()
                log_trim(str(self.path), by_age, by_size, self.retention, kept, kept_bytes)
        return by_age + by_size

    # -- reading --------------------------------------------------------------------------------------------
    def count(self) -> int:
        return self._reader().execute("SELECT COUNT(*) FROM events").fetchone()[0]

    def size_bytes(self) -> int:
        """The events' counted size (what retention by size compares with `events_max_bytes`)."""
        return self._reader().execute("SELECT COALESCE(SUM(size), 0) FROM events").fetchone()[0]

    def get(self, event_id: str, owner: str | None = None) -> Event | None:
        conn = self._reader()
        row = conn.execute(f"SELECT {COLUMNS}, embedding FROM events WHERE id = ?", (event_id,)).fetchone()
        return full_event(conn, row, owner, "SELECT ts, jpeg FROM frames WHERE seq = ? ORDER BY idx",
                          lambda blob: list(memoryview(blob).cast("f")))

    def search(self, query: EventQuery) -> EventPage:
        where, params = filters(query, "?", lambda name: f"e.{name}")
        if query.q is None:
            sql, params = newest_first("events", where, params, query.position(), "?")
        else:
            match = " ".join(f'"{term}"' for term in query_terms(query.q))
            later, more = after(query.position(), "t.rank", "?")
            # The matches ranked first, once (materialized): the planner otherwise probes the index per row.
            sql = (f"WITH t AS MATERIALIZED (SELECT rowid, bm25(events_text, 1.0, 0.5) AS rank FROM events_text "
                   f"WHERE events_text MATCH ?) SELECT {SELECTED}, t.rank FROM t JOIN events e ON e.seq = t.rowid "
                   f"WHERE {where}{later} ORDER BY t.rank, e.id LIMIT ?")
            params = [match, *params, *more]
        rows = self._reader().execute(sql, [*params, query.limit + 1]).fetchall()
        return page_from_rows(rows, query)

    def similar(self, vector: list[float], query: EventQuery) -> list[tuple[Event, float]]:
        unit = sqlite_vec.serialize_float32(check_vector(vector))
        where, params = filters(query, "?")
        rows = self._reader().execute(
            f"SELECT {COLUMNS}, 1 - vec_distance_cosine(embedding, ?) AS score FROM events "
            f"WHERE embedding IS NOT NULL AND vec_length(embedding) = ? AND {where} "
            f"ORDER BY score DESC, id LIMIT ?", [unit, len(vector), *params, query.limit]).fetchall()
        return scored(rows)

    def __repr__(self) -> str:
        return f"SQLiteEventStore({os.fspath(self.path)!r})"
