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
from api.completion_store import check_metadata
from api.errors import ENGINE_FAILED, APIError, error_body
from api.grammars import compile_ahead, structured_output_spec
from api.guard import cache_salt
from api.images import load_image_url
from api.openai_schemas import (
    ChatCompletionRequest,
    ChatVideoPart,
    InputFunctionCall,
    InputFunctionCallOutput,
    NamedToolChoice,
    ResponsesNamedToolChoice,
    ResponsesRequest,
    SamplingFields,
    client_priority,
    refuse_unsupported,
)
from api.state import ServerState, server_state
from api.streaming import ClientDisconnected, SSEResponse, sse, until_disconnect
from api.tools import (
    Function,
    ParsedCall,
    ToolCallParser,
    ToolPlan,
    render_tools,
    template_takes_tools,
    tool_plan,
    tools_and_answer,
)
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
    text: str | None = None  # the prompt already rendered (with the template's tools): sent instead of messages


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
            if limits.max_images_per_request is not None and len(images) >= limits.max_images_per_request:
                raise APIError(400, f"{param}: more than max_images_per_request = {limits.max_images_per_request} "
                                    "images in one request", param, "too_many_images")
            images.append(await load_image_url(value, limits, param))
            content.append({"type": "image"})
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return EnginePrompt(messages, images, videos)


def check_model(model: str, state: ServerState) -> None:
    if model != state.settings.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.settings.model_name!r}",
                       "model", "model_not_found")


