"""Events: what one tracked person did, as one job of several frames. Every tracked sighting is recorded per
track; when a track ends (not seen for `end_seconds` of frame time) or has lasted `max_seconds`, its life is cut
into `frames` stretches of equal time and the best sighting of each (confidence x area) becomes a frame, with
the tracker's note before it (`t=+0.0 s: person 3 enters at the left`). A fall job takes the sightings that led
up to the fall the same way (`lead_up`).

Memory stays bounded whatever a track's length: a track keeps the best sighting of each time bucket, at most
BUCKETS_PER_FRAME buckets per frame asked for; when they are more, buckets double in width (the better sighting
of each pair is kept). Buckets nest, so the best sighting of a stretch is one of those kept."""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

from jobqueue.checks import not_negative, positive
from jobqueue.contract import FALL_CLASS, MAX_FRAMES_PER_JOB, Detection, JobImage
from pipeline.frame import Frame

BUCKETS_PER_FRAME = 4
FIRST_BUCKET_SECONDS = 0.05
BOX_COLOR = (0, 255, 0)  # BGR: the tracked person's box; pure green, which photos rarely have
FALL_BOX_COLOR = (0, 0, 255)  # red: the person is on the ground
# The text after an event's frames; {camera}, {track} (the person's track id), {frames} and {seconds} (the
# track's length) are filled in.
DEFAULT_EVENT_PROMPT = ("Camera {camera}: these {frames} frames follow person {track} over {seconds} s, boxed and "
                        "labelled in each frame. Describe what the person did, in order.")
EVENT_PROMPT_PLACEHOLDERS = {"camera", "track", "frames", "seconds"}


@dataclass
class Sighting:
    """A tracked person on one frame: the frame, their box and how many other people the frame shows."""

    frame: Frame
    detection: Detection
    others: int = 0

    @property
    def ts(self) -> float:
        return self.frame.ts

    @property
    def score(self) -> float:
        return self.detection.confidence * self.detection.area


@dataclass
class Clip:
    """The chosen sightings of one track (time order), the track's first sighting and its last time; `ended`:
    the track was lost (not cut at the event's longest length, nor a fall's lead-up)."""

    track_id: int
    sightings: list[Sighting]
    first: Sighting
    end_ts: float
    ended: bool
    continued: bool = False  # the track's earlier part was an event of its own (cut at max_seconds)

    @property
    def start_ts(self) -> float:
        return self.first.ts


