"""What the SQL stores share: an event query's filters as a WHERE clause, its keyset pagination, the retention rule,
the trim log line."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memory.store import Event, EventFrame, EventPage, EventQuery, encode_cursor

log = logging.getLogger("memory")

DAY_S = 86400.0
# The columns of an event row, in the order `event_from_row` reads them; a query adds its sort key after them.
COLUMNS = ("id, camera_id, kind, start_ts, end_ts, finished_at, caption, structured, fall, track_id, person_count, "
           "owner, seq, frame_count")
SELECTED = ", ".join("e." + c.strip() for c in COLUMNS.split(","))  # the same, of the table aliased `e`


@dataclass(frozen=True)
class Retention:
    """How long and how much the store keeps (`MemorySettings.events_max_age_days`, `events_max_bytes`)."""

    max_age_s: float = 30 * DAY_S
    max_bytes: int = 2 * 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.max_age_s > 0 or self.max_bytes < 1:
            raise ValueError(f"retention needs a positive age and size, got {self.max_age_s!r} s, {self.max_bytes!r}")


def _as_is(value: Any) -> Any:
    return value


# The filters on one value each: (the query's field, the column, the condition on `{col}` with the placeholder `{mark}`,
# the parameter made of the field's value); in the order of the WHERE clause and its parameters.
VALUE_FILTERS: tuple[tuple[str, str, str, Callable[[Any], Any]], ...] = (
    ("since", "end_ts", "{col} >= {mark}", _as_is),
    ("until", "start_ts", "{col} <= {mark}", _as_is),
    ("kind", "kind", "{col} = {mark}", _as_is),
    ("fall", "fall", "{col} = {mark}", bool),
    ("owner", "owner", "({col} IS NULL OR {col} = {mark})", _as_is),
)


def filters(query: EventQuery, mark: str, column: Callable[[str], str] = lambda name: name) -> tuple[str, list]:
    """The query's filters (cameras, time range, kind, fall, owner) as `cond AND cond ...` (`1=1` when none)
    with their parameters; `mark` is the driver's placeholder (`?`, `%s`)."""
    conds, params = ["1=1"], []
    if query.cameras:
        conds.append(f"{column('camera_id')} IN ({', '.join(mark for _ in query.cameras)})")
        params.extend(query.cameras)
    for field, name, condition, convert in VALUE_FILTERS:
        value = getattr(query, field)
        if value is not None:
            conds.append(condition.format(col=column(name), mark=mark))
            params.append(convert(value))
    return " AND ".join(conds), params


def after(position: tuple[float, str] | None, key: str, mark: str, descending: bool = False,
          key_params: tuple = ()) -> tuple[str, list]:
    """Keyset pagination: the condition ` AND (...)` that keeps the rows after `position` (the previous page's last
    sort key and event id) in the order `key, e.id` (both descending when `descending`), and its parameters;
    nothing on the first page (`position` None). `key_params` are what `key` itself takes, once for each use."""
    if position is None:
        return "", []
    beyond = "<" if descending else ">"
    return (f" AND ({key} {beyond} {mark} OR ({key} = {mark} AND e.id {beyond} {mark}))",
            [*key_params, position[0], *key_params, position[0], position[1]])


def newest_first(table: str, where: str, params: list, position: tuple[float, str] | None,
                 mark: str) -> tuple[str, list]:
    """A search without words: the events of `table` (as `e`) that match `where` (with `params`), newest first
    (start time, then id, descending) from `position` on, with their start time as the sort key; the page's size
    is the last parameter, the caller's."""
    condition, more = after(position, "e.start_ts", mark, descending=True)
    return (f"SELECT {SELECTED}, e.start_ts FROM {table} e WHERE {where}{condition} "
            f"ORDER BY e.start_ts DESC, e.id DESC LIMIT {mark}", [*params, *more])


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


def full_event(conn: Any, row: tuple | None, owner: str | None, frames_sql: str,
               vector: Callable[[Any], list[float]]) -> Event | None:
    """The event of a row of (COLUMNS..., its vector as the store keeps it, which `vector` reads) with its frames,
    read on `conn` by `frames_sql` with the event's `seq`; None without a row or where the event is another
    owner's (`owner` None: anyone's)."""
    if row is None or (owner is not None and row[11] not in (None, owner)):
        return None
    event = event_from_row(row)
    event.frames = [EventFrame(jpeg=bytes(jpeg), ts=ts) for ts, jpeg in conn.execute(frames_sql, (row[12],))]
    if row[14] is not None:
        event.embedding = vector(row[14])
    return event


def scored(rows: list[tuple]) -> list[tuple[Event, float]]:
    """Rows of (COLUMNS..., score) as (event, score)."""
    return [(event_from_row(row), float(row[14])) for row in rows]


def page_from_rows(rows: list[tuple], query: EventQuery) -> EventPage:
    """Rows of (COLUMNS..., sort key), at most `limit` + 1, as a page: `limit` events and the cursor after the last
    when there are more. A text query's sort key is its negated relevance (ascending), so its scores descend."""
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    events = [event_from_row(row) for row in rows]
    cursor = encode_cursor(float(rows[-1][14]), rows[-1][0], query.fingerprint()) if more and rows else None
    scores = [-float(row[14]) for row in rows] if query.q is not None else []
    return EventPage(events=events, next_cursor=cursor, scores=scores)
