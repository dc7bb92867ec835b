"""The dashboard in a real browser: headless Chromium (Debian's package, driven by Playwright's Python
client) loads the page from a real server on loopback (tiny model, embedded Redis, in-process queue
worker). A real camera pipeline's job becomes a caption card with its frame, the pipeline's published
counters show up, a chat with an image streams its answer in, a caption carrying HTML stays text, and with
an API key the page asks for it once, then says so when the server goes away."""

from __future__ import annotations

import asyncio
import io
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import redis
from PIL import Image
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.routes_dashboard import BOX_COLOR
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from jobqueue.contract import (
    CAMERA_STATS_TTL_SECONDS,
    CAMERAS_INDEX,
    CAPTIONS_STREAM,
    CAPTIONS_STREAM_MAXLEN,
    CameraStats,
    CaptionResult,
    Detection,
    Job,
    JobFrame,
    camera_captions_stream,
    camera_stats_key,
    frame_key,
    result_key,
)
from jobqueue.producer import JobProducer
from pipeline.camera_stats import CameraStatsPublisher
from pipeline.runner import CameraPipeline, PipelineConfig
from tests.api.test_api_prefix_cache import chat_turns

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; `.ci/run` installs it
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUS = ASSETS / "bus.jpg"
HANG_GUARD_MS = 60_000  # how long a wait may last before the test fails as hung; never a speed check
expect.set_options(timeout=HANG_GUARD_MS)  # expect()'s own default is 5 s: too short on a loaded machine


def settings(**extra) -> ServerSettings:
    return ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=12, **extra)


@pytest.fixture(scope="module")
def redis_url(module_redis_url: str) -> str:
    """One Redis for the module's server and its tests."""
    return module_redis_url


