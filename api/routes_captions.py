"""Captioning REST: submit an image (multipart upload or JSON with base64), read a result by id, list
recent captions, follow new ones as server-sent events. Results of camera jobs (the Redis queue) are read
through the same routes when the server has Redis."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile

from api.bridge import EngineFailure, RequestStream
from api.errors import APIError
from api.grammars import compile_ahead
from api.guard import cache_salt
from api.images import decode_base64, decode_image
from api.openai_schemas import CacheSalt, Priority, client_priority, ranged
from api.pools import work_pools
from api.state import ServerState, server_state
from api.streaming import ClientDisconnected, SSEResponse, sse, until_disconnect
from engine.grammar import GrammarSpec
from jobqueue.contract import CaptionResult, JobStatus
from jobqueue.results import captions_feed
from jobqueue.structured import SchemaRefused, caption_validator, structured_caption

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

CameraId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="letters, digits, _ . : -")]


class CaptionFields(BaseModel):
    prompt: str | None = Field(None, min_length=1, max_length=20_000)
    camera_id: CameraId | None = None
    priority: Priority | None = None
    cache_salt: CacheSalt = None
    max_tokens: int | None = ranged("max_tokens")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema",
        description="a JSON Schema (an object, or its JSON text in a multipart field): the caption is decoded "
                    "under it and its parsed object returned as `structured`")

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_text(cls, value: Any) -> Any:
        """Multipart fields are text: a schema there is JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value, parse_constant=_refuse_constant)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"schema is not valid JSON: {exc}") from None
        return value


class CaptionRequest(CaptionFields):
    image: str = Field(description="the image, base64-encoded or as a data URL (data:image/jpeg;base64,...)")


MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["image"],
    "properties": {
        "image": {"type": "string", "format": "binary"},
        **{f.alias or name: {"type": "string"} for name, f in CaptionFields.model_fields.items()},
    },
}
CAPTION_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": CaptionRequest.model_json_schema()},
    "multipart/form-data": {"schema": MULTIPART_SCHEMA},
}}}


def result_json(result: CaptionResult) -> dict[str, Any]:
    return {**result.to_json(), "camera_id": result.camera_id or None}


def _fields(model: type[BaseModel], values: dict[str, Any]) -> Any:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