@dataclass
class _Track:
    first: Sighting
    last: Sighting
    continued: bool = False
    width: float = FIRST_BUCKET_SECONDS
    buckets: dict[int, Sighting] = field(default_factory=dict)

    def add(self, sighting: Sighting, max_buckets: int) -> None:
        self.last = sighting
        self._keep(sighting)
        while len(self.buckets) > max_buckets:
            self.width *= 2
            kept = list(self.buckets.values())
            self.buckets = {}
            for old in kept:
                self._keep(old)

    def _keep(self, sighting: Sighting) -> None:
        bucket = int((sighting.ts - self.first.ts) // self.width)
        held = self.buckets.get(bucket)
        if held is None or sighting.score > held.score:
            self.buckets[bucket] = sighting

    def choose(self, frames: int, until: float | None = None) -> list[Sighting]:
        """Up to `frames` sightings (at or before `until`), the best of each of `frames` equal stretches."""
        candidates = sorted((s for s in self.buckets.values() if until is None or s.ts <= until),
                            key=lambda s: s.ts)
        if len(candidates) <= frames:
            return candidates
        start, end = candidates[0].ts, candidates[-1].ts
        span = (end - start) / frames
        chosen = []
        for stretch in range(frames):
            low, high = start + stretch * span, start + (stretch + 1) * span
            members = [s for s in candidates
                       if low <= s.ts < high or (stretch == frames - 1 and s.ts == end)]
            if members:
                chosen.append(max(members, key=lambda s: s.score))
        return chosen


class EventRecorder:
    """Per-track sightings in, clips of finished (or long) tracks out."""

    def __init__(self, frames: int, end_seconds: float, max_seconds: float) -> None:
        if not 1 <= frames <= MAX_FRAMES_PER_JOB:
            raise ValueError(f"event frames must be between 1 and {MAX_FRAMES_PER_JOB} (the job limit), got {frames}")
        not_negative("event end seconds", end_seconds)
        positive("event max seconds", max_seconds)
        self.frames = frames
        self.end_seconds = end_seconds
        self.max_seconds = max_seconds
        self._tracks: dict[int, _Track] = {}
        self._cut: dict[int, float] = {}  # tracks cut at max_seconds, by the time of their last sighting

    def update(self, frame: Frame, detections: list[Detection]) -> list[Clip]:
        """Record this frame's tracked people; the clips of tracks that ended or reached `max_seconds`."""
        tracked = [d for d in detections if d.track_id is not None]
        for det in tracked:
            sighting = Sighting(frame, det, len(detections) - 1)
            track = self._tracks.get(det.track_id)
            if track is None:
                continued = self._cut.pop(det.track_id, None) is not None
                self._tracks[det.track_id] = track = _Track(sighting, sighting, continued)
            track.add(sighting, BUCKETS_PER_FRAME * self.frames)
        self._cut = {t: ts for t, ts in self._cut.items() if frame.ts - ts <= self.end_seconds}
        clips = []
        for track_id, track in list(self._tracks.items()):
            lost = frame.ts - track.last.ts > self.end_seconds
            if lost or track.last.ts - track.first.ts >= self.max_seconds:
                clips.append(self._clip(track_id, track, ended=lost))
                del self._tracks[track_id]
                if not lost:
                    self._cut[track_id] = track.last.ts
        return clips

    def flush(self) -> list[Clip]:
        """At the end of the source: the clip of every open track."""
        clips = [self._clip(track_id, track, ended=True) for track_id, track in sorted(self._tracks.items())]
        self._tracks.clear()
        return clips

    def lead_up(self, last: Sighting) -> Clip:
        """The frames that led up to `last` (a fall): up to `frames - 1` of the track's earlier sightings, spread
        over its life so far, then `last`."""
        track_id = last.detection.track_id
        track = self._tracks.get(track_id) if track_id is not None else None
        if track is None:
            return Clip(track_id or 0, [last], last, last.ts, ended=False)
        earlier = [s for s in track.choose(self.frames - 1, until=last.ts) if s.ts < last.ts] if self.frames > 1 else []
        return Clip(track_id, [*earlier, last], track.first, last.ts, ended=False, continued=track.continued)

    def _clip(self, track_id: int, track: _Track, ended: bool) -> Clip:
        return Clip(track_id, track.choose(self.frames), track.first, track.last.ts, ended, track.continued)


# -- the job's frames and notes ---------------------------------------------------------------------------

def _where(det: Detection, width: int) -> str:
    centre = (det.x1 + det.x2) / 2 / width
    return "at the left" if centre < 1 / 3 else "at the right" if centre > 2 / 3 else "in the middle"


def note(clip: Clip, index: int) -> str:
    """The tracker's note before frame `index` of the clip: its time from the track's start, where the person
    is (where they entered, or that they were in view before a continued track's start; whether they moved by
    more than half their width since the frame before), whether on the ground, others in view; after the last
    frame of an ended track, when the person was last seen."""
    sighting = clip.sightings[index]
    det, width = sighting.detection, sighting.frame.image.shape[1]
    where = _where(det, width)
    if index == 0 and clip.continued:
        what = f"(in view since before t=+0.0 s) is {where}"
    elif index == 0:
        entered = _where(clip.first.detection, clip.first.frame.image.shape[1])
        what = f"enters {where}" if sighting is clip.first else f"(entered {entered} at t=+0.0 s) is {where}"
    else:
        previous = clip.sightings[index - 1].detection
        shift = ((det.x1 + det.x2) - (previous.x1 + previous.x2)) / 2
        moved = abs(shift) > (det.x2 - det.x1) / 2
        what = f"moves {'right' if shift > 0 else 'left'}, now {where}" if moved else f"is {where}"
    parts = [f"t=+{sighting.ts - clip.start_ts:.1f} s: person {clip.track_id} {what}"]
    if det.label == FALL_CLASS:
        parts.append("on the ground")
    if sighting.others:
        parts.append(f"{sighting.others} other {'person' if sighting.others == 1 else 'people'} in view")
    text = ", ".join(parts)
    if index == len(clip.sightings) - 1 and clip.ended:
        text += f"; last seen at t=+{clip.end_ts - clip.start_ts:.1f} s"
    return text


def labelled_frame(sighting: Sighting, track_id: int, size: int, jpeg_quality: int) -> tuple[bytes, Detection]:
    """The frame scaled so that its longer side is at most `size` pixels, the person's box drawn and labelled
    `person <track_id>` (red when on the ground); the JPEG and the box in its pixels."""
    image: np.ndarray = sighting.frame.image
    height, width = image.shape[:2]
    scale = min(1.0, size / max(height, width))
    if scale < 1.0:
        image = cv2.resize(image, (max(1, round(width * scale)), max(1, round(height * scale))),
                           interpolation=cv2.INTER_AREA)
    else:
        image = image.copy()
    det = sighting.detection
    box = Detection(det.x1 * scale, det.y1 * scale, det.x2 * scale, det.y2 * scale, det.confidence, det.track_id,
                    det.label)
    color = FALL_BOX_COLOR if det.label == FALL_CLASS else BOX_COLOR
    top_left, bottom_right = (int(box.x1), int(box.y1)), (int(box.x2), int(box.y2))
    cv2.rectangle(image, top_left, bottom_right, color, 2)
    label = f"person {track_id}"
    (text_w, text_h), baseline = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, 0.5, 1)
    text_top = max(0, top_left[1] - text_h - baseline - 2)
    cv2.rectangle(image, (top_left[0], text_top), (top_left[0] + text_w + 4, text_top + text_h + baseline + 2),
                  color, -1)
    cv2.putText(image, label, (top_left[0] + 2, text_top + text_h + 1), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1,
                cv2.LINE_AA)
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for an image of shape {image.shape}")
    return encoded.tobytes(), box


def clip_frames(clip: Clip, size: int, jpeg_quality: int) -> list[JobImage]:
    """The clip as a job's frames: each labelled and scaled, with its note."""
    frames = []
    for index, sighting in enumerate(clip.sightings):
        jpeg, box = labelled_frame(sighting, clip.track_id, size, jpeg_quality)
        frames.append(JobImage(jpeg, sighting.ts, note(clip, index), [box]))
    return frames
