"""A camera memory filled before its server starts: events with known captions, cameras, times and frames written
straight into the SQLite store a server then opens (`--data-dir`), so that what `POST /v1/cameras/ask` and the
MCP tools retrieve can be checked against what is there (the random-weight model's own captions mean nothing)."""

from __future__ import annotations

import io
import time
from pathlib import Path

from PIL import Image

from memory import Event, EventFrame, open_store_at
from memory.settings import EVENTS_FILE

NOW = time.time() - 3600  # an hour ago: inside the default windows


def jpeg(color: tuple[int, int, int], size: tuple[int, int] = (96, 72)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="JPEG")
    return out.getvalue()


def frames(start: float, count: int, shade: int) -> list[EventFrame]:
    return [EventFrame(jpeg((shade, 10 * i % 256, 255 - shade)), start + i) for i in range(count)]


def known_events() -> list[Event]:
    """Four events on two cameras, oldest first: a red coat at gate 1, a delivery van at gate 2, a fall in the
    warehouse (gate 2), a dog at gate 1."""
    return [
        Event(id="red-coat", camera_id="gate-1", kind="sighting", start_ts=NOW, end_ts=NOW, finished_at=NOW + 1,
              caption="a person in a red coat waits at the gate", track_id=1, person_count=1,
              frames=frames(NOW, 1, 200)),
        Event(id="van", camera_id="gate-2", kind="event", start_ts=NOW + 100, end_ts=NOW + 104,
              finished_at=NOW + 105, caption="a delivery van stops and a courier carries a parcel", track_id=2,
              person_count=1, frames=frames(NOW + 100, 4, 120)),
        Event(id="fall", camera_id="gate-2", kind="fall", start_ts=NOW + 200, end_ts=NOW + 203, finished_at=NOW + 204,
              caption="a worker slips and lies on the warehouse floor", fall=True, track_id=3, person_count=1,
              frames=frames(NOW + 200, 3, 60)),
        Event(id="dog", camera_id="gate-1", kind="sighting", start_ts=NOW + 300, end_ts=NOW + 300,
              finished_at=NOW + 301, caption="a dog runs past the gate", structured={"title": "dog", "people": 0},
              person_count=0, frames=frames(NOW + 300, 2, 30)),
    ]


def seed(data_dir: Path, events: list[Event]) -> Path:
    """The events written into the store a server with `data_dir` opens."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = open_store_at(str(data_dir / EVENTS_FILE))
    try:
        for event in events:
            assert store.add(event)
    finally:
        store.close()
    return data_dir


def assert_error(answer, status: int, param: str | None = None) -> dict:
    """An OpenAI error body with `status` (and the field at fault)."""
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
