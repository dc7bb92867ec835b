"""The event store on a PostgreSQL server, for several servers sharing one memory: the same `EventStore` as the
SQLite file. Full text is PostgreSQL's own (a generated `tsvector` over the caption, weight A, and the structured
fields, weight B, with the `simple` configuration; a GIN index; `ts_rank_cd`); the user's words become a
`tsquery` of quoted lexemes, never query syntax.

Vectors: where the server has pgvector (`CREATE EXTENSION IF NOT EXISTS vector` succeeds) the `embedding` column
is pgvector's `vector` (a `real[]` column of an older store is converted once, at start) and each vector size
gets a partial HNSW index on cosine distance (`(embedding::vector(n)) vector_cosine_ops WHERE vector_dims(embedding)
= n`, made when the first vector of that size is written; pgvector indexes at most 2,000 values, so a larger
model's vectors are scanned exactly). Similar events come from the index with pgvector 0.8's iterative scan in
strict order (a filter that leaves few events does not cut the page short) and an `ef_search` of at least twice
the page; a page that still comes back short is asked again without the index (exact). Where the server has no
pgvector (Debian's postgresql-15 has none) vectors stay `real[]` and are ranked by their dot product in SQL (the
vectors are unit length): exact, a scan of what the filters keep.

Tables are created when missing (`vlmcap_events`, `vlmcap_event_frames`); writes are one transaction an event;
each thread has its own connection."""

from __future__ import annotations

import logging
import time

import psycopg

from memory.connections import Connections
from memory.sql import SELECTED, Retention, after, filters, full_event, log_trim, newest_first, page_from_rows, scored
from memory.store import Event, EventPage, EventQuery, check_vector, query_terms, search_fields

SCHEMA = """
CREATE TABLE IF NOT EXISTS vlmcap_events (
  seq BIGSERIAL PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,
  camera_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  start_ts DOUBLE PRECISION NOT NULL,
  end_ts DOUBLE PRECISION NOT NULL,
  finished_at DOUBLE PRECISION NOT NULL,
  caption TEXT NOT NULL,
  structured JSONB,
  fall BOOLEAN NOT NULL,
  track_id BIGINT,
  person_count INTEGER NOT NULL,
  owner TEXT,
  size BIGINT NOT NULL,
  frame_count INTEGER NOT NULL,
  fields TEXT NOT NULL,
  embedding REAL[],
  search TSVECTOR GENERATED ALWAYS AS (
    setweight(to_tsvector('simple', caption), 'A') || setweight(to_tsvector('simple', fields), 'B')) STORED
);
CREATE INDEX IF NOT EXISTS vlmcap_events_search ON vlmcap_events USING GIN (search);
CREATE INDEX IF NOT EXISTS vlmcap_events_start ON vlmcap_events (start_ts);
CREATE INDEX IF NOT EXISTS vlmcap_events_camera_start ON vlmcap_events (camera_id, start_ts);
CREATE INDEX IF NOT EXISTS vlmcap_events_finished ON vlmcap_events (finished_at);
CREATE TABLE IF NOT EXISTS vlmcap_event_frames (
  seq BIGINT NOT NULL REFERENCES vlmcap_events (seq) ON DELETE CASCADE,
  idx INTEGER NOT NULL,
  ts DOUBLE PRECISION NOT NULL,
  jpeg BYTEA NOT NULL,
  PRIMARY KEY (seq, idx)
);
"""
SCHEMA_LOCK = 7_202_612  # an advisory lock: servers starting together create the tables once
HNSW_MAX_DIM = 2000  # pgvector's HNSW index takes vectors of at most 2,000 values
MIN_EF_SEARCH = 64  # candidates an HNSW search keeps (pgvector's default is 40); at least twice the page
# pgvector's errors where the server has no `vector` extension or this user may not create it.
NO_PGVECTOR = (psycopg.errors.FeatureNotSupported, psycopg.errors.UndefinedFile, psycopg.errors.InsufficientPrivilege)

log = logging.getLogger("memory")