def sampling_params(body: SamplingFields, max_tokens: int | None, stop: str | list[str] | None,
                    state: ServerState, param: str, grammar: GrammarSpec | None = None,
                    **chat_only: Any) -> SamplingParams:
    """The engine's parameters of a request; `chat_only`: SamplingParams fields that only chat completions take."""
    limits = state.settings.limits
    context = state.bridge.engine.max_model_len
    cap = min(limits.max_tokens_cap or context, context)
    if max_tokens is not None and max_tokens > cap:
        raise APIError(400, f"{param} is {max_tokens}, over this server's cap of {cap} (the context, max_model_len "
                            f"{context}, or max_tokens_cap)", param, "max_tokens_too_large")
    try:
        # Without max_tokens, up to the context (the engine ends a request at max_model_len), as OpenAI and vLLM do.
        return SamplingParams(
            max_tokens=max_tokens or limits.default_max_tokens or context,
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


ToolTurns = list[dict[str, Any]]  # per turn: its `tool_calls` [(id, name, arguments, param)] and `tool_call_id`


async def start(body: SamplingFields, sampling: SamplingParams, grammar: GrammarSpec | None, grammar_param: str,
                turns: list[tuple[str, list[tuple[str, str, str]]]], request: Request, state: ServerState,
                plan: ToolPlan | None = None,
                tool_turns: ToolTurns | None = None) -> tuple[RequestStream, ToolCallParser | None] | Response:
    """A request's stream, after the checks it passes before it reaches the engine: every parameter honoured (400
    naming one that is not), its priority not below the server's floor, its grammar compiled, its prompt built
    (with its tools and its history's calls: `plan`, `tool_turns`); with the parser of its output's tool calls
    where `plan` lets the model call tools (else None). A Response (499) if the client left before the request was
    submitted (the grammar's compile is then cancelled)."""
    try:
        refuse_unsupported(body)
        client_priority(body.priority, 0, state.settings.limits.min_client_priority)
        await compile_ahead(state.bridge.engine, grammar, grammar_param, request)
        prompt = await build_prompt(turns, state, body)
        if plan is not None or any(tool_turns or []):
            prompt = with_tools(prompt, plan, tool_turns or [], state)
        stream = await submit(prompt, sampling, body, request, state)
    except ClientDisconnected:
        return Response(status_code=499)
    parser = ToolCallParser(tuple(f.name for f in plan.functions)) if plan is not None and plan.calls else None
    return stream, parser


def with_tools(prompt: EnginePrompt, plan: ToolPlan | None, tool_turns: ToolTurns, state: ServerState) -> EnginePrompt:
    """The prompt with the tools and the history's calls and results: through the checkpoint's template where it
    takes tools, else the generic rendering (api/tools.py)."""
    engine = state.bridge.engine
    native = template_takes_tools(engine.chat_template)
    messages = [{**message, **extra} for message, extra in zip(prompt.messages, tool_turns or [{}] * len(
        prompt.messages), strict=True)]
    functions = plan.functions if plan is not None else ()
    messages = render_tools(messages, functions, native)
    if not native:
        return EnginePrompt(messages, prompt.images, prompt.videos)
    try:
        text = engine.render_messages(messages, tools=[f.openai() for f in functions] or None)
    except Exception as exc:  # the template refuses malformed turns in many ways
        raise APIError(400, f"messages could not be rendered with the chat template: {exc}", "messages",
                       "invalid_value") from None
    return EnginePrompt(messages, prompt.images, prompt.videos, text)


async def submit(prompt: EnginePrompt, sampling: SamplingParams, body: SamplingFields, request: Request,
                 state: ServerState) -> RequestStream:
    return await state.bridge.add(messages=None if prompt.text is not None else prompt.messages,
                                  prompt=prompt.text, images=prompt.images, videos=prompt.videos,
                                  sampling=sampling,
                                  priority=body.priority,
                                  cache_salt=cache_salt(request, state.settings, body.cache_salt))


async def final_output(request: Request, stream: RequestStream,
                       state: ServerState) -> tuple[RequestOutput, list[TokenLogprobs]]:
    """Wait for the request to finish (its last output, and its tokens' log-probabilities if it asked for them;
    its prompt's, from its first output, set on the last); abort it if the client leaves first."""
    logprobs: list[TokenLogprobs] = []

    async def collect() -> RequestOutput:
        last = None
        scores = None
        async for last in stream:
            logprobs.extend(last.new_logprobs or [])
            scores = last.prompt_logprobs if last.prompt_logprobs is not None else scores
        assert last is not None
        last.prompt_logprobs = scores
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

def chat_turns(body: ChatCompletionRequest) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], ToolTurns]:
    """The messages as turns of parts, and each turn's tool calls (assistant) or call id (tool)."""
    turns = []
    tool_turns: ToolTurns = []
    for i, message in enumerate(body.messages):
        content = message.content if message.content is not None else ""
        if isinstance(content, str):
            parts = [("text", content, f"messages[{i}].content")]
        else:
            parts = [
                ("text", part.text, f"messages[{i}].content[{j}]") if part.type == "text"
                else ("text", part.refusal, f"messages[{i}].content[{j}]") if part.type == "refusal"
                else video_turn_part(part, f"messages[{i}].content[{j}]") if isinstance(part, ChatVideoPart)
                else ("image", part.image_url if isinstance(part.image_url, str) else part.image_url.url,
                      f"messages[{i}].content[{j}].image_url")
                for j, part in enumerate(content)
            ]
        extra: dict[str, Any] = {}
        calls = [(c.id, c.function.name, c.function.arguments, f"messages[{i}].tool_calls[{k}].function.arguments")
                 for k, c in enumerate(message.tool_calls or [])]
        if message.function_call is not None:  # the deprecated single call
            calls.append((f"call_{i}", message.function_call.name, message.function_call.arguments,
                          f"messages[{i}].function_call.arguments"))
        if calls:
            if message.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant turns carry tool calls", f"messages[{i}].role",
                               "invalid_value")
            extra["tool_calls"] = calls
        role = "tool" if message.role == "function" else message.role
        if role == "tool":
            extra["tool_call_id"] = message.tool_call_id or message.name or ""
        turns.append((role, parts))
        tool_turns.append(extra)
    return turns, tool_turns


def chat_tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    functions = [Function(t.function.name, t.function.description, t.function.parameters) for t in body.tools or []]
    named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    return tool_plan(functions, None if named else body.tool_choice, named, body.parallel_tool_calls)