@pytest.fixture(scope="module")
def server(redis_url) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(settings(redis_url=redis_url))) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser) -> Iterator[Page]:
    """A fresh tab (its own session storage); fails the test on any script error of the page."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    tab = context.new_page()
    tab.set_default_timeout(HANG_GUARD_MS)
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    yield tab
    context.close()
    assert not errors, errors


def wait_until_loaded(image: Locator, min_width: int = 1) -> None:
    """Until the <img> has loaded a picture at least `min_width` pixels wide (a blocked or broken one never
    does)."""
    image.page.wait_for_function("([image, width]) => image.complete && image.naturalWidth >= width",
                                 arg=[image.element_handle(), min_width])


def stored_frame(redis_url: str, job_id: str) -> JobFrame:
    client = redis.Redis.from_url(redis_url)
    try:
        return JobFrame.from_fields(client.hgetall(frame_key(job_id)))
    finally:
        client.close()


def assert_boxes_drawn(boxed_jpeg: bytes, plain_jpeg: bytes, boxes: list[Detection]) -> None:
    """The left edge of every person box is in the box colour on the boxed frame and not on the plain one."""
    boxed, plain = (np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=float)
                    for jpeg in (boxed_jpeg, plain_jpeg))
    assert boxed.shape == plain.shape
    for box in boxes:
        edge = (slice(int(box.y1) + 4, int(box.y2) - 4), int(box.x1) + 1)
        assert np.abs(boxed[edge].mean(axis=0) - BOX_COLOR).max() < 40, box
        assert np.abs(plain[edge].mean(axis=0) - BOX_COLOR).max() > 40, box


def run_camera(redis_url: str, tmp_path: Path, camera_id: str) -> dict[str, int]:
    """A real camera pipeline (HOG) over a folder of three copies of bus.jpg (one second apart), one-frame jobs
    only (events: tests/api/test_dashboard_events.py)."""
    folder = tmp_path / "frames"
    folder.mkdir()
    for index in range(3):
        shutil.copy(BUS, folder / f"{index}.jpg")
    config = PipelineConfig(source=str(folder), camera_id=camera_id, redis_url=redis_url, detector="hog",
                            events=False)
    return CameraPipeline(config).run()


def test_camera_caption_frame_counters_and_chat(server, redis_url, page, tmp_path):
    page.goto(server.url)
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    expect(page.locator("#engine-requests")).to_have_text("0 running · 0 waiting")
    expect(page.locator("#banner")).to_be_hidden()

    counters = run_camera(redis_url, tmp_path, "porch")
    assert counters["enqueued"] >= 1, counters

    # The queue worker captions the job; the card arrives over the event stream.
    card = page.locator(".caption-card").filter(has=page.locator(".camera-badge", has_text="porch")).first
    expect(card).to_be_visible()
    caption_id = card.get_attribute("data-id")
    with httpx.Client(base_url=server.url) as http:
        result = http.get(f"/v1/captions/{caption_id}").json()
        frame = http.get(f"/v1/captions/{caption_id}/image")
        plain = http.get(f"/v1/captions/{caption_id}/image", params={"boxes": "false"})
        small = http.get(f"/v1/captions/{caption_id}/image", params={"max_width": 320})
    assert result["status"] == "done" and result["camera_id"] == "porch"
    assert_boxes_drawn(frame.content, plain.content, stored_frame(redis_url, caption_id).detections)
    assert Image.open(io.BytesIO(small.content)).width == 320
    expect(card.locator(".caption-text")).to_have_text(result["caption"])
    expect(card.locator(".people")).to_contain_text(str(result["person_count"]))
    assert frame.status_code == 200 and frame.headers["content-type"] == "image/jpeg"
    thumbnail = card.locator(".thumb img")
    expect(thumbnail).to_be_visible()
    wait_until_loaded(thumbnail)

    # The pipeline's published counters, with its last caption.
    camera = page.locator("#cameras .camera").filter(has_text="porch")
    expect(camera).to_be_visible()
    expect(camera.locator(".rate").first).to_have_attribute("title", f"{counters['captured']} captured since "
                                                                     "the pipeline started")
    expect(camera.locator(".last-caption .caption-text")).to_have_text(result["caption"])
    expect(page.locator("#camera-filter option[value='porch']")).to_have_count(1)

    # Click for the full frame.
    card.click()
    full = page.locator("#frame-image")
    wait_until_loaded(full, min_width=400)
    expect(page.locator("#frame-caption")).to_have_text(result["caption"])
    page.locator("#frame-close").click()
    expect(page.locator("#frame-dialog")).to_be_hidden()

    # Chat with an image through the file picker; the answer streams in.
    page.set_input_files("#chat-file", str(BUS))
    preview = page.locator("#chat-preview")
    wait_until_loaded(preview)
    page.fill("#chat-input", "Who is in the picture?")
    page.click("#chat-send")
    answer = page.locator(".message.assistant[data-state='done']")
    expect(answer).to_have_count(1)
    sent = page.locator(".message.user img")
    wait_until_loaded(sent)
    assert answer.locator(".text").text_content()
    assert int(answer.get_attribute("data-chunks")) > 1, "the answer came in as one piece, not streamed"
    expect(answer.locator(".status")).to_contain_text("tokens in")

    # The engine charts saw the chat's tokens.
    expect(page.locator("#engine-itl")).to_contain_text("p99")
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


class HeldCaptioner:
    """The server's own captioner, each job held (on the server's loop) until `release` is set."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.release = threading.Event()

    async def _held(self) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.05)

    async def caption(self, *args, **kwargs) -> str:
        await self._held()
        return await self.inner.caption(*args, **kwargs)

    async def caption_frames(self, *args, **kwargs) -> str:
        await self._held()
        return await self.inner.caption_frames(*args, **kwargs)

    async def caption_video(self, *args, **kwargs) -> str:
        await self._held()
        return await self.inner.caption_video(*args, **kwargs)


def test_a_job_claimed_ahead_says_claimed_by_the_worker_then_running_then_done(server, redis_url, page):
    """With one slot, the server's worker runs one job and claims the next ahead: the status route says
    `running` and `claimed` (with the worker's name) and `queued` for the third, the engine panel counts the
    jobs the worker holds; once released, all three are done."""
    worker = server.state.worker
    held, inner, batch_size = HeldCaptioner(worker.captioner), worker.captioner, worker.batch_size
    worker.captioner, worker.batch_size = held, 1
    try:
        time.sleep(worker.block_ms / 1000 * 1.5)  # a read in flight (up to batch_size jobs) has returned
        image = BUS.read_bytes()
        jobs = [Job(camera_id="held-cam", frame_ts=float(i), prompt="Who is there?", image=image,
                    detections=[Detection(10, 20, 110, 220, 0.9, 1)]) for i in range(3)]
        producer = JobProducer(redis_url)
        for job in jobs:
            producer.submit(job)
        producer.close()

        def statuses() -> list[tuple[str, str | None]]:
            answers = [httpx.get(f"{server.url}/v1/captions/{job.job_id}").json() for job in jobs]
            return [(answer["status"], answer["consumer"]) for answer in answers]

        expected = [("running", worker.consumer_name), ("claimed", worker.consumer_name), ("queued", None)]
        deadline = time.monotonic() + HANG_GUARD_MS / 1000
        while statuses() != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        assert statuses() == expected
        claimed = httpx.get(f"{server.url}/v1/captions/{jobs[1].job_id}").json()
        assert claimed["claimed_at"] is not None and claimed["started_at"] is None and claimed["deliveries"] == 1
        assert httpx.get(f"{server.url}/v1/engine/stats").json()["camera_jobs"] == {"claimed": 1, "running": 1}
        page.goto(server.url)
        expect(page.locator("#engine-note")).to_contain_text("camera jobs: 1 running, 1 claimed")
        held.release.set()
        while {status for status, _ in statuses()} != {"done"} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert statuses() == [("done", worker.consumer_name)] * 3
        expect(page.locator("#engine-note")).to_contain_text("camera jobs: 0 running, 0 claimed")
    finally:
        held.release.set()
        worker.captioner, worker.batch_size = inner, batch_size


