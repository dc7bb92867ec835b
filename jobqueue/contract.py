"""The Redis queue contract between camera pipelines (producers) and queue workers (consumers).

Written once and imported by both sides, so a producer and a consumer of different versions agree on
every key and field as long as this module agrees.

Life of a job:

1. A producer `XADD`s the job to `JOBS_STREAM` and, in the same atomic step, writes the job's result
   hash `result_key(job_id)` with status `queued`.
2. A worker of `CONSUMER_GROUP` reads it (`XREADGROUP` or `XAUTOCLAIM`) and marks the result `claimed` (with
   its name as `consumer` and `claimed_at`) while the job waits for one of its slots; it marks it `running`
   (`started_at`) when it hands the job to its captioner, captions the image, then in one atomic step
   finishes the result (`done` with the caption, or `failed` with the error and an entry on `DEAD_STREAM`),
   appends it to the caption feeds, `XACK`s and `XDEL`s the stream entry. Finishing is first-writer-wins
   per job_id, so a redelivered job never yields a second caption or a second dead-letter entry. A worker
   that stops hands the jobs it claimed and never started back (`queued` again; another claims them).

The job stream thus holds only outstanding jobs (waiting or in progress): its length is the backlog.

For viewers (the dashboard): a worker keeps each finished job's image and person boxes under
`frame_key(job_id)` for `FRAME_TTL_SECONDS`, and each camera pipeline publishes its counters every few
seconds to `camera_stats_key(camera_id)` (a hash with a TTL), listed in the sorted set `CAMERAS_INDEX`.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path

from jobqueue.checks import at_least

JOBS_STREAM = "vlmcap:jobs"
DEAD_STREAM = "vlmcap:jobs:dead"
CONSUMER_GROUP = "vlmcap:workers"
# Feed of finished results (done and failed) for all cameras, and one per camera.
CAPTIONS_STREAM = "vlmcap:captions"
CAPTIONS_STREAM_MAXLEN = 10_000
# Feed of finished fall alerts (results of jobs with `fall` set), capped like the caption feeds.
ALERTS_STREAM = "vlmcap:alerts"
# Box classes: a person on the ground (the people-fall detector's "Fall"), and the class of boxes from
# detectors (and older producers) that have no other.
FALL_CLASS = "Fall"
PERSON_CLASS = "person"
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
# What a job is: a first sighting of people (one frame), an event (a tracked person's frames over its life)
# or a fall alert (the frames that led up to a person seen on the ground).
JOB_KINDS = ("sighting", "event", "fall")
# A job with several frames: at most this many, of at most this many bytes together (JPEGs), each frame's
# note (the tracker's text before it) at most MAX_NOTE_CHARS characters.
MAX_FRAMES_PER_JOB = 16
MAX_JOB_IMAGE_BYTES = 16 * 1024 * 1024
# A job's clip (`Job.video`): a short encoded video; the server's video limits (duration, frames) apply too.
MAX_JOB_VIDEO_BYTES = 16 * 1024 * 1024
VIDEO_FIELD = "video"
MAX_NOTE_CHARS = 2_000
# A camera's id: what the server's routes take (`?camera=`, `/cameras/{id}`), so every job's camera can be
# filtered on; a job with another is dead-lettered.
CAMERA_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
# The person boxes of one frame: at most this many (a detector's own cap: ultralytics' max_det), their JSON at
# most this many characters, so that no job's boxes cost the worker more than a few milliseconds to parse.
MAX_BOXES_PER_FRAME = 300
MAX_BOXES_JSON_CHARS = MAX_BOXES_PER_FRAME * 400
# The pixels of a job's frames together, as their headers say (stills decode at the size they declare): what a
# job's decoding may take, besides the bytes (16 frames of 4 MP, or 1 of 64 MP).
MAX_JOB_PIXELS = 64_000_000
# Camera summaries over time windows (api/routes_summaries.py): one stream per camera.
SUMMARIES_STREAM_PREFIX = "vlmcap:summaries:"
# The job entry's fields as a JSON Schema, for producers written in other languages (docs/pipeline-and-queue.md:
# "Sending jobs from your own system"); `Job.from_fields` is the check that decides, the schema documents it.
JOB_SCHEMA_PATH = Path(__file__).with_name("job.schema.json")


def result_key(job_id: str) -> str:
    return f"{RESULT_KEY_PREFIX}{job_id}"


def camera_captions_stream(camera_id: str) -> str:
    return f"{CAPTIONS_STREAM}:{camera_id}"


def frame_key(job_id: str, index: int = 0) -> str:
    """Where a finished job's frame `index` is kept for viewers (frame 0 of every job, the others of a job with
    several frames)."""
    return f"{FRAME_KEY_PREFIX}{job_id}" if index == 0 else f"{FRAME_KEY_PREFIX}{job_id}:{index}"


def image_field(index: int) -> str:
    """The stream field of a job's frame `index`: `image` for the first (or only) one, `image_<index>` after."""
    return "image" if index == 0 else f"image_{index}"


