"""Server-sent event streams of the Redis feeds (captions, a camera's captions, alerts), fanned out in memory.

Each feed that has subscribers has one reader in this process: a task that blocks on XREAD with a connection of
its own and hands each new entry to every subscriber's queue. So Redis sees one blocked client per feed per
server, however many browsers follow it (Redis's `maxclients` is shared by the whole fleet). A subscriber that
resumes (`Last-Event-ID`) first reads what it missed with XRANGE (those reads take turns on one connection),
then takes the reader's entries, skipping what it already sent. Subscribers are capped (`max_sse_subscribers`):
one more answers 503 with Retry-After before its stream starts. A subscriber too slow to keep up with its queue
is ended (it resumes where it left off by reconnecting with `Last-Event-ID`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from api.errors import APIError
from api.streaming import SSEResponse
from jobqueue.contract import CaptionResult, as_text
from jobqueue.results import readable

log = logging.getLogger(__name__)

READ_BLOCK_MS = 5000  # a reader's XREAD blocks this long before it reads again
READ_COUNT = 100  # entries per XREAD or XRANGE
QUEUE_SIZE = 1000  # entries a subscriber may lag behind its reader before it is ended
RETRY_S = 1.0  # a reader's pause after Redis failed to answer
_OVERFLOW = object()  # put in a subscriber's queue when it is full: the subscriber ends


MAX_ID_PART = 2**64 - 1  # a Redis stream id is two unsigned 64-bit numbers


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq", or "ms") as a tuple that orders like the stream."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def resume_after(last_event_id: str | None) -> str | None:
    """The entry a subscriber resumes after: its `Last-Event-ID` when that is a stream id entries can follow,
    else None (only new entries, as for a first connection): an id over 2^64-1 (Redis refuses it in XRANGE)
    or one no entry can follow is never sent by this server, only made up."""
    if last_event_id is None:
        return None
    ms, dash, seq = last_event_id.partition("-")
    if not ms.isascii() or not ms.isdigit() or (dash and (not seq.isascii() or not seq.isdigit())):
        log.warning("event stream: Last-Event-ID %r is not a stream id; sending new entries only",
                    last_event_id[:64])
        return None
    key = entry_key(last_event_id)
    if key[0] > MAX_ID_PART or key[1] > MAX_ID_PART or key == (MAX_ID_PART, MAX_ID_PART):
        log.warning("event stream: Last-Event-ID %r is past any stream id; sending new entries only",
                    last_event_id[:64])
        return None
    return f"{key[0]}-{key[1]}"


class _Reader:
    """One feed's XREAD loop, handing entries to its subscribers' queues."""

    def __init__(self, redis: aioredis.Redis, feed: str) -> None:
        self.redis, self.feed = redis, feed
        self.queues: set[asyncio.Queue] = set()
        self.task = asyncio.create_task(self._run(), name=f"feed-reader {feed}")

    async def _run(self) -> None:
        position = None
        while True:
            try:
                if position is None:
                    newest = await self.redis.xrevrange(self.feed, count=1)
                    position = as_text(newest[0][0]) if newest else "0-0"
                reply = await self.redis.xread({self.feed: position}, count=READ_COUNT, block=READ_BLOCK_MS)
            except (RedisError, OSError) as err:
                log.warning("feed reader %s: Redis did not answer (%s); retrying", self.feed, err)
                await asyncio.sleep(RETRY_S)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    position = as_text(entry_id)
                    result = readable(CaptionResult.from_fields, fields, f"{self.feed} {position}")
                    if result is not None:
                        self._hand_out((position, result))

    def _hand_out(self, item: tuple[str, CaptionResult]) -> None:
        for queue in list(self.queues):
            if queue.full():
                continue  # already ended by overflow
            if queue.qsize() == queue.maxsize - 1:
                queue.put_nowait(_OVERFLOW)
            else:
                queue.put_nowait(item)


class FeedHub:
    """The readers of one server and the count of its event streams (at most `max_subscribers`)."""

    def __init__(self, redis: aioredis.Redis | None, max_subscribers: int) -> None:
        if max_subscribers < 1:
            raise ValueError(f"max_sse_subscribers must be at least 1, got {max_subscribers}")
        self.redis = redis
        self.max_subscribers = max_subscribers
        self.subscribers = 0
        self._readers: dict[str, _Reader] = {}
        self._catch_up = asyncio.Lock()  # catch-up reads take turns: one pooled connection serves them all

    def response(self, events: Callable[[], AsyncIterator[str]]) -> SSEResponse:
        """An event stream of `events()`, holding one subscriber place until it ends; 503 when all are taken."""
        if self.subscribers >= self.max_subscribers:
            raise APIError(503, f"{self.subscribers} event streams are open, this server's limit "
                                f"(max_sse_subscribers); retry later", code="too_many_streams")
        self.subscribers += 1
        return _HeldStream(events(), self._leave)

    def _leave(self) -> None:
        self.subscribers -= 1

    async def tail(self, feed: str, after: str | None) -> AsyncIterator[tuple[str, CaptionResult]]:
        """The feed's entries after `after` (None, or an id no entry can follow: only new ones), as (entry id,
        result), until the consumer stops iterating or falls `QUEUE_SIZE` entries behind."""
        assert self.redis is not None, "a feed needs Redis"
        after = resume_after(after)
        queue: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        reader = self._readers.get(feed) or self._readers.setdefault(feed, _Reader(self.redis, feed))
        reader.queues.add(queue)
        try:
            last = after or await self._newest(feed)
            while True:  # what the stream holds past `last` already (the reader may hand some of it out too)
                async with self._catch_up:
                    batch = await self.redis.xrange(feed, min=f"({last}", max="+", count=READ_COUNT)
                for entry_id, fields in batch:
                    last = as_text(entry_id)
                    result = readable(CaptionResult.from_fields, fields, f"{feed} {last}")
                    if result is not None:
                        yield last, result
                if len(batch) < READ_COUNT:
                    break
            while True:
                item = await queue.get()
                if item is _OVERFLOW:
                    log.warning("event stream of %s fell %d entries behind; ending it", feed, QUEUE_SIZE)
                    return
                entry_id, result = item
                if entry_key(entry_id) > entry_key(last):
                    last = entry_id
                    yield entry_id, result
        finally:
            reader.queues.discard(queue)
            if not reader.queues and self._readers.get(feed) is reader:
                del self._readers[feed]
                reader.task.cancel()

    async def _newest(self, feed: str) -> str:
        async with self._catch_up:
            newest = await self.redis.xrevrange(feed, count=1)
        return as_text(newest[0][0]) if newest else "0-0"

    async def close(self) -> None:
        readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.task.cancel()
        await asyncio.gather(*(reader.task for reader in readers), return_exceptions=True)


class _HeldStream(SSEResponse):
    """An event stream that gives its subscriber place back when it ends, however it ends."""

    def __init__(self, content: Any, release: Callable[[], None]) -> None:
        super().__init__(content)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
