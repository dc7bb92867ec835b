"""Detection and gating on real photos: HOG finds the people of bus.jpg and nothing in empty scenes; the
gate turns a person standing still for many frames into one job per cooldown."""

from __future__ import annotations

import numpy as np
import pytest

from jobqueue.contract import Detection
from pipeline.detector import HogDetector
from pipeline.frame import Frame
from pipeline.gate import Gate
from pipeline.runner import validate_prompt_template
from pipeline.tracker import IoUTracker, tracking_function


@pytest.fixture(scope="module")
def hog() -> HogDetector:
    return HogDetector()


def test_hog_finds_people_in_the_street_photo_and_none_in_empty_scenes(hog, sample_maker):
    scenes = sample_maker.scenes()
    people = hog.detect(scenes["bus"])
    assert len(people) >= 1
    assert all(d.area > 0 and d.confidence > 0 for d in people)
    assert hog.detect(scenes["empty-blur"]) == []
    assert hog.detect(scenes["empty-dark"]) == []


def test_min_box_area_filters_small_boxes(sample_maker):
    scene = sample_maker.scenes()["bus"]
    all_boxes = HogDetector().detect(scene)
    largest = max(d.area for d in all_boxes)
    assert HogDetector(min_box_area=largest + 1).detect(scene) == []
    assert len(HogDetector(min_box_area=largest).detect(scene)) >= 1


def test_person_standing_still_yields_one_job_per_cooldown(hog, sample_maker):
    """60 s of the same street at 2 fps (120 frames) through HOG and the IoU tracker: with a 1 s
    best-frame window and a 20 s cooldown, jobs fall at 1.5 s (first confirmed at 0.5 s), 21.5 s and
    41.5 s: three jobs, each covering every person tracked."""
    scene = sample_maker.scenes()["bus"]
    people = hog.detect(scene)  # the frames are identical, so detect once and feed the tracker each frame
    tracker = IoUTracker()
    gate = Gate(cooldown_seconds=20.0, best_frame_window_seconds=1.0, max_jobs_per_minute=100)
    jobs = []
    for index in range(120):
        frame = Frame(scene, index * 0.5, index)
        jobs += [(frame.ts, g) for g in gate.update(frame, tracker.update(people))]
    jobs += [(None, g) for g in gate.flush()]
    assert [ts for ts, _ in jobs] == [1.5, 21.5, 41.5]
    track_ids = {tuple(g.track_ids) for _, g in jobs}
    assert track_ids == {tuple(range(1, len(people) + 1))}
    assert all(len(g.detections) == len(people) for _, g in jobs)


def test_gate_picks_the_best_frame_of_the_window():
    gate = Gate(cooldown_seconds=60.0, best_frame_window_seconds=2.0)
    image = np.zeros((10, 10, 3), np.uint8)
    scores = [0.5, 0.9, 0.6, 0.7, 0.4]  # confidences of one still box; frame 1 is the best
    emitted = []
    for index, confidence in enumerate(scores):
        emitted += gate.update(Frame(image, float(index), index), [Detection(0, 0, 4, 8, confidence, 7)])
    assert [g.frame.index for g in emitted] == [1]
    assert emitted[0].detections[0].confidence == 0.9


def test_track_seen_briefly_still_gets_its_first_job():
    gate = Gate(cooldown_seconds=60.0, best_frame_window_seconds=5.0, lost_after_seconds=1.0)
    image = np.zeros((10, 10, 3), np.uint8)
    assert gate.update(Frame(image, 0.0, 0), [Detection(0, 0, 4, 8, 0.8, 3)]) == []
    emitted = gate.update(Frame(image, 2.0, 1), [])  # gone before its window ended
    assert [g.track_ids for g in emitted] == [[3]]
    assert gate.flush() == []


def test_rate_cap_holds_jobs_of_many_people_per_camera():
    gate = Gate(cooldown_seconds=1000.0, best_frame_window_seconds=0.0, max_jobs_per_minute=3)
    image = np.zeros((10, 10, 3), np.uint8)
    emitted = []
    for index in range(10):  # a new person every second, each in a frame of their own
        det = Detection(index * 10, 0, index * 10 + 5, 8, 0.9, index + 1)
        emitted += gate.update(Frame(image, float(index), index), [det])
    assert len(emitted) == 3
    assert gate.rate_limited > 0
    # A minute later the cap has room again and the held first jobs come out.
    later = gate.update(Frame(image, 70.0, 99), [])
    assert len(later) == 3


def test_iou_tracker_confirms_on_second_frame_and_keeps_ids():
    tracker = IoUTracker(min_hits=2)
    first = tracker.update([Detection(0, 0, 10, 20, 0.9)])
    assert first[0].track_id is None
    second = tracker.update([Detection(1, 0, 11, 20, 0.9), Detection(100, 100, 110, 120, 0.8)])
    assert second[0].track_id == 1 and second[1].track_id is None
    third = tracker.update([Detection(100, 100, 110, 120, 0.8), Detection(2, 0, 12, 20, 0.9)])
    assert {d.track_id for d in third} == {1, 2}


def test_hog_has_no_tracker_of_its_own_so_the_iou_tracker_is_used(hog, sample_maker):
    track = tracking_function(hog)
    scene = sample_maker.scenes()["bus"]
    assert all(d.track_id is None for d in track(scene))
    assert all(d.track_id is not None for d in track(scene))


@pytest.mark.parametrize("template", ["Who is on {cam}?", "{count} people {where}", "broken {"])
def test_bad_prompt_template_is_named(template):
    with pytest.raises(ValueError, match="prompt template"):
        validate_prompt_template(template)
