"""The embedded event store on a real SQLite file (FTS5, sqlite-vec), every case of memory_store_cases."""

from __future__ import annotations

import memory_store_cases as store_cases
import pytest

from memory import Event, EventQuery, EventWriter, open_store, open_store_at
from memory.settings import MemorySettings


@pytest.fixture
def opener(tmp_path):
    return lambda retention=None: open_store_at(str(tmp_path / "data" / "events.db"), retention)


@pytest.mark.parametrize("case", store_cases.CASES, ids=lambda case: case.__name__)
def test_store_case(case, opener):
    case(opener)


def test_retention(opener, caplog):
    store_cases.case_retention(opener, caplog)


def test_the_file_is_under_the_data_dir_in_wal_mode(tmp_path):
    settings = MemorySettings(data_dir=str(tmp_path / "vlmcap"))
    store = open_store(settings)
    store.add(store_cases.make_event(1))
    assert (tmp_path / "vlmcap" / "events.db").exists()
    assert store._reader().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()
    assert open_store(MemorySettings(events_store="off")) is None


def test_the_writer_thread_writes_each_job_once(opener):
    store = opener()
    writer = EventWriter(store, prepare=lambda index: store_cases.make_event(index) if index >= 0 else None)
    for index in (1, 2, 1, -1, 3):
        assert writer.submit(index)
    assert writer.flush()
    assert (writer.written, writer.duplicates, store.count()) == (3, 1, 3)
    writer.close()
    assert opener().count() == 3


def test_a_full_writer_queue_drops_instead_of_blocking(opener):
    import threading

    gate = threading.Event()
    writer = EventWriter(opener(), prepare=lambda item: gate.wait(30) and None, max_pending=2)
    results = [writer.submit(i) for i in range(6)]  # the thread holds one, the queue two
    assert results.count(False) >= 3 and writer.dropped == results.count(False)
    gate.set()
    writer.close()


def test_bad_events_and_queries_name_the_value():
    with pytest.raises(ValueError, match="kind"):
        store_cases.make_event(1, kind="party")
    with pytest.raises(ValueError, match="before start_ts"):
        store_cases.make_event(1, end_ts=0.0)
    with pytest.raises(ValueError, match="before since"):
        EventQuery(since=100.0, until=50.0)
    with pytest.raises(ValueError, match="limit"):
        EventQuery(limit=0)
    with pytest.raises(ValueError, match="characters"):
        EventQuery(q="a" * 501)
    with pytest.raises(ValueError, match="words"):
        EventQuery(q=" ".join(["w"] * 40))
    with pytest.raises(ValueError, match="camera"):
        EventQuery(cameras=("../etc",))
    with pytest.raises(ValueError, match="since"):
        EventQuery(since=float("nan"))
    assert isinstance(store_cases.make_event(1), Event)


def test_a_crash_mid_write_loses_no_committed_event(tmp_path):
    """A writer killed (SIGKILL) while it writes: the file opens, passes SQLite's integrity check and holds every
    event whose add had returned."""
    path = tmp_path / "events.db"
    committed = store_cases.kill_a_writer_mid_write(str(path))
    store = open_store_at(str(path))
    assert store._reader().execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert store.count() >= 200
    assert all(store.get(job) is not None for job in committed)
    store.close()
