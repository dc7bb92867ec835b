"""The camera memory over HTTP: events searched (`GET /v1/events`), read with their frames (`GET /v1/events/{id}`,
`.../frames/{index}`), found by likeness (`GET /v1/events/{id}/similar`, `POST /v1/events/similar` with an
image), and `POST /v1/embeddings` (OpenAI's shape; text, or images as data URLs, as Frigate's embeddings provider
sends them) from the served model itself.

`CameraMemory` is the server's store with its writer (memory/outputs.py's `EventKeeper`, which `vlmcap worker` keeps
too, with the engine's embeddings): the queue worker's finish hook (`on_finished`) hands it each
finished job and returns at once; the writer's thread makes the thumbnails and the embedding and writes the event.
The embedding is the mean of the kept frames' (each as POST /v1/embeddings gives it): taken from the caption's own
encoder run where each frame was one encoder input (`EngineCaptioner.keep_embeddings` -> `remember`), else run on
the engine's vision tower by the writer (one thread, outside the step loop). Every read runs on a worker thread,
never on the event loop.

Which events a key sees: every event on a server without keys, for --api-key's key (named default) and with
--events-shared; a named key of --api-keys sees the cameras --events-key-cameras gives it (none: no events)."""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import re
import struct
import threading
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile

from api.bridge import EngineBridge
from api.errors import APIError
from api.guard import DEFAULT_KEY_NAME, key_name
from api.images import data_url_bytes, decode_base64, decode_image
from api.pools import work_pools
from api.settings import ServerSettings
from api.state import ServerState, server_state
from engine.embeddings import MAX_EMBED_INPUTS
from memory import Event, EventQuery, EventStore
from memory.jobs import FrameEmbeddings
from memory.outputs import EventKeeper, open_keeper
from memory.store import MAX_CAMERAS, mean_unit

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

MAX_EMBED_TEXT_CHARS = 32_000
# One embedding at a time in the process (an event's frames or a request's inputs): each runs the vision tower on
# one thread beside the step loop, so the step loop keeps the other cores.
EMBEDDING = threading.Lock()


class CameraMemory(EventKeeper):
    """The server's event store, its writer thread and the engine that embeds events' frames (in the background:
    `EngineBridge.background`)."""

    def __init__(self, store: EventStore, settings: ServerSettings, bridge: EngineBridge) -> None:
        self.bridge = bridge
        self.engine = bridge.engine
        # The embeddings a caption's own encoder run gave its frames (`remember`), which the writer reuses.
        self.frame_embeddings = FrameEmbeddings()
        self.frames_reused = 0  # kept frames whose vector came with their caption
        self.frames_embedded = 0  # kept frames the writer ran the vision tower for
        super().__init__(store, settings, embed=self.embed_frames)

    def remember(self, frames: list[bytes], vectors: list[list[float]]) -> None:
        """The captioner's hook (`EngineCaptioner.keep_embeddings`): the embeddings its caption's own encoder run
        gave these frames, kept until the writer takes them for their event."""
        self.frame_embeddings.put(frames, vectors)

    def embed_frames(self, jpegs: list[bytes]) -> list[float] | None:
        """An event's vector: its kept frames' embeddings averaged, each what POST /v1/embeddings gives for that
        frame: the one its caption's own encoder run gave it (`remember`), else the vision tower run here (a
        sighting whose caption tiled its image, a clip's still, a job captioned by another server). None when the
        model gives none."""
        vectors = self.frame_embeddings.take(jpegs)
        missing = [jpeg for jpeg, vector in zip(jpegs, vectors) if vector is None]
        self.frames_reused += len(jpegs) - len(missing)
        if missing:
            try:
                with self.bridge.background(EMBEDDING):  # after any fall alert's caption, beside the steps
                    computed = iter(self.engine.embed(images=missing))
            except Exception as exc:  # the event is kept without a vector: found by text, not by likeness
                log.warning("event store: no embedding for an event's frames: %s: %s", type(exc).__name__, exc)
                return None
            self.frames_embedded += len(missing)
            vectors = [vector if vector is not None else next(computed) for vector in vectors]
        return mean_unit(vectors)


async def open_memory(settings: ServerSettings, bridge: EngineBridge) -> CameraMemory | None:
    """The configured store opened (None when off); a store that cannot be opened is logged and left off, so the
    server still captions."""
    return await asyncio.to_thread(open_keeper, settings, lambda store: CameraMemory(store, settings, bridge))


def camera_memory(request: Request, state: ServerState = Depends(server_state)) -> CameraMemory:
    """The server's camera memory, or 503 when the store is off or failed to open."""
    memory = getattr(request.app.state, "memory", None)
    if memory is None:
        raise APIError(503, "the event store is off on this server (--events-store off, or it failed to open)",
                       code="events_off")
    return memory


