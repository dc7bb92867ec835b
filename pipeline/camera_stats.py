"""A camera's counters, published to Redis every few seconds from a thread of their own, so that viewers
(the server's dashboard) can show every camera's frame rates; a slow or absent Redis never blocks capture.

Each publication writes `camera_stats_key(camera_id)` (a `CameraStats` hash that expires after
`CAMERA_STATS_TTL_SECONDS` unless refreshed), scores the camera in `CAMERAS_INDEX` with the time and drops
from the index the cameras that have not published within the TTL (so readers only read)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from jobqueue.connection import connect_sync
from jobqueue.contract import (
    CAMERA_RATE_COUNTERS,
    CAMERA_STATS_TTL_SECONDS,
    CAMERAS_INDEX,
    CameraStats,
    camera_stats_key,
)

log = logging.getLogger(__name__)


class CameraStatsPublisher:
    """`start()` publishes every `interval_seconds` until `close()`, which publishes a last, "stopped"
    snapshot. `read_counters` returns the camera's counters since it started (called from this thread)."""

    def __init__(self, redis_url: str, camera_id: str, detector: str, read_counters: Callable[[], dict[str, int]],
                 interval_seconds: float = 2.0) -> None:
        if not 0 < interval_seconds < CAMERA_STATS_TTL_SECONDS:
            raise ValueError(f"the stats interval must be between 0 and {CAMERA_STATS_TTL_SECONDS} seconds, "
                             f"got {interval_seconds}")
        self.camera_id = camera_id
        self.detector = detector
        self.read_counters = read_counters
        self.interval_seconds = interval_seconds
        self.consecutive_failures = 0  # publications Redis did not take, since the last it took
        self._redis = connect_sync(redis_url)
        self._started_at = time.time()
        self._previous: tuple[float, dict[str, int]] = (time.monotonic(), {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish_loop, name=f"vlmcap-stats-{camera_id}", daemon=True)

    def start(self) -> None:
        self._started_at = time.time()
        self._previous = (time.monotonic(), {})
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.publish("stopped")
        self._redis.close()

    def snapshot(self, status: str) -> CameraStats:
        """The counters now, with rates over the time since the previous snapshot."""
        now, counters = time.monotonic(), self.read_counters()
        before, previous = self._previous
        self._previous = (now, counters)
        elapsed = max(now - before, 1e-9)
        rates = {name: (counters.get(name, 0) - previous.get(name, 0)) / elapsed for name in CAMERA_RATE_COUNTERS}
        return CameraStats(camera_id=self.camera_id, status=status, detector=self.detector,
                           started_at=self._started_at, updated_at=time.time(), counters=counters, rates=rates)

    def publish(self, status: str = "running") -> None:
        stats = self.snapshot(status)
        key = camera_stats_key(self.camera_id)
        try:
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping=stats.to_fields())
                pipe.expire(key, CAMERA_STATS_TTL_SECONDS)
                pipe.zadd(CAMERAS_INDEX, {self.camera_id: stats.updated_at})
                pipe.zremrangebyscore(CAMERAS_INDEX, "-inf", stats.updated_at - CAMERA_STATS_TTL_SECONDS)
                pipe.execute()
        except redis.RedisError as err:
            if not self.consecutive_failures:
                log.warning("camera %s: could not publish its stats (%s); retrying every %.0f s",
                            self.camera_id, err, self.interval_seconds)
            self.consecutive_failures += 1
            return
        if self.consecutive_failures:
            log.info("camera %s: publishing its stats again after %d failures", self.camera_id,
                     self.consecutive_failures)
            self.consecutive_failures = 0

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.publish()