def test_engine_panel_shows_the_prefix_cache(server, page):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat_turns(client, "You are the dashboard's test.", model="tiny")
    stats = httpx.get(f"{server.url}/v1/engine/stats").json()
    assert stats["prefix_cache_hit_tokens"] == server.state.bridge.engine.stats().prefix_cache_hit_tokens > 0
    page.goto(server.url)
    expect(page.locator("#engine-prefix")).to_have_text(
        f"{stats['prefix_cache_hit_rate'] * 100:.1f} % · {stats['prefix_cache_hit_tokens']} tokens · "
        f"{stats['encoder_cache_hits']} images or tiles reused")


def test_a_caption_with_html_is_shown_as_text(server, redis_url, page):
    page.goto(server.url)
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    hostile = '<img src=x onerror="window.hacked=1"><script>window.hacked=2</script>'
    camera_id = '<b id="bold">gate</b>'
    result = CaptionResult(id="html-caption", status="done", camera_id=camera_id, created_at=time.time(),
                           frame_ts=0.0, person_count=1, caption=hostile, finished_at=time.time())
    client = redis.Redis.from_url(redis_url)
    try:  # what a queue worker writes when it finishes a job
        client.hset(result_key(result.id), mapping=result.to_fields())
        for feed in (CAPTIONS_STREAM, camera_captions_stream(camera_id)):
            client.xadd(feed, result.to_fields(), maxlen=CAPTIONS_STREAM_MAXLEN)
    finally:
        client.close()

    card = page.locator(".caption-card[data-id='html-caption']")
    expect(card.locator(".caption-text")).to_have_text(hostile)
    expect(card.locator(".camera-badge")).to_have_text(camera_id)
    expect(card.locator(".thumb")).to_have_text("no frame")
    assert page.locator("img[src='x'], #bold, .feed script").count() == 0
    assert page.evaluate("window.hacked") is None


