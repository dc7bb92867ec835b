"""Ask the cameras: `POST /v1/cameras/ask` answers a question in plain words from the camera memory.

The relevant events are retrieved from the event store (`retrieve`): each word of the question (stop words left
out) is a full-text search of its own, and an event ranks by how many of the words its caption and structured
fields have, then by their relevance, then by recency; the newest events fill what is left. Their captions (with
time, camera, kind, person and span, each under a reference `[E1]`, `[E2]`, ... oldest first) and a few of their
frames (spread over the best-ranked events, each frame one encoder input, as event jobs are sent) become one
multimodal prompt on the server's own engine, at `--summary-priority` (after chats, before camera captions).

Bounded: at most `max_events` events (50) and `max_frames` frames (8, and within `--max-images-per-request`),
and the prompt, counted by the model's own processor, leaves `max_tokens` of the context (`max_model_len`):
frames go first, then the lowest-ranked events, until it fits (`fit_prompt`). The answer says which events it
was given (`event_ids`, `frames`) and which of them the answer cites (`cited_event_ids`, from the references it
wrote). `stream: true` answers server-sent events as the chat route does: the retrieval first, then the text,
then `[DONE]`."""

from __future__ import annotations

import io
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from api.bridge import EngineFailure
from api.errors import APIError, error_body
from api.guard import cache_salt
from api.pools import work_pools
from api.routes_events import CameraMemory, camera_memory, event_json, timestamp, visible_query
from api.routes_openai import final_output, text_deltas
from api.state import ServerState, server_state
from api.streaming import SSEResponse, sse
from engine import SamplingParams
from memory.jobs import spread
from memory.store import MAX_CAMERAS, Event, EventFrame, EventQuery, EventStore, query_terms

router = APIRouter(prefix="/v1")

DEFAULT_ASK_EVENTS = 12
MAX_ASK_EVENTS = 50
DEFAULT_ASK_FRAMES = 4
MAX_ASK_FRAMES = 8
DEFAULT_ASK_MAX_TOKENS = 256
MAX_QUESTION_CHARS = 2000
MAX_ASK_TERMS = 12  # words of a question searched (each one search)
MAX_LINE_CHARS = 400  # of one event's line in the prompt
STOP_WORDS = frozenset("""
a about above after again all am an and any anyone anybody anything are around as at be been before being below
between both but by can could did do does doing down during each few for from had has have having he her here
hers him his how i if in into is it its just last me more most my no nor not now of off on once only or other our
out over own same she should so some someone somebody something such than that the their them then there these
they this those through to too under until up very was we were what when where which while who whom why will with
would you your yesterday today tonight night morning evening week day show tell see seen saw happen happened
""".split())
INSTRUCTION = ("You answer questions about what security cameras saw, from the events below (oldest first). Each "
               "event starts with its reference in brackets; frames of an event follow it. Answer briefly and cite "
               "the references of the events you use, e.g. [E2].")
REFERENCE = re.compile(r"\[?\bE(\d{1,3})\b\]?")


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS, description="the question, in plain words")
    cameras: list[str] = Field(default_factory=list, max_length=MAX_CAMERAS,
                               description="only these cameras' events (default: every camera the key sees)")
    since: float | str | None = Field(None, description="events that end at or after this time (epoch s or ISO 8601)")
    until: float | str | None = Field(None, description="events that start at or before this time")
    max_events: int = Field(DEFAULT_ASK_EVENTS, ge=1, le=MAX_ASK_EVENTS, description="events in the prompt, at most")
    max_frames: int = Field(DEFAULT_ASK_FRAMES, ge=0, le=MAX_ASK_FRAMES, description="frames in the prompt, at most")
    max_tokens: int | None = Field(None, ge=1, description=f"answer tokens (default {DEFAULT_ASK_MAX_TOKENS})")
    stream: bool = False


