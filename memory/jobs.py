"""A finished camera job as an event: what the queue worker's finish hook (`jobqueue.finish.FinishedJob`) hands
the store. Thumbnails are made here, off the event loop (on the writer's thread): a few of the job's frames,
spread over them, each scaled to `thumbnail_size` pixels on its longer side and encoded as JPEG."""

from __future__ import annotations

import io
from collections.abc import Callable

from PIL import Image

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


def event_from_job(job: Job, result: CaptionResult, max_frames: int = 4, thumbnail_size: int = 320,
                   embed: Callable[[list[bytes]], list[float] | None] | None = None,
                   owner: str | None = None) -> Event | None:
    """The event a finished job is kept as; None for a job that failed (it has no caption to find it by).
    `embed(thumbnails)` gives the event's vector (None: none)."""
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
        embedding=embed([f.jpeg for f in frames]) if embed is not None and frames else None,
        owner=owner,
    )
