"""The camera memory's contract: what an event is (`Event`, `EventFrame`), how it is asked for (`EventQuery`, a
page of results with an opaque cursor) and the interface every store has (`EventStore`). The SQLite store
(memory/sqlite.py) and the PostgreSQL store (memory/postgres.py) implement it; `memory.open_store` opens the
configured one.

Bad input raises ValueError naming the value (the HTTP routes turn it into a 400): a text query too long or with
too many words, a time range that ends before it starts, a cursor that was not made by this query."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

# The kinds of events (the job's kind, jobqueue's `Job.job_kind`): a first sighting, a track's event, a fall, a
# clip's caption.
EVENT_KINDS = ("sighting", "event", "fall", "video")
MAX_QUERY_CHARS = 500
MAX_QUERY_TERMS = 32
MAX_PAGE = 200
MAX_CAMERAS = 64
MAX_CURSOR_CHARS = 512
CAMERA_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


@dataclass
class EventFrame:
    """A thumbnail of an event: a JPEG, the time it was taken (seconds, as the job's frame times)."""

    jpeg: bytes
    ts: float


@dataclass
class Event:
    """One finished camera job, kept: a sighting, an event, a fall alert or a clip's caption.

    `id` is the job's id, so a job finished twice (a redelivery) is one event. `embedding` is the L2-normalised
    image embedding the similar-event search ranks by (None when none was computed). `owner` is the name of the
    API key the job came in under (None: the server's own cameras, seen by every key)."""

    id: str
    camera_id: str
    kind: str
    start_ts: float
    end_ts: float
    finished_at: float
    caption: str = ""
    structured: dict | None = None
    fall: bool = False
    track_id: int | None = None
    person_count: int = 0
    frames: list[EventFrame] = field(default_factory=list)
    embedding: list[float] | None = None
    owner: str | None = None
    frame_count: int = 0  # the frames kept, also when `frames` is left out (a search's events)

    def __post_init__(self) -> None:
        self.frame_count = self.frame_count or len(self.frames)
        if not self.id or len(self.id) > 128:
            raise ValueError(f"an event id is 1 to 128 characters, got {self.id!r}")
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(EVENT_KINDS)}, got {self.kind!r}")
        for name in ("start_ts", "end_ts", "finished_at"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.end_ts < self.start_ts:
            raise ValueError(f"end_ts {self.end_ts} is before start_ts {self.start_ts}")

    @property
    def size_bytes(self) -> int:
        """What the event costs the store, roughly: its frames, text and vector (retention by size counts it)."""
        text = len(self.caption.encode()) + len(json.dumps(self.structured or {}))
        return sum(len(f.jpeg) for f in self.frames) + text + 4 * len(self.embedding or ()) + 256

    def to_json(self, frames: bool = False) -> dict[str, Any]:
        """The event as the HTTP routes give it: without images and vector (`frame_count` says how many frames it
        has, each at `/v1/events/{id}/frames/{index}`)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("frames", "embedding", "owner")}
        out["frame_times"] = [f.ts for f in self.frames]
        out["has_embedding"] = self.embedding is not None
        if not frames:
            out.pop("frame_times")
        return out


@dataclass
class EventQuery:
    """What a search asks for; every filter is optional.

    cameras: only these cameras' events. since, until: events that overlap [since, until] (seconds since the
    epoch). kind: one of EVENT_KINDS. fall: only fall alerts (True) or none of them (False). q: words that must
    all occur in the caption or its structured fields (plain words: no query syntax; ranked by relevance).
    owner: the key asking (None: no filter; else its own events and the unowned ones). limit: events a page.
    cursor: the `next_cursor` of the previous page of the same query."""

    cameras: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None
    kind: str | None = None
    fall: bool | None = None
    q: str | None = None
    owner: str | None = None
    limit: int = 50
    cursor: str | None = None

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        if len(self.cameras) > MAX_CAMERAS:
            raise ValueError(f"at most {MAX_CAMERAS} cameras a query, got {len(self.cameras)}")
        for camera in self.cameras:
            if not CAMERA_ID.match(camera):
                raise ValueError(f"camera must be 1-128 letters, digits or _ . : @ -, got {camera!r}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 <= value < 1e11):
                raise ValueError(f"{name} must be seconds since the epoch, got {value!r}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ValueError(f"until {self.until} is before since {self.since}")
        if self.kind is not None and self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(EVENT_KINDS)}, got {self.kind!r}")
        if not 1 <= self.limit <= MAX_PAGE:
            raise ValueError(f"limit must be 1 to {MAX_PAGE}, got {self.limit}")
        if self.q is not None:
            if len(self.q) > MAX_QUERY_CHARS:
                raise ValueError(f"q is {len(self.q)} characters, over the limit of {MAX_QUERY_CHARS}")
            if len(query_terms(self.q)) > MAX_QUERY_TERMS:
                raise ValueError(f"q has {len(query_terms(self.q))} words, over the limit of {MAX_QUERY_TERMS}")
            if not query_terms(self.q):
                self.q = None
        if self.cursor is not None:
            self.position()  # refused now, not halfway through a search

    def fingerprint(self) -> str:
        """What a cursor is bound to: the filters, not the page."""
        filters = [self.cameras, self.since, self.until, self.kind, self.fall, self.q, self.owner]
        return hashlib.sha256(json.dumps(filters, default=list).encode()).hexdigest()[:16]

    def position(self) -> tuple[float, str] | None:
        """Where the cursor says the previous page ended: (its last sort key, its last event id)."""
        if self.cursor is None:
            return None
        return decode_cursor(self.cursor, self.fingerprint())


@dataclass
class EventPage:
    """A page of a search: the events (each with its frames' count, not their images) and the cursor of the next
    page (None on the last)."""

    events: list[Event]
    next_cursor: str | None = None
    scores: list[float] = field(default_factory=list)  # a text query's relevance of each event (higher first)


def query_terms(q: str) -> list[str]:
    """The words of a text query: runs of letters and digits (everything else separates them), so no character
    of the user's text reaches a full-text engine as syntax."""
    return re.findall(r"\w+", q)[: MAX_QUERY_TERMS + 1]


def encode_cursor(sort_key: float, event_id: str, fingerprint: str) -> str:
    payload = json.dumps([fingerprint, sort_key, event_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(payload).decode().rstrip("=")


def decode_cursor(cursor: str, fingerprint: str) -> tuple[float, str]:
    """The position a cursor holds; ValueError unless it is one this query made."""
    shown = cursor if len(cursor) <= 40 else cursor[:40] + "..."
    if len(cursor) > MAX_CURSOR_CHARS:
        raise ValueError(f"cursor is {len(cursor)} characters, over the limit of {MAX_CURSOR_CHARS}")
    try:
        found, sort_key, event_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        sort_key = float(sort_key)
    except (ValueError, TypeError):
        raise ValueError(f"cursor {shown!r} is not a cursor this server gave") from None
    if not isinstance(event_id, str) or not math.isfinite(sort_key):
        raise ValueError(f"cursor {shown!r} is not a cursor this server gave")
    if found != fingerprint:
        raise ValueError(f"cursor {shown!r} belongs to another query (its filters differ)")
    return sort_key, event_id


def structured_text(value: Any) -> str:
    """The words of a structured caption, keys and values, for the full-text index."""
    if isinstance(value, dict):
        return " ".join(f"{key} {structured_text(item)}" for key, item in value.items())
    if isinstance(value, list):
        return " ".join(structured_text(item) for item in value)
    return "" if value is None else str(value)


def search_fields(event: Event) -> str:
    """What the full-text index holds besides the caption: the camera, the kind, 'fall' for a fall alert and the
    structured caption's keys and values."""
    return " ".join((event.camera_id, event.kind, "fall" if event.fall else "", structured_text(event.structured)))


def check_vector(vector: list[float], dim: int | None = None) -> list[float]:
    """A finite, non-empty vector (of `dim` values when given), L2-normalised."""
    if not vector or (dim is not None and len(vector) != dim):
        raise ValueError(f"the vector has {len(vector)} values, the store's have {dim}")
    if not all(math.isfinite(v) for v in vector):
        raise ValueError("the vector has a value that is not a finite number")
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0:
        raise ValueError("the vector is all zeros")
    return [v / norm for v in vector]


def mean_unit(vectors: list[list[float]]) -> list[float]:
    """The L2-normalised mean of unit vectors (an event's vector from its frames'); ValueError when empty."""
    if not vectors:
        raise ValueError("no vectors to average")
    return check_vector([sum(column) / len(vectors) for column in zip(*vectors)])


@runtime_checkable
class EventStore(Protocol):
    """Where events are kept. Safe to call from several threads: writes are serialised by the store, reads run
    beside them. The server writes through an `EventWriter` (memory/writer.py), never from its event loop or
    the engine's step loop."""

    def add(self, event: Event) -> bool:
        """Keep `event`; False (and nothing written) when an event of that id is already kept."""
        ...

    def get(self, event_id: str, owner: str | None = None) -> Event | None:
        """The event with its frames and embedding, or None (also when `owner` may not see it)."""
        ...

    def search(self, query: EventQuery) -> EventPage:
        """A page of events: newest first, or by relevance with a text query (frames left out)."""
        ...

    def similar(self, vector: list[float], query: EventQuery) -> list[tuple[Event, float]]:
        """The events nearest `vector` by cosine similarity (highest first, at most `query.limit`) among those the
        query's filters let through (its text query and cursor are not used)."""
        ...

    def trim(self, now: float | None = None) -> int:
        """Drop events older than the retention age and the oldest beyond the size limit; how many went."""
        ...

    def count(self) -> int:
        ...

    def close(self) -> None:
        ...