# -- retrieval ------------------------------------------------------------------------------------------------
def question_terms(question: str) -> list[str]:
    """The words of a question worth searching: lower-cased, without stop words and one-letter words, each once."""
    terms: list[str] = []
    for word in query_terms(question.lower()):
        if len(word) > 1 and word not in STOP_WORDS and word not in terms:
            terms.append(word)
    return terms[:MAX_ASK_TERMS]


def retrieve(store: EventStore, base: EventQuery, question: str, max_events: int) -> list[Event]:
    """The events most relevant to `question` among those `base` lets through, best first (without frames):
    by the number of its words an event has, then the summed relevance of those words, then the newest; the newest
    events fill the rest up to `max_events`."""
    found: dict[str, list[Any]] = {}  # id -> [words matched, relevance, event]
    for term in question_terms(question):
        page = store.search(replace(base, q=term, limit=max_events, cursor=None))
        for event, score in zip(page.events, page.scores or [0.0] * len(page.events)):
            entry = found.setdefault(event.id, [0, 0.0, event])
            entry[0] += 1
            entry[1] += score
    ranked = [e for _, _, e in sorted(found.values(), key=lambda f: (-f[0], -f[1], -f[2].start_ts, f[2].id))]
    if len(ranked) < max_events:
        recent = store.search(replace(base, q=None, limit=max_events, cursor=None)).events
        ranked += [e for e in recent if e.id not in found]
    return ranked[:max_events]


def choose_frames(store: EventStore, ranked: list[Event], max_frames: int,
                  owner: str | None) -> dict[str, list[tuple[int, EventFrame]]]:
    """Up to `max_frames` frames, one an event round by round from the best-ranked down (spread over each event's
    own frames): event id -> [(its frame's index, frame)]."""
    kept: dict[str, list[EventFrame]] = {}
    for event in ranked[:max_frames]:
        full = store.get(event.id, owner)
        if full is not None and full.frames:
            kept[event.id] = full.frames
    share = dict.fromkeys(kept, 0)
    total = 0
    while total < max_frames and any(share[i] < len(kept[i]) for i in kept):
        for event_id in kept:
            if total < max_frames and share[event_id] < len(kept[event_id]):
                share[event_id] += 1
                total += 1
    return {i: [(index, kept[i][index]) for index in spread(len(kept[i]), n)] for i, n in share.items() if n}


# -- the prompt -------------------------------------------------------------------------------------------------
def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def event_line(reference: int, event: Event) -> str:
    """An event in the prompt: its reference, time, camera, kind, person and span, and what its caption says."""
    what = json.dumps(event.structured) if event.structured is not None else (event.caption or "").strip()
    fall = ", fall" if event.fall and event.kind != "fall" else ""
    who = f", person {event.track_id}" if event.track_id is not None else ""
    span = f" ({event.end_ts - event.start_ts:.1f} s)" if event.end_ts > event.start_ts else ""
    return f"[E{reference}] {_clock(event.start_ts)}, camera {event.camera_id}, {event.kind}{fall}{who}{span}: " \
           f"{what}"[:MAX_LINE_CHARS]


@dataclass
class AskPrompt:
    """The prompt of a question: the text with its image markers, the images in order, the events given (oldest
    first, the reference of each is its place + 1), the frames given (event id, frame index, time), its tokens."""

    text: str
    images: list[Image.Image]
    events: list[Event]
    frames: list[tuple[str, int, float]]
    tokens: int = 0
    dropped_events: int = 0
    dropped_frames: int = 0
    references: dict[str, str] = field(default_factory=dict)  # "E1" -> event id


