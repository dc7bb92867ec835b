"""Ollama's API on the same engine and keys (what Home Assistant's Ollama integration, Frigate's Ollama provider and the
`ollama` Python client call): `/api/chat` (with `tools`, alone or beside a `format`: the model calls the tools or
answers in the format, held by one grammar as OpenAI's `auto` tools beside a `response_format`) and `/api/generate`
with base64 `images`, `format` ("json" or a JSON Schema), `options`, `stream` (default true: NDJSON, one object a
line), `keep_alive` accepted and ignored (the model stays loaded); `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`. Errors are Ollama's `{"error": "..."}`.

Sampling defaults are Ollama's (OLLAMA_OPTIONS), not OpenAI's: a client that sends no options gets what it would get
from Ollama. `num_predict` -1 (Ollama's default) and -2 mean up to the context.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.bridge import EngineFailure, RequestStream
from api.errors import APIError, error_headers
from api.grammars import compile_ahead
from api.guard import cache_salt
from api.images import decode_image
from api.pools import work_pools
from api.routes_openai import EnginePrompt, final_output, text_deltas, with_tools
from api.state import ServerState, server_state
from api.streaming import ClientDisconnected
from api.tools import Function, ToolCallParser, tool_plan, tools_and_answer
from engine import RequestOutput, SamplingParams
from engine.grammar import GrammarSpec, tool_call_begin

router = APIRouter(prefix="/api")

OLLAMA_VERSION = "0.12.0"  # the Ollama API version these routes follow
OLLAMA_TAG = "latest"
# Ollama's own defaults for the options a client leaves out.
OLLAMA_OPTIONS: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repeat_penalty": 1.1}
# Options that change how the model is loaded or run, not what is sampled: accepted and ignored.
IGNORED_OPTIONS = frozenset({
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread", "numa", "low_vram", "num_keep",
    "repeat_last_n", "typical_p", "min_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline",
    "f16_kv", "vocab_only", "use_mlock", "embedding_only", "logits_all",
})


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | str | None = None


class ChatBody(Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    # vlmcap's extension (Ollama has none): "auto" (Ollama's behaviour), "none", "required" or a function's name.
    tool_choice: str | None = None


class GenerateBody(Common):
    prompt: str | None = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None
    context: list[int] | None = None
    template: str | None = None


def tool_function(tool: dict[str, Any], index: int) -> Function:
    """An Ollama tool ({"type": "function", "function": {name, description, parameters}}) as a Function."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type", "function") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise APIError(400, f"tools[{index}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    return Function(function["name"], function.get("description"), function.get("parameters"))


def history_calls(message: Message, index: int) -> dict[str, Any]:
    """A turn's tool calls (assistant) or the called function's name (tool), as `with_tools` takes them."""
    if message.role == "tool":
        return {"tool_call_id": message.tool_name or ""}
    calls = []
    for k, call in enumerate(message.tool_calls or []):
        function = call.get("function") or {}
        arguments = function.get("arguments", {})
        calls.append((call.get("id") or f"call_{index}_{k}", function.get("name", ""),
                      arguments if isinstance(arguments, str) else json.dumps(arguments),
                      f"messages[{index}].tool_calls[{k}].function.arguments"))
    return {"tool_calls": calls} if calls else {}


def ollama_error(status: int, message: str, retry_after_s: float | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=error_headers(status, retry_after_s))


def model_names(state: ServerState) -> tuple[str, str]:
    name = state.settings.model_name
    return name, name if ":" in name else f"{name}:{OLLAMA_TAG}"


def check_model(model: str, state: ServerState) -> None:
    if model not in model_names(state):
        raise APIError(404, f"model '{model}' not found, try pulling it first (this server serves "
                            f"{model_names(state)[1]!r})")


async def parse(request: Request, kind: type[BaseModel]) -> Any:
    """The request's JSON body as `kind`; APIError 400 with the first problem."""
    try:
        raw = await request.json()
    except ValueError:
        raise APIError(400, "invalid JSON in the request body") from None
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}") from None


def format_grammar(fmt: str | dict[str, Any] | None) -> GrammarSpec | None:
    if not fmt:
        return None
    try:
        return GrammarSpec(json_object=True) if fmt == "json" else GrammarSpec.from_schema(fmt)
    except ValueError as exc:
        raise APIError(400, f"format: {exc}") from None