class PostgresEventStore:
    """`EventStore` on the PostgreSQL server at `url` (postgresql://user:password@host:port/database)."""

    def __init__(self, url: str, retention: Retention | None = None, pgvector: bool = True) -> None:
        """`pgvector` False keeps vectors `real[]` even where the server has pgvector (a store already converted
        stays `vector`)."""
        self.url = url
        self.retention = retention or Retention()
        self._connections: Connections[psycopg.Connection] = Connections(
            lambda: psycopg.connect(self.url, autocommit=True, connect_timeout=10), "the event store is closed",
            usable=lambda conn: not conn.closed)
        self._indexed: set[int] = set()  # vector sizes whose HNSW index this store has made sure of
        conn = self._conn()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            conn.execute(SCHEMA)
            version = _vector_extension(conn) if pgvector else None
            if version is not None and self._embedding_type(conn) == "real[]":
                conn.execute("ALTER TABLE vlmcap_events ALTER COLUMN embedding TYPE vector USING embedding::vector")
            self.pgvector = self._embedding_type(conn) == "vector"  # similar events by pgvector's index
            if self.pgvector and version is None:
                version = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()[0]
        # pgvector 0.8 resumes an index scan that a filter left short (hnsw.iterative_scan)
        self._iterative = self.pgvector and tuple(int(p) for p in version.split(".")[:2]) >= (0, 8)
        self._embedding = "e.embedding::real[]" if self.pgvector else "e.embedding"

    @staticmethod
    def _embedding_type(conn: psycopg.Connection) -> str:
        return conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
                            "'vlmcap_events'::regclass AND attname = 'embedding'").fetchone()[0]

    def _index_vectors(self, dim: int) -> None:
        """The HNSW index of vectors of `dim` values, made when missing (under the schema lock: servers writing
        their first vectors together make it once)."""
        if dim in self._indexed or dim > HNSW_MAX_DIM:
            return
        conn = self._conn()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            conn.execute(f"CREATE INDEX IF NOT EXISTS vlmcap_events_embedding_{dim} ON vlmcap_events USING hnsw "
                         f"((embedding::vector({dim})) vector_cosine_ops) WHERE vector_dims(embedding) = {dim}")
        self._indexed.add(dim)

    def _conn(self) -> psycopg.Connection:
        return self._connections.mine()

    def close(self) -> None:
        self._connections.close()

    def add(self, event: Event) -> bool:
        vector = check_vector(event.embedding) if event.embedding is not None else None
        fields = search_fields(event)
        if vector is not None and self.pgvector:
            self._index_vectors(len(vector))
        conn = self._conn()
        with conn.transaction():
            row = conn.execute(
                "INSERT INTO vlmcap_events (id, camera_id, kind, start_ts, end_ts, finished_at, caption, structured, "
                "fall, track_id, person_count, owner, size, frame_count, fields, embedding) VALUES "
                "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::real[]) ON CONFLICT (id) DO NOTHING "
                "RETURNING seq",
                (event.id, event.camera_id, event.kind, event.start_ts, event.end_ts, event.finished_at,
                 event.caption, psycopg.types.json.Jsonb(event.structured) if event.structured is not None else None,
                 event.fall, event.track_id, event.person_count, event.owner, event.size_bytes, len(event.frames),
                 fields, vector)).fetchone()
            if row is None:
                return False
            with conn.cursor() as cursor:
                cursor.executemany("INSERT INTO vlmcap_event_frames (seq, idx, ts, jpeg) VALUES (%s, %s, %s, %s)",
                                   [(row[0], i, f.ts, f.jpeg) for i, f in enumerate(event.frames)])
        return True

    def trim(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        conn = self._conn()
        with conn.transaction():
            conn.execute("LOCK TABLE vlmcap_events IN SHARE ROW EXCLUSIVE MODE")  # one trim at a time
            by_age = conn.execute("DELETE FROM vlmcap_events WHERE finished_at < %s",
                                  (now - self.retention.max_age_s,)).rowcount
            by_size = conn.execute(
                "DELETE FROM vlmcap_events WHERE seq IN (SELECT seq FROM (SELECT seq, SUM(size) OVER "
                "(ORDER BY finished_at DESC, seq DESC) AS newer FROM vlmcap_events) t WHERE newer > %s)",
                (self.retention.max_bytes,)).rowcount
        if by_age or by_size:
            kept, kept_bytes = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM vlmcap_events").fetchone()
            log_trim(self.url.rsplit("@", 1)[-1], by_age, by_size, self.retention, kept, int(kept_bytes))
        return by_age + by_size

    def count(self) -> int:
        return self._conn().execute("SELECT COUNT(*) FROM vlmcap_events").fetchone()[0]

    def size_bytes(self) -> int:
        return int(self._conn().execute("SELECT COALESCE(SUM(size), 0) FROM vlmcap_events").fetchone()[0])

    def get(self, event_id: str, owner: str | None = None) -> Event | None:
        conn = self._conn()
        row = conn.execute(f"SELECT {SELECTED}, {self._embedding} FROM vlmcap_events e WHERE e.id = %s",
                           (event_id,)).fetchone()
        return full_event(conn, row, owner, "SELECT ts, jpeg FROM vlmcap_event_frames WHERE seq = %s ORDER BY idx",
                          list)

    def search(self, query: EventQuery) -> EventPage:
        where, params = filters(query, "%s", lambda name: f"e.{name}")
        if query.q is None:
            sql, params = newest_first("vlmcap_events", where, params, query.position(), "%s")
        else:
            # Each word a quoted lexeme: to_tsquery sees no operator of the user's.
            terms = " & ".join("'" + term.replace("'", "''") + "'" for term in query_terms(query.q))
            rank = "(-ts_rank_cd(e.search, to_tsquery('simple', %s))::float8)"
            later, more = after(query.position(), rank, "%s", key_params=(terms,))
            sql = (f"SELECT {SELECTED}, {rank} AS sort_key FROM vlmcap_events e "
                   f"WHERE e.search @@ to_tsquery('simple', %s) AND {where}{later} ORDER BY sort_key, e.id LIMIT %s")
            params = [terms, terms, *params, *more]
        rows = self._conn().execute(sql, [*params, query.limit + 1]).fetchall()
        return page_from_rows(rows, query)

    def similar(self, vector: list[float], query: EventQuery) -> list[tuple[Event, float]]:
        unit = check_vector(vector)
        sql, params = self.similar_sql(unit, query)
        conn = self._conn()
        if not self.pgvector:
            rows = conn.execute(sql, params).fetchall()
        else:
            with conn.transaction():
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)",
                             (str(min(1000, max(MIN_EF_SEARCH, 2 * query.limit))),))
                if self._iterative:
                    conn.execute("SELECT set_config('hnsw.iterative_scan', 'strict_order', true)")
                rows = conn.execute(sql, params).fetchall()
                if len(rows) < query.limit:  # the index may have stopped early: the exact answer
                    # planned afresh: psycopg prepares a statement run often, and a prepared statement's cached
                    # plan, the index scan, would ignore enable_indexscan and give the same short answer again
                    conn.execute("SELECT set_config('enable_indexscan', 'off', true)")
                    rows = conn.execute(sql, params, prepare=False).fetchall()
        return scored(rows)

    def similar_sql(self, unit: list[float], query: EventQuery) -> tuple[str, list]:
        """The similar-events query for the unit vector `unit` and its parameters: pgvector's cosine distance in
        the form its partial HNSW index serves, or the dot product over `real[]`."""
        where, params = filters(query, "%s", lambda name: f"e.{name}")
        if self.pgvector:
            dim = len(unit)  # an integer in the SQL: the partial index's predicate and cast must match it as written
            distance = f"(e.embedding::vector({dim}) <=> %s::real[]::vector({dim}))"
            return (f"SELECT {SELECTED}, (1 - {distance})::float8 AS score FROM vlmcap_events e "
                    f"WHERE e.embedding IS NOT NULL AND vector_dims(e.embedding) = {dim} AND {where} "
                    f"ORDER BY {distance}, e.id LIMIT %s", [unit, *params, unit, query.limit])
        return (f"SELECT {SELECTED}, (SELECT SUM(a * b) FROM unnest(e.embedding, %s::real[]) AS v(a, b))::float8 "
                f"AS score FROM vlmcap_events e WHERE e.embedding IS NOT NULL AND cardinality(e.embedding) = %s "
                f"AND {where} ORDER BY score DESC, e.id LIMIT %s", [unit, len(unit), *params, query.limit])

    def __repr__(self) -> str:
        return f"PostgresEventStore({self.url.rsplit('@', 1)[-1]!r})"


def _vector_extension(conn: psycopg.Connection) -> str | None:
    """pgvector's version once `CREATE EXTENSION IF NOT EXISTS vector` has run, or None where the server has no
    pgvector or this user may not create it (logged once; the transaction goes on)."""
    try:
        with conn.transaction():  # a savepoint
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    except NO_PGVECTOR as error:
        log.info("event store: no pgvector on this PostgreSQL server (%s); similar events scan real[] vectors",
                 str(error).strip().splitlines()[0])
        return None
    return conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()[0]
