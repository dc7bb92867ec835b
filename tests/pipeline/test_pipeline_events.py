"""Events end to end into a real Redis, with the trained people-fall detector: on the sample video and on a
second video made here (two people crossing in opposite directions, one of whom then lies on the ground), each
person track yields exactly one event job, its frames in time order, the tracked person's box drawn on them and
the tracker's notes consistent with the track; empty scenes yield nothing; a fall job carries the frames that led
up to it; `events=False` keeps one-frame jobs; a pipeline killed mid-event leaves only whole jobs on Redis."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import redis
from queue_support import stream_jobs

from jobqueue.contract import FALL_CLASS, JOBS_STREAM, RESULT_KEY_PREFIX, Detection, Job
from pipeline.detector import PEOPLE_FALL
from pipeline.events import EventRecorder, Sighting, note
from pipeline.frame import Frame
from pipeline.runner import CameraPipeline, PipelineConfig

VLMCAP = Path(sys.executable).with_name("vlmcap")


def run_camera(source: str, url: str, **config) -> tuple[dict, list[Job], set[int]]:
    """Run a camera; its stats, the jobs it queued and the track ids its tracker reported."""
    pipeline = CameraPipeline(PipelineConfig(source=source, camera_id="cam", redis_url=url, detector=PEOPLE_FALL,
                                             **config))
    tracks: set[int] = set()
    track = pipeline._track

    def observed(image: np.ndarray) -> list[Detection]:
        detections = track(image)
        tracks.update(d.track_id for d in detections if d.track_id is not None)
        return detections

    pipeline._track = observed
    return pipeline.run(), stream_jobs(url), tracks


def box_is_drawn(jpeg: bytes, box: Detection) -> bool:
    """The box's top edge is drawn in the pipeline's colour (green; red for a person on the ground)."""
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR).astype(int)
    row = image[int(box.y1), int(box.x1) + 2:int(box.x2) - 2]
    main = 2 if box.label == FALL_CLASS else 1
    coloured = (row[:, main] > 180) & (np.delete(row, main, axis=1) < 90).all(axis=1)
    return coloured.mean() > 0.8


def check_event(job: Job, size: int) -> None:
    """What every event job holds to: frames in time order within the track, its person's box drawn on each,
    notes naming the person with their time from the track's start."""
    assert job.job_kind == "event" and job.track_id is not None and 1 <= job.frame_count <= 6
    times = [frame.ts for frame in job.frames]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert job.prompt.startswith(f"Camera cam: these {job.frame_count} frames follow person {job.track_id} over ")
    for frame in job.frames:
        image = cv2.imdecode(np.frombuffer(frame.image, np.uint8), cv2.IMREAD_COLOR)
        assert max(image.shape[:2]) <= size
        [box] = frame.detections
        assert box.track_id == job.track_id and box_is_drawn(frame.image, box)
        match = re.match(rf"t=\+(\d+\.\d) s: person {job.track_id} (enters|\(entered|is|moves)", frame.note)
        assert match, frame.note
        offset = float(match.group(1))
        assert abs(offset - (frame.ts - times[0])) < 0.06 if match.group(2) == "enters" else offset >= 0
    assert "last seen at t=+" in job.frames[-1].note


@pytest.mark.timeout(240)
def test_sample_video_one_event_per_track(redis_url, sample_video, sample_maker, people_fall_weights):
    stats, jobs, tracks = run_camera(str(sample_video), redis_url, fps=2.5)
    events = [job for job in jobs if job.job_kind == "event"]
    assert sorted(job.track_id for job in events) == sorted(tracks), "exactly one event per track"
    assert stats["events"] == len(events) and stats["jobs"] == len(jobs)
    for job in events:
        check_event(job, 512)
        assert {sample_maker.segment_at(frame.ts) for frame in job.frames} <= sample_maker.PEOPLE_SEGMENTS
    sightings = [job for job in jobs if job.job_kind == "sighting"]
    assert sightings and all(job.frame_count == 1 and not job.frames for job in sightings)
    [fall] = [job for job in jobs if job.job_kind == "fall"]
    assert fall.fall and fall.frames[-1].detections[0].label == FALL_CLASS