def sampling(body: Common, state: ServerState, grammar: GrammarSpec | None) -> SamplingParams:
    """The engine's parameters from Ollama's `options` (Ollama's defaults for those left out)."""
    given = body.options or Options()
    for name in given.model_extra or {}:
        if name not in IGNORED_OPTIONS:
            raise APIError(400, f"options.{name} is not supported by this server")
    context = state.bridge.engine.max_model_len
    cap = min(state.settings.limits.max_tokens_cap or context, context)
    predict = given.num_predict
    if predict is not None and predict > cap:
        raise APIError(400, f"options.num_predict is {predict}, over this server's cap of {cap}")
    stop = given.stop
    values = {name: getattr(given, name) for name in OLLAMA_OPTIONS}
    values = {name: OLLAMA_OPTIONS[name] if value is None else value for name, value in values.items()}
    try:
        return SamplingParams(
            max_tokens=predict if predict is not None and predict > 0 else cap,
            temperature=values["temperature"], top_p=values["top_p"], top_k=values["top_k"],
            repetition_penalty=values["repeat_penalty"], seed=given.seed,
            presence_penalty=given.presence_penalty or 0.0, frequency_penalty=given.frequency_penalty or 0.0,
            stop=[stop] if isinstance(stop, str) else list(stop or []), grammar=grammar,
        )
    except ValueError as exc:
        raise APIError(400, f"options: {exc}") from None


def decode_images(images: list[str] | None, state: ServerState, param: str) -> list[Any]:
    """Ollama's images: base64 (a data URL's prefix tolerated)."""
    decoded = []
    for i, text in enumerate(images or []):
        try:
            data = base64.b64decode(text.split(",", 1)[1] if text.startswith("data:") else text, validate=True)
        except ValueError:
            raise APIError(400, f"{param}[{i}]: not base64") from None
        decoded.append(decode_image(data, state.settings.limits, f"{param}[{i}]"))
    return decoded


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def stats(output: RequestOutput, started: float) -> dict[str, Any]:
    total = int((time.perf_counter() - started) * 1e9)
    return {"total_duration": total, "load_duration": 0, "prompt_eval_count": output.num_prompt_tokens,
            "prompt_eval_duration": 0, "eval_count": len(output.token_ids), "eval_duration": total}


def done_reason(output: RequestOutput) -> str:
    return "length" if output.finish_reason == "length" else "stop"


async def run(request: Request, state: ServerState, body: Common, params: SamplingParams, grammar: GrammarSpec | None,
              shape: Any, grammar_param: str = "format", **engine_input: Any) -> Response:
    """Submit, then answer whole or as NDJSON; `shape(text, output_or_None)` makes one response object;
    `grammar_param`: the field the grammar's errors name."""
    await compile_ahead(state.bridge.engine, grammar, grammar_param, request)
    stream = await state.bridge.add(sampling=params, cache_salt=cache_salt(request, state.settings, None),
                                    **engine_input)
    started = time.perf_counter()
    if body.stream:
        return StreamingResponse(lines(stream, state, shape, started), media_type="application/x-ndjson")
    output, _ = await final_output(request, stream, state)
    return JSONResponse({**shape(output.text, output), **stats(output, started)})


async def lines(stream: RequestStream, state: ServerState, shape: Any, started: float) -> AsyncIterator[str]:
    try:
        async for delta, output in text_deltas(stream, state):
            if output.finished:
                if delta:
                    yield json.dumps(shape(delta, None)) + "\n"
                yield json.dumps({**shape("", output), **stats(output, started)}) + "\n"
            elif delta:
                yield json.dumps(shape(delta, None)) + "\n"
    except EngineFailure as exc:
        yield json.dumps({"error": str(exc)}) + "\n"


async def answered(work: Any) -> Response:
    try:
        return await work
    except APIError as exc:
        return ollama_error(exc.status, exc.message, exc.retry_after_s)
    except ClientDisconnected:
        return Response(status_code=499)