def is_image_field(name: str) -> bool:
    return name == "image" or (name.startswith("image_") and name[6:].isdigit())


def is_binary_field(name: str) -> bool:
    """The fields whose values are bytes, not text: the images and the clip."""
    return is_image_field(name) or name == VIDEO_FIELD


def camera_stats_key(camera_id: str) -> str:
    return f"{CAMERA_STATS_KEY_PREFIX}{camera_id}"


def summaries_stream(camera_id: str) -> str:
    """The periodic summaries of one camera (`vlmcap serve --summary-every`), capped like the caption feeds."""
    return f"{SUMMARIES_STREAM_PREFIX}{camera_id}"


def dead_letter_fields(job_fields: dict, error: str, deliveries: int) -> dict:
    """A dead-letter entry: the job's own fields (image included, so it can be inspected or replayed),
    the error that ended it, how often it was delivered and when it died."""
    return {**job_fields, "error": error, "deliveries": str(deliveries), "dead_at": repr(time.time())}


def flat(fields: dict) -> list:
    """Fields as the flat name, value, name, value... list that Lua scripts take."""
    return [item for pair in fields.items() for item in pair]


class JobStatus(str, Enum):
    """A result's state: queued (on the stream, or back there after a failed attempt), claimed (read by the
    worker named in `consumer`, waiting there for a slot), running (being captioned), done or failed (final)."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


FINAL_STATUSES = (JobStatus.DONE.value, JobStatus.FAILED.value)


def as_text(value: bytes | str) -> str:
    """A Redis reply's bytes as str (clients here do not decode responses: images stay bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def _decoded_fields(fields: dict) -> dict[str, bytes | str]:
    """Field names as str; values of the image fields (`image`, `image_<n>`) and of the clip (`video`) stay bytes,
    all others become str."""
    out: dict[str, bytes | str] = {}
    for key, value in fields.items():
        name = as_text(key)
        out[name] = value if is_binary_field(name) else as_text(value)
    return out


# -- field checks: each raises ValueError naming the field and the value it got -------------------------

def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def finite_number(name: str, value: object) -> float:
    """A finite float from a JSON number or a stream field's text ("1.5"); not NaN, not infinite."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{name} must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {_shown(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
    return number


def integer(name: str, value: object) -> int:
    """An int from a JSON integer or a stream field's text ("3"); not a bool, not 1.5."""
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise ValueError(f"{name} must be an integer, got {_shown(value)}")
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_shown(value)}")
    return value


def text(name: str, value: object, max_length: int = 100_000) -> str:
    """A non-empty string of at most `max_length` characters."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {_shown(value)}")
    if len(value) > max_length:
        raise ValueError(f"{name} is {len(value)} characters, over the limit of {max_length}")
    return value


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_shown(value)}")
    return value


def flag(name: str, value: object) -> bool:
    """A stream field's boolean, written as the text "true" or "false"."""
    if value not in ("true", "false"):
        raise ValueError(f"{name} must be 'true' or 'false', got {_shown(value)}")
    return value == "true"