def request_grammar(body: SamplingFields, fmt: Any, format_param: str,
                    plan: ToolPlan | None) -> tuple[GrammarSpec | None, str]:
    """The request's grammar: its structured output's, its tool calls', or under `auto` both (calls, or an answer
    in the structured output: `calls_or_answer`); `required` and a named function make calls only, so their
    structured output holds no text."""
    return tools_and_answer(plan, *structured_output_spec(body, fmt, format_param))


def openai_tool_call(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


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
    from api.server_tools import answer as with_server_tools  # here: it builds on this module

    served = await with_server_tools(body, request, state)  # None: the request names none of the server's tools
    if served is not None:
        return served
    metadata = check_metadata(body.metadata)
    if body.n not in (None, 1):  # one engine request per choice (api/routes_completions.py)
        from api.routes_completions import chat_choices

        response = await chat_choices(body, request, state)
    else:
        started = await start_chat(body, request, state)
        response = started if isinstance(started, Response) else await answer_chat(started, request, state)
    if body.store:
        from api.routes_stored import keep

        keep(response, body, metadata, request, state)
    return response


@dataclass
class ChatCall:
    """A chat completion whose engine request is submitted: what its answer is made from."""

    body: ChatCompletionRequest
    stream: Any  # a RequestStream, or one whose first output was awaited (routes_completions.Primed)
    parser: ToolCallParser | None
    completion_id: str
    created: int


async def start_chat(body: ChatCompletionRequest, request: Request, state: ServerState) -> ChatCall | Response:
    """The checks of one chat completion (one choice) and its engine request; a Response (499) if the client left
    before it was submitted."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    check_stream_options(body.stream, body.stream_options)
    check_prompt_logprobs(body.stream, body.prompt_logprobs)
    max_tokens = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    plan = chat_tool_plan(body)
    grammar, grammar_param = request_grammar(body, body.response_format, "response_format", plan)
    sampling = sampling_params(body, max_tokens, body.stop, state, param, grammar,
                               presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                               repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                               stop_token_ids=body.stop_token_ids,
                               logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                               prompt_logprobs=body.prompt_logprobs)
    turns, tool_turns = chat_turns(body)
    started = await start(body, sampling, grammar, grammar_param, turns, request, state, plan, tool_turns)
    if isinstance(started, Response):
        return started
    stream, parser = started
    return ChatCall(body, stream, parser, f"chatcmpl-{stream.request_id}", int(time.time()))


async def answer_chat(call: ChatCall, request: Request, state: ServerState) -> Response:
    """The chat completion's answer: its event stream, or (not streamed) its message once it has finished."""
    body, stream, parser = call.body, call.stream, call.parser
    completion_id, created = call.completion_id, call.created
    model = state.settings.model_name
    if body.stream:
        options = body.stream_options
        return SSEResponse(chat_events(stream, state, completion_id, created, model,
                                       bool(options and options.include_usage), body.return_token_ids, parser,
                                       bool(options and options.continuous_usage_stats)))
    try:
        output, logprobs = await final_output(request, stream, state)
    except ClientDisconnected:
        return Response(status_code=499)
    message: dict[str, Any] = {"role": "assistant", "content": output.text}
    finish_reason = output.finish_reason
    if parser is not None:
        parser.feed(output.text, final=True)
        if parser.calls:
            message = {"role": "assistant", "content": parser.text or None,
                       "tool_calls": [openai_tool_call(call) for call in parser.calls]}
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    choice: dict[str, Any] = {
        "index": 0, "message": message,
        "finish_reason": finish_reason, "logprobs": chat_logprobs(logprobs, state) if body.logprobs else None,
    }
    answer: dict[str, Any] = {
        "id": completion_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [choice], "usage": chat_usage(output),
    }
    if body.return_token_ids:
        choice["token_ids"] = output.token_ids
        answer["prompt_token_ids"] = output.prompt_token_ids
    if body.prompt_logprobs is not None:
        answer["prompt_logprobs"] = vllm_prompt_logprobs(output.prompt_logprobs, state)
    return JSONResponse(answer)


def check_prompt_logprobs(stream: bool | None, prompt_logprobs: int | None) -> None:
    """vLLM refuses prompt log-probabilities on a streamed request."""
    if prompt_logprobs is not None and stream:
        raise APIError(400, "prompt_logprobs is not available with stream: true", "prompt_logprobs", "invalid_value")


def vllm_prompt_logprobs(scored: list[TokenLogprobs | None] | None, state: ServerState) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the token itself and its likeliest alternatives."""
    tokenizer = state.bridge.engine.tokenizer

    def entry(logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": max(logprob, IMPOSSIBLE_LOGPROB), "rank": rank}

    answer: list[Any] = []
    for lp in scored or []:
        if lp is None:
            answer.append(None)
            continue
        tops = {str(token): entry(value, rank) for rank, (token, value) in enumerate(lp.top, start=1)}
        tops.setdefault(str(lp.token_id), entry(lp.logprob, lp.rank or 0))
        answer.append({token: {**value, "decoded_token": tokenizer.decode([int(token)])}
                       for token, value in tops.items()})
    return answer


def check_stream_options(stream: bool | None, options: Any) -> None:
    """OpenAI refuses `stream_options` on a request that is not streamed."""
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value")


def tool_deltas(events: list[tuple]) -> tuple[str, list[dict[str, Any]]]:
    """A parser's events as a delta's text and OpenAI's `tool_calls` delta entries (a call's first entry carries
    its id, type and name; the next ones its arguments in chunks)."""
    text, entries = "", []
    for event in events:
        if event[0] == "text":
            text += event[1]
        elif event[0] == "call":
            call = event[1]
            entries.append({"index": call.index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
        else:
            entries.append({"index": event[1].index, "function": {"arguments": event[2]}})
    return text, entries


async def chat_events(stream: RequestStream, state: ServerState, completion_id: str, created: int, model: str,
                      include_usage: bool, return_token_ids: bool, parser: ToolCallParser | None = None,
                      continuous_usage: bool = False) -> AsyncIterator[str]:
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
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = prompt_token_ids
        return sse(body)

    num_tokens = 0
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in the first chunk
    try:
        async for delta, output in text_deltas(stream, state):
            new_ids = output.token_ids[num_tokens:]
            first = num_tokens == 0
            num_tokens = len(output.token_ids)
            finish_reason = output.finish_reason
            usage = chat_usage(output) if continuous_usage else None
            prompt_token_ids = output.prompt_token_ids if return_token_ids and first else None
            entries: list[dict[str, Any]] = []
            if parser is not None:
                delta, entries = tool_deltas(parser.feed(delta, final=output.finished))
                if parser.calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            # One chunk a tool call entry (the SDK accumulates a call's entries across chunks); the text, the
            # token ids, the log-probabilities and the finish reason go with the last.
            for entry in entries[:-1]:
                yield chunk({"role": "assistant", "tool_calls": [entry]} if first else {"tool_calls": [entry]},
                            usage=usage)
                first = False
            last: dict[str, Any] = {"role": "assistant", "content": delta} if first else \
                {"content": delta} if delta else {}
            if entries:
                last["tool_calls"] = [entries[-1]]
                if not delta:
                    last.pop("content", None)
            if first or last or output.finished or return_token_ids or output.new_logprobs:
                # the role goes with the first token, as OpenAI and vLLM send it (clients time TTFT by it)
                yield chunk(last, finish_reason, new_ids if return_token_ids else None, usage=usage,
                            logprobs=output.new_logprobs)
            if output.finished and include_usage:
                yield chunk({}, usage=chat_usage(output), choices=False)
    except EngineFailure as exc:
        yield sse(error_body(500, str(exc), code="engine_error"))
    yield sse("[DONE]")


# -- /v1/responses ------------------------------------------------------------------------------------

def responses_turns(body: ResponsesRequest) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], ToolTurns]:
    """The input as turns of parts, and each turn's tool calls or call id: `function_call` items join the
    assistant turn before them (or make one), each `function_call_output` is a tool turn."""
    turns: list[tuple[str, list[tuple[str, str, str]]]] = []
    tool_turns: ToolTurns = []
    if body.instructions:
        turns.append(("system", [("text", body.instructions, "instructions")]))
        tool_turns.append({})
    if isinstance(body.input, str):
        return [*turns, ("user", [("text", body.input, "input")])], [*tool_turns, {}]
    for i, message in enumerate(body.input):
        if isinstance(message, InputFunctionCall):
            call = (message.call_id, message.name, message.arguments, f"input[{i}].arguments")
            if turns and turns[-1][0] == "assistant":
                tool_turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append(("assistant", [("text", "", f"input[{i}]")]))
                tool_turns.append({"tool_calls": [call]})
            continue
        if isinstance(message, InputFunctionCallOutput):
            output = message.output if isinstance(message.output, str) else "".join(p.text for p in message.output)
            turns.append(("tool", [("text", output, f"input[{i}].output")]))
            tool_turns.append({"tool_call_id": message.call_id})
            continue
        tool_turns.append({})
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
    return turns, tool_turns


def responses_tool_plan(body: ResponsesRequest) -> ToolPlan | None:
    functions = [Function(t.name, t.description, t.parameters) for t in body.tools or []]
    named = body.tool_choice.name if isinstance(body.tool_choice, ResponsesNamedToolChoice) else None
    return tool_plan(functions, None if named else body.tool_choice, named, body.parallel_tool_calls)


def function_call_item(call: ParsedCall, status: str = "completed") -> dict[str, Any]:
    """A call as the Responses API's `function_call` output item."""
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


