"""The dashboard: the page at `/` (plain files in `api/static/`, public) and the JSON it reads besides the
OpenAI and captioning routes (under `/v1`, so behind the API key): a caption's frame with its person
boxes drawn, the cameras' published counters with their last caption, and the engine's live numbers."""

from __future__ import annotations

import asyncio
import io
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from PIL import ImageDraw
from starlette.types import Scope

from api.errors import APIError
from api.images import decode_image
from api.percentiles import percentiles_ms
from api.pools import work_pools
from api.routes_captions import result_json
from api.settings import Limits
from api.state import ServerState, server_state
from jobqueue.contract import (
    CAMERA_ID_PATTERN,
    CAMERA_STATS_TTL_SECONDS,
    CAMERAS_INDEX,
    FALL_CLASS,
    MAX_FRAMES_PER_JOB,
    CameraStats,
    JobFrame,
    as_text,
    camera_stats_key,
)
from jobqueue.results import get_frame, readable, recent_captions

STATIC_DIR = Path(__file__).parent / "static"
RATE_WINDOW_S = 5.0  # rates and step sizes are averaged over this many seconds
BOX_COLOR = (0, 230, 118)
FALL_BOX_COLOR = (239, 68, 68)  # boxes of people on the ground
# The page loads only its own files and talks only to this server: data shown in it can never run.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

# Rendered frames kept for views to come (a frame is viewed again and again: thumbnails, then the full size),
# at most this many bytes of JPEG; views of a frame being rendered wait for that render instead of starting one.
RENDER_CACHE_BYTES = 64 * 1024 * 1024

router = APIRouter()


class RenderCache:
    """Rendered frames by (caption id, frame, boxes, width), the least recently used dropped past `max_bytes`,
    and the renders in flight, which a second view of the same frame awaits."""

    def __init__(self, max_bytes: int = RENDER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._done: OrderedDict[tuple, bytes] = OrderedDict()
        self._rendering: dict[tuple, asyncio.Future] = {}

    async def get(self, key: tuple, render: Any) -> bytes:
        """The cached JPEG of `key`, else `await render()`'s (kept; an error is not)."""
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        if key in self._rendering:
            return await asyncio.shield(self._rendering[key])
        future = asyncio.get_running_loop().create_future()
        self._rendering[key] = future
        try:
            jpeg = await render()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a view that awaits none raises no warning
            raise
        finally:
            del self._rendering[key]
        future.set_result(jpeg)
        self._done[key] = jpeg
        self.bytes += len(jpeg)
        while self.bytes > self.max_bytes and self._done:
            self.bytes -= len(self._done.popitem(last=False)[1])
        return jpeg


def render_cache(holder: Any) -> RenderCache:
    """The render cache kept on `holder` (the app's state), made at first use."""
    cache = getattr(holder, "render_cache", None)
    if cache is None:
        cache = holder.render_cache = RenderCache()
    return cache


class PageFiles(StaticFiles):
    """The page's static files, each with the page's headers (its CSP too: `/static/index.html` is the
    page itself)."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


static_files = PageFiles(directory=STATIC_DIR)


@router.get("/", include_in_schema=False)
async def dashboard_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)


def render_frame(frame: JobFrame, limits: Limits, boxes: bool, max_width: int | None) -> bytes:
    """The frame as a JPEG, its person boxes drawn, scaled down to `max_width` pixels wide if wider."""
    image = decode_image(frame.image, limits, "frame")
    scale = 1.0
    if max_width is not None and image.width > max_width:
        scale = max_width / image.width
        image = image.resize((max_width, max(1, round(image.height * scale))))
    if boxes:  # drawn after scaling, so that lines keep their width on thumbnails
        draw = ImageDraw.Draw(image)
        line = max(2, round(max(image.size) / 300))
        for box in frame.detections:
            draw.rectangle((box.x1 * scale, box.y1 * scale, box.x2 * scale, box.y2 * scale),
                           outline=FALL_BOX_COLOR if box.label == FALL_CLASS else BOX_COLOR, width=line)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=85)
    return out.getvalue()


@router.get("/v1/captions/{caption_id}/image", response_class=Response,
            responses={200: {"content": {"image/jpeg": {}}, "description": "the frame as a JPEG"}})
async def caption_image(request: Request, caption_id: str,
                        boxes: bool = Query(True, description="draw the person boxes"),
                        max_width: int | None = Query(None, ge=16, le=8192, description="scale down to this width"),
                        frame_index: int = Query(0, alias="frame", ge=0, lt=MAX_FRAMES_PER_JOB,
                                                 description="which frame of an event or fall job (0: the first)"),
                        state: ServerState = Depends(server_state)) -> Response:
    """The frame of a camera job's caption (kept for a few hours), with its person boxes drawn; `frame` picks
    one of an event's frames. REST captions keep no frame."""
    redis = state.redis

    async def render() -> bytes:
        frame = await get_frame(redis, caption_id, frame_index) if redis is not None else None
        if frame is None:
            raise APIError(404, f"no frame for caption {caption_id!r} (not a camera job's, or expired)",
                           "caption_id", "not_found")
        return await work_pools(state).run("render", render_frame, frame, state.settings.limits, boxes, max_width)

    try:
        jpeg = await render_cache(request.app.state).get((caption_id, frame_index, boxes, max_width), render)
    except APIError as exc:
        if exc.code in ("not_found", "busy"):
            raise
        raise APIError(404, f"the frame of caption {caption_id!r} is unreadable: {exc.message}",
                       "caption_id", "not_found") from None
    return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})


