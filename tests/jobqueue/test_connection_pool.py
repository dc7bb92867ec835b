"""The asyncio Redis client's pool is bounded (jobqueue/connection.py): 40 commands at once, each blocking a
while (as 40 SSE subscribers arriving together do), all get their answer over at most MAX_CONNECTIONS
connections, the rest waiting their turn instead of opening more."""

from __future__ import annotations

import asyncio

import pytest
import redis

from jobqueue.connection import MAX_CONNECTIONS, connect


@pytest.mark.timeout(120)
def test_forty_commands_at_once_share_a_bounded_pool(redis_url):
    watcher = redis.Redis.from_url(redis_url)
    before = len(watcher.client_list())

    async def scenario() -> tuple[list, int]:
        client = connect(redis_url)
        try:
            calls = [asyncio.create_task(client.blpop([f"nothing-{i}"], timeout=1)) for i in range(40)]
            await asyncio.sleep(0.5)
            during = len(watcher.client_list())
            return await asyncio.gather(*calls), during
        finally:
            await client.aclose()

    answers, during = asyncio.run(scenario())
    assert answers == [None] * 40
    assert during - before <= MAX_CONNECTIONS, (before, during)
    watcher.close()


def test_a_pool_needs_a_connection():
    with pytest.raises(ValueError, match="max_connections"):
        connect("redis://localhost:1", max_connections=0)
