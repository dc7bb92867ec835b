"""Which frames become jobs. Frames without people never do. People are tracked so that one person is
not captioned on every frame: each track yields one job when it is first confirmed (its best frame of a
short window) and at most one more every `cooldown_seconds`, and a camera yields at most
`max_jobs_per_minute`. All times are frame times (`Frame.ts`), so the gate behaves the same whether a
file is read faster or slower than real time.

Falls: a tracked person seen on the ground (boxes of class FALL_CLASS, from the people-fall detector, with
a confidence of at least `fall_min_confidence`) in `fall_min_frames` frames yields a fall job
(`GatedFrame.fall`) on the frame that makes them enough: the best of those frames, without waiting for a
better one (an alert is wanted now; the track's event shows the rest); then no other fall job for that track
until `fall_cooldown_seconds` have passed. Fall jobs are not held by the per-camera rate cap (they are rare:
one per track and cooldown) and count as that track's next caption job."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jobqueue.checks import at_least, not_negative
from jobqueue.contract import FALL_CLASS, Detection
from pipeline.frame import Frame

DEFAULT_FALL_COOLDOWN_SECONDS = 300.0
DEFAULT_FALL_MIN_FRAMES = 2
# people-fall gives standing people at the edge of a photo a Fall box of about 0.3 now and then; the people
# lying on the ground of the sample and the test photo get about 0.7.
DEFAULT_FALL_MIN_CONFIDENCE = 0.5


@dataclass
class GatedFrame:
    """A frame chosen to become a job, with all its detections and the tracks it was chosen for."""

    frame: Frame
    detections: list[Detection]
    track_ids: list[int]
    fall: bool = False  # a fall alert for the tracks in track_ids


@dataclass
class _TrackState:
    next_due_ts: float  # when this track may yield its next job
    last_seen_ts: float
    emitted: bool = False
    best_score: float = -1.0
    best_frame: Frame | None = None
    best_detections: list[Detection] | None = None
    # Falls: sightings on the ground since the last fall job, and the best frame of them.
    fall_next_due_ts: float = float("-inf")
    fall_frames: int = 0
    fall_best_score: float = -1.0
    fall_frame: Frame | None = None
    fall_detections: list[Detection] | None = None


class Gate:
    def __init__(
        self,
        cooldown_seconds: float = 30.0,
        best_frame_window_seconds: float = 1.0,
        max_jobs_per_minute: int = 12,
        lost_after_seconds: float = 2.0,
        fall_cooldown_seconds: float = DEFAULT_FALL_COOLDOWN_SECONDS,
        fall_min_frames: int = DEFAULT_FALL_MIN_FRAMES,
        fall_min_confidence: float = DEFAULT_FALL_MIN_CONFIDENCE,
    ) -> None:
        for name, value in (("cooldown_seconds", cooldown_seconds),
                            ("best_frame_window_seconds", best_frame_window_seconds),
                            ("lost_after_seconds", lost_after_seconds),
                            ("fall_cooldown_seconds", fall_cooldown_seconds)):
            not_negative(name, value)
        at_least("max_jobs_per_minute", max_jobs_per_minute, 1)
        at_least("fall_min_frames", fall_min_frames, 1)
        self.fall_cooldown_seconds = fall_cooldown_seconds
        self.fall_min_frames = fall_min_frames
        self.fall_min_confidence = fall_min_confidence
        self.falls = 0  # fall jobs emitted
        self.cooldown_seconds = cooldown_seconds
        self.window_seconds = best_frame_window_seconds
        self.max_jobs_per_minute = max_jobs_per_minute
        self.lost_after_seconds = lost_after_seconds
        self.rate_limited = 0  # times a due job had to wait for the per-camera rate cap
        self._tracks: dict[int, _TrackState] = {}
        self._emitted_ts: deque[float] = deque()

    def update(self, frame: Frame, detections: list[Detection]) -> list[GatedFrame]:
        """Feed one frame's tracked detections; returns the frames to enqueue now (often none)."""
        for det in detections:
            if det.track_id is None:
                continue
            state = self._tracks.get(det.track_id)
            if state is None:
                state = self._tracks[det.track_id] = _TrackState(frame.ts + self.window_seconds, frame.ts)
            state.last_seen_ts = frame.ts
            score = det.confidence * det.area
            if score > state.best_score:
                state.best_score, state.best_frame, state.best_detections = score, frame, detections
            if self._is_fall(det) and frame.ts >= state.fall_next_due_ts:
                state.fall_frames += 1
                if score > state.fall_best_score:
                    state.fall_best_score, state.fall_frame, state.fall_detections = score, frame, detections
        return self._emit_due(frame.ts, flush=False)

    def flush(self) -> list[GatedFrame]:
        """At the end of a source: the pending first job of every track that has not had one yet
        (the rate cap still applies at the time of the last frame seen)."""
        if not self._tracks:
            return []
        return self._emit_due(max(state.last_seen_ts for state in self._tracks.values()), flush=True)

    def _is_fall(self, detection: Detection) -> bool:
        return detection.label == FALL_CLASS and detection.confidence >= self.fall_min_confidence

    def _emit_falls(self, now: float) -> list[GatedFrame]:
        """Fall jobs due now: tracks seen on the ground in enough frames. One job covers every due track on the
        ground in its frame."""
        due = {
            track_id for track_id, state in self._tracks.items()
            if state.fall_frames >= self.fall_min_frames and state.fall_frame is not None
        }
        out: list[GatedFrame] = []
        for track_id in sorted(due):
            if track_id not in due:
                continue  # covered by an earlier fall job of this round
            state = self._tracks[track_id]
            frame, detections = state.fall_frame, state.fall_detections or []
            covered = {d.track_id for d in detections if self._is_fall(d) and d.track_id in due}
            covered.add(track_id)
            out.append(GatedFrame(frame, detections, sorted(covered), fall=True))
            self.falls += 1
            for covered_id in covered:
                covered_state = self._tracks[covered_id]
                covered_state.fall_next_due_ts = now + self.fall_cooldown_seconds
                covered_state.fall_frames, covered_state.fall_best_score = 0, -1.0
                covered_state.fall_frame = covered_state.fall_detections = None
                # The fall job is also this track's caption job.
                covered_state.emitted = True
                covered_state.next_due_ts = now + self.cooldown_seconds
                covered_state.best_score, covered_state.best_frame, covered_state.best_detections = -1.0, None, None
            due -= covered
        return out

    def _emit_due(self, now: float, flush: bool) -> list[GatedFrame]:
        while self._emitted_ts and self._emitted_ts[0] <= now - 60.0:
            self._emitted_ts.popleft()
        out = self._emit_falls(now)
        due: set[int] = set()
        for track_id, state in list(self._tracks.items()):
            lost = now - state.last_seen_ts > self.lost_after_seconds
            if lost and (state.emitted or state.best_frame is None):
                del self._tracks[track_id]
                continue
            first_job_ends_track = (lost or flush) and not state.emitted
            if state.best_frame is not None and (now >= state.next_due_ts or first_job_ends_track):
                due.add(track_id)
        while due:
            if len(self._emitted_ts) >= self.max_jobs_per_minute:
                self.rate_limited += 1
                break
            frame, detections, covered = self._best_shared_frame(due)
            out.append(GatedFrame(frame, detections, sorted(covered)))
            self._emitted_ts.append(now)
            for track_id in covered:
                state = self._tracks[track_id]
                state.emitted = True
                state.next_due_ts = now + self.cooldown_seconds
                state.best_score, state.best_frame, state.best_detections = -1.0, None, None
            due -= covered
        return out

    def _best_shared_frame(self, due: set[int]) -> tuple[Frame, list[Detection], set[int]]:
        """Among the best frames of the due tracks, the one that shows the most of them (then the highest
        score), so people who appeared together share one job."""
        def covered(detections: list[Detection]) -> set[int]:
            return {d.track_id for d in detections if d.track_id in due}

        candidates = [self._tracks[t] for t in sorted(due)]
        best = max(candidates, key=lambda s: (len(covered(s.best_detections or [])), s.best_score))
        detections = best.best_detections or []
        return best.best_frame, detections, covered(detections)
