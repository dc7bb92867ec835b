"""OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions` and the `/v1/responses` subset that
vision clients (the `openai` SDK, `ultralytics.LLM`) use."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from api.bridge import EngineFailure, RequestStream
from api.errors import ENGINE_FAILED, APIError, error_body
from api.grammars import compile_ahead
from api.guard import cache_salt
from api.images import load_image_url
from api.openai_schemas import (
    ChatCompletionRequest,
    ChatVideoPart,
    JSONSchemaFormat,
    ResponseFormat,
    ResponsesRequest,
    ResponsesTextFormat,
    SamplingFields,
    client_priority,
    refuse_unsupported,
)
from api.state import ServerState, server_state
from api.streaming import ClientDisconnected, SSEResponse, sse, until_disconnect
from api.videos import check_video_input, load_video_url, video_sampling
from engine import RequestOutput, SamplingParams
from engine.grammar import GrammarSpec
from engine.sampling import TokenLogprobs
from engine.video import Video

# OpenAI's log-probability for a token the distribution cannot produce (JSON has no -Infinity).
IMPOSSIBLE_LOGPROB = -9999.0

router = APIRouter(prefix="/v1")


# -- shared request handling ----------------------------------------------------------------------

@dataclass
class EnginePrompt:
    """Messages in the engine's form (`{"type": "image"}` / `{"type": "video"}` / `{"type": "text"}` parts),
    images and videos in order."""

    messages: list[dict[str, Any]]
    images: list[Image.Image]
    videos: list[Video]


async def build_prompt(turns: list[tuple[str, list[tuple[str, str, str]]]], state: ServerState,
                       body: SamplingFields) -> EnginePrompt:
    """`turns` is (role, [(kind, value, param)]) with kind "text", "image" or "video" (value: the URL)."""
    limits = state.settings.limits
    messages: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    videos: list[Video] = []
    options = body.video_options
    sampling = video_sampling(limits, options and options.num_frames, options and options.fps, "video_options")
    for role, parts in turns:
        content: list[dict[str, str]] = []
        for kind, value, param in parts:
            if kind == "text":
                content.append({"type": "text", "text": value})
                continue
            if kind == "video":
                if len(videos) >= limits.max_videos_per_request:
                    raise APIError(400, f"{param}: more than max_videos_per_request = {limits.max_videos_per_request} "
                                        "videos in one request", param, "too_many_videos")
                check_video_input(state.bridge.engine, param)
                videos.append(await load_video_url(value, sampling, limits, param))
                content.append({"type": "video"})
                continue
            if len(images) >= limits.max_images_per_request:
                raise APIError(400, f"{param}: more than {limits.max_images_per_request} images in one request",
                               param, "too_many_images")
            images.append(await load_image_url(value, limits, param))
            content.append({"type": "image"})
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return EnginePrompt(messages, images, videos)


def check_model(model: str, state: ServerState) -> None:
    if model != state.settings.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.settings.model_name!r}",
                       "model", "model_not_found")


def grammar_spec(fmt: ResponseFormat | ResponsesTextFormat | None, param: str) -> GrammarSpec | None:
    """The grammar a `response_format` (chat) or `text.format` (Responses) asks for; None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(json_object=True)
    spec = fmt.json_schema if isinstance(fmt, JSONSchemaFormat) else fmt
    where = f"{param}.json_schema.schema" if isinstance(fmt, JSONSchemaFormat) else f"{param}.schema"
    if spec.schema_ is None:
        raise APIError(400, f"{where} is required for a json_schema format", where, "invalid_value")
    try:
        return GrammarSpec.from_schema(spec.schema_)
    except ValueError as exc:
        raise APIError(400, f"{where}: {exc}", where, "invalid_json_schema") from None


