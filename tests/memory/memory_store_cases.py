"""The cases every event store passes (SQLite and PostgreSQL run the same ones): the store is handed in by each
test file's `store` fixture (a factory: `store()` opens it, again after a close for a restart)."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memory import Event, EventFrame, EventQuery, Retention

NOW = float(int(time.time()) - 3600)  # recent: within the default retention


def unit(*values: float) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def make_event(index: int, **fields) -> Event:
    values = dict(id=f"job-{index}", camera_id=f"cam-{index % 3}", kind="event", start_ts=NOW + index * 10,
                  end_ts=NOW + index * 10 + 5, finished_at=NOW + index * 10 + 6,
                  caption=f"person {index} walks past the gate", frames=[EventFrame(b"\xff\xd8jpeg%d" % index,
                                                                                       NOW + index * 10)],
                  embedding=unit(1.0, index, 0.5))
    values.update(fields)
    return Event(**values)


def case_add_get_and_restart(open_store):
    store = open_store()
    event = make_event(1, structured={"clothing": "red coat", "threat": 0}, track_id=7, person_count=2,
                       frames=[EventFrame(b"a", NOW + 1), EventFrame(b"b", NOW + 2)])
    assert store.add(event)
    store.close()
    store = open_store()  # a restart keeps it
    got = store.get("job-1")
    assert got is not None
    assert (got.camera_id, got.kind, got.track_id, got.person_count) == ("cam-1", "event", 7, 2)
    assert got.structured == {"clothing": "red coat", "threat": 0}
    assert [(f.jpeg, f.ts) for f in got.frames] == [(b"a", NOW + 1), (b"b", NOW + 2)]
    assert got.embedding == pytest.approx(unit(1.0, 1, 0.5), abs=1e-6)
    assert store.get("job-404") is None
    store.close()


def case_same_job_twice_is_one_event(open_store):
    store = open_store()
    assert store.add(make_event(1))
    assert not store.add(make_event(1, caption="another caption"))
    assert store.count() == 1
    assert store.get("job-1").caption == "person 1 walks past the gate"
    store.close()


def case_filters(open_store):
    store = open_store()
    for i in range(9):
        store.add(make_event(i, fall=(i == 4), kind="fall" if i == 4 else "event"))
    page = store.search(EventQuery(fall=True))
    assert [e.id for e in page.events] == ["job-4"]
    assert [e.id for e in store.search(EventQuery(kind="fall")).events] == ["job-4"]
    assert {e.id for e in store.search(EventQuery(cameras=("cam-0",))).events} == {"job-0", "job-3", "job-6"}
    # events overlapping [since, until]: job-2 ends at +25, job-3 starts at +30
    window = store.search(EventQuery(since=NOW + 25, until=NOW + 30))
    assert [e.id for e in window.events] == ["job-3", "job-2"]
    assert store.search(EventQuery()).events[0].id == "job-8"  # newest first
    assert store.search(EventQuery()).events[0].frame_count == 1
    store.close()


def case_text_search_ranked_and_safe(open_store):
    store = open_store()
    store.add(make_event(1, caption="a man in a red coat at gate 3"))
    store.add(make_event(2, caption="a woman with a dog"))
    store.add(make_event(3, caption="red car", structured={"clothing": "red coat", "colour": "red"}))
    store.add(make_event(4, caption="coat coat coat red red red coat"))
    found = store.search(EventQuery(q="red coat"))
    assert {e.id for e in found.events} == {"job-1", "job-3", "job-4"}
    assert found.events[0].id == "job-4"  # the most mentions rank first
    assert found.scores == sorted(found.scores, reverse=True)
    assert [e.id for e in store.search(EventQuery(q="DOG")).events] == ["job-2"]
    assert [e.id for e in store.search(EventQuery(q="colour")).events] == ["job-3"]  # a structured field
    # full-text syntax in the user's words is words, never syntax
    for hostile in ['"', 'red OR', 'NEAR(red coat)', 'caption:red', '* ) (', "red' --", "^coat", "a\x00b", "🙂"]:
        store.search(EventQuery(q=hostile))
    assert store.search(EventQuery(q="!!!")).events  # no words: no text filter
    assert [e.id for e in store.search(EventQuery(q="caption:dog")).events] == []  # 'caption' is a word, not a column
    store.close()


def case_pages(open_store):
    store = open_store()
    for i in range(25):
        store.add(make_event(i, caption="person walks" + " walks" * (i % 4)))
    for query in (EventQuery(limit=10), EventQuery(limit=7, q="walks"), EventQuery(limit=4, cameras=("cam-1",))):
        seen, cursor = [], None
        while True:
            page = store.search(EventQuery(**{**query.__dict__, "cursor": cursor}))
            seen += [e.id for e in page.events]
            cursor = page.next_cursor
            if cursor is None:
                break
        total = store.search(EventQuery(**{**query.__dict__, "limit": 200})).events
        assert seen == [e.id for e in total]
    first = store.search(EventQuery(limit=5))
    with pytest.raises(ValueError, match="another query"):
        EventQuery(limit=5, kind="fall", cursor=first.next_cursor)
    for bad in ("nonsense", "x" * 600, "WzEsMl0", "eyJhIjoxfQ"):
        with pytest.raises(ValueError, match="cursor"):
            EventQuery(cursor=bad)
    store.close()


def case_similar(open_store):
    store = open_store()
    store.add(make_event(1, embedding=unit(1, 0, 0)))
    store.add(make_event(2, embedding=unit(0.9, 0.1, 0)))
    store.add(make_event(3, embedding=unit(0, 1, 0)))
    store.add(make_event(4, embedding=None))
    found = store.similar(unit(1, 0, 0), EventQuery(limit=3))
    assert [e.id for e, _ in found] == ["job-1", "job-2", "job-3"]
    assert found[0][1] == pytest.approx(1.0, abs=1e-5)
    assert [e.id for e, _ in store.similar(unit(1, 0, 0), EventQuery(cameras=("cam-0",)))] == ["job-3"]
    assert store.similar(unit(1, 0, 0, 0), EventQuery()) == []  # another model's vectors match none
    with pytest.raises(ValueError):
        store.similar([0.0, 0.0, 0.0], EventQuery())
    store.close()


def case_owner(open_store):
    store = open_store()
    store.add(make_event(1))  # the server's own camera
    store.add(make_event(2, owner="ward-a"))
    store.add(make_event(3, owner="ward-b"))
    assert {e.id for e in store.search(EventQuery(owner="ward-a")).events} == {"job-1", "job-2"}
    assert {e.id for e in store.search(EventQuery()).events} == {"job-1", "job-2", "job-3"}
    assert store.get("job-3", owner="ward-a") is None
    assert store.get("job-3", owner="ward-b") is not None
    assert {e.id for e, _ in store.similar(unit(1, 2, 0.5), EventQuery(owner="ward-b"))} == {"job-1", "job-3"}
    store.close()


def case_retention(open_store, caplog):
    store = open_store(Retention(max_age_s=100.0, max_bytes=10_000))
    for i in range(10):
        store.add(make_event(i, frames=[EventFrame(b"x" * 1500, NOW + i * 10)]))
    with caplog.at_level(logging.INFO, logger="memory"):
        trimmed = store.trim(now=NOW + 60 + 100)  # events finished before +60 are too old
    assert trimmed >= 6
    kept = {e.id for e in store.search(EventQuery()).events}
    assert "job-0" not in kept and "job-9" in kept
    assert store.size_bytes() <= 10_000
    assert store.get("job-0") is None
    assert "trimmed" in caplog.text and "older than" in caplog.text
    store.add(make_event(0))  # its id is free again
    store.close()


WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
import memory_store_cases as cases
from memory import open_store_at
store = open_store_at(sys.argv[1])
for index in range(100000):
    store.add(cases.make_event(index, frames=[cases.EventFrame(b"x" * 20000, cases.NOW)]))
    print(f"job-{index}", flush=True)
"""


def kill_a_writer_mid_write(location: str, events: int = 200) -> list[str]:
    """A process writing events into the store at `location` killed (SIGKILL) while it writes, once `events` of
    its adds have returned: their ids."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, location, str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    committed = [writer.stdout.readline().strip() for _ in range(events)]
    writer.kill()
    writer.wait(30)
    assert all(committed) and committed[-1] == f"job-{events - 1}"
    return committed


CASES = [case_add_get_and_restart, case_same_job_twice_is_one_event, case_filters, case_text_search_ranked_and_safe,
         case_pages, case_similar, case_owner]