async def read_caption_request(request: Request, state: ServerState) -> tuple[bytes, CaptionFields]:
    """The image bytes and fields of a multipart or JSON caption request."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    limits = state.settings.limits
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=len(CaptionFields.model_fields) + 1)
        upload = form.get("image")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "the multipart body needs the image as a file field named 'image'", "image")
        data = await upload.read(limits.max_image_bytes + 1)
        fields = {k: v for k, v in form.items() if k != "image" and isinstance(v, str) and v != ""}
        return data, _fields(CaptionFields, fields)
    if content_type == "application/json":
        try:
            body = json.loads(await request.body(), parse_constant=_refuse_constant)
        except ValueError as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError(422, "the body must be a JSON object with an 'image' field")
        parsed = _fields(CaptionRequest, body)
        image = parsed.image.partition(",")[2] if parsed.image.startswith("data:") else parsed.image
        return decode_base64(image, limits, "image"), parsed
    raise APIError(415, f"send the image as multipart/form-data or application/json, not {content_type!r}")


async def run_caption(state: ServerState, result: CaptionResult, stream: RequestStream,
                      schema: dict[str, Any] | None = None) -> None:
    """Collect a caption into its result (parsed into `structured` under a schema); a failure or cancellation
    becomes a failed result."""
    async def running() -> None:
        result.status = JobStatus.RUNNING.value
        await state.captions.put(result)

    try:
        result.caption = await state.captioner.collect(stream, on_running=running)
        if schema is not None:
            result.structured = await work_pools(state).run("schema", structured_caption, result.caption, schema)
        result.status = JobStatus.DONE.value
    except asyncio.CancelledError:
        result.status, result.error = JobStatus.FAILED.value, "cancelled: the client disconnected"
        raise
    except APIError as exc:
        result.status, result.error = JobStatus.FAILED.value, exc.message
    except (EngineFailure, ValueError) as exc:
        result.status, result.error = JobStatus.FAILED.value, str(exc)
    finally:
        result.finished_at = time.time()
        try:
            await state.captions.finish(result)
        except Exception:
            log.exception("could not store caption result %s", result.id)


@router.post("/captions", status_code=202, openapi_extra=CAPTION_BODY,
             responses={200: {"description": "the finished caption (with ?wait=true)"}})
async def create_caption(request: Request, wait: bool = Query(False, description="answer with the caption"),
                         state: ServerState = Depends(server_state)) -> Response:
    data, fields = await read_caption_request(request, state)
    settings = state.settings
    if None not in (fields.max_tokens, settings.limits.max_tokens_cap) and \
            fields.max_tokens > settings.limits.max_tokens_cap:
        raise APIError(400, f"max_tokens is {fields.max_tokens}, over this server's cap of "
                            f"{settings.limits.max_tokens_cap}", "max_tokens")
    priority = client_priority(fields.priority, settings.caption_priority, settings.limits.min_client_priority)
    if fields.schema_ is not None:
        try:  # the checks that need no engine, then the grammar (cancelled if the client leaves meanwhile)
            await work_pools(state).run("schema", caption_validator, fields.schema_)
            spec = GrammarSpec.from_schema(fields.schema_)
        except (SchemaRefused, ValueError) as exc:
            raise APIError(400, f"schema: {exc}", "schema", "invalid_json_schema") from None
        try:
            await compile_ahead(state.bridge.engine, spec, "schema", request)
        except ClientDisconnected:
            return Response(status_code=499)
    image = await work_pools(state).run("decode", decode_image, data, settings.limits, "image")
    stream = await state.captioner.submit(
        image, fields.prompt or settings.caption_prompt, priority, fields.max_tokens, schema=fields.schema_,
        cache_salt=cache_salt(request, settings, fields.cache_salt),
    )
    now = time.time()
    result = CaptionResult(id=uuid.uuid4().hex, status=JobStatus.QUEUED.value, camera_id=fields.camera_id or "",
                           created_at=now, frame_ts=now, person_count=0)
    try:
        await state.captions.put(result)
    except BaseException:
        state.bridge.abort(stream.request_id)
        raise
    task = asyncio.create_task(run_caption(state, result, stream, fields.schema_))
    state.background.add(task)
    task.add_done_callback(state.background.discard)
    if not wait:
        return JSONResponse(result_json(result), status_code=202, headers={"Location": f"/v1/captions/{result.id}"})
    try:
        await until_disconnect(request, task)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result_json(result), status_code=200)


@router.get("/captions")
async def list_captions(camera: CameraId | None = None, limit: int = Query(50, ge=1, le=1000),
                        state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Finished captions (done and failed), newest first."""
    return {"object": "list", "data": [result_json(r) for r in await state.captions.recent(camera, limit)]}


@router.get("/captions/stream", response_class=SSEResponse, status_code=200,
            responses={200: {"content": {"text/event-stream": {}}}})
async def stream_captions(camera: CameraId | None = None,
                          last_event_id: str | None = Header(None, pattern=r"^[0-9]{1,20}(-[0-9]{1,20})?$"),
                          state: ServerState = Depends(server_state)) -> SSEResponse:
    """Finished captions as server-sent events (`event: caption`); resumes after `Last-Event-ID`. 503 when the
    store (Redis) does not answer, or when the server's event streams are all taken, before the stream starts."""
    await state.captions.ping()
    redis = state.redis

    async def events() -> AsyncIterator[str]:
        yield ": connected\n\n"
        tail = state.feeds.tail(captions_feed(camera), last_event_id) if redis is not None else \
            state.captions.tail(camera, last_event_id)
        async for position, result in tail:
            yield sse(result_json(result), event="caption", event_id=position)

    return state.feeds.response(events)


@router.get("/captions/{caption_id}")
async def get_caption(caption_id: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    result = await state.captions.get(caption_id)
    if result is None:
        raise APIError(404, f"no caption with id {caption_id!r} (unknown or expired)", "caption_id", "not_found")
    return result_json(result)