def sampling_params(body: SamplingFields, max_tokens: int | None, stop: str | list[str] | None,
                    state: ServerState, param: str, grammar: GrammarSpec | None = None,
                    **chat_only: Any) -> SamplingParams:
    """The engine's parameters of a request; `chat_only`: SamplingParams fields that only chat completions take."""
    limits = state.settings.limits
    if max_tokens is not None and max_tokens > limits.max_tokens_cap:
        raise APIError(400, f"{param} is {max_tokens}, over this server's cap of {limits.max_tokens_cap}",
                       param, "max_tokens_too_large")
    try:
        return SamplingParams(
            max_tokens=max_tokens or limits.default_max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            ignore_eos=body.ignore_eos,
            grammar=grammar,
            **{name: value for name, value in chat_only.items() if value is not None},
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


async def start(body: SamplingFields, sampling: SamplingParams, grammar: GrammarSpec | None, grammar_param: str,
                turns: list[tuple[str, list[tuple[str, str, str]]]], request: Request,
                state: ServerState) -> RequestStream:
    """A request's stream, after the checks it passes before it reaches the engine: every parameter honoured (400
    naming one that is not), its priority not below the server's floor, its grammar compiled (cancelled if the
    client leaves: ClientDisconnected), its prompt built."""
    refuse_unsupported(body)
    client_priority(body.priority, 0, state.settings.limits.min_client_priority)
    await compile_ahead(state.bridge.engine, grammar, grammar_param, request)
    prompt = await build_prompt(turns, state, body)
    return await submit(prompt, sampling, body, request, state)


async def submit(prompt: EnginePrompt, sampling: SamplingParams, body: SamplingFields, request: Request,
                 state: ServerState) -> RequestStream:
    return await state.bridge.add(messages=prompt.messages, images=prompt.images, videos=prompt.videos,
                                  sampling=sampling,
                                  priority=body.priority,
                                  cache_salt=cache_salt(request, state.settings, body.cache_salt))


async def final_output(request: Request, stream: RequestStream,
                       state: ServerState) -> tuple[RequestOutput, list[TokenLogprobs]]:
    """Wait for the request to finish (its last output, and its tokens' log-probabilities if it asked for them);
    abort it if the client leaves first."""
    logprobs: list[TokenLogprobs] = []

    async def collect() -> RequestOutput:
        last = None
        async for last in stream:
            logprobs.extend(last.new_logprobs or [])
        assert last is not None
        return last

    try:
        output = await until_disconnect(request, collect())
    except EngineFailure as exc:
        raise APIError(500, str(exc), code="engine_error") from None
    finally:
        state.bridge.abort(stream.request_id)  # a no-op once finished
    if output.finish_reason == "error":
        raise APIError(500, ENGINE_FAILED, code="engine_error")
    return output, logprobs


def chat_logprobs(logprobs: list[TokenLogprobs], state: ServerState) -> dict[str, Any]:
    """OpenAI's `choices[].logprobs` of these tokens: each token's text, log-probability and UTF-8 bytes, with its
    likeliest alternatives."""
    tokenizer = state.bridge.engine.tokenizer

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": max(logprob, IMPOSSIBLE_LOGPROB), "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


async def text_deltas(stream: RequestStream, state: ServerState) -> AsyncIterator[tuple[str, RequestOutput]]:
    """(new text, output) for each output; aborts the request if the consumer stops early."""
    sent = ""
    try:
        async for output in stream:
            if output.finish_reason == "error":  # ended by the engine: the consumer reports an error
                raise EngineFailure(ENGINE_FAILED)
            delta = output.text[len(sent):]
            sent = output.text
            yield delta, output
    finally:
        state.bridge.abort(stream.request_id)


# -- /v1/models -----------------------------------------------------------------------------------

@router.get("/models")
async def list_models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": state.settings.model_name, "object": "model", "created": int(state.started_at),
        "owned_by": "vlmcap", "max_model_len": state.bridge.engine.max_model_len,
    }]}


# -- /v1/chat/completions ---------------------------------------------------------------------------

