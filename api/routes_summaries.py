"""Camera summaries: what one camera saw over a time window, as JSON under SUMMARY_SCHEMA. One text prompt
carries the window's finished captions and events (oldest first, with their times) and runs on the server's
engine, grammar-constrained, at `ServerSettings.summary_priority` (after chats, before camera captions). A
window of any size (up to the feed's cap, CAPTIONS_STREAM_MAXLEN) is read in pages in the summary pool, off the
event loop, and condensed to fit the context rather than refused: consecutive near-identical captions become one
line with their count, then lines are sampled evenly across the window until the prompt's tokens (counted by
the engine's processor) leave `summary_max_tokens` of `max_model_len`. An answer is cached per window and set of
captions; a window without captions answers an empty summary without running the model. With `summary_every_s`
the server appends one summary per camera and interval to `summaries_stream(camera)` (`summarize_every`), which
the dashboard shows."""

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
from api.pools import work_pools
from api.routes_captions import CameraId
from api.state import ServerState, server_state
from engine import SamplingParams
from engine.grammar import GrammarSpec
from jobqueue.consumer import structured_caption
from jobqueue.contract import CAMERAS_INDEX, CAPTIONS_STREAM_MAXLEN, CaptionResult, as_text, summaries_stream
from jobqueue.results import captions_feed, readable

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

DEFAULT_WINDOW_S = 3600.0
MAX_WINDOW_S = 7 * 24 * 3600.0
MAX_SUMMARY_CAPTIONS = 200  # the most lines (captions, merged runs) a summary's prompt carries, sampled evenly
WINDOW_PAGE = 500  # feed entries read (and parsed in the summary pool) at a time
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
    return summary_text(camera, start, end, [caption_line(r) for r in results])


def summary_text(camera: str, start: float, end: float, lines: list[str], left_out: int = 0) -> str:
    """The prompt's text: the window, its lines (oldest first) and, when the window was condensed, how many
    captions its lines stand for."""
    note = f" ({left_out} more captions left out, evenly across the window)" if left_out else ""
    return (f"Camera {camera}, {_clock(start)} to {_clock(end)} UTC. Its captions and events, oldest first{note}:\n"
            + "\n".join(lines) + f"\n{INSTRUCTION}")


def _same(a: CaptionResult, b: CaptionResult) -> bool:
    """Near-identical: the same kind and person saying the same thing (case and spacing aside)."""
    def said(r: CaptionResult) -> str:
        return " ".join((json.dumps(r.structured) if r.structured is not None else r.caption or "").lower().split())
    return (a.kind, a.track_id) == (b.kind, b.track_id) and said(a) == said(b)


def merged_runs(results: list[CaptionResult]) -> list[list[CaptionResult]]:
    """The window's results, oldest first, in runs of consecutive near-identical captions (most runs are one)."""
    runs: list[list[CaptionResult]] = []
    for result in results:
        if runs and _same(runs[-1][-1], result):
            runs[-1].append(result)
        else:
            runs.append([result])
    return runs


def run_line(run: list[CaptionResult]) -> str:
    """A run's line: its first caption's, with the run's count and the time of its last when there are more."""
    line = caption_line(run[0])
    if len(run) > 1:
        line = f"{line[:MAX_LINE_CHARS - 40]} [x{len(run)}, until {_clock(run[-1].created_at)}]"
    return line


def merged_lines(results: list[CaptionResult]) -> list[str]:
    """The window's lines, oldest first, each run of consecutive near-identical captions one line with its count
    and the time of its last."""
    return [run_line(run) for run in merged_runs(results)]


def evenly(items: list[str], count: int) -> list[str]:
    """`count` of `items` spread evenly, the first and last kept (all of them when there are no more)."""
    if count >= len(items):
        return list(items)
    if count <= 1:
        return items[-1:] if count == 1 else []
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def prompt_tokens(engine: Any, prompt: str) -> int:
    """A text prompt's tokens as the engine will see them (its processor)."""
    return len(engine.tokenize(prompt))


def fit_summary(engine: Any, camera: str, start: float, end: float, results: list[CaptionResult],
                budget: int) -> tuple[str, list[CaptionResult]]:
    """The summary prompt of `results` (oldest first), condensed until its tokens are within `budget`: merged runs
    of near-identical captions, then at most MAX_SUMMARY_CAPTIONS lines sampled evenly, fewer until it fits; and
    the first result of each line it carries. ValueError when not even one line fits. Runs in the summary pool
    (the processor)."""
    runs = merged_runs(results)
    lines = [run_line(run) for run in runs]
    count = min(len(lines), MAX_SUMMARY_CAPTIONS)
    while count >= 1:
        chosen = evenly(list(range(len(lines))), count)
        prompt = engine.user_prompt([{"type": "text", "text": summary_text(
            camera, start, end, [lines[i] for i in chosen], len(results) - count if count < len(lines) else 0)}])
        tokens = prompt_tokens(engine, prompt)
        if tokens <= budget:
            return prompt, [runs[i][0] for i in chosen]
        count = min(count - 1, int(count * budget / tokens))  # about the share that fits, then exactly
    raise ValueError(f"the summary's prompt does not fit the {budget} tokens this server's context leaves for it")


