"""The readers of what queue workers write: a job's result, a finished job's frame, the caption feeds (recent
and tailed as they grow) and the queue's depth. Entries that do not hold to the contract (a foreign or older
writer's) are skipped, logged, never fatal."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from jobqueue.checks import at_least
from jobqueue.contract import (
    CAPTIONS_STREAM,
    CONSUMER_GROUP,
    DEAD_STREAM,
    JOBS_STREAM,
    CaptionResult,
    JobFrame,
    as_text,
    camera_captions_stream,
    frame_key,
    result_key,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def readable(decode: Callable[[dict], T], fields: dict, where: str) -> T | None:
    """A stored entry decoded, or None (logged) when it does not hold to the contract (written by a
    foreign or older producer): readers skip it rather than fail on it."""
    try:
        return decode(fields)
    except ValueError as err:
        log.warning("skipping %s: %s", where, err)
        return None


async def get_result(redis_client: aioredis.Redis, job_id: str) -> CaptionResult | None:
    """The job's current state (queued, running, done or failed), or None if unknown or expired."""
    fields = await redis_client.hgetall(result_key(job_id))
    return readable(CaptionResult.from_fields, fields, result_key(job_id)) if fields else None


async def get_frame(redis_client: aioredis.Redis, job_id: str, index: int = 0) -> JobFrame | None:
    """A finished camera job's image (its frame `index`, for a job of several) and person boxes, or None if
    unknown or expired."""
    key = frame_key(job_id, index)
    fields = await redis_client.hgetall(key)
    return readable(JobFrame.from_fields, fields, key) if fields else None


def captions_feed(camera: str | None) -> str:
    """The feed of one camera's captions, or of all cameras'."""
    return camera_captions_stream(camera) if camera else CAPTIONS_STREAM


async def recent_captions(redis_client: aioredis.Redis, camera: str | None = None,
                          limit: int = 50, feed: str | None = None) -> list[CaptionResult]:
    """Finished results (done and failed), newest first, of one camera or all (or of `feed`, e.g. the
    alerts feed)."""
    at_least("limit", limit, 1)
    feed = feed or captions_feed(camera)
    entries = await redis_client.xrevrange(feed, count=limit)
    results = [readable(CaptionResult.from_fields, fields, f"{feed} {as_text(entry_id)}")
               for entry_id, fields in entries]
    return [result for result in results if result is not None]


async def tail_captions(redis_client: aioredis.Redis, camera: str | None = None, after: str = "$",
                        block_seconds: float = 5.0, feed: str | None = None, stop: asyncio.Event | None = None
                        ) -> AsyncIterator[tuple[str, CaptionResult]]:
    """Finished results as they arrive, as (feed entry id, result); `after` is a feed entry id to resume
    after (e.g. an SSE Last-Event-ID), or "$" for only new ones; `feed` another feed than the camera's or
    all captions (the alerts feed). Runs until the consumer stops iterating, or until `stop` is set (within
    `block_seconds`, with nothing cancelled)."""
    feed = feed or captions_feed(camera)
    if after == "$":
        newest = await redis_client.xrevrange(feed, count=1)
        after = as_text(newest[0][0]) if newest else "0-0"
    while stop is None or not stop.is_set():
        reply = await redis_client.xread({feed: after}, count=100, block=int(block_seconds * 1000))
        for _, entries in reply or []:
            for entry_id, fields in entries:
                after = as_text(entry_id)
                result = readable(CaptionResult.from_fields, fields, f"{feed} {after}")
                if result is not None:
                    yield after, result


async def queue_stats(redis_client: aioredis.Redis) -> dict[str, int]:
    """backlog: jobs in the stream (waiting or in progress); pending: read but not finished;
    dead: entries in the dead-letter stream."""
    backlog = await redis_client.xlen(JOBS_STREAM)
    try:
        pending = (await redis_client.xpending(JOBS_STREAM, CONSUMER_GROUP))["pending"]
    except ResponseError:  # no group yet: nothing was ever read
        pending = 0
    return {"backlog": backlog, "pending": pending, "dead": await redis_client.xlen(DEAD_STREAM)}
