"""The camera pipeline end to end into a real Redis: only frames with people become jobs (HOG on the
sample video of real photos), each job decodes through the contract, and the YOLO path runs through the
real ultralytics code with an untrained model built from its YAML."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import redis

from pipeline.contract import JOBS_STREAM, CaptionResult, Job, result_key
from pipeline.detector import DetectorUnavailable, HogDetector, YoloDetector, load_detector
from pipeline.runner import Annotate, CameraPipeline, PipelineConfig


def _stream_jobs(url: str) -> list[Job]:
    client = redis.Redis.from_url(url)
    try:
        return [Job.from_fields(fields) for _, fields in client.xrange(JOBS_STREAM)]
    finally:
        client.close()


def test_only_frames_with_people_are_enqueued(redis_url, sample_video, sample_maker):
    config = PipelineConfig(source=str(sample_video), camera_id="gate-1", redis_url=redis_url, detector="hog",
                            prompt="Camera {camera}: {count} people. What are they doing?")
    pipeline = CameraPipeline(config)
    stats = pipeline.run()
    jobs = _stream_jobs(redis_url)

    assert stats["captured"] == 50
    assert 0 < stats["detected"] < 50
    assert stats["enqueued"] == stats["jobs"] == len(jobs) >= 1
    segments = {sample_maker.segment_at(job.frame_ts) for job in jobs}
    assert "bus" in segments
    assert segments <= sample_maker.PEOPLE_SEGMENTS

    client = redis.Redis.from_url(redis_url)
    for job in jobs:
        assert job.camera_id == "gate-1"
        assert job.person_count >= 1
        assert job.prompt == f"Camera gate-1: {job.person_count} people. What are they doing?"
        image = cv2.imdecode(np.frombuffer(job.image, np.uint8), cv2.IMREAD_COLOR)
        assert image.shape == (480, 640, 3)
        assert HogDetector().detect(image), "every job's image shows people"
        result = CaptionResult.from_fields(client.hgetall(result_key(job.job_id)))
        assert (result.status, result.person_count, result.frame_ts) == ("queued", job.person_count, job.frame_ts)
    client.close()


@pytest.mark.parametrize("annotate", [Annotate.CROP, Annotate.BOXES])
def test_job_image_can_be_cropped_or_boxed(redis_url, sample_video, annotate):
    config = PipelineConfig(source=str(sample_video), camera_id="c", redis_url=redis_url, detector="hog",
                            annotate=annotate, fps=2.0)
    CameraPipeline(config).run()
    jobs = _stream_jobs(redis_url)
    assert jobs
    for job in jobs:
        image = cv2.imdecode(np.frombuffer(job.image, np.uint8), cv2.IMREAD_COLOR)
        if annotate is Annotate.CROP:
            assert image.shape[0] < 480 or image.shape[1] < 640
        else:  # boxes drawn in pure green, a colour the photos do not have
            assert image.shape == (480, 640, 3)
            green = (image[:, :, 1] > 200) & (image[:, :, 0] < 60) & (image[:, :, 2] < 60)
            assert green.sum() > 100


@pytest.fixture(scope="module")
def untrained_yolo_weights(tmp_path_factory) -> str:
    from ultralytics import YOLO

    path = tmp_path_factory.mktemp("yolo") / "yolo26n-untrained.pt"
    YOLO("yolo26n.yaml").save(path)
    return str(path)


@pytest.mark.timeout(120)
def test_yolo_path_runs_through_ultralytics(redis_url, sample_video, untrained_yolo_weights):
    config = PipelineConfig(source=str(sample_video), camera_id="yolo-cam", redis_url=redis_url,
                            detector=untrained_yolo_weights, fps=1.0, imgsz=320, conf=0.01)
    pipeline = CameraPipeline(config)
    assert isinstance(pipeline.detector, YoloDetector)
    assert pipeline.detector.name == "yolo:yolo26n-untrained.pt"
    stats = pipeline.run()
    assert stats["captured"] == 50 and stats["skipped"] == 40
    # Untrained weights: boxes mean nothing, but whatever was enqueued came from frames with detections.
    assert stats["enqueued"] == len(_stream_jobs(redis_url)) <= stats["detected"]


def test_yolo_detections_are_persons_in_frame_coordinates(untrained_yolo_weights, sample_maker):
    detector = YoloDetector(untrained_yolo_weights, conf=0.001, imgsz=320)
    scene = sample_maker.scenes()["bus"]
    for detections in (detector.detect(scene), detector.track(scene) if detector.can_track else []):
        for det in detections:
            assert 0 <= det.x1 <= det.x2 <= 640 and 0 <= det.y1 <= det.y2 <= 480
            assert det.confidence >= 0.001


def test_missing_default_yolo_weights_fall_back_to_hog(caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no yolo26n.pt here, and no network to download it
    detector = load_detector(None)
    assert isinstance(detector, HogDetector)
    assert "falling back to the HOG people detector" in caplog.text


def test_explicit_detector_that_cannot_load_is_an_error(tmp_path):
    missing = str(tmp_path / "nope.pt")
    with pytest.raises(DetectorUnavailable, match="nope.pt"):
        load_detector(missing)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("camera_id", " ", "camera id"),
    ("prompt", "{camera} at {time}", "{time}"),
    ("jpeg_quality", 0, "jpeg_quality"),
])
def test_bad_pipeline_config_is_named(redis_url, sample_video, field, value, message):
    kwargs = {"source": str(sample_video), "camera_id": "c", "redis_url": redis_url, field: value}
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        PipelineConfig(**kwargs)
