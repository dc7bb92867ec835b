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


def result_key(job_id: str) -> str:
    return f"{RESULT_KEY_PREFIX}{job_id}"


def camera_captions_stream(camera_id: str) -> str:
    return f"{CAPTIONS_STREAM}:{camera_id}"


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
    sources, Unix time for live ones. `created_at` is Unix time of enqueueing."""

    camera_id: str
    frame_ts: float
    prompt: str
    image: bytes
    detections: list[Detection]
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)

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
            )
        except KeyError as missing:
            raise ValueError(f"job entry lacks field {missing}") from None
        except (TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"job entry has a malformed field: {err}") from None

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