def build_prompt(engine: Any, question: str, events: list[Event],
                 frames: dict[str, list[tuple[int, EventFrame, Image.Image]]]) -> AskPrompt:
    content: list[dict[str, Any]] = [{"type": "text", "text": INSTRUCTION}]
    images: list[Image.Image] = []
    given: list[tuple[str, int, float]] = []
    ordered = sorted(events, key=lambda e: (e.start_ts, e.id))
    for reference, event in enumerate(ordered, 1):
        content.append({"type": "text", "text": "\n" + event_line(reference, event)})
        for index, frame, image in frames.get(event.id, []):
            content.append({"type": "text", "text": f"\nframe of [E{reference}] at {_clock(frame.ts)}:"})
            content.append({"type": "image"})
            images.append(image)
            given.append((event.id, index, frame.ts))
    content.append({"type": "text", "text": f"\nQuestion: {question}"})
    return AskPrompt(engine.user_prompt(content), images, ordered, given,
                     references={f"E{n}": e.id for n, e in enumerate(ordered, 1)})


def count_tokens(engine: Any, prompt: AskPrompt) -> int:
    """The prompt's tokens as the engine will see them (its processor: text, image markers expanded)."""
    return len(engine.tokenize(prompt.text, prompt.images, engine.single_input_options))


def fit_prompt(engine: Any, question: str, ranked: list[Event], frames: dict[str, list[tuple[int, EventFrame]]],
               budget: int) -> AskPrompt:
    """The prompt of the best-ranked events and frames whose tokens are within `budget`: the last-chosen frame
    goes first, then the lowest-ranked event (with its frames), until it fits. ValueError when the question alone
    does not fit. Runs on a worker thread beside the steps (`EngineBridge.beside`: the processor, image decoding)."""
    events = list(ranked)
    decoded = {i: [(index, f, Image.open(io.BytesIO(f.jpeg)).convert("RGB")) for index, f in chosen]
               for i, chosen in frames.items()}
    order = [i for round_ in range(MAX_ASK_FRAMES) for i in decoded if round_ < len(decoded[i])]  # choice order
    picks = {i: len(chosen) for i, chosen in decoded.items()}
    dropped_events = dropped_frames = 0
    while True:
        current = {i: decoded[i][:picks[i]] for i in picks if picks[i] and any(e.id == i for e in events)}
        prompt = build_prompt(engine, question, events, current)
        prompt.tokens = count_tokens(engine, prompt)
        if prompt.tokens <= budget:
            prompt.dropped_events, prompt.dropped_frames = dropped_events, dropped_frames
            return prompt
        while order and not current.get(order[-1]):
            order.pop()
        if order:
            picks[order.pop()] -= 1
            dropped_frames += 1
        elif events:
            events.pop()
            dropped_events += 1
        else:
            raise ValueError(f"the question alone is {prompt.tokens} prompt tokens, over the {budget} this server's "
                             "context leaves for it")