@dataclass
class ResponseMeta:
    response_id: str
    message_id: str
    created_at: float
    body: ResponsesRequest
    model: str

    parser: ToolCallParser | None = None

    def response(self, status: str, text: str | None = None, output: RequestOutput | None = None) -> dict[str, Any]:
        """The Response object; `text` None means no output item yet. With tools, `text` is the text beside the
        calls (None: a message item only if there is text) and the calls follow as `function_call` items."""
        item_status = "completed" if status == "completed" else "incomplete"
        calls = self.parser.calls if self.parser is not None else []
        items = [] if text is None or (calls and not text) else [{
            "type": "message", "id": self.message_id, "status": item_status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }]
        items += [function_call_item(call, "completed" if call.complete else "incomplete") for call in calls]
        body = self.body
        choice = body.tool_choice
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        result: dict[str, Any] = {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": items, "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens, "temperature": self.body.temperature,
            "top_p": self.body.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": choice.model_dump() if isinstance(choice, ResponsesNamedToolChoice) else choice or (
                "auto" if tools else "none"), "tools": tools,
            "error": None, "incomplete_details": None, "metadata": {}, "usage": None,
            "text": self.body.text.model_dump(by_alias=True, exclude_none=True) if self.body.text and
            self.body.text.format else {"format": {"type": "text"}},
        }
        if text is not None:
            result["output_text"] = text or ""
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
        text = output.text
        if self.parser is not None:
            if not self.parser.calls and not self.parser.text:  # not streamed: read the whole output now
                self.parser.feed(output.text, final=True)
            text = self.parser.text
        return self.response(status, text, output)


