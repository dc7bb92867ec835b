"""A finished camera job as an event: what the queue worker's finish hook (`jobqueue.finish.FinishedJob`) hands
the store. Thumbnails are made here, off the event loop (on the writer's thread): a few of the job's frames,
spread over them, each scaled to `thumbnail_size` pixels on its longer side and encoded as JPEG. The event's vector
is made from the same kept frames as they were captioned (the job's own JPEGs, not their thumbnails), so that it
is the mean of what POST /v1/embeddings gives for each; `FrameEmbeddings` holds the ones a caption's own encoder
run gave, until the writer takes them."""

from __future__ import annotations

import hashlib
import io
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable

from PIL import Image

from jobqueue.checks import positive_count
from jobqueue.contract import CaptionResult, Job, JobStatus
from memory.store import Event, EventFrame

THUMBNAIL_QUALITY = 80


def spread(count: int, keep: int) -> list[int]:
    """`keep` indices out of `count`, evenly spread from the first to the last (all of them when fewer)."""
    if count <= keep:
        return list(range(count))
    if keep == 1:
        return [count // 2]
    return sorted({round(i * (count - 1) / (keep - 1)) for i in range(keep)})


def thumbnail(image: bytes, size: int) -> bytes:
    """`image` scaled to at most `size` pixels on its longer side, as JPEG (ValueError when it is no image)."""
    try:
        opened = Image.open(io.BytesIO(image))
        opened.draft("RGB", (size, size))  # JPEG decodes at a reduced scale when it can
        picture = opened.convert("RGB")
    except Exception as exc:  # PIL raises many types for bad data
        raise ValueError(f"a frame could not be read: {type(exc).__name__}: {exc}") from exc
    picture.thumbnail((size, size))
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=THUMBNAIL_QUALITY)
    return out.getvalue()


class FrameEmbeddings:
    """Frames' embeddings by the frames' bytes, as a caption's own encoder run gave them (api/captioner.py), until
    the writer takes them for their event (`take`). The newest `max_frames` are kept: an older one is dropped, and
    its event's writer computes it again. Safe across threads."""

    def __init__(self, max_frames: int = 2048) -> None:
        positive_count("max_frames", max_frames)
        self.max_frames = max_frames
        self._kept: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(frame: bytes) -> bytes:
        return hashlib.blake2b(frame, digest_size=16).digest()

    def put(self, frames: list[bytes], vectors: list[list[float]]) -> None:
        """Keep each frame's vector (float32, as the engine's features are: the values are kept exactly)."""
        if len(frames) != len(vectors):
            raise ValueError(f"{len(frames)} frames but {len(vectors)} vectors")
        with self._lock:
            for frame, vector in zip(frames, vectors):
                key = self._key(frame)
                self._kept[key] = array("f", vector)
                self._kept.move_to_end(key)
            while len(self._kept) > self.max_frames:
                self._kept.popitem(last=False)

    def take(self, frames: list[bytes]) -> list[list[float] | None]:
        """Each frame's kept vector, taken out (None for one not kept)."""
        with self._lock:
            found = [self._kept.pop(self._key(frame), None) for frame in frames]
        return [None if vector is None else vector.tolist() for vector in found]

    def __len__(self) -> int:
        return len(self._kept)


def event_from_job(job: Job, result: CaptionResult, max_frames: int = 4, thumbnail_size: int = 320,
                   embed: Callable[[list[bytes]], list[float] | None] | None = None,
                   owner: str | None = None) -> Event | None:
    """The event a finished job is kept as; None for a job that failed (it has no caption to find it by).
    `embed(frames)` gives the event's vector from its kept frames, the job's JPEGs as they were captioned (None:
    none)."""
    if result.status != JobStatus.DONE.value:
        return None
    views = job.frame_views()
    times = [f.ts for f in job.frames] if job.frames else [job.frame_ts]
    chosen = spread(len(views), max_frames)
    frames = [EventFrame(jpeg=thumbnail(views[i].image, thumbnail_size), ts=times[i]) for i in chosen]
    return Event(
        id=job.job_id,
        camera_id=job.camera_id,
        kind="video" if job.video is not None and not job.fall else job.job_kind,
        start_ts=job.start_ts,
        end_ts=max(job.end_ts, job.start_ts),
        finished_at=result.finished_at or job.end_ts,
        caption=result.caption or "",
        structured=result.structured,
        fall=job.fall,
        track_id=job.track_id,
        person_count=job.person_count,
        frames=frames,
        embedding=embed([views[i].image for i in chosen]) if embed is not None and chosen else None,
        owner=owner,
    )