@router.post("/chat", response_model=None)
async def chat(request: Request, state: ServerState = Depends(server_state)) -> Response:
    async def work() -> Response:
        body: ChatBody = await parse(request, ChatBody)
        check_model(body.model, state)
        if not body.messages:  # Ollama's way to load a model
            return JSONResponse({"model": body.model, "created_at": now(), "message": {"role": "assistant",
                                 "content": ""}, "done_reason": "load", "done": True})
        named = body.tool_choice if body.tool_choice not in (None, "auto", "none", "required") else None
        plan = tool_plan([tool_function(t, i) for i, t in enumerate(body.tools or [])],
                         None if named else body.tool_choice, named, None)
        # tools with a format, as Ollama answers them: calls, or an answer in the format (`auto`)
        grammar, grammar_param = tools_and_answer(plan, format_grammar(body.format), "format")
        params = sampling(body, state, grammar)
        messages, images, tool_turns = [], [], []
        for i, message in enumerate(body.messages):
            loaded = await work_pools(state).run(
                "decode", decode_images, message.images, state, f"messages[{i}].images")
            images += loaded
            parts = [{"type": "image"} for _ in loaded] + [{"type": "text", "text": message.content or ""}]
            messages.append({"role": message.role, "content": parts})
            tool_turns.append(history_calls(message, i))
        prompt = EnginePrompt(messages, images, [])
        if plan is not None or any(tool_turns):
            prompt = with_tools(prompt, plan, tool_turns, state)
        parser = ToolCallParser(tuple(f.name for f in plan.functions)) if plan is not None and plan.calls else None

        def shape(text: str, output: RequestOutput | None) -> dict[str, Any]:
            if parser is not None:
                text = "".join(e[1] for e in parser.feed(text, final=output is not None) if e[0] == "text")
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            answer = {"model": body.model, "created_at": now(), "message": reply, "done": output is not None}
            if output is not None:
                answer["done_reason"] = done_reason(output)
                calls = parser.calls if parser is not None else []
                if any(c.complete for c in calls):
                    reply["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                           for c in calls if c.complete]
                # a call cut by num_predict (done_reason "length") has no arguments to give: its text is content
                reply["content"] += "".join(tool_call_begin(c.name) + c.arguments for c in calls if not c.complete)
            return answer

        return await run(request, state, body, params, grammar, shape, grammar_param, images=prompt.images,
                         messages=None if prompt.text is not None else prompt.messages, prompt=prompt.text)

    return await answered(work())


@router.post("/generate", response_model=None)
async def generate(request: Request, state: ServerState = Depends(server_state)) -> Response:
    async def work() -> Response:
        body: GenerateBody = await parse(request, GenerateBody)
        check_model(body.model, state)
        if body.suffix:
            raise APIError(400, "suffix is not supported by this server")
        if not body.prompt and not body.images:
            return JSONResponse({"model": body.model, "created_at": now(), "response": "", "done_reason": "load",
                                 "done": True})
        grammar = format_grammar(body.format)
        params = sampling(body, state, grammar)
        images = await work_pools(state).run("decode", decode_images, body.images, state, "images")

        def shape(text: str, output: RequestOutput | None) -> dict[str, Any]:
            answer = {"model": body.model, "created_at": now(), "response": text, "done": output is not None}
            if output is not None:
                answer["done_reason"] = done_reason(output)
            return answer

        if body.raw:  # the prompt as it is, no template (an image marker per image is the client's to write)
            return await run(request, state, body, params, grammar, shape, prompt=body.prompt, images=images)
        messages = [{"role": "system", "content": [{"type": "text", "text": body.system}]}] if body.system else []
        messages.append({"role": "user", "content": [{"type": "image"} for _ in images]
                         + [{"type": "text", "text": body.prompt or ""}]})
        return await run(request, state, body, params, grammar, shape, messages=messages, images=images)

    return await answered(work())


def model_entry(state: ServerState) -> dict[str, Any]:
    _, tagged = model_names(state)
    return {"name": tagged, "model": tagged, "modified_at": datetime.fromtimestamp(state.started_at, timezone.utc)
            .isoformat(), "size": 0, "digest": "", "details": details()}


def details() -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": "vlm", "families": ["vlm"],
            "parameter_size": "", "quantization_level": ""}


@router.get("/tags")
async def tags(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return {"models": [model_entry(state)]}


@router.get("/ps")
async def running(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return {"models": [{**model_entry(state), "expires_at": "2999-01-01T00:00:00Z", "size_vram": 0}]}


@router.post("/show", response_model=None)
async def show(request: Request, state: ServerState = Depends(server_state)) -> Response:
    async def work() -> Response:
        raw = await request.json() if await request.body() else {}
        name = raw.get("model") or raw.get("name") if isinstance(raw, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "model is required")
        check_model(name, state)
        engine = state.bridge.engine
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": "", "license": "", "details": details(),
            "model_info": {"general.architecture": "vlm", "vlm.context_length": engine.max_model_len},
            "capabilities": ["completion", "vision"], "modified_at": model_entry(state)["modified_at"],
        })

    return await answered(work())


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}
