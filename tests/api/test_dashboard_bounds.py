"""The dashboard's JSON under hostile data (api/routes_dashboard.py), on a real uvicorn server (tiny model, real
Redis): a camera published under an id the routes cannot filter on is not listed (its filter would answer 422),
while every listed camera's filter answers 200; six views of one frame render it once (a cache, and views of a
frame being rendered wait for that render), each getting the same JPEG, in the render pool."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import pytest
import redis
from PIL import Image

import api.routes_dashboard as dashboard
from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from jobqueue.contract import CAMERAS_INDEX, CameraStats, Detection, JobFrame, camera_stats_key, frame_key


@pytest.fixture(scope="module")
def server(module_redis_url):
    settings = ServerSettings(engine=EngineConfig(model="tiny"), redis_url=module_redis_url, run_queue_worker=False)
    with BackgroundServer(create_app(settings)) as running:
        yield running


def publish_stats(client: redis.Redis, camera: str) -> None:
    now = time.time()
    stats = CameraStats(camera_id=camera, status="running", detector="hog", started_at=now, updated_at=now,
                        counters={"captured": 1}, rates={"captured": 0.1})
    client.hset(camera_stats_key(camera), mapping=stats.to_fields())
    client.zadd(CAMERAS_INDEX, {camera: time.time()})


def test_only_cameras_the_routes_can_filter_on_are_listed(server, module_redis_url):
    client = redis.Redis.from_url(module_redis_url)
    for camera in ("porch-2", "cam 7", "<b>x</b>"):
        publish_stats(client, camera)
    client.close()
    listed = [c["camera_id"] for c in httpx.get(f"{server.url}/v1/cameras", timeout=30).json()["data"]]
    assert "porch-2" in listed and "cam 7" not in listed and "<b>x</b>" not in listed
    for camera in listed:
        reply = httpx.get(f"{server.url}/v1/captions", params={"camera": camera}, timeout=30)
        assert reply.status_code == 200, (camera, reply.text)


@pytest.mark.timeout(120)
def test_six_views_of_one_frame_render_it_once(server, module_redis_url, monkeypatch):
    image = io.BytesIO()
    Image.new("RGB", (320, 240), (40, 90, 160)).save(image, format="JPEG")
    client = redis.Redis.from_url(module_redis_url)
    frame = JobFrame(image.getvalue(), [Detection(10, 10, 90, 120, 0.9)])
    client.hset(frame_key("viewed", 0), mapping=frame.to_fields())
    client.close()
    renders = []
    real = dashboard.render_frame

    def counted(*args):
        renders.append(args[2:])
        time.sleep(0.3)  # long enough for the other views to arrive while it renders
        return real(*args)

    monkeypatch.setattr(dashboard, "render_frame", counted)

    async def views() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.get(f"{server.url}/v1/captions/viewed/image") for _ in range(6)))

    replies = asyncio.run(views())
    assert [r.status_code for r in replies] == [200] * 6
    assert len({r.content for r in replies}) == 1 and replies[0].headers["content-type"] == "image/jpeg"
    assert len(renders) == 1
    thumb = httpx.get(f"{server.url}/v1/captions/viewed/image", params={"max_width": 64}, timeout=60)
    assert thumb.status_code == 200 and Image.open(io.BytesIO(thumb.content)).width == 64
    assert len(renders) == 2
    missing = httpx.get(f"{server.url}/v1/captions/nothing/image", timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_the_render_cache_keeps_to_its_bytes():
    cache = dashboard.RenderCache(max_bytes=10)

    async def fill() -> None:
        for key in range(5):
            async def render(key: int = key) -> bytes:
                return bytes([key]) * 4
            assert await cache.get((key,), render) == bytes([key]) * 4

    asyncio.run(fill())
    assert cache.bytes <= 10 and list(cache._done) == [(3,), (4,)]
