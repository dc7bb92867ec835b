"""What the SQL stores share: an event query's filters as a WHERE clause, the retention rule, the trim log line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from memory.store import EventQuery

log = logging.getLogger("memory")

DAY_S = 86400.0


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
