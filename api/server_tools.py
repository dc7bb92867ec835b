"""The camera memory's tools run by the server inside a chat completion: a request opts in by naming one of the
server's tools (api/mcp_server.py: `search_events`, `get_event`, `camera_summary`, `latest_frame`) among its
function `tools` without `parameters` of its own, e.g. `{"type": "function", "function": {"name":
"search_events"}}`. The server gives the model each such tool's description and input schema (the MCP tool's),
runs the calls the model makes to them against the event store with the caller's key (what that key sees over
HTTP, nothing else), feeds the results back as tool turns and runs the model again, until it answers without
calling them; the client gets the final answer (streamed or not), its usage summed over the rounds, and what the
server ran in `message.server_tool_calls` (a vlmcap extension: id, name, arguments, the result as the model read
it). The client's own function tools (with `parameters`) stay the client's: a turn that calls one is answered as
usual, with its calls (the server's calls of that turn are not run).

Bounded: at most MAX_TOOL_ROUNDS rounds run tools, the last round answers without them (`tool_choice: none`); the
request's `tool_choice` holds for the first round, `auto` for the next. A result is cut to MAX_TOOL_RESULT_CHARS
and to its share of the context left after the prompt, the turn so far and the answer's room (`max_tokens`, else
ANSWER_ROOM_TOKENS), counted by the model's tokenizer; when no room is left, the next round answers. Frames come as
their URLs (the JSON of `call_function_tool`), never as images."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from api.bridge import EngineFailure
from api.errors import APIError, error_body
from api.mcp_server import call_function_tool, function_tools
from api.openai_schemas import ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, Tool, ToolCall
from api.routes_openai import ChatCall, chat_usage, check_stream_options, openai_tool_call, start_chat, text_deltas
from api.state import ServerState
from api.streaming import SSEResponse, sse
from api.tools import ParsedCall
from engine import RequestOutput

MAX_TOOL_ROUNDS = 4  # rounds whose calls the server runs; one more answers
MAX_TOOL_RESULT_CHARS = 16_000  # of one call's result, before it is counted in tokens
ANSWER_ROOM_TOKENS = 256  # kept free for the answer when the request sets no max_tokens
TURN_TOKENS = 32  # a tool turn's own tokens (role, call id, the template's markers), besides its content
CUT_NOTE = " [cut: {shown} of {total} characters]"


def served_names(body: ChatCompletionRequest, available: set[str]) -> set[str]:
    """The server's tools the request names without parameters of its own."""
    return {t.function.name for t in body.tools or [] if t.function.parameters is None and t.function.name in available}


def refuse_with_server_tools(body: ChatCompletionRequest) -> None:
    """What a request with the server's tools cannot ask for (each choice, token and score is one round's)."""
    for given, param in ((body.n not in (None, 1), "n"), (bool(body.logprobs), "logprobs"),
                         (body.prompt_logprobs is not None, "prompt_logprobs"),
                         (body.return_token_ids, "return_token_ids"), (bool(getattr(body, "store", None)), "store")):
        if given:
            raise APIError(400, f"{param} is not available with the server's tools (a function tool named as one "
                                "of them without parameters)", param, "invalid_value")


def cut(content: str, tokens: int, tokenizer: Any) -> str:
    """`content` within MAX_TOOL_RESULT_CHARS and `tokens` of the model's tokenizer, with a note when cut."""
    total = len(content)
    shown = content[:MAX_TOOL_RESULT_CHARS]
    ids = tokenizer(shown, add_special_tokens=False)["input_ids"]
    if len(ids) <= tokens and len(shown) == total:
        return content
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    keep = max(0, min(len(ids), tokens - count(CUT_NOTE.format(shown=total, total=total))))
    for _ in range(4):  # decoding a cut and encoding it again may merge differently at the seam: a token or two
        text = tokenizer.decode(ids[:keep]) if keep < len(ids) else shown
        result = text + CUT_NOTE.format(shown=len(text), total=total)
        over = count(result) - tokens
        if over <= 0:
            return result
        if keep == 0:
            return "[cut]"  # not even the note fits
        keep = max(0, keep - over)
    return result