@router.post("/responses", response_model=None)
async def responses(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state)) -> Response:
    check_model(body.model, state)
    plan = responses_tool_plan(body)
    grammar, grammar_param = request_grammar(body, body.text.format if body.text else None, "text.format", plan)
    sampling = sampling_params(body, body.max_output_tokens, body.stop, state, "max_output_tokens", grammar)
    turns, tool_turns = responses_turns(body)
    started = await start(body, sampling, grammar, grammar_param, turns, request, state, plan, tool_turns)
    if isinstance(started, Response):
        return started
    stream, parser = started
    meta = ResponseMeta(f"resp_{stream.request_id}", f"msg_{stream.request_id}", time.time(), body,
                        state.settings.model_name, parser)
    if body.stream:
        return SSEResponse(response_events(stream, state, meta))
    try:
        output, _ = await final_output(request, stream, state)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(meta.final(output))


async def response_events(stream: RequestStream, state: ServerState, meta: ResponseMeta) -> AsyncIterator[str]:
    """The Responses event stream, as the `openai` SDK's parser expects it. Without tools, one message item from
    the start; with tools, a message item once text comes and a `function_call` item for each call, its arguments
    streamed as `response.function_call_arguments.delta`."""
    sequence = 0
    parser = meta.parser

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return sse({"type": kind, "sequence_number": sequence - 1, **fields}, event=kind)

    next_index = 0
    message_index: int | None = None
    call_index: dict[int, int] = {}  # a call's index -> its output index
    calls_done: set[int] = set()  # calls whose done events were sent

    def open_message() -> list[str]:
        nonlocal next_index, message_index
        message_index, next_index = next_index, next_index + 1
        return [event("response.output_item.added", output_index=message_index, item={
                    "type": "message", "id": meta.message_id, "status": "in_progress", "role": "assistant",
                    "content": []}),
                event("response.content_part.added", item_id=meta.message_id, output_index=message_index,
                      content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def call_done(call: ParsedCall) -> list[str]:
        item = function_call_item(call, "completed" if call.complete else "incomplete")
        ids = {"item_id": item["id"], "output_index": call_index[call.index]}
        return [event("response.function_call_arguments.done", **ids, name=call.name, arguments=call.arguments),
                event("response.output_item.done", output_index=call_index[call.index], item=item)]

    yield event("response.created", response=meta.response("in_progress"))
    yield event("response.in_progress", response=meta.response("in_progress"))
    if parser is None:
        for line in open_message():
            yield line
    text = ""
    try:
        async for delta, output in text_deltas(stream, state):
            events = [("text", delta)] if parser is None else parser.feed(delta, final=output.finished)
            for item in events:
                if item[0] == "text":
                    if not item[1]:
                        continue
                    if message_index is None:
                        for line in open_message():
                            yield line
                    text += item[1]
                    yield event("response.output_text.delta", item_id=meta.message_id, output_index=message_index,
                                content_index=0, delta=item[1], logprobs=[])
                elif item[0] == "call":
                    call = item[1]
                    call_index[call.index], next_index = next_index, next_index + 1
                    yield event("response.output_item.added", output_index=call_index[call.index],
                                item=function_call_item(call, "in_progress"))
                else:
                    call, chunk = item[1], item[2]
                    yield event("response.function_call_arguments.delta", item_id=function_call_item(call)["id"],
                                output_index=call_index[call.index], delta=chunk)
            if parser is not None:
                for call in parser.calls:
                    if call.complete and call.index not in calls_done:
                        calls_done.add(call.index)
                        for line in call_done(call):
                            yield line
            if output.finished:
                final = meta.final(output)
                if parser is not None:
                    for call in parser.calls:
                        if call.index not in calls_done:
                            for line in call_done(call):
                                yield line
                if message_index is not None:
                    message = next(item for item in final["output"] if item["type"] == "message")
                    part = message["content"][0]
                    ids = {"item_id": meta.message_id, "output_index": message_index}
                    yield event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
                    yield event("response.content_part.done", **ids, content_index=0, part=part)
                    yield event("response.output_item.done", output_index=message_index, item=message)
                # Also when cut at max_output_tokens (status "incomplete"), as vLLM does: clients such as the
                # SDK's `responses.stream()` need `response.completed` for their final response.
                yield event("response.completed", response=final)
    except EngineFailure as exc:
        failed = meta.response("failed")
        failed["error"] = {"code": "server_error", "message": str(exc)}
        yield event("response.failed", response=failed)