async def published_cameras(redis: aioredis.Redis) -> list[CameraStats]:
    """The latest stats of every camera that published within `CAMERA_STATS_TTL_SECONDS`, by id. Only reads:
    publishers drop cameras gone silent from the index."""
    recent = await redis.zrangebyscore(CAMERAS_INDEX, time.time() - CAMERA_STATS_TTL_SECONDS, "+inf")
    # Only ids the routes take: the page filters captions by each camera it lists.
    camera_ids = [text for text in map(as_text, recent) if re.fullmatch(CAMERA_ID_PATTERN, text)]
    async with redis.pipeline(transaction=False) as pipe:
        for camera_id in camera_ids:
            pipe.hgetall(camera_stats_key(camera_id))
        published = await pipe.execute()
    stats = [readable(CameraStats.from_fields, fields, camera_stats_key(camera_id))
             for camera_id, fields in zip(camera_ids, published, strict=True) if fields]
    return [s for s in stats if s is not None]


@router.get("/v1/cameras")
async def list_cameras(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Cameras whose pipelines publish their counters (frames captured, skipped, dropped, detected and
    enqueued: totals and per second), each with the age of its stats in seconds and its last caption."""
    redis = state.redis
    if redis is None:
        return {"object": "list", "data": []}
    cameras = []
    for stats in await published_cameras(redis):
        last = await recent_captions(redis, stats.camera_id, 1)
        cameras.append({**stats.to_json(), "age_s": max(0.0, time.time() - stats.updated_at),
                        "last_caption": result_json(last[0]) if last else None})
    return {"object": "list", "data": cameras}


@router.get("/v1/engine/stats")
async def engine_stats(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The engine now: requests running and waiting, KV cache use, tokens per step against the budget and
    output tokens per second (over the last few seconds), inter-token latency over the last minute, the
    prefix cache's hit rate and the images or tiles whose encoder features were reused (since start); with the
    in-process queue worker, the camera jobs it holds (`camera_jobs`: running, and claimed waiting for a slot;
    null without a worker)."""
    stats, metrics = state.bridge.stats, state.metrics
    step_tokens = metrics.recent_step_tokens.last(RATE_WINDOW_S)
    itl = metrics.recent_itl.last(metrics.recent_itl.horizon_s)
    used, total = stats.kv_blocks_used, stats.kv_blocks_total
    itl_ms = percentiles_ms(itl)
    return {
        "model": state.settings.model_name,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_cache_usage": used / total if total else 0.0,
        "step_token_budget": stats.max_num_batched_tokens,
        "step_tokens_mean": sum(step_tokens) / len(step_tokens) if step_tokens else 0.0,
        "step_tokens_max": max(step_tokens, default=0),
        "steps_per_s": len(step_tokens) / RATE_WINDOW_S,
        "output_tokens_per_s": sum(metrics.recent_output_tokens.last(RATE_WINDOW_S)) / RATE_WINDOW_S,
        "itl_p50_ms": itl_ms["p50"] if itl else None,
        "itl_p99_ms": itl_ms["p99"] if itl else None,
        "itl_samples": len(itl),
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "encoder_cache_hits": stats.encoder_cache_hits,
        "rate_window_s": RATE_WINDOW_S,
        "itl_window_s": metrics.recent_itl.horizon_s,
        "camera_jobs": state.worker.jobs_in_hand if state.worker is not None else None,
    }