# -- who sees what --------------------------------------------------------------------------------------------
def visible_query(request: Request, settings: ServerSettings, **fields: Any) -> EventQuery | None:
    """The query as this key may ask it: its cameras only, for a named key without shared events; None when it
    sees none of the cameras asked for. A bad filter is a 400 naming it."""
    name = key_name(request)
    cameras = tuple(fields.pop("cameras", ()) or ())
    owner = None
    if name is not None and name != DEFAULT_KEY_NAME and not settings.events_shared:
        allowed = settings.key_cameras.get(name, frozenset())
        cameras = tuple(c for c in cameras if c in allowed) if cameras else tuple(sorted(allowed))
        if not cameras:
            return None
        owner = name
    try:
        return EventQuery(cameras=cameras, owner=owner, **fields)
    except ValueError as exc:
        raise APIError(400, str(exc), _param_of(str(exc)), "invalid_query") from None


def _param_of(message: str) -> str | None:
    if message.startswith("at most ") and " cameras a query" in message:
        return "camera"  # the query parameter, repeated too often
    word = message.split(" ", 1)[0]
    return {"camera": "camera"}.get(word, word if word in ("since", "until", "kind", "limit", "q", "cursor") else None)


def may_see(request: Request, settings: ServerSettings, event: Event) -> bool:
    query = visible_query(request, settings, cameras=(event.camera_id,))
    return query is not None and (query.owner is None or event.owner in (None, query.owner))


def timestamp(value: str | None, param: str) -> float | None:
    """Seconds since the epoch from a number or an ISO 8601 time ('2026-12-03T10:00:00Z'); 400 otherwise."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError):
            raise APIError(400, f"{param} must be seconds since the epoch or an ISO 8601 time, got {value[:64]!r}",
                           param, "invalid_time") from None
    if not math.isfinite(seconds) or not 0 <= seconds < 1e11:
        raise APIError(400, f"{param} must be a time after 1970 and before 5138, got {value[:64]!r}", param,
                       "invalid_time")
    return seconds


def event_json(event: Event, score: float | None = None, frames: bool = False) -> dict[str, Any]:
    out = event.to_json(frames=frames)
    out["frames_url"] = f"/v1/events/{event.id}/frames"
    if score is not None:
        out["score"] = round(score, 6)
    return out


async def _get_visible(request: Request, memory: CameraMemory, event_id: str) -> Event:
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", event_id):
        raise APIError(404, f"no event {event_id[:64]!r}", "event_id", "event_not_found")
    event = await work_pools(memory.settings).run("summary", memory.store.get, event_id)
    if event is None or not may_see(request, memory.settings, event):
        raise APIError(404, f"no event {event_id!r}", "event_id", "event_not_found")
    return event


# -- routes -------------------------------------------------------------------------------------------------
CAMERAS_HELP = f"only these cameras' events (repeat, at most {MAX_CAMERAS})"
SINCE_HELP = "events that end at or after this time (epoch seconds or ISO 8601)"
UNTIL_HELP = "events that start at or before this time"


@router.get("/events")
async def list_events(
    request: Request,
    camera: list[str] = Query([], description=CAMERAS_HELP),
    since: str | None = Query(None, description=SINCE_HELP),
    until: str | None = Query(None, description=UNTIL_HELP),
    kind: str | None = Query(None, description="sighting, event, fall or video"),
    fall: bool | None = Query(None, description="only fall alerts (true) or none of them (false)"),
    q: str | None = Query(None, description="words of the caption or its structured fields, all of them; ranked"),
    cursor: str | None = Query(None, description="the next_cursor of the previous page"),
    limit: int = Query(50, description="events a page, 1 to 200"),
    memory: CameraMemory = Depends(camera_memory),
) -> dict[str, Any]:
    """Events newest first, or by relevance with `q`; `next_cursor` is the next page (null on the last)."""
    query = visible_query(request, memory.settings, cameras=camera, since=timestamp(since, "since"),
                          until=timestamp(until, "until"), kind=kind, fall=fall, q=q, cursor=cursor, limit=limit)
    if query is None:
        return {"object": "list", "data": [], "next_cursor": None, "has_more": False}
    page = await work_pools(memory.settings).run("summary", memory.store.search, query)
    scores = page.scores or [None] * len(page.events)
    return {"object": "list", "data": [event_json(e, s) for e, s in zip(page.events, scores)],
            "next_cursor": page.next_cursor, "has_more": page.next_cursor is not None}


@router.get("/events/{event_id}")
async def get_event(event_id: str, request: Request, memory: CameraMemory = Depends(camera_memory)) -> dict[str, Any]:
    """One event with its frames' times and addresses (`frames`: each `url` is the JPEG)."""
    event = await _get_visible(request, memory, event_id)
    out = event_json(event, frames=True)
    out["frames"] = [{"index": i, "ts": f.ts, "url": f"/v1/events/{event.id}/frames/{i}", "bytes": len(f.jpeg)}
                     for i, f in enumerate(event.frames)]
    return out