@dataclass
class Rounds:
    """What the rounds of one request have given so far."""

    ran: list[dict[str, Any]] = field(default_factory=list)  # the server's calls, with their results
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    completion_id: str = ""

    def count(self, output: RequestOutput) -> None:
        usage = chat_usage(output)
        self.prompt_tokens += usage["prompt_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


async def start_round(body: ChatCompletionRequest, messages: list[ChatMessage], choice: Any, request: Request,
                      state: ServerState) -> ChatCall | Response:
    """One round's engine request (a Response when the client left before it was submitted)."""
    return await start_chat(body.model_copy(update={"messages": messages, "tool_choice": choice, "stream": False,
                                                    "stream_options": None}), request, state)


async def rounds(body: ChatCompletionRequest, served: set[str], request: Request, state: ServerState,
                 done: Rounds, first: ChatCall) -> AsyncIterator[tuple]:
    """The rounds' events, from the `first` round's request on: ("text", delta) as the model writes it, ("ran",
    calls) after the server ran a round's calls, and last ("final", calls, finish_reason): the client's calls (or
    the last round's) and why it ended."""
    engine = state.bridge.engine
    answer_room = body.max_completion_tokens or body.max_tokens or ANSWER_ROOM_TOKENS
    messages = list(body.messages)
    last_round = False
    for round_ in range(MAX_TOOL_ROUNDS + 1):
        last_round = last_round or round_ == MAX_TOOL_ROUNDS
        choice = "none" if last_round or body.tool_choice == "none" else "auto"
        call = first if round_ == 0 else await start_round(body, messages, choice, request, state)
        if isinstance(call, Response):  # the client left
            return
        parser, output = call.parser, None
        async for delta, output in text_deltas(call.stream, state):
            for event in parser.feed(delta, final=output.finished) if parser is not None else [("text", delta)]:
                if event[0] == "text" and event[1]:
                    yield ("text", event[1])
        assert output is not None
        done.count(output)
        calls: list[ParsedCall] = list(parser.calls) if parser is not None else []
        if last_round or not calls or any(c.name not in served or not c.complete for c in calls):
            finish = "tool_calls" if calls and output.finish_reason == "stop" else output.finish_reason
            yield ("final", calls, finish)
            return
        room = engine.max_model_len - output.num_prompt_tokens - len(output.token_ids) - answer_room
        share = room // len(calls) - TURN_TOKENS
        messages.append(ChatMessage(role="assistant", content=parser.text or None, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]))
        ran = []
        for c in calls:
            content = cut(await call_function_tool(request.app, request, c.name, c.arguments), max(share, 0),
                          engine.tokenizer)
            ran.append({"id": c.id, "name": c.name, "arguments": c.arguments, "content": content})
            messages.append(ChatMessage(role="tool", tool_call_id=c.id, content=content))
        done.ran.extend(ran)
        last_round = share < 2 * TURN_TOKENS  # no room for more results: the next round answers
        yield ("ran", ran)


async def answer(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response | None:
    """The chat completion with the server's tools run, or None when the request names none of them."""
    if not any(t.function.parameters is None for t in body.tools or []) or getattr(request.app.state, "mcp",
                                                                                   None) is None:
        return None
    definitions = {d["function"]["name"]: d["function"] for d in await function_tools(request.app)}
    served = served_names(body, set(definitions))
    if not served:
        return None
    refuse_with_server_tools(body)
    check_stream_options(body.stream, body.stream_options)  # the rounds run unstreamed: checked here
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.function.name, description=definitions[t.function.name]["description"],
        parameters=definitions[t.function.name]["parameters"])) if t.function.name in served else t
        for t in body.tools]
    body = body.model_copy(update={"tools": tools})
    first = await start_round(body, list(body.messages), body.tool_choice, request, state)  # a bad request: 4xx
    if isinstance(first, Response):
        return first
    model, created, done = state.settings.model_name, int(time.time()), Rounds(completion_id=first.completion_id)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(_events(rounds(body, served, request, state, done, first), done, model, created,
                                   include_usage))
    text, calls, finish = "", [], None
    try:
        async for event in rounds(body, served, request, state, done, first):
            if event[0] == "text":
                text += event[1]
            elif event[0] == "final":
                calls, finish = event[1], event[2]
    except EngineFailure as exc:
        raise APIError(500, str(exc), code="engine_error") from None
    if finish is None:
        return Response(status_code=499)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else ""),
                               "server_tool_calls": done.ran}
    if calls:
        message["tool_calls"] = [openai_tool_call(c) for c in calls]
    return JSONResponse({"id": done.completion_id, "object": "chat.completion", "created": created, "model": model,
                         "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                         "usage": done.usage()})


async def _events(events: AsyncIterator[tuple], done: Rounds, model: str, created: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """The rounds as one chat completion's event stream: the text as it comes, each round the server ran as a
    `server_tool_calls` delta, the client's calls, the finish reason, the usage."""
    def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None,
              choices: bool = True) -> str:
        body: dict[str, Any] = {"id": done.completion_id, "object": "chat.completion.chunk", "created": created,
                                "model": model,
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
                                if choices else []}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    role = {"role": "assistant"}
    try:
        async for event in events:
            if event[0] == "text":
                yield chunk({**role, "content": event[1]})
            elif event[0] == "ran":
                yield chunk({**role, "server_tool_calls": event[1]})
            else:
                calls, finish = event[1], event[2]
                for index, call in enumerate(calls):
                    entry = {**openai_tool_call(call), "index": index}
                    yield chunk({**role, "tool_calls": [entry]})
                    role = {}
                yield chunk({**role}, finish)
                if include_usage:
                    yield chunk({}, usage=done.usage(), choices=False)
            role = {}
    except EngineFailure as exc:
        yield sse(error_body(500, str(exc), code="engine_error"))
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield sse("[DONE]")
