"""Bounds at the root of a job (jobqueue/contract.py): its boxes (a frame's count and their JSON's size), the
pixels its frames declare, and its camera id (the one pattern the server's routes filter on). A worker
dead-letters each hostile job once while a plain job beside it gets its caption."""

from __future__ import annotations

import asyncio
import json
import re

import cv2
import numpy as np
import pytest
import redis
from pydantic import TypeAdapter, ValidationError
from queue_support import DecodingCaptioner, make_job, work_until_idle

from api.routes_captions import CameraId
from jobqueue.consumer import QueueWorker
from jobqueue.contract import (
    CAMERA_ID_PATTERN,
    CAPTIONS_STREAM,
    DEAD_STREAM,
    JOB_SCHEMA_PATH,
    JOBS_STREAM,
    MAX_BOXES_PER_FRAME,
    MAX_JOB_PIXELS,
    Job,
    JobImage,
    declared_pixels,
)

BOX = {"x1": 1.0, "y1": 2.0, "x2": 30.0, "y2": 40.0, "confidence": 0.9}


def entry(job: Job, **override: str | bytes) -> dict[bytes, bytes]:
    fields = {**job.to_fields(), **override}
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def declaring(width: int, height: int) -> bytes:
    """A small JPEG whose header (SOF0) declares width x height."""
    data = bytearray(cv2.imencode(".jpg", np.full((8, 8, 3), 90, np.uint8))[1].tobytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def test_a_frame_s_boxes_are_capped_by_count_and_by_size():
    job = make_job()
    assert len(Job.from_fields(entry(job, detections=json.dumps([BOX] * MAX_BOXES_PER_FRAME))).detections) == 300
    with pytest.raises(ValueError, match=f"301 boxes, over the limit of {MAX_BOXES_PER_FRAME}"):
        Job.from_fields(entry(job, detections=json.dumps([BOX] * (MAX_BOXES_PER_FRAME + 1))))
    with pytest.raises(ValueError, match="detections is .* characters, over the limit"):
        Job.from_fields(entry(job, detections=json.dumps([BOX] * 100_000)))
    frames = Job.of_frames("cam", "p", [JobImage(job.image, 0.0), JobImage(job.image, 1.0)])
    with pytest.raises(ValueError, match=r"frame_detections\[1\] has 301 boxes"):
        Job.from_fields(entry(frames, frame_detections=json.dumps([[BOX], [BOX] * 301])))


def test_a_job_s_frames_declare_at_most_max_job_pixels():
    assert declared_pixels(declaring(4000, 3000)) == 12_000_000 and declared_pixels(b"not an image") is None
    big = declaring(8000, 5000)  # 40 MP: with a 12 MP one it passes, eight of them do not
    two = Job.of_frames("cam", "p", [JobImage(big, 0.0), JobImage(declaring(4000, 3000), 1.0)])
    assert Job.from_fields(entry(two)).frame_count == 2
    eight = Job.of_frames("cam", "p", [JobImage(big, float(i)) for i in range(8)])
    with pytest.raises(ValueError, match=f"320000000 pixels, over the limit of {MAX_JOB_PIXELS}"):
        Job.from_fields(entry(eight))
    with pytest.raises(ValueError, match="pixels per job"):
        Job.from_fields(entry(make_job(image=declaring(9000, 9000))))


@pytest.mark.parametrize("camera", ["cam 7", "<b>gate</b>", "a/b", "x" * 129, "caméra"])
def test_a_camera_id_the_routes_cannot_filter_on_is_refused(camera):
    with pytest.raises(ValueError, match="camera_id must be 1-128 letters"):
        Job.from_fields(entry(make_job(), camera_id=camera))
    assert Job.from_fields(entry(make_job(camera_id="gate:1.a_b-c"))).camera_id == "gate:1.a_b-c"


def test_the_camera_id_pattern_is_the_routes_and_the_schema_s():
    route = TypeAdapter(CameraId)
    for camera in ("gate:1.a_b-c", "cam 7", "<b>gate</b>", "a/b", "x" * 128, "x" * 129, "caméra", ""):
        try:
            route.validate_python(camera)
            routes_take = True
        except ValidationError:
            routes_take = False
        assert routes_take == bool(re.fullmatch(CAMERA_ID_PATTERN, camera)), camera
    schema = json.loads(JOB_SCHEMA_PATH.read_text())
    assert schema["properties"]["camera_id"]["pattern"] == CAMERA_ID_PATTERN
    assert re.fullmatch(CAMERA_ID_PATTERN, "gate:1.a_b-c")


@pytest.mark.timeout(120)
def test_hostile_jobs_are_dead_lettered_once_beside_a_plain_one(redis_url):
    client = redis.Redis.from_url(redis_url)
    hostile = [entry(make_job(), detections=json.dumps([BOX] * 100_000)),
               entry(make_job(), camera_id="cam 7"),
               entry(make_job(image=declaring(9000, 9000)))]
    for fields in hostile:
        client.xadd(JOBS_STREAM, fields)
    plain = make_job(camera_id="porch")
    client.xadd(JOBS_STREAM, entry(plain))

    async def scenario() -> int:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)
        await worker.redis.aclose()
        return worker.stats.dead

    assert asyncio.run(scenario()) == 3
    dead = [fields[b"error"].decode() for _, fields in client.xrange(DEAD_STREAM)]
    assert len(dead) == 3
    assert any("boxes" in e or "characters" in e for e in dead) and any("camera_id" in e for e in dead)
    assert any("pixels" in e for e in dead)
    (_, done), = client.xrange(CAPTIONS_STREAM)
    assert done[b"id"].decode() == plain.job_id and done[b"caption"].startswith(b"64x48")
    client.close()
