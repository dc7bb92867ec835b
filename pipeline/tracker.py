"""Person tracks across frames: the detector's own tracker when it has one (ultralytics' ByteTrack), else
greedy IoU matching, so the gate can tell one person seen on many frames from many people."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from jobqueue.contract import Detection


def iou(a: Detection, b: Detection) -> float:
    inter_w = min(a.x2, b.x2) - max(a.x1, b.x1)
    inter_h = min(a.y2, b.y2) - max(a.y1, b.y1)
    if inter_w <= 0 or inter_h <= 0:
        return 0.0
    inter = inter_w * inter_h
    return inter / (a.area + b.area - inter)


@dataclass
class _IoUTrack:
    track_id: int
    box: Detection
    hits: int = 1
    missed: int = 0


class IoUTracker:
    """Greedy IoU matching frame to frame, for detectors without a tracker of their own (HOG). A track
    is confirmed after `min_hits` matched frames, like ByteTrack's activation on its second frame, and
    forgotten after `max_missed` frames without a match."""

    def __init__(self, iou_threshold: float = 0.3, min_hits: int = 2, max_missed: int = 5) -> None:
        self.iou_threshold = iou_threshold
        self.min_hits = min_hits
        self.max_missed = max_missed
        self._tracks: list[_IoUTrack] = []
        self._next_id = 1

    def update(self, detections: list[Detection]) -> list[Detection]:
        """The detections with `track_id` set for confirmed tracks and None for the others."""
        pairs = sorted(
            ((iou(track.box, det), t, d)
             for t, track in enumerate(self._tracks) for d, det in enumerate(detections)),
            key=lambda pair: pair[0],
            reverse=True,
        )
        matched_tracks: set[int] = set()
        track_of_detection: dict[int, _IoUTrack] = {}
        for overlap, t, d in pairs:
            if overlap < self.iou_threshold:
                break
            if t in matched_tracks or d in track_of_detection:
                continue
            matched_tracks.add(t)
            track = self._tracks[t]
            track.box, track.hits, track.missed = detections[d], track.hits + 1, 0
            track_of_detection[d] = track
        for t, track in enumerate(self._tracks):
            if t not in matched_tracks:
                track.missed += 1
        self._tracks = [track for track in self._tracks if track.missed <= self.max_missed]
        for d, det in enumerate(detections):
            if d not in track_of_detection:
                track_of_detection[d] = _IoUTrack(self._next_id, det)
                self._tracks.append(track_of_detection[d])
                self._next_id += 1
        return [
            replace(det, track_id=track.track_id if track.hits >= self.min_hits else None)
            for det, track in ((det, track_of_detection[d]) for d, det in enumerate(detections))
        ]


def tracking_function(detector) -> Callable[[np.ndarray], list[Detection]]:
    """Frame -> detections with track ids: the detector's own tracker when it has a usable one
    (ultralytics' ByteTrack), else its detections through an IoUTracker."""
    if getattr(detector, "can_track", False):
        return detector.track
    tracker = IoUTracker()
    return lambda image: tracker.update(detector.detect(image))
