"""Where a queue worker's finished jobs go besides Redis, wired the same way by `vlmcap serve` (its in-process
worker) and `vlmcap worker` (a worker captioning through another OpenAI-compatible server): the event store
(`EventKeeper`, opened from `MemorySettings` by `open_keeper`) and MQTT out (`start_mqtt`, from `MqttSettings`),
both behind one finish hook (`each`, `jobqueue.finish.FinishedJob`) and stopped after the worker (`stop_outputs`),
so that its last jobs are written and published.

An event's embedding comes from the `embed` function its keeper is given: the server's engine gives an event's
kept frames' embeddings from its own vision tower, most of them from the caption's own encoder run
(api/routes_events.py); a keeper without one stores events without a vector
(found by camera, time, kind, fall and words, not by likeness)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from jobqueue.contract import CaptionResult, Job
from memory.jobs import event_from_job
from memory.settings import MemorySettings, MqttSettings
from memory.store import Event, EventStore
from memory.writer import EventWriter

log = logging.getLogger("memory")

FinishHook = Callable[[Job, CaptionResult], None]  # as jobqueue.finish.FinishedJob
Embed = Callable[[list[bytes]], list[float] | None]  # an event's kept frames (the job's JPEGs) -> its vector, or None


class EventKeeper:
    """The event store and its writer thread: `on_finished` (the queue worker's finish hook) hands a finished job
    to the thread and returns at once; the thread makes its thumbnails (`MemorySettings.events_frames`, of
    `events_thumbnail_size` pixels), its vector (`embed`, when given) and writes the event."""

    def __init__(self, store: EventStore, settings: MemorySettings, embed: Embed | None = None) -> None:
        self.store = store
        self.settings = settings
        self.embed = embed
        self.writer = EventWriter(store, prepare=self._prepare)

    def on_finished(self, job: Job, result: CaptionResult) -> None:
        """The queue worker's finish hook: queue the job for writing (never waits)."""
        self.writer.submit((job, result))

    def _prepare(self, item: tuple[Job, CaptionResult]) -> Event | None:
        job, result = item
        return event_from_job(job, result, self.settings.events_frames, self.settings.events_thumbnail_size,
                              embed=self.embed)

    def close(self) -> None:
        """Write what is queued and close the store."""
        self.writer.close()


K = TypeVar("K", bound=EventKeeper)


def open_keeper(settings: MemorySettings, make: Callable[[EventStore], K] | None = None) -> K | EventKeeper | None:
    """The configured store opened and its keeper made (`make(store)`, else a keeper without embeddings); None
    when the store is off. A store that cannot be opened is logged and left off, so the worker still captions.
    It opens a database: call it off the event loop."""
    from memory import open_store

    try:
        store = open_store(settings)
    except Exception:
        log.exception("the event store %s could not be opened; events are not kept", settings.events_location)
        return None
    if store is None:
        return None
    log.info("event store: %r, %d event(s) kept", store, store.count())
    return make(store) if make is not None else EventKeeper(store, settings)


def start_mqtt(settings: MqttSettings) -> Any | None:
    """MQTT out started (a `memory.mqtt.MqttPublisher`: its `on_finished` is the finish hook) when `mqtt_url` is
    set, else None."""
    if not settings.mqtt_url:
        return None
    from memory.mqtt import MqttPublisher

    publisher = MqttPublisher(settings.mqtt_url, settings.mqtt_prefix, settings.mqtt_discovery_prefix or None)
    publisher.start()
    return publisher


def each(*hooks: FinishHook | None) -> FinishHook | None:
    """One finish hook calling each given one (each its own failure, logged: the others still run); None when
    none is given."""
    given = [hook for hook in hooks if hook is not None]
    if not given:
        return None

    def call_each(job: Job, result: CaptionResult) -> None:
        for hook in given:
            try:
                hook(job, result)
            except Exception:
                log.exception("job %s: a finish hook failed", getattr(job, "job_id", "?"))

    return call_each


def stop_outputs(keeper: EventKeeper | None, mqtt: Any | None, grace_s: float | None = None) -> None:
    """After the queue worker stopped: MQTT's last messages given `grace_s` to leave (None: the publisher's own
    default), the store's last events written and the store closed. It waits: call it off the event loop."""
    if mqtt is not None:
        mqtt.stop() if grace_s is None else mqtt.stop(grace_s)
    if keeper is not None:
        keeper.close()
