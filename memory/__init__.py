"""The camera memory: every finished camera job kept as an event, searched by camera, time, kind, fall and words
of its caption, and found by likeness of its frames (an image embedding from the engine's own vision tower).

Open the configured store with `open_store(settings)` (a `MemorySettings`, e.g. the server's `ServerSettings`,
which inherits it): the SQLite file under the data directory by default, a PostgreSQL server for a
`postgresql://` URL, None when `--events-store off`. Or name the location yourself:
`open_store_at("/var/lib/vlmcap/events.db")`. Every store has the `EventStore` interface (memory/store.py):
`add`, `get`, `search`, `similar`, `trim`, `count`, `close`. Write from a server through an `EventWriter`
(memory/writer.py): its thread does the writing, so no event loop or step loop waits on the database.

This package imports neither the engine, the server, the queue, the command line nor the camera side."""

from __future__ import annotations

from memory.settings import MemorySettings
from memory.sql import DAY_S, Retention
from memory.store import EVENT_KINDS, Event, EventFrame, EventPage, EventQuery, EventStore
from memory.writer import EventWriter

__all__ = ["EVENT_KINDS", "Event", "EventFrame", "EventPage", "EventQuery", "EventStore", "EventWriter",
           "MemorySettings", "Retention", "open_store", "open_store_at"]


def open_store_at(location: str, retention: Retention | None = None) -> EventStore:
    """The store at `location`: a postgresql:// (or postgres://) URL, else a SQLite file's path."""
    if location.startswith(("postgresql://", "postgres://")):
        from memory.postgres import PostgresEventStore

        return PostgresEventStore(location, retention)
    from memory.sqlite import SQLiteEventStore

    return SQLiteEventStore(location, retention)


def open_store(settings: MemorySettings) -> EventStore | None:
    """The store the settings name, with their retention; None when the store is off."""
    location = settings.events_location
    if location is None:
        return None
    retention = Retention(max_age_s=settings.events_max_age_days * DAY_S, max_bytes=settings.events_max_bytes)
    return open_store_at(location, retention)