def empty_summary(camera: str) -> dict[str, Any]:
    return {"title": "No activity", "summary": f"No captions or events from camera {camera} in this window.",
            "notable_events": [], "threat_level": 0}


def _parse_page(feed: str, entries: list) -> list[CaptionResult]:
    results = (readable(CaptionResult.from_fields, fields, f"{feed} {as_text(entry_id)}")
               for entry_id, fields in entries)
    return [r for r in results if r is not None]


async def window_captions(state: ServerState, camera: str, start: float, end: float) -> list[CaptionResult]:
    """The camera's finished, captioned results made within [start, end], oldest first. From Redis the feed is
    read newest first in pages of WINDOW_PAGE, each parsed in the summary pool, down to the window's start (a
    result enters its feed after it was made, so older entries hold only older results)."""
    pools = work_pools(state)
    redis = state.redis
    if redis is None:
        recent = await state.captions.recent(camera, CAPTIONS_STREAM_MAXLEN)
    else:
        feed, recent, upper = captions_feed(camera), [], "+"
        lower = f"{min(max(0, int(start * 1000)), 2**63 - 1)}-0"  # a stream id's range, whatever the window
        while len(recent) < CAPTIONS_STREAM_MAXLEN:
            entries = await redis.xrevrange(feed, max=upper, min=lower, count=WINDOW_PAGE)
            recent.extend(await pools.run("summary", _parse_page, feed, entries))
            if len(entries) < WINDOW_PAGE:
                break
            upper = f"({as_text(entries[-1][0])}"  # exclusive: the page after the last entry read
    inside = [r for r in recent if start <= r.created_at <= end and r.status == "done"]
    return sorted(inside, key=lambda r: r.created_at)


def summary_cache(holder: Any) -> OrderedDict:
    """The summaries cache kept on `holder` (the app's state), made at first use."""
    cache = getattr(holder, "summary_cache", None)
    if cache is None:
        cache = OrderedDict()
        holder.summary_cache = cache
    return cache


async def summary_of(state: ServerState, camera: str, start: float, end: float, results: list[CaptionResult],
                     cache_salt: str | None = None) -> tuple[dict[str, Any], list[CaptionResult]]:
    """The summary of a window's `results` (oldest first) on the server's engine, its prompt condensed to the context
    (`fit_summary`, in the summary pool), and the first result of each line the prompt carried; without results the
    empty summary, the model not run. APIError: 400 when not even one line fits, 500 when the answer does not
    parse. Camera summaries and the MCP tool `camera_summary` both make theirs here."""
    if not results:
        return empty_summary(camera), []
    engine = state.bridge.engine
    max_tokens = state.settings.summary_max_tokens
    try:
        prompt, shown = await work_pools(state).run("summary", fit_summary, engine, camera, start, end, results,
                                                    engine.max_model_len - max_tokens)
    except ValueError as exc:
        raise APIError(400, f"{exc} (summary_max_tokens is {max_tokens} of max_model_len "
                            f"{engine.max_model_len})", "window_s", "summary_too_long") from None
    stream = await state.bridge.add(
        prompt=prompt,  # any checkpoint: with or without a chat template (Engine.user_prompt)
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                grammar=GrammarSpec.from_schema(SUMMARY_SCHEMA)),
        priority=state.settings.summary_priority, cache_salt=cache_salt,
    )
    text = await state.captioner.collect(stream)
    try:
        return structured_caption(text, SUMMARY_SCHEMA), shown
    except ValueError as exc:
        raise APIError(500, f"the summary did not parse: {exc}", code="summary_failed") from None


async def summarize(state: ServerState, camera: str, start: float, end: float, cache: OrderedDict) -> dict[str, Any]:
    """The summary answer of one camera and window (cached by window and the captions in it)."""
    if end <= start:
        raise APIError(400, f"the window ends ({end}) before it starts ({start})", "end")
    results = await window_captions(state, camera, start, end)
    digest = hashlib.sha256(json.dumps([camera, start, end, [r.id for r in results]]).encode()).hexdigest()
    if digest in cache:
        cache.move_to_end(digest)
        return {**cache[digest], "cached": True}
    summary, _ = await summary_of(state, camera, start, end, results)
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
    stream. The intervals tile time: each starts where the last ended, so the time the summaries themselves take
    (a busy engine) falls in the next one instead of between two. Runs until cancelled; a failed summary is logged
    and the next interval comes."""
    start = time.time()
    while True:
        await asyncio.sleep(max(0.0, start + interval_s - time.time()))
        end = time.time()
        for camera in await known_cameras(state, start):
            try:
                answer = await summarize(state, camera, start, end, cache)
                if state.redis is not None:
                    await state.redis.xadd(summaries_stream(camera), {"answer": json.dumps(answer)},
                                           maxlen=CAPTIONS_STREAM_MAXLEN, approximate=True)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the summary of camera %s failed", camera)
        start = end
