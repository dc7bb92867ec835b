"""Event streams share one Redis reader per feed (api/feeds.py), on a real uvicorn server with a real Redis: 20
subscribers of the caption feed add a constant number of Redis clients, not 20, and every one of them gets each
new caption; a subscriber resuming after `Last-Event-ID` gets what it missed; one stream past the cap answers
503 with Retry-After, and a closed stream gives its place back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis

from api.background import BackgroundServer
from api.feeds import resume_after
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from jobqueue.contract import ALERTS_STREAM, CAPTIONS_STREAM, CaptionResult

SUBSCRIBERS = 20
# Besides the feed's reader: the pooled connection catch-up reads take turns on, and the one answering pings.
CONSTANT_CLIENTS = 3


@pytest.fixture
def server(redis_url):
    settings = ServerSettings(engine=EngineConfig(model="tiny"), redis_url=redis_url, run_queue_worker=False,
                              max_sse_subscribers=SUBSCRIBERS)
    with BackgroundServer(create_app(settings)) as running:
        yield running


def publish(redis_url: str, caption_id: str, feed: str = CAPTIONS_STREAM) -> str:
    result = CaptionResult(id=caption_id, status="done", camera_id="cam", created_at=1.0, frame_ts=1.0,
                           person_count=1, caption=f"caption {caption_id}", finished_at=2.0)
    client = redis.Redis.from_url(redis_url)
    entry = client.xadd(feed, result.to_fields()).decode()
    client.close()
    return entry


def redis_clients(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    count = len(client.client_list())
    client.close()
    return count


async def next_event(lines, kind: str) -> dict:
    """The data of the next event of `kind` on an SSE stream's lines."""
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: ") and event == kind:
            return json.loads(line[len("data: "):])
    raise AssertionError("the stream ended")


@pytest.mark.timeout(180)
def test_twenty_subscribers_share_one_reader_and_the_cap_answers_503(server, redis_url):
    url = f"{server.url}/v1/captions/stream"

    async def scenario() -> tuple[int, int, list[str], httpx.Response, int]:
        before = redis_clients(redis_url)
        async with httpx.AsyncClient(timeout=60) as http:
            streams = [await http.send(http.build_request("GET", url), stream=True) for _ in range(SUBSCRIBERS)]
            lines = [s.aiter_lines() for s in streams]
            for line in lines:
                assert await anext(line) == ": connected"
            await asyncio.sleep(0.5)  # let each subscriber reach its reader before the caption is written
            publish(redis_url, "c-1")
            got = await asyncio.gather(*(next_event(line, "caption") for line in lines))
            during = redis_clients(redis_url)
            refused = await http.get(url)
            await streams[0].aclose()
            deadline = time.monotonic() + 30
            while (again := await http.send(http.build_request("GET", url), stream=True)).status_code == 503:
                await again.aclose()
                assert time.monotonic() < deadline, "the closed stream never gave its place back"
                await asyncio.sleep(0.1)
            status = again.status_code
            await again.aclose()
            for stream in streams[1:]:
                await stream.aclose()
        return before, during, [g["id"] for g in got], refused, status

    before, during, ids, refused, status = asyncio.run(scenario())
    assert ids == ["c-1"] * SUBSCRIBERS
    assert during - before <= CONSTANT_CLIENTS, (before, during)
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "too_many_streams"
    assert status == 200


@pytest.mark.timeout(120)
def test_a_subscriber_resuming_gets_what_it_missed_then_new_ones(server, redis_url):
    first = publish(redis_url, "a-1", ALERTS_STREAM)
    publish(redis_url, "a-2", ALERTS_STREAM)

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("GET", f"{server.url}/v1/alerts/stream",
                                   headers={"Last-Event-ID": first}) as stream:
                lines = stream.aiter_lines()
                missed = await next_event(lines, "alert")
                await asyncio.sleep(0.5)
                publish(redis_url, "a-3", ALERTS_STREAM)
                return [missed["id"], (await next_event(lines, "alert"))["id"]]

    assert asyncio.run(scenario()) == ["a-2", "a-3"]


@pytest.mark.parametrize("made_up", ["99999999999999999999", "18446744073709551616-0", "1-18446744073709551616",
                                     "18446744073709551615-18446744073709551615"])
def test_resume_after_drops_ids_no_entry_can_follow(made_up):
    assert resume_after(made_up) is None
    assert resume_after("18446744073709551615") == "18446744073709551615-0"
    assert resume_after("5-1") == "5-1" and resume_after(None) is None


@pytest.mark.timeout(120)
def test_a_made_up_last_event_id_over_2_64_streams_new_entries_beside_a_plain_resume(server, redis_url):
    first = publish(redis_url, "m-1", ALERTS_STREAM)

    async def follow(http: httpx.AsyncClient, path: str, kind: str, last_event_id: str) -> str:
        async with http.stream("GET", f"{server.url}{path}", headers={"Last-Event-ID": last_event_id}) as stream:
            assert stream.status_code == 200
            return (await next_event(stream.aiter_lines(), kind))["id"]

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            followers = [asyncio.create_task(follow(http, "/v1/alerts/stream", "alert", "99999999999999999999")),
                         asyncio.create_task(follow(http, "/v1/captions/stream", "caption", "99999999999999999999")),
                         asyncio.create_task(follow(http, "/v1/alerts/stream", "alert", first))]
            await asyncio.sleep(1.0)
            publish(redis_url, "m-2", ALERTS_STREAM)
            publish(redis_url, "c-2", CAPTIONS_STREAM)
            return await asyncio.gather(*followers)

    assert asyncio.run(scenario()) == ["m-2", "c-2", "m-2"]