def flag_text(value: bool) -> str:
    return "true" if value else "false"


def labels_from_json(name: str, value: str) -> list[str]:
    """A stream field holding a JSON list of class names (non-empty strings)."""
    labels = json_field(name, value)
    if not isinstance(labels, list):
        raise ValueError(f"{name} must be a JSON list of class names, got {_shown(labels)}")
    return [text(f"{name}[{i}]", label, 256) for i, label in enumerate(labels)]


def _optional(check: Callable[[str, object], object]) -> Callable[[str, object], object]:
    return lambda name, value: None if value is None else check(name, value)


def _json_number(check: Callable[[str, object], object]) -> Callable[[str, object], object]:
    """Inside JSON a number is a JSON number, not a string that reads as one."""
    def checked(name: str, value: object) -> object:
        if isinstance(value, str):
            raise ValueError(f"{name} must be a JSON number, got the string {_shown(value)}")
        return check(name, value)
    return checked


# The check of a JSON object's field by its dataclass annotation: a field added to `Detection` with one of
# these types is validated with no other change.
FIELD_CHECKS: dict[str, Callable[[str, object], object]] = {
    "float": _json_number(finite_number), "int": _json_number(integer), "str": text, "bool": boolean,
    "float | None": _optional(_json_number(finite_number)), "int | None": _optional(_json_number(integer)),
    "str | None": _optional(text), "bool | None": _optional(boolean),
}


def json_field(name: str, value: str) -> object:
    """A field that holds JSON text, parsed strictly (no NaN or Infinity, bounded nesting)."""
    def refuse(constant: str) -> object:
        raise ValueError(f"{name} holds {constant}, which is not JSON")

    try:
        return json.loads(value, parse_constant=refuse)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} is not valid JSON ({err}): {_shown(value)}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply") from None


def _dataclass_from_json(cls: type, value: object, where: str) -> object:
    """An instance of dataclass `cls` from a JSON object, each field checked by its annotation; fields the
    class does not know are ignored (a newer producer may send more)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {_shown(value)}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in value:
            if _has_default(f):
                continue
            raise ValueError(f"{where} lacks field {f.name!r}")
        check = FIELD_CHECKS.get(str(f.type))
        if check is None:
            raise TypeError(f"{cls.__name__}.{f.name}: no check for the type {f.type!r} (add it to FIELD_CHECKS)")
        kwargs[f.name] = check(f"{where}.{f.name}", value[f.name])
    return cls(**kwargs)


def _has_default(f: Field) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


@dataclass
class Detection:
    """One person box in pixel coordinates of the full frame."""

    x1: float
    y1: float
    x2: float
    y2: float
    confidence: float
    track_id: int | None = None
    label: str | None = None  # the detector's class ("person", "Normal", FALL_CLASS); None from older producers

    @property
    def area(self) -> float:
        return max(0.0, self.x2 - self.x1) * max(0.0, self.y2 - self.y1)

    @classmethod
    def from_json(cls, value: object, where: str = "detection") -> Detection:
        """A detection from its JSON object: every field of the right type, numbers finite, the box
        ordered (x1 <= x2, y1 <= y2); ValueError naming the field otherwise."""
        detection = _dataclass_from_json(cls, value, where)
        assert isinstance(detection, Detection)
        if detection.x2 < detection.x1 or detection.y2 < detection.y1:
            raise ValueError(f"{where} is a reversed box: ({detection.x1}, {detection.y1}) to "
                             f"({detection.x2}, {detection.y2}); x1 <= x2 and y1 <= y2 are required")
        return detection


def detections_from_json(name: str, value: str) -> list[Detection]:
    """The detections of a stream field: a JSON list of at most MAX_BOXES_PER_FRAME detection objects."""
    if len(value) > MAX_BOXES_JSON_CHARS:
        raise ValueError(f"{name} is {len(value)} characters, over the limit of {MAX_BOXES_JSON_CHARS}")
    items = json_field(name, value)
    if not isinstance(items, list):
        raise ValueError(f"{name} must be a JSON list, got {_shown(items)}")
    return boxes_from_list(name, items)


def boxes_from_list(name: str, items: list) -> list[Detection]:
    if len(items) > MAX_BOXES_PER_FRAME:
        raise ValueError(f"{name} has {len(items)} boxes, over the limit of {MAX_BOXES_PER_FRAME} per frame")
    return [Detection.from_json(item, f"{name}[{i}]") for i, item in enumerate(items)]


def camera_id(name: str, value: object) -> str:
    """A camera id of CAMERA_ID_PATTERN."""
    if not isinstance(value, str) or not re.fullmatch(CAMERA_ID_PATTERN, value):
        raise ValueError(f"{name} must be 1-128 letters, digits or _ . : - (what the server's routes filter on), "
                         f"got {_shown(value)}")
    return value


def declared_pixels(image: bytes) -> int | None:
    """The pixels an image's header declares (None when no header is readable: the decoder refuses it later)."""
    try:
        from PIL import Image

        with Image.open(io.BytesIO(image)) as opened:
            width, height = opened.size
    except Exception:  # any unreadable header: not this check's to judge
        return None
    return width * height