@pytest.fixture(scope="module")
def crossing_video(tmp_path_factory, sample_maker) -> Path:
    return sample_maker.write_crossing_video(tmp_path_factory.mktemp("crossing") / "crossing.mp4")


@pytest.mark.timeout(240)
def test_two_people_crossing_one_falling(redis_url, crossing_video, sample_maker, people_fall_weights):
    """The walker (upper band, walking right) and the faller (lower band, walking left) each get one event whose
    boxes stay on them in every frame; the faller lying down is a track of its own, with a fall job ending on
    the frame of the fall."""
    stats, jobs, tracks = run_camera(str(crossing_video), redis_url, event_frame_size=320)
    events = {job.track_id: job for job in jobs if job.job_kind == "event"}
    assert sorted(events) == sorted(tracks) and len(events) == sum(job.job_kind == "event" for job in jobs)
    scale = 320 / 640
    by_band = {}
    for job in events.values():
        check_event(job, 320)
        centres = [((f.detections[0].x1 + f.detections[0].x2) / 2 / scale,
                    (f.detections[0].y1 + f.detections[0].y2) / 2 / scale) for f in job.frames]
        lying = job.frames[0].detections[0].label == FALL_CLASS
        band = "lying" if lying else "walker" if centres[0][1] < sample_maker.FALLER_TOP else "faller"
        assert band not in by_band, "one event per person"
        by_band[band] = (job, centres)
    assert set(by_band) == {"walker", "faller", "lying"}
    walker, faller = by_band["walker"][1], by_band["faller"][1]
    assert all(y < sample_maker.FALLER_TOP for _, y in walker)
    assert all(y > sample_maker.FALLER_TOP for _, y in faller)
    assert [x for x, _ in walker] == sorted(x for x, _ in walker) and walker[-1][0] - walker[0][0] > 300
    assert [x for x, _ in faller] == sorted((x for x, _ in faller), reverse=True)
    assert by_band["walker"][0].frame_count == by_band["faller"][0].frame_count == 6
    assert "moves right" in " ".join(f.note for f in by_band["walker"][0].frames)
    assert "moves left" in " ".join(f.note for f in by_band["faller"][0].frames)
    assert all("on the ground" in f.note for f in by_band["lying"][0].frames)
    [fall] = [job for job in jobs if job.job_kind == "fall"]
    assert fall.track_id == by_band["lying"][0].track_id and fall.fall
    assert fall.frames[-1].detections[0].label == FALL_CLASS and fall.end_ts <= by_band["lying"][0].end_ts
    assert [f.ts for f in fall.frames] == sorted(f.ts for f in fall.frames)
    assert stats["falls"] == 1


def test_empty_scenes_yield_no_event(redis_url, tmp_path, sample_maker, people_fall_weights):
    scenes = sample_maker.scenes()
    for index, name in enumerate(["empty-blur", "empty-dark"] * 3):
        cv2.imwrite(str(tmp_path / f"{index:02d}.jpg"), scenes[name])
    stats, jobs, tracks = run_camera(str(tmp_path), redis_url)
    assert (jobs, tracks, stats["events"]) == ([], set(), 0)


@pytest.mark.timeout(240)
def test_events_off_keeps_one_frame_jobs(redis_url, crossing_video, people_fall_weights):
    stats, jobs, _ = run_camera(str(crossing_video), redis_url, events=False, track_cooldown_seconds=2.0)
    assert jobs and stats["events"] == 0
    assert all(not job.frames and job.job_kind in ("sighting", "fall") for job in jobs)
    # The cooldown's repeats: some track has more than one job.
    ids = [job.track_id for job in jobs if job.track_id is not None]
    assert len(ids) > len(set(ids))


def _sighting(ts: float, x: float, confidence: float = 0.8, track_id: int = 1) -> tuple[Frame, Detection]:
    frame = Frame(np.zeros((100, 200, 3), np.uint8), ts, int(ts * 10))
    return frame, Detection(x, 10, x + 20, 60, confidence, track_id)


