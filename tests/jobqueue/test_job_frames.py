"""Jobs of several frames on the real queue: they round-trip through the contract, the worker captions them as
one prompt (`caption_frames`) and keeps every frame for viewers, results carry kind, track, start and end and
frame count; a job over a limit is dead-lettered once naming the limit; a third-party producer's one-image entry
(written the old way, with none of the new fields) works unchanged."""

from __future__ import annotations

import asyncio
import json

import cv2
import numpy as np
import pytest
import redis
from queue_support import DecodingCaptioner, enqueue, work_until_idle

from jobqueue.consumer import QueueWorker
from jobqueue.contract import (
    CAPTIONS_STREAM,
    DEAD_STREAM,
    JOBS_STREAM,
    MAX_FRAMES_PER_JOB,
    MAX_JOB_IMAGE_BYTES,
    CaptionResult,
    Detection,
    Job,
    JobFrame,
    JobImage,
    frame_key,
    result_key,
)


def jpeg(width: int, height: int, shade: int = 100) -> bytes:
    return cv2.imencode(".jpg", np.full((height, width, 3), shade, np.uint8))[1].tobytes()


def event_job(frames: int = 3, camera: str = "door") -> Job:
    images = [JobImage(jpeg(32 + 8 * i, 24), 10.0 + i, f"t=+{i}.0 s: person 4 note {i}",
                       [Detection(1, 2, 20, 22, 0.9, 4, "person")]) for i in range(frames)]
    return Job.of_frames(camera, "What did person 4 do?", images, kind="event", track_id=4)


def test_a_job_of_frames_round_trips_through_its_fields():
    job = event_job()
    fields = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in job.to_fields().items()}
    assert {b"image", b"image_1", b"image_2"} <= set(fields) and b"image_3" not in fields
    back = Job.from_fields(fields)
    assert back.frames == job.frames and (back.kind, back.track_id, back.frame_count) == ("event", 4, 3)
    assert (back.start_ts, back.end_ts, back.frame_ts) == (10.0, 12.0, 10.0)
    result = back.queued_result()
    assert (result.kind, result.track_id, result.start_ts, result.end_ts, result.frame_count) == \
        ("event", 4, 10.0, 12.0, 3)
    assert CaptionResult.from_fields(result.to_fields()) == result


def _raw(job: Job, **override: str | bytes) -> dict:
    return {**job.to_fields(), **override}


def run_worker(redis_url: str, captioner: object, **options: object) -> None:
    """A real queue worker until the stream is empty."""
    async def work() -> None:
        worker = QueueWorker(redis_url, captioner, block_seconds=0.1, **options)
        await work_until_idle(worker)
        await worker.redis.aclose()

    asyncio.run(work())


@pytest.mark.parametrize(("override", "message"), [
    ({"frame_count": str(MAX_FRAMES_PER_JOB + 1)}, f"over the limit of {MAX_FRAMES_PER_JOB} frames per job"),
    ({"frame_count": "0"}, "frame_count must be at least 1"),
    ({"frame_count": "4"}, "'image_3' is missing"),
    ({"notes": '["a", "b"]'}, "notes must be a JSON list of 3 strings"),
    ({"frame_times": "[3, 2, 1]"}, "frame_times must be in time order"),
    ({"frame_times": '[1, 2, "3"]'}, "frame_times[2] must be a JSON number"),
    ({"kind": "party"}, "kind must be one of sighting, event, fall"),
    ({"image_1": b"x" * (MAX_JOB_IMAGE_BYTES + 1)}, f"over the limit of {MAX_JOB_IMAGE_BYTES} bytes per job"),
])
def test_a_job_over_a_limit_or_malformed_is_dead_lettered_once_naming_it(redis_url, override, message):
    client = redis.Redis.from_url(redis_url)
    job = event_job()
    client.xadd(JOBS_STREAM, _raw(job, **override))
    client.xadd(JOBS_STREAM, _raw(job, **override))  # the same entry twice: each dead-lettered once
    captioner = DecodingCaptioner()
    run_worker(redis_url, captioner)
    dead = client.xrange(DEAD_STREAM)
    assert len(dead) == 2 and captioner.calls == 0
    assert all(message in fields[b"error"].decode() for _, fields in dead)
    assert client.xlen(JOBS_STREAM) == 0 and client.xlen(CAPTIONS_STREAM) == 0
    client.close()