def check_job_pixels(images: list[bytes]) -> None:
    """A job's frames together declare at most MAX_JOB_PIXELS pixels."""
    total = sum(declared_pixels(image) or 0 for image in images)
    if total > MAX_JOB_PIXELS:
        raise ValueError(f"the job's {len(images)} frame(s) are {total} pixels, over the limit of {MAX_JOB_PIXELS} "
                         "pixels per job")


# A job's cache salt (`Job.cache_salt`): the engine's bound (engine.block_hash.MAX_CACHE_SALT), which the queue may
# not import; tests/test_layout.py keeps the two equal.
MAX_CACHE_SALT_CHARS = 256
# A caption schema travels with every job that has one: kept to a size a JSON schema needs.
MAX_CAPTION_SCHEMA_CHARS = 64_000


def caption_schema_from_json(value: str) -> dict:
    """A job's caption schema: JSON text of a JSON Schema object (whether the server can use it is the
    server's check: a schema it cannot compile dead-letters the job with the reason)."""
    if len(value) > MAX_CAPTION_SCHEMA_CHARS:
        raise ValueError(f"schema is {len(value)} characters, over the limit of {MAX_CAPTION_SCHEMA_CHARS}")
    schema = json_field("schema", value)
    if not isinstance(schema, dict):
        raise ValueError(f"schema must be a JSON object (a JSON Schema), got {_shown(schema)}")
    return schema


def structured_from_json(value: str) -> dict:
    structured = json_field("structured", value)
    if not isinstance(structured, dict):
        raise ValueError(f"structured must be a JSON object, got {_shown(structured)}")
    return structured


def image_origin_from_json(value: str) -> tuple[int, int]:
    origin = json_field("image_origin", value)
    if (not isinstance(origin, list) or len(origin) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in origin)):
        raise ValueError(f"image_origin must be a JSON list of two integers >= 0, got {_shown(origin)}")
    return origin[0], origin[1]


def numbers_from_json(name: str, value: str, count: int) -> list[float]:
    """A stream field holding a JSON list of `count` finite numbers in non-decreasing order."""
    numbers = json_field(name, value)
    if not isinstance(numbers, list) or len(numbers) != count:
        raise ValueError(f"{name} must be a JSON list of {count} numbers (one per frame), got {_shown(numbers)}")
    checked = [_json_number(finite_number)(f"{name}[{i}]", v) for i, v in enumerate(numbers)]
    if any(later < earlier for earlier, later in zip(checked, checked[1:])):
        raise ValueError(f"{name} must be in time order (non-decreasing), got {_shown(numbers)}")
    return checked