def test_with_an_api_key_the_page_asks_for_it_and_shows_when_the_server_is_down(page):
    with BackgroundServer(create_app(settings(api_key="s3cret"))) as keyed:
        page.goto(keyed.url)
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        page.fill("#key-input", "wrong")
        page.click("#key-save")
        expect(page.locator("#key-message")).to_contain_text("refused")
        page.fill("#key-input", "s3cret")
        page.click("#key-save")
        expect(dialog).to_be_hidden()
        expect(page.locator("#connection")).to_have_attribute("data-state", "live")
        expect(page.locator("#engine-requests")).to_have_text("0 running · 0 waiting")
        expect(page.locator("#model")).to_have_text("model: tiny")

        page.reload()  # the key is kept for the tab's session
        expect(page.locator("#engine-requests")).to_have_text("0 running · 0 waiting")
        expect(dialog).to_be_hidden()
    banner = page.locator("#banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("cannot be reached")
    expect(page.locator("#connection")).to_have_attribute("data-state", "offline")


def test_a_cropped_job_keeps_its_boxes_in_the_crop_coordinates():
    job = Job(camera_id="c", frame_ts=0.0, prompt="p", image=b"jpeg", detections=[Detection(110, 220, 150, 300, 0.9)],
              image_origin=(100, 200))
    decoded = Job.from_fields(job.to_fields())
    assert decoded.image_origin == (100, 200)
    assert decoded.frame().detections == [Detection(10, 20, 50, 100, 0.9)]
    legacy = {name: value for name, value in job.to_fields().items() if name != "image_origin"}
    assert Job.from_fields(legacy).image_origin == (0, 0)  # a job from a producer that predates crops


def test_camera_stats_are_published_with_rates_and_a_ttl(redis_url):
    counters = {"captured": 0, "skipped": 0, "dropped": 0, "detected": 0, "enqueued": 0}
    publisher = CameraStatsPublisher(redis_url, "yard", "hog", lambda: dict(counters), interval_seconds=30)
    publisher.publish()
    counters["captured"], counters["detected"] = 10, 4
    publisher.publish()
    client = redis.Redis.from_url(redis_url)
    try:
        stats = CameraStats.from_fields(client.hgetall(camera_stats_key("yard")))
        assert stats.status == "running" and stats.counters == counters
        assert stats.rates["captured"] == pytest.approx(2.5 * stats.rates["detected"])
        assert stats.rates["captured"] > 0 and stats.rates["skipped"] == 0
        assert 0 < client.ttl(camera_stats_key("yard")) <= CAMERA_STATS_TTL_SECONDS
        assert client.zscore(CAMERAS_INDEX, "yard") == pytest.approx(stats.updated_at)
        publisher.close()
        assert CameraStats.from_fields(client.hgetall(camera_stats_key("yard"))).status == "stopped"
    finally:
        client.close()


def test_listing_cameras_only_reads_and_publishers_drop_the_silent_ones(server, redis_url):
    """GET /v1/cameras leaves Redis as it was: a camera gone silent is left out, not deleted; the next camera
    that publishes drops it from the index."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.zadd(CAMERAS_INDEX, {"gone": time.time() - CAMERA_STATS_TTL_SECONDS - 5})
        publisher = CameraStatsPublisher(redis_url, "porch", "hog", dict, interval_seconds=30)
        ids = [camera["camera_id"] for camera in httpx.get(f"{server.url}/v1/cameras").json()["data"]]
        assert "gone" not in ids and client.zscore(CAMERAS_INDEX, "gone") is not None
        publisher.publish()
        assert client.zscore(CAMERAS_INDEX, "gone") is None
        assert "porch" in [c["camera_id"] for c in httpx.get(f"{server.url}/v1/cameras").json()["data"]]
        publisher.close()
    finally:
        client.close()


def test_a_fall_alert_is_highlighted(server, redis_url, page):
    """A fall job's result, as a queue worker writes it (result, caption feeds, alerts feed): its card is
    marked, and the alert strip above the page shows it and opens its frame."""
    from jobqueue.contract import ALERTS_STREAM, FALL_CLASS

    result = CaptionResult(id="fall-caption", status="done", camera_id="ward", created_at=time.time(),
                           frame_ts=9.0, person_count=1, caption="a person lies on the floor",
                           finished_at=time.time(), fall=True, classes=[FALL_CLASS])
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(result_key(result.id), mapping=result.to_fields())
        for feed in (CAPTIONS_STREAM, camera_captions_stream("ward"), ALERTS_STREAM):
            client.xadd(feed, result.to_fields(), maxlen=CAPTIONS_STREAM_MAXLEN)
    finally:
        client.close()
    page.goto(server.url)
    card = page.locator(".caption-card.fall[data-id='fall-caption']")
    expect(card.locator(".badge-fall")).to_have_text("fall")
    strip = page.locator("#alert")
    expect(strip).to_be_visible()
    expect(strip).to_contain_text("ward")
    expect(strip).to_contain_text("a person lies on the floor")
    page.click("#alert-dismiss")
    expect(strip).to_be_hidden()


def test_a_structured_caption_shows_its_fields(server, redis_url, page):
    page.goto(server.url)
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    structured = {"people_count": 2, "people": [{"action": "walking", "position": "left"},
                                                {"action": "lying", "position": "center"}],
                  "anyone_on_ground": True, "summary": "<b>two</b> people"}
    result = CaptionResult(id="structured-caption", status="done", camera_id="ward", created_at=time.time(),
                           frame_ts=0.0, person_count=2, caption="{...}", finished_at=time.time(),
                           structured=structured)
    client = redis.Redis.from_url(redis_url)
    try:  # what a queue worker writes when it finishes a job with a schema
        client.hset(result_key(result.id), mapping=result.to_fields())
        for feed in (CAPTIONS_STREAM, camera_captions_stream(result.camera_id)):
            client.xadd(feed, result.to_fields(), maxlen=CAPTIONS_STREAM_MAXLEN)
    finally:
        client.close()

    card = page.locator(".caption-card[data-id='structured-caption']")
    expected_names = ["people count", "people", "anyone on ground", "summary"]
    expected_values = ["2", "walking · left", "lying · center", "true", "<b>two</b> people"]
    expect(card.locator(".structured dt")).to_have_text(expected_names)
    expect(card.locator(".structured dd")).to_have_text(expected_values)
    card.click()
    expect(page.locator("#frame-structured dd")).to_have_text(expected_values)
    page.locator("#frame-close").click()