def test_frames_are_captioned_as_one_prompt_and_kept_for_viewers(redis_url):
    job = event_job()
    enqueue(redis_url, [job])
    captioner = DecodingCaptioner()
    run_worker(redis_url, captioner)
    client = redis.Redis.from_url(redis_url)
    result = CaptionResult.from_fields(client.hgetall(result_key(job.job_id)))
    assert captioner.calls == 1
    assert result.caption == ("32x24: t=+0.0 s: person 4 note 0 | 40x24: t=+1.0 s: person 4 note 1 | "
                              "48x24: t=+2.0 s: person 4 note 2 | What did person 4 do?")
    assert (result.kind, result.track_id, result.start_ts, result.end_ts, result.frame_count) == \
        ("event", 4, 10.0, 12.0, 3)
    feed = CaptionResult.from_fields(client.xrange(CAPTIONS_STREAM)[0][1])
    assert feed == result
    for index, frame in enumerate(job.frames):
        kept = JobFrame.from_fields(client.hgetall(frame_key(job.job_id, index)))
        assert kept.image == frame.image and kept.detections == frame.detections
    assert not client.exists(frame_key(job.job_id, 3))
    client.close()


class OneImageCaptioner(DecodingCaptioner):
    """A captioner of one image per job: it refuses jobs of frames."""

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        return "one image"

    async def caption_frames(self, images: list[bytes], notes: list[str], prompt: str, priority: int,
                             schema: dict | None = None, cache_salt: str | None = None) -> str:
        raise ValueError(f"{type(self).__name__} takes one image per job; this job has {len(images)} frames")


def test_a_third_party_one_image_entry_works_unchanged_and_a_one_image_captioner_refuses_frames(redis_url):
    """An entry with only the fields the contract had before frames (no kind, no frame fields), XADDed by hand
    as another language's producer would: captioned through `caption`, its result a sighting of one frame. A job
    of frames its captioner refuses fails with the captioner's error."""
    client = redis.Redis.from_url(redis_url)
    old_style = {"job_id": "third-party-1", "camera_id": "lobby", "frame_ts": "7.5", "prompt": "Who is there?",
                 "image": jpeg(64, 48), "detections": json.dumps([{"x1": 1, "y1": 2, "x2": 30, "y2": 40,
                                                                   "confidence": 0.9}])}
    client.xadd(JOBS_STREAM, old_style)
    framed = event_job(camera="lobby")
    client.xadd(JOBS_STREAM, framed.to_fields())
    run_worker(redis_url, OneImageCaptioner(), max_deliveries=1)
    result = CaptionResult.from_fields(client.hgetall(result_key("third-party-1")))
    assert (result.status, result.caption, result.kind, result.frame_count) == ("done", "one image", "sighting", 1)
    assert (result.start_ts, result.end_ts, result.track_id) == (7.5, 7.5, None)
    failed = CaptionResult.from_fields(client.hgetall(result_key(framed.job_id)))
    assert failed.status == "failed"
    assert failed.error == "ValueError: OneImageCaptioner takes one image per job; this job has 3 frames"
    client.close()


def test_job_limits_hold_for_producers_too():
    with pytest.raises(ValueError, match=f"over the limit of {MAX_FRAMES_PER_JOB} frames per job"):
        Job.of_frames("c", "p", [JobImage(b"x", float(i)) for i in range(MAX_FRAMES_PER_JOB + 1)])
    with pytest.raises(ValueError, match="kind must be one of"):
        Job("c", 1.0, "p", b"x", [], kind="clip")
    assert Job("c", 1.0, "p", b"x", [], kind="fall").fall
