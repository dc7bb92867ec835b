"""Camera summaries: what one camera saw over a time window, as JSON under SUMMARY_SCHEMA. One text prompt
carries the window's finished captions and events (oldest first, with their times) and runs on the server's
engine, grammar-constrained, at `ServerSettings.summary_priority` (after chats, before camera captions). An
answer is cached per window and set of captions; a window without captions answers an empty summary without
running the model. With `summary_every_s` the server appends one summary per camera and interval to
`summaries_stream(camera)` (`summarize_every`), which the dashboard shows."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Body, Depends, Query, Request
from pydantic import BaseModel, Field

from api.errors import APIError
from api.routes_captions import CameraId
from api.state import ServerState, server_state
from engine import SamplingParams
from engine.grammar import GrammarSpec
from jobqueue.consumer import structured_caption
from jobqueue.contract import CAMERAS_INDEX, CAPTIONS_STREAM_MAXLEN, CaptionResult, as_text, summaries_stream

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

DEFAULT_WINDOW_S = 3600.0
MAX_WINDOW_S = 7 * 24 * 3600.0
MAX_SUMMARY_CAPTIONS = 200  # the newest of a window's captions that go into its prompt
MAX_LINE_CHARS = 300
CACHE_SIZE = 256
# Bounded strings and lists: a summary always ends within the server's summary max_tokens.
SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 48},
        "summary": {"type": "string", "minLength": 1, "maxLength": 160},
        "notable_events": {
            "type": "array", "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"time": {"type": "string", "minLength": 1, "maxLength": 8},
                               "what": {"type": "string", "minLength": 1, "maxLength": 80}},
                "required": ["time", "what"], "additionalProperties": False,
            },
        },
        "threat_level": {"type": "integer", "minimum": 0, "maximum": 2},
    },
    "required": ["title", "summary", "notable_events", "threat_level"],
    "additionalProperties": False,
}
INSTRUCTION = ("Summarize what this camera saw in the window: a short title, a summary, the notable events with "
               "their times (HH:MM:SS) and a threat level (0: nothing unusual, 1: unusual, 2: needs attention).")


class SummaryWindow(BaseModel):
    # Finite numbers only: a NaN or infinite bound makes no window (NaN compared false to every caption's time).
    start: float | None = Field(None, allow_inf_nan=False, description="Unix time the window starts (default: "
                                                                       "end - window_s)")
    end: float | None = Field(None, allow_inf_nan=False, description="Unix time the window ends (default: now)")
    window_s: float = Field(DEFAULT_WINDOW_S, gt=0, le=MAX_WINDOW_S, allow_inf_nan=False,
                            description="window length without start")


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def caption_line(result: CaptionResult) -> str:
    """One caption or event in a summary's prompt: its time (UTC), kind, person and what it said."""
    what = json.dumps(result.structured) if result.structured is not None else (result.caption or "").strip()
    who = f" person {result.track_id}" if result.track_id is not None else ""
    span = f" ({result.end_ts - result.start_ts:.1f} s, {result.frame_count} frames)" if result.frame_count > 1 else ""
    return f"{_clock(result.created_at)} {result.kind or 'caption'}{who}{span}: {what}"[:MAX_LINE_CHARS]


def summary_prompt(camera: str, start: float, end: float, results: list[CaptionResult]) -> str:
    lines = "\n".join(caption_line(r) for r in results)
    return (f"Camera {camera}, {_clock(start)} to {_clock(end)} UTC. Its captions and events, oldest first:\n"
            f"{lines}\n{INSTRUCTION}")


def empty_summary(camera: str) -> dict[str, Any]:
    return {"title": "No activity", "summary": f"No captions or events from camera {camera} in this window.",
            "notable_events": [], "threat_level": 0}


async def window_captions(state: ServerState, camera: str, start: float, end: float) -> list[CaptionResult]:
    """The camera's finished, captioned results made within [start, end], oldest first (at most
    MAX_SUMMARY_CAPTIONS, the newest)."""
    recent = await state.captions.recent(camera, CAPTIONS_STREAM_MAXLEN)
    inside = [r for r in recent if start <= r.created_at <= end and r.status == "done"]
    return sorted(inside[:MAX_SUMMARY_CAPTIONS], key=lambda r: r.created_at)