@router.get("/events/{event_id}/frames/{index}", response_class=Response,
            responses={200: {"content": {"image/jpeg": {}}}})
async def get_event_frame(event_id: str, index: int, request: Request,
                          memory: CameraMemory = Depends(camera_memory)) -> Response:
    """One of the event's kept thumbnails, as JPEG."""
    event = await _get_visible(request, memory, event_id)
    if not 0 <= index < len(event.frames):
        raise APIError(404, f"event {event_id!r} has {len(event.frames)} frame(s), no frame {index}", "index",
                       "frame_not_found")
    return Response(event.frames[index].jpeg, media_type="image/jpeg",
                    headers={"Cache-Control": "private, max-age=3600"})


def _similar_json(found: list[tuple[Event, float]]) -> dict[str, Any]:
    return {"object": "list", "data": [event_json(event, score) for event, score in found]}


@router.get("/events/{event_id}/similar")
async def similar_events(event_id: str, request: Request, camera: list[str] = Query([], description=CAMERAS_HELP),
                         since: str | None = Query(None, description=SINCE_HELP),
                         until: str | None = Query(None, description=UNTIL_HELP),
                         limit: int = Query(10, description="events, 1 to 200"),
                         memory: CameraMemory = Depends(camera_memory)) -> dict[str, Any]:
    """The events whose frames look most like this one's (cosine of the embeddings, highest first): the event
    itself comes first (when the filters keep it). A bad camera, time or limit is a 400 naming it."""
    filters = {"cameras": camera, "since": timestamp(since, "since"), "until": timestamp(until, "until"),
               "limit": limit}
    query = visible_query(request, memory.settings, **filters)  # the filters checked before the event is read
    event = await _get_visible(request, memory, event_id)
    if event.embedding is None:
        raise APIError(409, f"event {event_id!r} has no embedding (its frames could not be embedded)", "event_id",
                       "no_embedding")
    found = [] if query is None else await work_pools(memory.settings).run("summary", memory.store.similar,
                                                                           event.embedding, query)
    return _similar_json(_itself_first(event, found, query))


def _itself_first(event: Event, found: list[tuple[Event, float]],
                  query: EventQuery | None) -> list[tuple[Event, float]]:
    """The event first of its similar events when the filters keep it. The store breaks equal scores by id, so
    an event whose frames are another's too (two people's first sightings on one frame: one image, one vector)
    could come second, or past the page's end."""
    if query is None or not _kept_by(event, query):
        return found
    own = next((score for other, score in found if other.id == event.id),
               sum(v * v for v in event.embedding or []))  # its cosine with itself (a unit vector)
    return [(event, own)] + [(other, score) for other, score in found if other.id != event.id][: query.limit - 1]


def _kept_by(event: Event, query: EventQuery) -> bool:
    """Whether a visible event passes a similar search's filters (memory/sql.py's `filters`: cameras, a time range
    the event overlaps)."""
    return ((not query.cameras or event.camera_id in query.cameras)
            and (query.since is None or event.end_ts >= query.since)
            and (query.until is None or event.start_ts <= query.until))


@router.post("/events/similar")
async def events_like_image(request: Request, camera: list[str] = Query([], description=CAMERAS_HELP),
                            since: str | None = Query(None, description=SINCE_HELP),
                            until: str | None = Query(None, description=UNTIL_HELP),
                            limit: int = Query(10, description="events, 1 to 200"),
                            memory: CameraMemory = Depends(camera_memory)) -> dict[str, Any]:
    """The events that look most like an uploaded image: a multipart file field `image`, or JSON
    `{"image": "<base64 or data URL>"}`. A bad camera, time or limit is a 400 naming it, before the upload is
    read."""
    state: ServerState = server_state(request)
    query = visible_query(request, memory.settings, cameras=camera, since=timestamp(since, "since"),
                          until=timestamp(until, "until"), limit=limit)
    data = await _uploaded_image(request, state.settings)
    vector = (await embed_inputs(state, [data], []))[0]
    found = [] if query is None else await work_pools(memory.settings).run("summary", memory.store.similar,
                                                                           vector, query)
    return _similar_json(found)