# -- the route ------------------------------------------------------------------------------------------------
@dataclass
class Asked:
    """A question's retrieval and prompt, before the engine runs it."""

    prompt: AskPrompt | None  # None: no event to answer from
    max_tokens: int
    answer_id: str = field(default_factory=lambda: f"ask-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def given(self) -> dict[str, Any]:
        prompt = self.prompt
        events = prompt.events if prompt else []
        return {
            "event_ids": [e.id for e in events],
            "events": [{**event_json(e), "reference": f"E{n}"} for n, e in enumerate(events, 1)],
            "frames": [{"event_id": i, "index": index, "ts": ts} for i, index, ts in (prompt.frames if prompt else [])],
            "dropped": {"events": prompt.dropped_events if prompt else 0,
                        "frames": prompt.dropped_frames if prompt else 0},
        }

    def cited(self, answer: str) -> list[str]:
        """The events the answer refers to by their references, in the order it first does."""
        references = self.prompt.references if self.prompt else {}
        cited: list[str] = []
        for match in REFERENCE.finditer(answer):
            event_id = references.get(f"E{int(match.group(1))}")
            if event_id is not None and event_id not in cited:
                cited.append(event_id)
        return cited


NO_EVENTS = "No events in the camera memory match the question's cameras and time range."


async def prepare(body: AskRequest, request: Request, memory: CameraMemory, state: ServerState) -> Asked:
    """Retrieval and prompt of a question (400 naming a bad field)."""
    context = state.bridge.engine.max_model_len
    max_tokens = body.max_tokens or min(DEFAULT_ASK_MAX_TOKENS, context // 4)
    if max_tokens >= context:
        raise APIError(400, f"max_tokens is {max_tokens}, at or over the context of {context} tokens (max_model_len)",
                       "max_tokens", "max_tokens_too_large")
    max_frames = body.max_frames
    if state.settings.limits.max_images_per_request is not None:
        max_frames = min(max_frames, state.settings.limits.max_images_per_request)
    since = timestamp(None if body.since is None else str(body.since), "since")
    until = timestamp(None if body.until is None else str(body.until), "until")
    query = visible_query(request, memory.settings, cameras=body.cameras, since=since, until=until,
                          limit=body.max_events)
    if query is None:
        return Asked(None, max_tokens)

    def run() -> AskPrompt | None:
        ranked = retrieve(memory.store, query, body.question, body.max_events)
        if not ranked:
            return None
        frames = choose_frames(memory.store, ranked, max_frames, query.owner)
        with state.bridge.beside():
            return fit_prompt(state.bridge.engine, body.question, ranked, frames, context - max_tokens)

    try:
        return Asked(await work_pools(state).run("summary", run), max_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), "question", "question_too_long") from None


@router.post("/cameras/ask", response_model=None)
async def ask_cameras(body: AskRequest, request: Request, memory: CameraMemory = Depends(camera_memory),
                      state: ServerState = Depends(server_state)) -> Response | dict[str, Any]:
    """A question about what the cameras saw, answered from the events of the camera memory on the served model:
    the answer, the events and frames it was given and the events it cites."""
    asked = await prepare(body, request, memory, state)
    head = {"id": asked.answer_id, "created": asked.created, "model": state.settings.model_name,
            "question": body.question, **asked.given()}
    if asked.prompt is None:
        answer = {"object": "camera.answer", **head, "answer": NO_EVENTS, "cited_event_ids": [], "empty": True,
                  "finish_reason": "stop", "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        if body.stream:
            return SSEResponse(_single(answer))
        return answer
    stream = await state.bridge.add(
        prompt=asked.prompt.text, images=asked.prompt.images,
        sampling=SamplingParams(max_tokens=asked.max_tokens, temperature=0.0),
        priority=state.settings.summary_priority, cache_salt=cache_salt(request, state.settings, None),
        mm_processor_kwargs=state.bridge.engine.single_input_options)
    if body.stream:
        return SSEResponse(_answer_events(stream, state, asked, head))
    output, _ = await final_output(request, stream, state)
    return {"object": "camera.answer", **head, "answer": output.text, "cited_event_ids": asked.cited(output.text),
            "empty": False, "finish_reason": output.finish_reason, "usage": _usage(output)}


def _usage(output: Any) -> dict[str, int]:
    completion = len(output.token_ids)
    return {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": output.num_prompt_tokens + completion}


async def _single(answer: dict[str, Any]) -> AsyncIterator[str]:
    yield sse({**answer, "object": "camera.answer.chunk", "delta": answer["answer"]})
    yield sse("[DONE]")


async def _answer_events(stream: Any, state: ServerState, asked: Asked, head: dict[str, Any]) -> AsyncIterator[str]:
    """The retrieval (with an empty delta) first, a chunk a new piece of text, the last with the citations, the
    finish reason and the usage; then [DONE]."""
    yield sse({"object": "camera.answer.chunk", **head, "delta": ""})
    try:
        async for delta, output in text_deltas(stream, state):
            chunk: dict[str, Any] = {"object": "camera.answer.chunk", "id": asked.answer_id, "delta": delta}
            if output.finished:
                chunk |= {"finish_reason": output.finish_reason, "cited_event_ids": asked.cited(output.text),
                          "usage": _usage(output)}
            if delta or output.finished:
                yield sse(chunk)
    except EngineFailure as exc:
        yield sse(error_body(500, str(exc), code="engine_error"))
    yield sse("[DONE]")
