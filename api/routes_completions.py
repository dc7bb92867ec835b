"""OpenAI's legacy `/v1/completions` (what litellm's text_completion and lm-eval's local-completions call) and
`GET /v1/models/{id}`.

A prompt is a string, a list of strings, a list of token ids or a list of lists of token ids (token ids go to the
engine as they are, no image markers among them; `echo` gives them back decoded by the model's tokenizer). Each
prompt gives `n` choices, choice `prompt_index * n + i`; with a `seed`, choice i samples with seed + i, so `n`
choices with seed s equal n requests sent one by one with seeds s, s + 1, ... `logprobs` is OpenAI's legacy format
(tokens, token_logprobs, top_logprobs, text_offset); with `echo` the prompt's tokens come first, scored by the
engine (`SamplingParams.prompt_logprobs`; the first token's null, as OpenAI and vLLM give it), and vLLM's
`prompt_logprobs` adds each choice's in vLLM's form. `suffix` (insertion) is refused.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from api.bridge import EngineFailure, RequestStream
from api.errors import APIError, error_body
from api.grammars import compile_ahead
from api.guard import cache_salt
from api.openai_schemas import (
    MAX_LOGPROBS,
    PromptLogprobs,
    ResponseFormat,
    SamplingFields,
    Stop,
    StreamOptions,
    client_priority,
    ranged,
    refuse_unsupported,
)
from api.routes_openai import (
    IMPOSSIBLE_LOGPROB,
    chat_usage,
    check_model,
    check_prompt_logprobs,
    check_stream_options,
    final_output,
    request_grammar,
    sampling_params,
    text_deltas,
    vllm_prompt_logprobs,
)
from api.state import ServerState, server_state
from api.streaming import ClientDisconnected, SSEResponse, sse, until_disconnect
from engine import RequestOutput, SamplingParams
from engine.sampling import INT64_MAX, TokenLogprobs

router = APIRouter(prefix="/v1")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # prompts times n in one request

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    model: str
    prompt: Prompt
    suffix: str | None = None
    max_tokens: int | None = ranged("max_tokens")
    min_tokens: int | None = ranged("min_tokens", description="vLLM's extension: EOS held back until then")
    stop: Stop = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="vLLM's extension")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = PromptLogprobs
    presence_penalty: float | None = ranged("presence_penalty")
    frequency_penalty: float | None = ranged("frequency_penalty")
    repetition_penalty: float | None = ranged("repetition_penalty", description="vLLM's extension: 1 is off")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None


def prompt_texts(prompt: Prompt, state: ServerState) -> list[tuple[str, list[int] | None]]:
    """The request's prompts, each as text and, where it came as token ids, those ids (the engine takes them as
    they are; the text, decoded by the model's tokenizer, is what `echo` gives back)."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]  # one prompt of token ids
    tokenizer = state.bridge.engine.tokenizer
    vocab = state.bridge.engine.vocab_size
    texts = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            texts.append((p, None))
            continue
        bad = next((t for t in p if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt[{i}] has token id {bad}, outside the model's vocabulary of {vocab}",
                           f"prompt[{i}]", "invalid_value")
        texts.append((tokenizer.decode(p), list(p)))
    if not all(text or ids for text, ids in texts):
        raise APIError(400, "every prompt must be non-empty", "prompt", "invalid_value")
    return texts


def prompt_scores(body: CompletionRequest) -> int | None:
    """The engine's prompt_logprobs of a request: its own (vLLM's), or with `echo` its `logprobs` (the echoed
    prompt's tokens scored as the generated ones are), the larger of the two."""
    asked = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(asked) if asked else None


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice i's seed: seed + i (None without a seed), so n choices equal n one-by-one requests with those seeds."""
    return [None if seed is None else seed + i for i in range(n)]


def legacy_logprobs(prompt_ids: list[int] | None, logprobs: list[TokenLogprobs], start: int,
                    state: ServerState, prompt_scores: list[TokenLogprobs | None] | None = None) -> dict[str, Any]:
    """OpenAI's legacy `logprobs`: each token's text, log-probability, top alternatives ({text: logprob}) and
    character offset in the choice's text from `start`; `prompt_ids` (echo) come first, scored by `prompt_scores`
    (the engine's prompt log-probabilities: the first token's null, as OpenAI and vLLM give it)."""
    tokenizer = state.bridge.engine.tokenizer
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = start
    scores = prompt_scores or []
    for i, token_id in enumerate(prompt_ids or []):
        text = tokenizer.decode([token_id])
        score = scores[i] if i < len(scores) else None
        tokens.append(text)
        values.append(None if score is None else max(score.logprob, IMPOSSIBLE_LOGPROB))
        tops.append(None if score is None else
                    {tokenizer.decode([t]): max(v, IMPOSSIBLE_LOGPROB) for t, v in score.top})
        offsets.append(offset)
        offset += len(text)
    for lp in logprobs:
        text = tokenizer.decode([lp.token_id])
        tokens.append(text)
        values.append(max(lp.logprob, IMPOSSIBLE_LOGPROB))
        tops.append({tokenizer.decode([t]): max(v, IMPOSSIBLE_LOGPROB) for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def completion_params(body: CompletionRequest, state: ServerState) -> tuple[list[SamplingParams], Any, str]:
    """The engine's parameters of each of the n choices, and the request's grammar and its parameter's name."""
    if body.suffix:
        raise APIError(400, "suffix (text insertion) is not supported by this server: send the prompt alone",
                       "suffix", "unsupported_parameter")
    if body.best_of not in (None, body.n):
        raise APIError(400, f"best_of={body.best_of} is not supported: send it equal to n or not at all",
                       "best_of", "unsupported_value")
    check_stream_options(body.stream, body.stream_options)
    check_prompt_logprobs(body.stream, body.prompt_logprobs)
    grammar, grammar_param = request_grammar(body, body.response_format, "response_format", None)
    base = sampling_params(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, body.stop, state,
                           "max_tokens", grammar, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                           logprobs=body.logprobs, min_tokens=body.min_tokens,
                           stop_token_ids=body.stop_token_ids, prompt_logprobs=prompt_scores(body))
    if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
        raise APIError(400, f"seed {body.seed} + n - 1 is over {INT64_MAX}", "seed", "invalid_value")
    params = []
    for seed in choice_seeds(body.seed, body.n):
        try:
            params.append(SamplingParams(**{**base.__dict__, "seed": seed}))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
    return params, grammar, grammar_param


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request,
                      state: ServerState = Depends(server_state)) -> Response:
    check_model(body.model, state)
    refuse_unsupported(body)
    client_priority(body.priority, 0, state.settings.limits.min_client_priority)
    texts = prompt_texts(body.prompt, state)
    if len(texts) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(texts)} prompts times n={body.n} is over {MAX_CHOICES} choices", "n",
                       "invalid_value")
    params, grammar, grammar_param = completion_params(body, state)
    try:
        await compile_ahead(state.bridge.engine, grammar, grammar_param, request)
    except ClientDisconnected:
        return Response(status_code=499)
    salt = cache_salt(request, state.settings, body.cache_salt)
    streams: list[Any] = []
    try:
        for text, ids in texts:
            for i, sampling in enumerate(params):  # choice order: the n choices of prompt 0, then of prompt 1, ...
                stream = await state.bridge.add(prompt=None if ids else text, prompt_token_ids=ids, sampling=sampling,
                                                priority=body.priority, cache_salt=salt)
                if i == 0 and len(params) > 1:
                    # The other choices are admitted once this one's prompt is computed, so they find its full
                    # blocks in the prefix cache: the prompt is computed once for the n choices.
                    stream = await Primed.first_output(stream)
                streams.append(stream)
    except EngineFailure as exc:
        for stream in streams:
            state.bridge.abort(stream.request_id)
        raise APIError(500, str(exc), code="engine_error") from None
    except BaseException:
        for stream in streams:
            state.bridge.abort(stream.request_id)
        raise
    completion_id, created = f"cmpl-{streams[0].request_id}", int(time.time())
    prompts = [text for text, _ in texts for _ in params]
    if body.stream:
        options = body.stream_options
        return SSEResponse(completion_events(streams, prompts, body, state, completion_id, created,
                                             bool(options and options.include_usage)))
    try:
        finished = await asyncio.gather(*(final_output(request, stream, state) for stream in streams))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        for stream in streams:
            state.bridge.abort(stream.request_id)
    choices = []
    for index, ((output, logprobs), prompt) in enumerate(zip(finished, prompts, strict=True)):
        text = prompt + output.text if body.echo else output.text
        scores = output.prompt_logprobs
        choice = {
            "index": index, "text": text, "finish_reason": output.finish_reason,
            "logprobs": None if body.logprobs is None else
            legacy_logprobs(output.prompt_token_ids if body.echo else None, logprobs, 0, state, scores),
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(scores, state)
        choices.append(choice)
    return JSONResponse({"id": completion_id, "object": "text_completion", "created": created,
                         "model": state.settings.model_name, "choices": choices,
                         "usage": total_usage([output for output, _ in finished])})


class Primed:
    """A request's stream whose first output has already been awaited (its prompt is computed); iterates as the
    stream does, from that first output."""

    def __init__(self, request_id: str, first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> None:
        self.request_id = request_id
        self.first = first
        self.rest = rest

    @classmethod
    async def first_output(cls, stream: RequestStream) -> Primed:
        rest = stream.__aiter__()
        return cls(stream.request_id, await rest.__anext__(), rest)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        if not self.first.finished:
            async for output in self.rest:
                yield output


def total_usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Usage over the choices: each distinct prompt counted once (its n choices share it), completions summed."""
    seen: dict[tuple[int, ...], int] = {}
    for output in outputs:
        seen.setdefault(tuple(output.prompt_token_ids or ()) or (id(output),), output.num_prompt_tokens)
    usages = [chat_usage(output) for output in outputs]
    prompt = sum(seen.values())
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def completion_events(streams: list[Any], prompts: list[str], body: CompletionRequest,
                            state: ServerState, completion_id: str, created: int,
                            include_usage: bool) -> AsyncIterator[str]:
    """The choices' chunks as they come (each with its `index`), the usage chunk if asked, then [DONE]."""
    model = state.settings.model_name
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    def chunk(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> str:
        return sse({"id": completion_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "finish_reason": finish_reason,
                                 "logprobs": logprobs}]})

    async def pump(index: int, stream: Any) -> None:
        try:
            async for delta, output in text_deltas(stream, state):
                await queue.put((index, (delta, output)))
        except EngineFailure as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    offsets = [len(p) if body.echo else 0 for p in prompts]
    last: dict[int, RequestOutput] = {}
    open_streams = len(streams)
    failed = False
    try:
        if body.echo:
            for index, prompt in enumerate(prompts):
                yield chunk(index, prompt, None, None)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, EngineFailure):
                yield sse(error_body(500, str(item), code="engine_error"))
                failed = True
                break
            delta, output = item
            first = index not in last
            last[index] = output
            logprobs = None
            if body.logprobs is not None:
                echoed = output.prompt_token_ids if body.echo and first else None
                logprobs = legacy_logprobs(echoed, output.new_logprobs or [], 0 if echoed else offsets[index], state,
                                           output.prompt_logprobs)
                offsets[index] += len(delta)
            if delta or output.finished or logprobs:
                yield chunk(index, delta, output.finish_reason, logprobs)
        if include_usage and not failed:
            yield sse({"id": completion_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": total_usage(list(last.values()))})
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            state.bridge.abort(stream.request_id)
    yield sse("[DONE]")


async def chat_choices(body: Any, request: Request, state: ServerState) -> Response:
    """Chat completions with n > 1: one engine request per choice, choice i with seed + i (the rule of
    `choice_seeds`). The others are submitted once the first one's prompt is computed (its first output: its
    full blocks are in the prefix cache), streamed or not, so they find those blocks and run beside it."""
    from api.routes_openai import answer_chat, start_chat

    if body.n > MAX_CHOICES:
        raise APIError(400, f"n={body.n} is over {MAX_CHOICES} choices", "n", "invalid_value")
    if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
        raise APIError(400, f"seed {body.seed} + n - 1 is over {INT64_MAX}", "seed", "invalid_value")
    bodies = [body.model_copy(update={"n": 1, "seed": seed}) for seed in choice_seeds(body.seed, body.n)]
    calls: list[Any] = []
    try:
        first = await start_chat(bodies[0], request, state)
        if isinstance(first, Response):
            return first
        calls.append(first)
        first.stream = await until_disconnect(request, Primed.first_output(first.stream))
        for one in bodies[1:]:
            started = await start_chat(one, request, state)
            if isinstance(started, Response):
                raise ClientDisconnected()
            calls.append(started)
    except ClientDisconnected:
        abort_all(calls, state)
        return Response(status_code=499)
    except EngineFailure as exc:
        abort_all(calls, state)
        raise APIError(500, str(exc), code="engine_error") from None
    except BaseException:
        abort_all(calls, state)
        raise
    if body.stream:
        responses = [await answer_chat(call, request, state) for call in calls]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(merged_chat_events(responses, state, include_usage))
    try:
        answered = await asyncio.gather(*(answer_chat(call, request, state) for call in calls))
    finally:
        abort_all(calls, state)
    failed = next((r for r in answered if r.status_code != 200), None)
    if failed is not None:
        return failed
    answers = [json.loads(r.body) for r in answered]
    merged = answers[0]
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = merged["usage"]
    usage["completion_tokens"] = sum(a["usage"]["completion_tokens"] for a in answers)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse(merged)


def abort_all(calls: list[Any], state: ServerState) -> None:
    for call in calls:
        state.bridge.abort(call.stream.request_id)  # a no-op once finished


def sse_items(lines: str) -> list[Any]:
    """The JSON data of the server-sent events in `lines` ("[DONE]" left out)."""
    return [json.loads(line[6:]) for line in lines.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


async def merged_chat_events(responses: list[Any], state: ServerState,
                             include_usage: bool) -> AsyncIterator[str]:
    """The choices' chunks as they come, each with its choice's index and the answer's one id; one usage chunk over
    all at the end."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, iterator: Any) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, response.body_iterator)) for i, response in enumerate(responses)]
    usages: list[dict[str, Any]] = []
    chunk_id: str | None = None  # the first chunk's: every chunk of the answer carries one id, as OpenAI's do
    open_streams = len(tasks)
    try:
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            for data in sse_items(item if isinstance(item, str) else item.decode()):
                if "choices" not in data:  # an error
                    yield sse(data)
                    continue
                chunk_id = chunk_id or data.get("id")
                data["id"] = chunk_id
                if not data["choices"]:
                    usages.append(data.get("usage") or {})
                    continue
                for choice in data["choices"]:
                    choice["index"] = index
                if not include_usage:
                    data.pop("usage", None)
                yield sse(data)
        if include_usage and usages:
            prompt = usages[0].get("prompt_tokens", 0)
            completion = sum(u.get("completion_tokens", 0) for u in usages)
            yield sse({"id": chunk_id or "chatcmpl-n", "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": state.settings.model_name, "choices": [],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}})
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in [response.body_iterator for response in responses]:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                await close()  # the choice's own generator aborts its request if it has not finished
    yield sse("[DONE]")


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The served model (`/v1/models`' one entry); 404 in OpenAI's error body for any other id."""
    check_model(model_id, state)
    return {"id": state.settings.model_name, "object": "model", "created": int(state.started_at),
            "owned_by": "vlmcap", "max_model_len": state.bridge.engine.max_model_len}
