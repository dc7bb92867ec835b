"""The Redis queue contract between camera pipelines (producers) and queue workers (consumers).

Written once and imported by both sides, so a producer and a consumer of different versions agree on
every key and field as long as this module agrees.

Life of a job:

1. A producer `XADD`s the job to `JOBS_STREAM` and, in the same atomic step, writes the job's result
   hash `result_key(job_id)` with status `queued`.
2. A worker of `CONSUMER_GROUP` reads it (`XREADGROUP` or `XAUTOCLAIM`), marks the result `running`,
   captions the image, then in one atomic step finishes the result (`done` with the caption, or `failed`
   with the error and an entry on `DEAD_STREAM`), appends it to the caption feeds, `XACK`s and `XDEL`s
   the stream entry. Finishing is first-writer-wins per job_id, so a redelivered job never yields a
   second caption or a second dead-letter entry.

The job stream thus holds only outstanding jobs (waiting or in progress): its length is the backlog.

For viewers (the dashboard): a worker keeps each finished job's image and person boxes under
`frame_key(job_id)` for `FRAME_TTL_SECONDS`, and each camera pipeline publishes its counters every few
seconds to `camera_stats_key(camera_id)` (a hash with a TTL), listed in the sorted set `CAMERAS_INDEX`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum

JOBS_STREAM = "vlmcap:jobs"
DEAD_STREAM = "vlmcap:jobs:dead"
CONSUMER_GROUP = "vlmcap:workers"
# Feed of finished results (done and failed) for all cameras, and one per camera.
CAPTIONS_STREAM = "vlmcap:captions"
CAPTIONS_STREAM_MAXLEN = 10_000
RESULT_KEY_PREFIX = "vlmcap:result:"
# Finished results expire after a week; queued ones live as long as the job can wait.
RESULT_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_STREAM_MAXLEN = 1_000
DEAD_STREAM_MAXLEN = 10_000
# A finished job's image with its person boxes, for viewers; kept shorter than results (JPEGs are large).
FRAME_KEY_PREFIX = "vlmcap:frame:"
FRAME_TTL_SECONDS = 6 * 3600
# Camera counters published by each pipeline: a hash per camera that expires unless refreshed, and an
# index of camera ids scored by the Unix time of their latest publication.
CAMERAS_INDEX = "vlmcap:cameras"
CAMERA_STATS_KEY_PREFIX = "vlmcap:camera:"
CAMERA_STATS_TTL_SECONDS = 60
CAMERA_RATE_COUNTERS = ("captured", "skipped", "dropped", "detected", "enqueued")


def result_key(job_id: str) -> str:
    return f"{RESULT_KEY_PREFIX}{job_id}"


def camera_captions_stream(camera_id: str) -> str:
    return f"{CAPTIONS_STREAM}:{camera_id}"


def frame_key(job_id: str) -> str:
    return f"{FRAME_KEY_PREFIX}{job_id}"


def camera_stats_key(camera_id: str) -> str:
    return f"{CAMERA_STATS_KEY_PREFIX}{camera_id}"


def dead_letter_fields(job_fields: dict, error: str, deliveries: int) -> dict:
    """A dead-letter entry: the job's own fields (image included, so it can be inspected or replayed),
    the error that ended it, how often it was delivered and when it died."""
    return {**job_fields, "error": error, "deliveries": str(deliveries), "dead_at": repr(time.time())}


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


FINAL_STATUSES = (JobStatus.DONE.value, JobStatus.FAILED.value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decoded_fields(fields: dict) -> dict[str, bytes | str]:
    """Field names as str; values of the `image` field stay bytes, all others become str."""
    out: dict[str, bytes | str] = {}
    for key, value in fields.items():
        name = _text(key)
        out[name] = value if name == "image" else _text(value)
    return out


@dataclass
class Detection:
    """One person box in pixel coordinates of the full frame."""

    x1: float
    y1: float
    x2: float
    y2: float
    confidence: float
    track_id: int | None = None

    @property
    def area(self) -> float:
        return max(0.0, self.x2 - self.x1) * max(0.0, self.y2 - self.y1)


@dataclass
class Job:
    """One frame with people, to be captioned. `frame_ts` is seconds: the frame's position for file
    sources, Unix time for live ones. `created_at` is Unix time of enqueueing. `image_origin` is where the
    image's top-left corner lies in the full frame: (0, 0) unless the image is a crop."""

    camera_id: str
    frame_ts: float
    prompt: str
    image: bytes
    detections: list[Detection]
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    image_origin: tuple[int, int] = (0, 0)

    @property
    def person_count(self) -> int:
        return len(self.detections)

    def to_fields(self) -> dict[str, bytes | str]:
        return {
            "job_id": self.job_id,
            "camera_id": self.camera_id,
            "frame_ts": repr(self.frame_ts),
            "prompt": self.prompt,
            "image": self.image,
            "detections": json.dumps([asdict(d) for d in self.detections]),
            "person_count": str(self.person_count),
            "created_at": repr(self.created_at),
            "image_origin": json.dumps(list(self.image_origin)),
        }

    @classmethod
    def from_fields(cls, fields: dict) -> Job:
        """Decode a stream entry; raises ValueError naming the field that is missing or malformed."""
        values = _decoded_fields(fields)
        try:
            image = values["image"]
            return cls(
                job_id=str(values["job_id"]),
                camera_id=str(values["camera_id"]),
                frame_ts=float(values["frame_ts"]),
                prompt=str(values["prompt"]),
                image=image if isinstance(image, bytes) else image.encode(),
                detections=[Detection(**d) for d in json.loads(values["detections"])],
                created_at=float(values.get("created_at", time.time())),
                image_origin=tuple(json.loads(values.get("image_origin", "[0, 0]"))),
            )
        except KeyError as missing:
            raise ValueError(f"job entry lacks field {missing}") from None
        except (TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"job entry has a malformed field: {err}") from None

    def frame(self) -> JobFrame:
        """The job's image with its person boxes moved into the image's own pixel coordinates."""
        dx, dy = self.image_origin
        boxes = [Detection(d.x1 - dx, d.y1 - dy, d.x2 - dx, d.y2 - dy, d.confidence, d.track_id)
                 for d in self.detections]
        return JobFrame(image=self.image, detections=boxes)

    def queued_result(self) -> CaptionResult:
        return CaptionResult(
            id=self.job_id,
            status=JobStatus.QUEUED.value,
            camera_id=self.camera_id,
            created_at=self.created_at,
            frame_ts=self.frame_ts,
            person_count=self.person_count,
        )