def notes_from_json(value: str, count: int) -> list[str]:
    """The `notes` field: a JSON list of `count` strings (empty ones allowed), each at most MAX_NOTE_CHARS."""
    notes = json_field("notes", value)
    if not isinstance(notes, list) or len(notes) != count:
        raise ValueError(f"notes must be a JSON list of {count} strings (one per frame), got {_shown(notes)}")
    for i, note in enumerate(notes):
        if not isinstance(note, str):
            raise ValueError(f"notes[{i}] must be a string, got {_shown(note)}")
        if len(note) > MAX_NOTE_CHARS:
            raise ValueError(f"notes[{i}] is {len(note)} characters, over the limit of {MAX_NOTE_CHARS}")
    return notes


def check_job_size(images: list[bytes]) -> None:
    """The limits of one job's frames: MAX_FRAMES_PER_JOB frames, MAX_JOB_IMAGE_BYTES bytes together."""
    if len(images) > MAX_FRAMES_PER_JOB:
        raise ValueError(f"the job has {len(images)} frames, over the limit of {MAX_FRAMES_PER_JOB} frames per job")
    total = sum(len(image) for image in images)
    if total > MAX_JOB_IMAGE_BYTES:
        raise ValueError(f"the job's {len(images)} frame(s) are {total} bytes, over the limit of "
                         f"{MAX_JOB_IMAGE_BYTES} bytes per job")


def check_job_video(video: bytes, frame_count: int) -> None:
    """A job's clip: not empty, at most MAX_JOB_VIDEO_BYTES, and a job carries frames or a clip, not both."""
    if not video:
        raise ValueError("video is empty")
    if len(video) > MAX_JOB_VIDEO_BYTES:
        raise ValueError(f"video is {len(video)} bytes, over the limit of {MAX_JOB_VIDEO_BYTES} bytes per job")
    if frame_count:
        raise ValueError(f"the job carries {frame_count} frames and a video; a job carries frames or a video")