def summary_cache(holder: Any) -> OrderedDict:
    """The summaries cache kept on `holder` (the app's state), made at first use."""
    cache = getattr(holder, "summary_cache", None)
    if cache is None:
        cache = OrderedDict()
        holder.summary_cache = cache
    return cache


async def summarize(state: ServerState, camera: str, start: float, end: float, cache: OrderedDict) -> dict[str, Any]:
    """The summary answer of one camera and window (cached by window and the captions in it)."""
    if end <= start:
        raise APIError(400, f"the window ends ({end}) before it starts ({start})", "end")
    results = await window_captions(state, camera, start, end)
    digest = hashlib.sha256(json.dumps([camera, start, end, [r.id for r in results]]).encode()).hexdigest()
    if digest in cache:
        cache.move_to_end(digest)
        return {**cache[digest], "cached": True}
    if results:
        stream = await state.bridge.add(
            messages=[{"role": "user", "content": [{"type": "text",
                                                    "text": summary_prompt(camera, start, end, results)}]}],
            sampling=SamplingParams(max_tokens=state.settings.summary_max_tokens, temperature=0.0,
                                    grammar=GrammarSpec.from_schema(SUMMARY_SCHEMA)),
            priority=state.settings.summary_priority,
        )
        text = await state.captioner.collect(stream)
        try:
            summary = structured_caption(text, SUMMARY_SCHEMA)
        except ValueError as exc:
            raise APIError(500, f"the summary did not parse: {exc}", code="summary_failed") from None
    else:
        summary = empty_summary(camera)
    answer = {"object": "camera.summary", "camera_id": camera, "start": start, "end": end,
              "captions": len(results), "empty": not results, "created_at": time.time(), "summary": summary}
    cache[digest] = answer
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return {**answer, "cached": False}


@router.post("/cameras/{camera_id}/summary")
async def camera_summary(camera_id: CameraId, request: Request, window: SummaryWindow | None = Body(None),
                         state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """One camera's captions and events over a window (default: the last hour) summarized as JSON (title,
    summary, notable events with their times, threat level); `empty` true when the window has no captions."""
    window = window or SummaryWindow()
    end = window.end if window.end is not None else time.time()
    start = window.start if window.start is not None else end - window.window_s
    if end - start > MAX_WINDOW_S:
        raise APIError(400, f"the window is {end - start:.0f} s, over the limit of {MAX_WINDOW_S:.0f} s", "start")
    return await summarize(state, camera_id, start, end, summary_cache(request.app.state))


@router.get("/cameras/{camera_id}/summaries")
async def camera_summaries(camera_id: CameraId, limit: int = Query(10, ge=1, le=1000),
                           state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The camera's periodic summaries (`--summary-every`), newest first."""
    redis = state.redis
    entries = await redis.xrevrange(summaries_stream(camera_id), count=limit) if redis is not None else []
    return {"object": "list", "data": [json.loads(as_text(fields[b"answer"])) for _, fields in entries
                                       if b"answer" in fields]}


async def known_cameras(state: ServerState, since: float) -> list[str]:
    """Cameras that published stats or had captions since `since`."""
    cameras = {r.camera_id for r in await state.captions.recent(None, CAPTIONS_STREAM_MAXLEN)
               if r.camera_id and r.created_at >= since}
    if state.redis is not None:
        cameras |= {as_text(c) for c in await state.redis.zrangebyscore(CAMERAS_INDEX, since, "+inf")}
    return sorted(cameras)


async def summarize_every(state: ServerState, interval_s: float, cache: OrderedDict) -> None:
    """Every `interval_s`: one summary per known camera of the interval just ended, appended to its summaries
    stream. Runs until cancelled; a failed summary is logged and the next interval comes."""
    while True:
        await asyncio.sleep(interval_s)
        end = time.time()
        for camera in await known_cameras(state, end - interval_s):
            try:
                answer = await summarize(state, camera, end - interval_s, end, cache)
                if state.redis is not None:
                    await state.redis.xadd(summaries_stream(camera), {"answer": json.dumps(answer)},
                                           maxlen=CAPTIONS_STREAM_MAXLEN, approximate=True)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the summary of camera %s failed", camera)
