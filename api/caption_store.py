"""Where caption results live: in Redis (the queue contract's result hashes and caption feeds, shared with
camera queue workers, read through `jobqueue.results`) when a Redis URL is configured, else in
this process's memory. Both hold `jobqueue.contract.CaptionResult`s; an id is a REST request's or a
camera job's."""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Protocol

import redis.asyncio as aioredis

from jobqueue.contract import (
    RESULT_TTL_SECONDS,
    CaptionResult,
    result_key,
)
from jobqueue.finish import finish_result
from jobqueue.results import get_result, recent_captions, tail_captions


class CaptionStore(Protocol):
    async def put(self, result: CaptionResult) -> None:
        """Write a result that is not finished yet (queued or running)."""

    async def finish(self, result: CaptionResult) -> None:
        """Write a finished result (done or failed) and append it to the caption feeds."""

    async def get(self, caption_id: str) -> CaptionResult | None: ...

    async def recent(self, camera: str | None, limit: int) -> list[CaptionResult]:
        """Finished results, newest first."""

    def tail(self, camera: str | None, after: str | None) -> AsyncIterator[tuple[str, CaptionResult]]:
        """Finished results as they come, as (feed position, result), after position `after` (None: only
        new ones)."""

    async def ping(self) -> None:
        """Return when the store answers; raise when it does not."""

    async def close(self) -> None: ...


class MemoryCaptionStore:
    """Results of this process only, the newest `capacity` of them."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._results: OrderedDict[str, CaptionResult] = OrderedDict()
        self._feed: deque[tuple[int, CaptionResult]] = deque(maxlen=capacity)
        self._positions = itertools.count(1)
        self._changed = asyncio.Condition()

    async def put(self, result: CaptionResult) -> None:
        self._results[result.id] = result
        self._results.move_to_end(result.id)
        while len(self._results) > self.capacity:
            self._results.popitem(last=False)

    async def finish(self, result: CaptionResult) -> None:
        await self.put(result)
        self._feed.append((next(self._positions), result))
        async with self._changed:
            self._changed.notify_all()

    async def get(self, caption_id: str) -> CaptionResult | None:
        return self._results.get(caption_id)

    async def recent(self, camera: str | None, limit: int) -> list[CaptionResult]:
        matching = (r for _, r in reversed(self._feed) if camera is None or r.camera_id == camera)
        return list(itertools.islice(matching, limit))

    async def tail(self, camera: str | None, after: str | None) -> AsyncIterator[tuple[str, CaptionResult]]:
        try:
            position = int(after) if after is not None else (self._feed[-1][0] if self._feed else 0)
        except ValueError:
            position = 0
        while True:
            for entry, result in list(self._feed):
                if entry > position:
                    position = entry
                    if camera is None or result.camera_id == camera:
                        yield str(entry), result
            async with self._changed:
                if not self._feed or self._feed[-1][0] <= position:
                    await self._changed.wait()

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass


class RedisCaptionStore:
    """The queue contract's result hashes and feeds; finished camera jobs show up here too."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client

    async def put(self, result: CaptionResult) -> None:
        key = result_key(result.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=result.to_fields())
            pipe.expire(key, RESULT_TTL_SECONDS)
            await pipe.execute()

    async def finish(self, result: CaptionResult) -> None:
        await finish_result(self.redis, result)

    async def get(self, caption_id: str) -> CaptionResult | None:
        return await get_result(self.redis, caption_id)

    async def recent(self, camera: str | None, limit: int) -> list[CaptionResult]:
        return await recent_captions(self.redis, camera, limit)

    def tail(self, camera: str | None, after: str | None) -> AsyncIterator[tuple[str, CaptionResult]]:
        return tail_captions(self.redis, camera, after or "$")

    async def ping(self) -> None:
        await self.redis.ping()

    async def close(self) -> None:
        await self.redis.aclose()