def _binary(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class JobImage:
    """One frame of a job with several: its encoded image, its time (seconds, as `Job.frame_ts`), the text
    placed before it in the prompt (the tracker's note) and its person boxes in this image's own pixels."""

    image: bytes
    ts: float
    note: str = ""
    detections: list[Detection] = field(default_factory=list)


def _frames_from_fields(values: dict) -> list[JobImage]:
    """The frames of an entry with `frame_count`: `image`, `image_1`, ... with `frame_times`, `notes` and
    (optional) `frame_detections`, each checked; the limits of `check_job_size` apply."""
    count = integer("frame_count", values["frame_count"])
    at_least("frame_count", count, 1)
    if count > MAX_FRAMES_PER_JOB:
        raise ValueError(f"frame_count is {count}, over the limit of {MAX_FRAMES_PER_JOB} frames per job")
    images = []
    for index in range(count):
        name = image_field(index)
        if not values.get(name):
            raise ValueError(f"frame_count is {count} but the field {name!r} is missing or empty")
        image = values[name]
        images.append(image if isinstance(image, bytes) else image.encode())
    check_job_size(images)
    times = numbers_from_json("frame_times", str(values["frame_times"]), count)
    notes = notes_from_json(str(values["notes"]), count)
    boxes: list[list[Detection]] = [[] for _ in range(count)]
    if "frame_detections" in values:
        text_value = str(values["frame_detections"])
        if len(text_value) > MAX_BOXES_JSON_CHARS * count:
            raise ValueError(f"frame_detections is {len(text_value)} characters, over the limit of "
                             f"{MAX_BOXES_JSON_CHARS * count} for {count} frames")
        per_frame = json_field("frame_detections", text_value)
        if not isinstance(per_frame, list) or len(per_frame) != count:
            raise ValueError(f"frame_detections must be a JSON list of {count} lists of boxes, got "
                             f"{_shown(per_frame)}")
        for i, items in enumerate(per_frame):
            if not isinstance(items, list):
                raise ValueError(f"frame_detections[{i}] must be a JSON list, got {_shown(items)}")
            boxes[i] = boxes_from_list(f"frame_detections[{i}]", items)
    return [JobImage(image, ts, note, detections)
            for image, ts, note, detections in zip(images, times, notes, boxes, strict=True)]


@dataclass
class Job:
    """One frame with people, to be captioned. `frame_ts` is seconds: the frame's position for file
    sources, Unix time for live ones. `created_at` is Unix time of enqueueing. `image_origin` is where the
    image's top-left corner lies in the full frame: (0, 0) unless the image is a crop. `fall` marks a fall
    alert: the gate saw a tracked person on the ground (a box of class FALL_CLASS) not alerted within its
    cooldown; such a job is captioned before other camera jobs and its result goes to `ALERTS_STREAM`.
    `schema` (a JSON Schema) asks for a structured caption: the worker decodes under it and stores the parsed
    object as the result's `structured`, or dead-letters the job saying why. `cache_salt` (vLLM's name and
    meaning): the caption shares cached prefixes and image features only with requests of the same salt.

    `kind` is one of JOB_KINDS (`job_kind`: "fall" for a fall job, else "sighting" by default); `track_id`
    the tracked person the job is about, if one. `frames` (empty for a one-image job) are the frames of an
    event or of a fall's lead-up, in time order, captioned as one prompt: each frame's note, then the frame,
    ..., then `prompt`; `image`, `detections` and `frame_ts` are then the first frame's (`Job.of_frames`).

    `video` (instead of frames) is a short clip, encoded (MP4 or any format FFmpeg reads, at most
    MAX_JOB_VIDEO_BYTES): a server whose model has a video path (Qwen2-VL's temporal patches, SmolVLM2's
    timestamped frames, LLaVA-OneVision's pooled frames) captions the clip, its frames sampled under the server's
    video limits, then `prompt`; `image` stays the still viewers are shown. A server whose model has no video path,
    or a clip over a limit or unreadable, fails the job naming why."""

    camera_id: str
    frame_ts: float
    prompt: str
    image: bytes
    detections: list[Detection]
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    image_origin: tuple[int, int] = (0, 0)
    fall: bool = False
    schema: dict | None = None
    kind: str | None = None
    track_id: int | None = None
    frames: list[JobImage] = field(default_factory=list)
    cache_salt: str | None = None
    video: bytes | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in JOB_KINDS:
            raise ValueError(f"kind must be one of {', '.join(JOB_KINDS)}, got {_shown(self.kind)}")
        self.fall = self.fall or self.kind == "fall"
        check_job_size([frame.image for frame in self.frames] or [self.image])
        if self.video is not None:
            check_job_video(self.video, len(self.frames))

    @classmethod
    def of_frames(cls, camera_id: str, prompt: str, frames: list[JobImage], **fields: object) -> Job:
        """A job with several frames: its image, boxes and frame_ts are the first frame's."""
        if not frames:
            raise ValueError("a job of frames needs at least one frame")
        first = frames[0]
        return cls(camera_id=camera_id, frame_ts=first.ts, prompt=prompt, image=first.image,
                   detections=first.detections, frames=frames, **fields)

    @property
    def job_kind(self) -> str:
        """The kind: "fall" for every fall job, else `kind` as given, "sighting" by default."""
        return "fall" if self.fall else self.kind or "sighting"

    @property
    def frame_count(self) -> int:
        return len(self.frames) or 1

    @property
    def start_ts(self) -> float:
        return self.frames[0].ts if self.frames else self.frame_ts

    @property
    def end_ts(self) -> float:
        return self.frames[-1].ts if self.frames else self.frame_ts

    @property
    def person_count(self) -> int:
        return len(self.detections)

    @property
    def classes(self) -> list[str]:
        """The class of each box, in the order of `detections`."""
        return [d.label or PERSON_CLASS for d in self.detections]

    def to_fields(self) -> dict[str, bytes | str]:
        fields: dict[str, bytes | str] = {
            "job_id": self.job_id,
            "camera_id": self.camera_id,
            "frame_ts": repr(self.frame_ts),
            "prompt": self.prompt,
            "image": self.image,
            "detections": json.dumps([asdict(d) for d in self.detections]),
            "person_count": str(self.person_count),
            "created_at": repr(self.created_at),
            "image_origin": json.dumps(list(self.image_origin)),
            "fall": flag_text(self.fall),
        }
        if self.schema is not None:  # absent otherwise, so older workers see the jobs they know
            fields["schema"] = json.dumps(self.schema)
        if self.cache_salt is not None:
            fields["cache_salt"] = self.cache_salt
        if self.video is not None:
            fields[VIDEO_FIELD] = self.video
        fields["kind"] = self.job_kind
        if self.track_id is not None:
            fields["track_id"] = str(self.track_id)
        if self.frames:
            fields["frame_count"] = str(len(self.frames))
            for index, frame in enumerate(self.frames[1:], start=1):
                fields[image_field(index)] = frame.image
            fields["frame_times"] = json.dumps([frame.ts for frame in self.frames])
            fields["notes"] = json.dumps([frame.note for frame in self.frames])
            fields["frame_detections"] = json.dumps([[asdict(d) for d in frame.detections] for frame in self.frames])
        return fields

    @classmethod
    def from_fields(cls, fields: dict) -> Job:
        """Decode and validate a stream entry completely (types, finite numbers, ordered boxes, an origin
        of two integers), so that a job that decodes can be captioned and shown; raises ValueError naming
        the field that is missing or malformed and the value it holds."""
        try:
            values = _decoded_fields(fields)
        except UnicodeDecodeError as err:
            raise ValueError(f"job entry has a field that is not UTF-8 text: {err}") from None
        try:
            image = values["image"]
            if not image:
                raise ValueError("image is empty")
            detections = detections_from_json("detections", str(values["detections"]))
            if "person_count" in values:
                integer("person_count", values["person_count"])
            frames = _frames_from_fields(values) if "frame_count" in values else []
            check_job_pixels([frame.image for frame in frames] or [image if isinstance(image, bytes)
                                                                    else image.encode()])
            return cls(
                job_id=text("job_id", values["job_id"], 256),
                camera_id=camera_id("camera_id", values["camera_id"]),
                frame_ts=finite_number("frame_ts", values["frame_ts"]),
                prompt=text("prompt", values["prompt"]),
                image=image if isinstance(image, bytes) else image.encode(),
                detections=detections,
                created_at=finite_number("created_at", values["created_at"]) if "created_at" in values
                else time.time(),
                image_origin=image_origin_from_json(str(values.get("image_origin", "[0, 0]"))),
                fall=flag("fall", values.get("fall", "false")),
                schema=caption_schema_from_json(str(values["schema"])) if "schema" in values else None,
                cache_salt=text("cache_salt", values["cache_salt"], MAX_CACHE_SALT_CHARS)
                if "cache_salt" in values else None,
                kind=text("kind", values["kind"], 32) if "kind" in values else None,
                track_id=integer("track_id", values["track_id"]) if "track_id" in values else None,
                frames=frames,
                video=_binary(values[VIDEO_FIELD]) if VIDEO_FIELD in values else None,
            )
        except KeyError as missing:
            raise ValueError(f"job entry lacks field {missing}") from None

    def frame(self) -> JobFrame:
        """The job's image with its person boxes moved into the image's own pixel coordinates."""
        dx, dy = self.image_origin
        boxes = [Detection(d.x1 - dx, d.y1 - dy, d.x2 - dx, d.y2 - dy, d.confidence, d.track_id, d.label)
                 for d in self.detections]
        return JobFrame(image=self.image, detections=boxes)

    def frame_views(self) -> list[JobFrame]:
        """Every frame of the job with its boxes in that frame's pixels, for viewers (`frame_key(id, i)`)."""
        if not self.frames:
            return [self.frame()]
        return [JobFrame(image=frame.image, detections=frame.detections) for frame in self.frames]

    def queued_result(self) -> CaptionResult:
        return CaptionResult(
            id=self.job_id,
            status=JobStatus.QUEUED.value,
            camera_id=self.camera_id,
            created_at=self.created_at,
            frame_ts=self.frame_ts,
            person_count=self.person_count,
            fall=self.fall,
            classes=self.classes,
            kind=self.job_kind,
            track_id=self.track_id,
            start_ts=self.start_ts,
            end_ts=self.end_ts,
            frame_count=self.frame_count,
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
    consumer: str | None = None  # the queue worker that holds the job (claimed, running) or finished it
    fall: bool = False  # a fall alert (see Job.fall)
    classes: list[str] = field(default_factory=list)  # the class of each person box
    structured: dict | None = None  # the caption parsed, for a job with a schema
    kind: str | None = None  # the job's kind (JOB_KINDS); None for a REST caption
    track_id: int | None = None  # the tracked person a sighting, event or fall job is about
    start_ts: float | None = None  # the first and last frame's times (seconds, as frame_ts); frame_ts if unset
    end_ts: float | None = None
    frame_count: int = 1
    claimed_at: float | None = None  # when a worker claimed the job last (Unix time, the worker's clock)
    started_at: float | None = None  # when that worker started captioning it

    def __post_init__(self) -> None:
        self.start_ts = self.frame_ts if self.start_ts is None else self.start_ts
        self.end_ts = self.frame_ts if self.end_ts is None else self.end_ts

    def to_fields(self) -> dict[str, str]:
        fields = {name: str(value) for name, value in asdict(self).items() if value is not None}
        fields["fall"], fields["classes"] = flag_text(self.fall), json.dumps(self.classes)
        if self.structured is not None:
            fields["structured"] = json.dumps(self.structured)
        return fields

    @classmethod
    def from_fields(cls, fields: dict) -> CaptionResult:
        values = {name: str(value) for name, value in _decoded_fields(fields).items()}
        try:
            return cls(
                id=values["id"],
                status=values["status"],
                camera_id=values["camera_id"],
                created_at=finite_number("created_at", values["created_at"]),
                frame_ts=finite_number("frame_ts", values["frame_ts"]),
                person_count=integer("person_count", values["person_count"]),
                caption=values.get("caption"),
                finished_at=finite_number("finished_at", values["finished_at"]) if "finished_at" in values
                else None,
                error=values.get("error"),
                deliveries=integer("deliveries", values.get("deliveries", "0")),
                consumer=values.get("consumer"),
                fall=flag("fall", values.get("fall", "false")),
                classes=labels_from_json("classes", values.get("classes", "[]")),
                structured=structured_from_json(values["structured"]) if "structured" in values else None,
                kind=values.get("kind"),
                track_id=integer("track_id", values["track_id"]) if "track_id" in values else None,
                start_ts=finite_number("start_ts", values["start_ts"]) if "start_ts" in values else None,
                end_ts=finite_number("end_ts", values["end_ts"]) if "end_ts" in values else None,
                frame_count=integer("frame_count", values.get("frame_count", "1")),
                claimed_at=finite_number("claimed_at", values["claimed_at"]) if "claimed_at" in values else None,
                started_at=finite_number("started_at", values["started_at"]) if "started_at" in values else None,
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
                       detections=detections_from_json("detections", str(values["detections"])))
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
            counters, rates = json_field("counters", values["counters"]), json_field("rates", values["rates"])
            if not isinstance(counters, dict) or not isinstance(rates, dict):
                raise ValueError("counters and rates must be JSON objects")
            return cls(camera_id=values["camera_id"], status=values["status"], detector=values["detector"],
                       started_at=finite_number("started_at", values["started_at"]),
                       updated_at=finite_number("updated_at", values["updated_at"]),
                       counters={str(k): integer(f"counters.{k}", v) for k, v in counters.items()},
                       rates={str(k): finite_number(f"rates.{k}", v) for k, v in rates.items()})
        except KeyError as missing:
            raise ValueError(f"camera stats lack field {missing}") from None

    def to_json(self) -> dict:
        return asdict(self)