def chat_turns(body: ChatCompletionRequest) -> list[tuple[str, list[tuple[str, str, str]]]]:
    turns = []
    for i, message in enumerate(body.messages):
        content = message.content if message.content is not None else ""
        if isinstance(content, str):
            parts = [("text", content, f"messages[{i}].content")]
        else:
            parts = [
                ("text", part.text, f"messages[{i}].content[{j}]") if part.type == "text"
                else video_turn_part(part, f"messages[{i}].content[{j}]") if isinstance(part, ChatVideoPart)
                else ("image", part.image_url if isinstance(part.image_url, str) else part.image_url.url,
                      f"messages[{i}].content[{j}].image_url")
                for j, part in enumerate(content)
            ]
        turns.append((message.role, parts))
    return turns


def video_turn_part(part: ChatVideoPart, param: str) -> tuple[str, str, str]:
    return ("video", part.video_url if isinstance(part.video_url, str) else part.video_url.url, f"{param}.video_url")


def chat_usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose keys and values came from the prefix cache."""
    completion = len(output.token_ids)
    return {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": output.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: ServerState = Depends(server_state)) -> Response:
    check_model(body.model, state)
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n} is not supported: this server returns exactly one choice (n=1)", "n",
                       "unsupported_value")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    max_tokens = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    grammar = grammar_spec(body.response_format, "response_format")
    sampling = sampling_params(body, max_tokens, body.stop, state, param, grammar,
                               presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                               repetition_penalty=body.repetition_penalty,
                               logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    try:
        stream = await start(body, sampling, grammar, "response_format", chat_turns(body), request, state)
    except ClientDisconnected:
        return Response(status_code=499)
    completion_id, created = f"chatcmpl-{stream.request_id}", int(time.time())
    model = state.settings.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(chat_events(stream, state, completion_id, created, model, include_usage,
                                       body.return_token_ids))
    try:
        output, logprobs = await final_output(request, stream, state)
    except ClientDisconnected:
        return Response(status_code=499)
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": output.text},
        "finish_reason": output.finish_reason, "logprobs": chat_logprobs(logprobs, state) if body.logprobs else None,
    }
    if body.return_token_ids:
        choice["token_ids"] = output.token_ids
    return JSONResponse({
        "id": completion_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [choice], "usage": chat_usage(output),
    })


async def chat_events(stream: RequestStream, state: ServerState, completion_id: str, created: int, model: str,
                      include_usage: bool, return_token_ids: bool) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None, token_ids: list[int] | None = None,
              usage: dict[str, Any] | None = None, choices: bool = True,
              logprobs: list[TokenLogprobs] | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                                  "logprobs": None if logprobs is None else chat_logprobs(logprobs, state)}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [choice] if choices else []}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    num_tokens = 0
    try:
        async for delta, output in text_deltas(stream, state):
            new_ids = output.token_ids[num_tokens:]
            first = num_tokens == 0
            num_tokens = len(output.token_ids)
            if first:  # the role goes with the first token, as OpenAI and vLLM send it (clients time TTFT by it)
                yield chunk({"role": "assistant", "content": delta}, output.finish_reason,
                            new_ids if return_token_ids else None, logprobs=output.new_logprobs)
            elif delta or output.finished or return_token_ids or output.new_logprobs:
                yield chunk({"content": delta} if delta else {}, output.finish_reason,
                            new_ids if return_token_ids else None, logprobs=output.new_logprobs)
            if output.finished and include_usage:
                yield chunk({}, usage=chat_usage(output), choices=False)
    except EngineFailure as exc:
        yield sse(error_body(500, str(exc), code="engine_error"))
    yield sse("[DONE]")


# -- /v1/responses ------------------------------------------------------------------------------------

def responses_turns(body: ResponsesRequest) -> list[tuple[str, list[tuple[str, str, str]]]]:
    turns: list[tuple[str, list[tuple[str, str, str]]]] = []
    if body.instructions:
        turns.append(("system", [("text", body.instructions, "instructions")]))
    if isinstance(body.input, str):
        return [*turns, ("user", [("text", body.input, "input")])]
    for i, message in enumerate(body.input):
        if isinstance(message.content, str):
            turns.append((message.role, [("text", message.content, f"input[{i}].content")]))
            continue
        parts = []
        for j, part in enumerate(message.content):
            param = f"input[{i}].content[{j}]"
            if part.type == "input_image":
                if not part.image_url:
                    raise APIError(400, f"{param}: only input_image parts with an image_url (a data URL) are "
                                        "supported, not file_id", param, "unsupported_value")
                parts.append(("image", part.image_url, f"{param}.image_url"))
            elif part.type == "input_video":
                parts.append(("video", part.video_url, f"{param}.video_url"))
            elif isinstance(part, ChatVideoPart):
                parts.append(video_turn_part(part, param))
            else:
                parts.append(("text", part.text, param))
        turns.append((message.role, parts))
    return turns


@dataclass
class ResponseMeta:
    response_id: str
    message_id: str
    created_at: float
    body: ResponsesRequest
    model: str

    def response(self, status: str, text: str | None = None, output: RequestOutput | None = None) -> dict[str, Any]:
        """The Response object; `text` None means no output item yet."""
        item_status = "completed" if status == "completed" else "incomplete"
        items = [] if text is None else [{
            "type": "message", "id": self.message_id, "status": item_status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }]
        result: dict[str, Any] = {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": items, "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens, "temperature": self.body.temperature,
            "top_p": self.body.top_p, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "error": None, "incomplete_details": None, "metadata": {}, "usage": None,
            "text": self.body.text.model_dump(by_alias=True, exclude_none=True) if self.body.text and
            self.body.text.format else {"format": {"type": "text"}},
        }
        if text is not None:
            result["output_text"] = text
        if output is not None:
            completion = len(output.token_ids)
            result["usage"] = {
                "input_tokens": output.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": output.num_prompt_tokens + completion,
            }
            result["completed_at"] = time.time()
            if output.finish_reason == "length":
                result["incomplete_details"] = {"reason": "max_output_tokens"}
        return result

    def final(self, output: RequestOutput) -> dict[str, Any]:
        status = "incomplete" if output.finish_reason in ("length", "abort") else "completed"
        return self.response(status, output.text, output)


@router.post("/responses", response_model=None)
async def responses(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state)) -> Response:
    check_model(body.model, state)
    grammar = grammar_spec(body.text.format if body.text else None, "text.format")
    sampling = sampling_params(body, body.max_output_tokens, body.stop, state, "max_output_tokens", grammar)
    try:
        stream = await start(body, sampling, grammar, "text.format", responses_turns(body), request, state)
    except ClientDisconnected:
        return Response(status_code=499)
    meta = ResponseMeta(f"resp_{stream.request_id}", f"msg_{stream.request_id}", time.time(), body,
                        state.settings.model_name)
    if body.stream:
        return SSEResponse(response_events(stream, state, meta))
    try:
        output, _ = await final_output(request, stream, state)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(meta.final(output))


async def response_events(stream: RequestStream, state: ServerState, meta: ResponseMeta) -> AsyncIterator[str]:
    """The Responses event stream, as the `openai` SDK's parser expects it."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    ids = {"item_id": meta.message_id, "output_index": 0}
    yield event("response.created", response=meta.response("in_progress"))
    yield event("response.in_progress", response=meta.response("in_progress"))
    yield event("response.output_item.added", output_index=0, item={
        "type": "message", "id": meta.message_id, "status": "in_progress", "role": "assistant", "content": []})
    yield event("response.content_part.added", **ids, content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    try:
        async for delta, output in text_deltas(stream, state):
            if delta:
                yield event("response.output_text.delta", **ids, content_index=0, delta=delta, logprobs=[])
            if output.finished:
                final = meta.final(output)
                part = final["output"][0]["content"][0]
                yield event("response.output_text.done", **ids, content_index=0, text=output.text, logprobs=[])
                yield event("response.content_part.done", **ids, content_index=0, part=part)
                yield event("response.output_item.done", output_index=0, item=final["output"][0])
                # Also when cut at max_output_tokens (status "incomplete"), as vLLM does: clients such as the
                # SDK's `responses.stream()` need `response.completed` for their final response.
                yield event("response.completed", response=final)
    except EngineFailure as exc:
        failed = meta.response("failed")
        failed["error"] = {"code": "server_error", "message": str(exc)}
        yield event("response.failed", response=failed)
