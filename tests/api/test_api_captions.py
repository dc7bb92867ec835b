"""Captioning REST on a real server: multipart and JSON uploads, `?wait=true` and 202-then-poll, listing,
the SSE feed; with Redis, results land in the queue contract's store and camera jobs from the Redis queue
are captioned by the server's in-process queue worker on its own engine."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from jobqueue.contract import Detection, Job
from jobqueue.producer import JobProducer
from jobqueue.results import get_result

BUS = (ASSETS / "bus.jpg").read_bytes()
ZIDANE = (ASSETS / "zidane.jpg").read_bytes()
PROMPT = "Who is in the picture?"


def settings(**extra) -> ServerSettings:
    return ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=6, **extra)


def poll(http: httpx.Client, caption_id: str, timeout_s: float = 120.0) -> dict:
    """The result once finished (the deadline only guards against a hang)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = http.get(f"/v1/captions/{caption_id}").json()
        if result["status"] in ("done", "failed") or time.monotonic() > deadline:
            return result
        assert result["status"] in ("queued", "claimed", "running"), result
        time.sleep(0.05)


def next_caption_event(lines) -> tuple[str, dict]:
    """(event id, result) of the next `caption` event."""
    fields: dict[str, str] = {}
    for line in lines:
        if not line:
            if fields.get("event") == "caption":
                return fields["id"], json.loads(fields["data"])
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    raise AssertionError("the caption stream ended")


@pytest.fixture(scope="module")
def memory_server():
    with BackgroundServer(create_app(settings())) as running:
        yield running


@pytest.fixture(scope="module")
def http(memory_server):
    with httpx.Client(base_url=memory_server.url, timeout=120) as client:
        yield client


def test_multipart_upload_waits_for_the_caption(http):
    reply = http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS, "image/jpeg")},
                      data={"prompt": PROMPT, "camera_id": "door-1"})
    assert reply.status_code == 200
    result = reply.json()
    assert result["status"] == "done" and result["error"] is None and isinstance(result["caption"], str)
    assert result["camera_id"] == "door-1" and result["finished_at"] >= result["created_at"]
    assert http.get(f"/v1/captions/{result['id']}").json() == result
    again = http.post("/v1/captions?wait=true", json={"image": base64.b64encode(BUS).decode(), "prompt": PROMPT})
    assert again.json()["caption"] == result["caption"]  # greedy: the same image gives the same caption


def test_json_upload_answers_202_then_the_result(http):
    image = "data:image/jpeg;base64," + base64.b64encode(ZIDANE).decode()
    reply = http.post("/v1/captions", json={"image": image, "camera_id": "pitch", "max_tokens": 3})
    assert reply.status_code == 202
    queued = reply.json()
    assert queued["status"] == "queued" and queued["caption"] is None
    assert reply.headers["location"] == f"/v1/captions/{queued['id']}"
    result = poll(http, queued["id"])
    assert result["status"] == "done" and result["camera_id"] == "pitch"
    listed = http.get("/v1/captions", params={"camera": "pitch", "limit": 5}).json()["data"]
    assert [r["id"] for r in listed] == [queued["id"]]
    newest = http.get("/v1/captions", params={"limit": 1}).json()["data"]
    assert [r["id"] for r in newest] == [queued["id"]]


def test_caption_stream_delivers_new_captions(memory_server, http):
    with httpx.Client(base_url=memory_server.url, timeout=120) as listener:
        with listener.stream("GET", "/v1/captions/stream", params={"camera": "lobby"}) as events:
            lines = events.iter_lines()
            assert next(lines) == ": connected"
            http.post("/v1/captions", files={"image": ("b.jpg", BUS)}, data={"camera_id": "elsewhere"})
            posted = http.post("/v1/captions", files={"image": ("b.jpg", BUS)}, data={"camera_id": "lobby"}).json()
            event_id, result = next_caption_event(lines)
    assert event_id.isdigit() and result == poll(http, posted["id"])


# -- with Redis ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_api(module_redis_url):
    with BackgroundServer(create_app(settings(redis_url=module_redis_url))) as running:
        yield running


def test_camera_jobs_and_rest_captions_share_the_redis_store(module_redis_url, redis_api):
    producer = JobProducer(module_redis_url)
    job = Job(camera_id="cam-a", frame_ts=12.5, prompt=PROMPT, image=BUS,
              detections=[Detection(10, 20, 110, 220, 0.9)])
    producer.submit(job)
    producer.close()
    with httpx.Client(base_url=redis_api.url, timeout=120) as http:
        from_queue = poll(http, job.job_id)
        assert from_queue["status"] == "done", from_queue
        assert from_queue["camera_id"] == "cam-a" and from_queue["person_count"] == 1
        rest = http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS)},
                         data={"prompt": PROMPT, "camera_id": "cam-b"}).json()
        # the queue worker and the REST route caption on the same engine, greedily: same image, same caption
        assert rest["caption"] == from_queue["caption"]
        assert [r["id"] for r in http.get("/v1/captions", params={"camera": "cam-a"}).json()["data"]] == [job.job_id]
        assert [r["id"] for r in http.get("/v1/captions", params={"limit": 2}).json()["data"]] == [rest["id"],
                                                                                                 job.job_id]

    async def stored() -> tuple:
        client = aioredis.Redis.from_url(module_redis_url)
        try:
            return await get_result(client, rest["id"]), await get_result(client, job.job_id)
        finally:
            await client.aclose()

    rest_result, job_result = asyncio.run(stored())
    assert rest_result.status == "done" and rest_result.caption == rest["caption"]
    assert rest_result.camera_id == "cam-b" and job_result.status == "done"