async def _uploaded_image(request: Request, settings: ServerSettings) -> bytes:
    limits = settings.limits
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=2)
        upload = form.get("image")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "the multipart body needs the image as a file field named 'image'", "image")
        data = await upload.read(limits.max_image_bytes + 1)
    elif content_type == "application/json":
        try:
            body = ImageBody.model_validate_json(await request.body())
        except ValueError as exc:
            raise APIError(400, f"the body must be a JSON object with an 'image' string: {str(exc)[:300]}",
                           "image") from None
        data = (data_url_bytes(body.image, limits, "image") if body.image.startswith("data:")
                else decode_base64(body.image, limits, "image"))
    else:
        raise APIError(415, f"send the image as multipart/form-data or application/json, not {content_type!r}")
    decode_image(data, limits, "image")  # the limits and a readable image, before the tower sees it
    return data


class ImageBody(BaseModel):
    image: str = Field(description="the image, base64 or a data URL")


# -- embeddings ---------------------------------------------------------------------------------------------
class EmbeddingsRequest(BaseModel):
    input: str | list[Any] = Field(description="a text, or a list of texts, data URLs of images, or "
                                                 "{'type': 'image_url', 'image_url': {'url': ...}} parts")
    model: str | None = None
    encoding_format: str = Field("float", description="float or base64 (little-endian float32)")
    dimensions: int | None = None
    user: str | None = None


def _embedding_inputs(body: EmbeddingsRequest, settings: ServerSettings) -> tuple[list[bytes | None], list[str]]:
    """Each input as image bytes (then None in `texts`' order) or as text, in the request's order."""
    items = [body.input] if isinstance(body.input, str) else list(body.input)
    if not items:
        raise APIError(400, "input must not be empty", "input", "invalid_input")
    if len(items) > MAX_EMBED_INPUTS:
        raise APIError(400, f"input has {len(items)} items, over the limit of {MAX_EMBED_INPUTS}", "input",
                       "invalid_input")
    images, texts = [], []
    for index, item in enumerate(items):
        param = f"input[{index}]" if not isinstance(body.input, str) else "input"
        if isinstance(item, dict):
            url = (item.get("image_url") or {}).get("url") if item.get("type") == "image_url" else item.get("image")
            if not isinstance(url, str):
                raise APIError(400, f"{param}: an object input is {{'type': 'image_url', 'image_url': {{'url': "
                                    "...}} or {'image': ...}", param, "invalid_input")
            item = url if url.startswith("data:") else f"data:image/jpeg;base64,{url}"
        if not isinstance(item, str) or (not item.startswith("data:") and not item.strip()):
            raise APIError(400, f"{param}: must be a non-empty string, an image data URL or an image part", param,
                           "invalid_input")
        if item.startswith("data:"):
            data = data_url_bytes(item, settings.limits, param)
            decode_image(data, settings.limits, param)
            images.append(data)
            texts.append(None)
        else:
            if len(item) > MAX_EMBED_TEXT_CHARS:
                raise APIError(400, f"{param}: {len(item)} characters, over the limit of {MAX_EMBED_TEXT_CHARS}",
                               param, "invalid_input")
            images.append(None)
            texts.append(item)
    return images, texts


async def embed_inputs(state: ServerState, images: list[bytes], texts: list[str]) -> list[list[float]]:
    """Embeddings from the engine on a worker thread; a refused input is a 400."""
    engine = state.bridge.engine

    def run() -> list[list[float]]:
        with EMBEDDING, state.bridge.beside():  # counted once it runs, not while it waits for the lock
            return engine.embed(images=images, texts=texts)

    try:
        return await work_pools(state).run("decode", run)
    except ValueError as exc:
        raise APIError(400, str(exc), "input", "invalid_input") from None


@router.post("/embeddings")
async def create_embeddings(body: EmbeddingsRequest, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """OpenAI's embeddings: one vector per input, from the served model (see engine/embeddings.py)."""
    if body.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be float or base64, got {body.encoding_format!r}",
                       "encoding_format", "invalid_value")
    if body.model is not None and body.model != state.settings.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server has {state.settings.model_name!r}",
                       "model", "model_not_found")
    images, texts = _embedding_inputs(body, state.settings)
    image_bytes = [i for i in images if i is not None]
    text_items = [t for t in texts if t is not None]
    vectors = await embed_inputs(state, image_bytes, text_items)
    by_image, by_text = iter(vectors[: len(image_bytes)]), iter(vectors[len(image_bytes):])
    ordered = [next(by_image) if image is not None else next(by_text) for image in images]
    if body.dimensions is not None and body.dimensions != len(ordered[0]):
        raise APIError(400, f"dimensions: this model's embeddings have {len(ordered[0])}, not {body.dimensions}",
                       "dimensions", "invalid_value")
    tokenizer = state.bridge.engine.tokenizer
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in text_items)
    data = [{"object": "embedding", "index": i,
             "embedding": vector if body.encoding_format == "float"
             else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()}
            for i, vector in enumerate(ordered)]
    return {"object": "list", "data": data, "model": state.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