def test_recorder_spreads_frames_over_the_track_and_stays_bounded():
    """A track of 100 s at 10 fps: cut at max_seconds into events whose frames are the best of each stretch;
    at most BUCKETS_PER_FRAME x frames sightings are held at any time."""
    recorder = EventRecorder(frames=4, end_seconds=1.0, max_seconds=39.95)
    clips = []
    for step in range(1000):
        ts = step / 10
        frame, det = _sighting(ts, 50, confidence=0.9 if step % 37 == 0 else 0.5)
        clips += recorder.update(frame, [det])
        held = recorder._tracks[1].buckets if 1 in recorder._tracks else {}
        assert len(held) <= 16
    clips += recorder.flush()
    assert [(round(c.start_ts, 1), round(c.end_ts, 1), c.ended) for c in clips] == [
        (0.0, 40.0, False), (40.1, 80.1, False), (80.2, 99.9, True)]
    for clip in clips:
        times = [s.ts for s in clip.sightings]
        assert len(times) == 4 and times == sorted(times)
        span = (times[-1] - times[0])
        assert span > 0.6 * (clip.end_ts - clip.start_ts), "spread over the track's life"
    # The best sighting (confidence 0.9, every 3.7 s) of a stretch is chosen where one lies in it.
    assert sum(s.detection.confidence == 0.9 for s in clips[0].sightings) >= 3
    # The person did not enter at the start of the later events: they were in view before.
    assert note(clips[0], 0).startswith("t=+0.0 s: person 1 enters at the left")
    assert [c.continued for c in clips] == [False, True, True]
    assert all(note(c, 0).startswith(f"t=+{c.sightings[0].ts - c.start_ts:.1f} s: person 1 (in view since before")
               for c in clips[1:])


def test_recorder_lead_up_ends_on_the_fall_and_bad_settings_are_named():
    recorder = EventRecorder(frames=3, end_seconds=2.0, max_seconds=60.0)
    for step in range(20):
        recorder.update(*_sighting(step / 2, 10 + step)[:1], [_sighting(step / 2, 10 + step)[1]])
    frame, det = _sighting(10.0, 40)
    clip = recorder.lead_up(Sighting(frame, Detection(40, 10, 90, 30, 0.7, 1, FALL_CLASS)))
    assert [s.ts for s in clip.sightings][-1] == 10.0 and len(clip.sightings) == 3
    assert all(s.ts < 10.0 for s in clip.sightings[:-1]) and clip.start_ts == 0.0
    with pytest.raises(ValueError, match="event frames must be between 1 and 16"):
        EventRecorder(frames=17, end_seconds=1.0, max_seconds=10.0)
    with pytest.raises(ValueError, match=r"unknown placeholder\(s\) \{count\}"):
        PipelineConfig(source="x", camera_id="c", redis_url="redis://x", event_prompt="{count} frames")


@pytest.mark.timeout(240)
def test_a_pipeline_killed_mid_event_leaves_only_whole_jobs(redis_url, crossing_video, people_fall_weights):
    """`vlmcap pipeline` in real time, killed (SIGKILL) once its first job is on Redis, while both people's
    tracks are open: every entry on the stream is a whole job with a result of its own; the events in progress
    are lost, nothing half-written is left."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    camera = subprocess.Popen([str(VLMCAP), "pipeline", "--source", str(crossing_video), "--camera-id", "cam",
                               "--redis-url", redis_url, "--detector", PEOPLE_FALL, "--realtime"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 180
        while client.xlen(JOBS_STREAM) == 0:
            assert camera.poll() is None, "the pipeline ended before its first job"
            assert time.monotonic() < deadline, "no job within 180 s"
            time.sleep(0.05)
        camera.send_signal(signal.SIGKILL)
        camera.wait(30)
        entries = client.xrange(JOBS_STREAM)
        jobs = [Job.from_fields(fields) for _, fields in entries]
        results = sorted(key.decode()[len(RESULT_KEY_PREFIX):] for key in client.keys(RESULT_KEY_PREFIX + "*"))
        assert results == sorted(job.job_id for job in jobs)
        assert all(job.job_kind == "sighting" for job in jobs), "killed before any track ended"
    finally:
        if camera.poll() is None:
            camera.kill()
        client.close()