def test_redis_caption_stream(redis_api):
    with httpx.Client(base_url=redis_api.url, timeout=120) as http:
        with http.stream("GET", "/v1/captions/stream", params={"camera": "cam-c"}) as events:
            lines = events.iter_lines()
            assert next(lines) == ": connected"
            posted = httpx.post(f"{redis_api.url}/v1/captions", files={"image": ("z.jpg", ZIDANE)},
                                data={"camera_id": "cam-c"}, timeout=120).json()
            event_id, result = next_caption_event(lines)
        assert event_id.count("-") == 1  # a Redis stream entry id, usable as Last-Event-ID
        assert result == poll(http, posted["id"])


def test_entries_off_the_contract_are_skipped_not_served(module_redis_url, redis_api):
    """A result with NaN on the caption feed (written by a foreign producer, bypassing the job checks) is
    skipped by the list and the SSE feed, which stay strict JSON; a stored frame with a reversed box
    answers 404, not 500."""
    import redis as sync_redis

    from jobqueue.contract import CAPTIONS_STREAM, CaptionResult, JobFrame, frame_key, result_key

    client = sync_redis.Redis.from_url(module_redis_url)
    bad = CaptionResult(id="nan-result", status="done", camera_id="cam-nan", created_at=1.0, frame_ts=1.0,
                        person_count=0, caption="x", finished_at=2.0).to_fields()
    bad["frame_ts"] = "nan"
    client.hset(frame_key("reversed"), mapping=JobFrame(BUS, [Detection(110, 20, 10, 220, 0.9)]).to_fields())
    with httpx.Client(base_url=redis_api.url, timeout=120) as http:
        with http.stream("GET", "/v1/captions/stream", params={"camera": "cam-nan"}) as events:
            lines = events.iter_lines()
            assert next(lines) == ": connected"
            client.xadd(CAPTIONS_STREAM, bad)
            client.xadd(f"{CAPTIONS_STREAM}:cam-nan", bad)
            client.hset(result_key("nan-result"), mapping=bad)
            posted = httpx.post(f"{redis_api.url}/v1/captions", files={"image": ("z.jpg", ZIDANE)},
                                data={"camera_id": "cam-nan"}, timeout=120).json()
            _, result = next_caption_event(lines)  # the NaN entry is skipped: the next event is the good one
            assert result["id"] == posted["id"]
        listed = http.get("/v1/captions", params={"camera": "cam-nan"})
        assert listed.status_code == 200 and [r["id"] for r in listed.json()["data"]] == [posted["id"]]
        assert http.get("/v1/captions/nan-result").status_code == 404
        frame = http.get("/v1/captions/reversed/image")
        assert frame.status_code == 404 and frame.json()["error"]["code"] == "not_found"
        client.hset("vlmcap:camera:cam-nan", mapping={"camera_id": "cam-nan", "status": "running", "detector": "hog",
                                                      "started_at": "1", "updated_at": "2", "counters": "{}",
                                                      "rates": '{"captured": NaN}'})
        client.zadd("vlmcap:cameras", {"cam-nan": time.time()})
        cameras = http.get("/v1/cameras")
        assert cameras.status_code == 200 and "cam-nan" not in [c["camera_id"] for c in cameras.json()["data"]]
    client.close()


def test_a_fall_alerts_caption_asks_the_engine_for_its_own_target(module_redis_url, redis_api, monkeypatch):
    """The in-process worker's captions reach the engine at their priorities; a fall alert's with the server's
    `fall_itl_target_ms`, which holds less urgent prompts out of its decode steps (engine/scheduler.py)."""
    engine = redis_api.state.bridge.engine
    asked: list[tuple[int, float | None]] = []
    preprocess_request = engine.preprocess_request

    def recording(**kwargs):
        asked.append((kwargs["priority"], kwargs.get("itl_target_ms")))
        return preprocess_request(**kwargs)

    monkeypatch.setattr(engine, "preprocess_request", recording)
    producer = JobProducer(module_redis_url)
    jobs = [Job(camera_id="cam-f", frame_ts=20.0 + i, prompt=PROMPT, image=BUS, fall=fall,
                detections=[Detection(10, 20, 110, 220, 0.9)]) for i, fall in enumerate((False, True))]
    for job in jobs:
        producer.submit(job)
    producer.close()
    with httpx.Client(base_url=redis_api.url, timeout=120) as http:
        assert [poll(http, job.job_id)["status"] for job in jobs] == ["done", "done"]
    settings = ServerSettings()
    assert sorted(asked) == [(settings.fall_priority, settings.fall_itl_target_ms), (settings.caption_priority, None)]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_fall_target_that_is_not_a_number_of_milliseconds_is_refused(bad):
    with pytest.raises(ValueError, match="fall_itl_target_ms must be 0 or a positive number"):
        ServerSettings(fall_itl_target_ms=bad)
    assert ServerSettings(fall_itl_target_ms=0).fall_itl_target_ms == 0  # 0: the engine's own target