@dataclass
class CaptionResult:
    """The state of one job as stored in `result_key(id)` and on the caption feeds."""

    id: str
    status: str
    camera_id: str
    created_at: float
    frame_ts: float
    person_count: int
    caption: str | None = None
    finished_at: float | None = None
    error: str | None = None
    deliveries: int = 0
    consumer: str | None = None  # the queue worker that finished the job

    def to_fields(self) -> dict[str, str]:
        return {name: str(value) for name, value in asdict(self).items() if value is not None}

    @classmethod
    def from_fields(cls, fields: dict) -> CaptionResult:
        values = {name: str(value) for name, value in _decoded_fields(fields).items()}
        try:
            return cls(
                id=values["id"],
                status=values["status"],
                camera_id=values["camera_id"],
                created_at=float(values["created_at"]),
                frame_ts=float(values["frame_ts"]),
                person_count=int(values["person_count"]),
                caption=values.get("caption"),
                finished_at=float(values["finished_at"]) if "finished_at" in values else None,
                error=values.get("error"),
                deliveries=int(values.get("deliveries", 0)),
                consumer=values.get("consumer"),
            )
        except KeyError as missing:
            raise ValueError(f"caption result lacks field {missing}") from None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class JobFrame:
    """A finished job's JPEG and its person boxes in that JPEG's pixel coordinates, as stored under
    `frame_key(job_id)`."""

    image: bytes
    detections: list[Detection]

    def to_fields(self) -> dict[str, bytes | str]:
        return {"image": self.image, "detections": json.dumps([asdict(d) for d in self.detections])}

    @classmethod
    def from_fields(cls, fields: dict) -> JobFrame:
        values = _decoded_fields(fields)
        try:
            image = values["image"]
            return cls(image=image if isinstance(image, bytes) else image.encode(),
                       detections=[Detection(**d) for d in json.loads(values["detections"])])
        except KeyError as missing:
            raise ValueError(f"job frame lacks field {missing}") from None


@dataclass
class CameraStats:
    """What a camera pipeline publishes to `camera_stats_key(camera_id)`: its counters since it started
    (`CameraPipeline.stats()`), and the per-second rates of `CAMERA_RATE_COUNTERS` over the interval since
    its previous publication. `status` is "running", or "stopped" once its source has ended."""

    camera_id: str
    status: str
    detector: str
    started_at: float
    updated_at: float
    counters: dict[str, int]
    rates: dict[str, float]

    def to_fields(self) -> dict[str, str]:
        return {
            "camera_id": self.camera_id, "status": self.status, "detector": self.detector,
            "started_at": repr(self.started_at), "updated_at": repr(self.updated_at),
            "counters": json.dumps(self.counters), "rates": json.dumps(self.rates),
        }

    @classmethod
    def from_fields(cls, fields: dict) -> CameraStats:
        values = {name: str(value) for name, value in _decoded_fields(fields).items()}
        try:
            return cls(camera_id=values["camera_id"], status=values["status"], detector=values["detector"],
                       started_at=float(values["started_at"]), updated_at=float(values["updated_at"]),
                       counters=json.loads(values["counters"]), rates=json.loads(values["rates"]))
        except KeyError as missing:
            raise ValueError(f"camera stats lack field {missing}") from None

    def to_json(self) -> dict:
        return asdict(self)
