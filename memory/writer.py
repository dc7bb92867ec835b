"""The store's writer thread: the server hands it finished jobs and goes on at once; the thread turns each into an
event (thumbnails, embedding: `prepare`), writes it, and trims the store now and then. Neither the event loop nor
the engine's step loop ever waits on the database.

The queue is bounded (`max_pending`): when the store falls that far behind, a new item is dropped and counted
(`dropped`), with a warning, rather than letting memory grow."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jobqueue.checks import positive_count
from memory.store import Event, EventStore

log = logging.getLogger("memory")

_STOP = object()


class EventWriter:
    """Writes events into `store` from its own thread. `prepare(item)` turns what `submit` was given into an
    `Event` (None: nothing to keep); without it, items are events."""

    def __init__(self, store: EventStore, prepare: Callable[[Any], Event | None] | None = None,
                 max_pending: int = 1000, trim_every_s: float = 600.0) -> None:
        positive_count("max_pending", max_pending)
        self.store = store
        self.prepare = prepare
        self.trim_every_s = trim_every_s
        self.written = 0
        self.duplicates = 0
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="vlmcap-event-writer", daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> bool:
        """Queue `item` for writing; False (counted in `dropped`) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.dropped += 1
            log.warning("event store: %d item(s) waiting; dropped one (%d dropped so far)",
                        self._queue.qsize(), self.dropped)
            return False

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is written (True) or `timeout` passed (False)."""
        done = threading.Event()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._queue.put(done, timeout=0.1)
                break
            except queue.Full:
                continue
        return done.wait(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, stop the thread and close the store."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        self.store.close()

    def _run(self) -> None:
        next_trim = time.monotonic()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                event = self.prepare(item) if self.prepare is not None else item
                if event is not None:
                    if self.store.add(event):
                        self.written += 1
                    else:
                        self.duplicates += 1
                if time.monotonic() >= next_trim:
                    next_trim = time.monotonic() + self.trim_every_s
                    self.store.trim()
            except Exception:
                self.failed += 1
                log.exception("event store: writing an event failed (%d failed so far)", self.failed)
