"""What the SQL stores share: an event query's filters as a WHERE clause, the retention rule, the trim log line."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from memory.store import Event, EventPage, EventQuery, encode_cursor

log = logging.getLogger("memory")

DAY_S = 86400.0
# The columns of an event row, in the order `event_from_row` reads them; a query adds its sort key after them.
COLUMNS = ("id, camera_id, kind, start_ts, end_ts, finished_at, caption, structured, fall, track_id, person_count, "
           "owner, seq, frame_count")


@dataclass(frozen=True)
class Retention:
    """How long and how much the store keeps (`MemorySettings.events_max_age_days`, `events_max_bytes`)."""

    max_age_s: float = 30 * DAY_S
    max_bytes: int = 2 * 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.max_age_s > 0 or self.max_bytes < 1:
            raise ValueError(f"retention needs a positive age and size, got {self.max_age_s!r} s, {self.max_bytes!r}")


def filters(query: EventQuery, mark: str, column: Callable[[str], str] = lambda name: name) -> tuple[str, list]:
    """The query's filters (cameras, time range, kind, fall, owner) as `cond AND cond ...` (`1=1` when none)
    with their parameters; `mark` is the driver's placeholder (`?`, `%s`)."""
    conds, params = ["1=1"], []
    if query.cameras:
        conds.append(f"{column('camera_id')} IN ({', '.join(mark for _ in query.cameras)})")
        params.extend(query.cameras)
    if query.since is not None:
        conds.append(f"{column('end_ts')} >= {mark}")
        params.append(query.since)
    if query.until is not None:
        conds.append(f"{column('start_ts')} <= {mark}")
        params.append(query.until)
    if query.kind is not None:
        conds.append(f"{column('kind')} = {mark}")
        params.append(query.kind)
    if query.fall is not None:
        conds.append(f"{column('fall')} = {mark}")
        params.append(bool(query.fall))
    if query.owner is not None:
        conds.append(f"({column('owner')} IS NULL OR {column('owner')} = {mark})")
        params.append(query.owner)
    return " AND ".join(conds), params


def log_trim(where: str, by_age: int, by_size: int, retention: Retention, kept: int, kept_bytes: int) -> None:
    log.info("event store %s: trimmed %d event(s): %d older than %g days, %d beyond the %d-byte limit; "
             "%d kept (%d bytes)", where, by_age + by_size, by_age, retention.max_age_s / DAY_S, by_size,
             retention.max_bytes, kept, kept_bytes)


def event_from_row(row: tuple) -> Event:
    """An event (without frames and vector) from a row of COLUMNS; `structured` as JSON text or as parsed."""
    structured = json.loads(row[7]) if isinstance(row[7], str) else row[7]
    return Event(id=row[0], camera_id=row[1], kind=row[2], start_ts=row[3], end_ts=row[4], finished_at=row[5],
                 caption=row[6], structured=structured, fall=bool(row[8]), track_id=row[9], person_count=row[10],
                 owner=row[11], frame_count=row[13])


def page_from_rows(rows: list[tuple], query: EventQuery) -> EventPage:
    """Rows of (COLUMNS..., sort key), at most `limit` + 1, as a page: `limit` events and the cursor after the last
    when there are more. A text query's sort key is its negated relevance (ascending), so its scores descend."""
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    events = [event_from_row(row) for row in rows]
    cursor = encode_cursor(float(rows[-1][14]), rows[-1][0], query.fingerprint()) if more and rows else None
    scores = [-float(row[14]) for row in rows] if query.q is not None else []
    return EventPage(events=events, next_cursor=cursor, scores=scores)
