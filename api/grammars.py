"""Structured output's grammars compiled before a request reaches the engine: on the grammar compiler's own
threads and child processes (engine/grammar_pool.py), never on the executor that admits requests and decodes
images, and cancelled when the client leaves. The request's `add_request` then finds its grammar compiled."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

from fastapi import Request

from api.errors import APIError
from api.openai_schemas import JSONSchemaFormat, ResponseFormat, ResponsesTextFormat, SamplingFields
from api.pools import CLIENT_KEY, WorkPools, work_pools
from api.streaming import until_disconnect
from engine import Engine
from engine.grammar import GrammarCompiler, GrammarSpec
from engine.grammar_limits import GrammarLimitError
from engine.grammar_pool import GrammarBusy, GrammarTimeout, keyed
from jobqueue.structured import SchemaRefused


class GrammarRefused(APIError, SchemaRefused):
    """A grammar the server will never compile: a 4xx for a client, a dead letter for a job."""


# Engines whose grammar compiler this process has built (or seen built) off the event loop.
_compilers_built: weakref.WeakSet[Engine] = weakref.WeakSet()


async def engine_grammars(engine: Engine, pools: WorkPools | None) -> GrammarCompiler:
    """The engine's grammar compiler, built off the event loop: its first use imports xgrammar, reads the
    vocabulary and starts the compiler's processes (0.9 s for the tiny model on an idle core), during which the
    loop would serve no other client. ValueError when xgrammar is not installed."""
    if engine in _compilers_built:
        return engine.grammars
    if pools is None:
        compiler = await asyncio.to_thread(lambda: engine.grammars)
    else:
        compiler = await pools.run("schema", lambda: engine.grammars)
    try:
        _compilers_built.add(engine)
    except TypeError:  # an engine that takes no weak reference (a test's stand-in): asked in the pool each time
        pass
    return compiler


async def compile_ahead(engine: Engine, spec: GrammarSpec | None, param: str, request: Request | None = None,
                        key: str | None = None, pools: WorkPools | None = None) -> None:
    """Compile `spec` into the engine's grammar cache, for `key` (default: the request's client key): the
    compile's thread from `pools`' schema pool (the server's, found from `request` when not given), its
    compiler process within the key's share (engine/grammar_pool.py), so one client's slow schemas do not hold
    up another's. GrammarRefused: 413 for a schema over its size limit, 400 over another limit, past the
    deadline or for a grammar that does not compile; APIError 503 (`busy`) when no compiler was free in time.
    ClientDisconnected (the compile cancelled) when `request`'s client leaves first."""
    if spec is None:
        return
    if pools is None and request is not None and getattr(request.app.state, "vlmcap", None) is not None:
        pools = work_pools(request.app.state.vlmcap)
    try:
        compiler = await engine_grammars(engine, pools)
    except ValueError as exc:  # xgrammar is not installed
        raise GrammarRefused(400, f"{param}: {exc}", param, "unsupported_value") from None
    cancelled = threading.Event()
    key = key or CLIENT_KEY.get()
    if pools is None:
        work = asyncio.get_running_loop().run_in_executor(compiler.executor, keyed, key, compiler.compile, spec,
                                                          cancelled)
    else:
        work = asyncio.ensure_future(pools.run("schema", keyed, key, compiler.compile, spec, cancelled, key=key))
    try:
        await (work if request is None else until_disconnect(request, work))
    except BaseException as exc:
        cancelled.set()  # a client that left, a cancelled task: the child compiling it is stopped
        if not work.done():
            work.cancel()
        if isinstance(exc, GrammarBusy):
            raise APIError(503, f"{param}: {exc}", param, "busy", exc.retry_after_s) from None
        if isinstance(exc, GrammarLimitError):
            status = 413 if exc.limit == "max_schema_bytes" else 400
            raise GrammarRefused(status, f"{param}: {exc}", param, "grammar_too_large") from None
        if isinstance(exc, GrammarTimeout):
            raise GrammarRefused(400, f"{param}: {exc}", param, "grammar_timeout") from None
        if isinstance(exc, ValueError):
            raise GrammarRefused(400, f"{param}: {exc}", param, "invalid_json_schema") from None
        raise


def schema_spec(schema: Any, where: str) -> GrammarSpec:
    """The spec of a JSON schema (a dict or JSON text) sent at `where`; APIError 400 naming it if it is not one."""
    try:
        return GrammarSpec.from_schema(schema)
    except ValueError as exc:
        raise APIError(400, f"{where}: {exc}", where, "invalid_json_schema") from None


def response_format_spec(fmt: ResponseFormat | ResponsesTextFormat | None, param: str) -> GrammarSpec | None:
    """The grammar a `response_format` (chat) or `text.format` (Responses) asks for; None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(json_object=True)
    spec = fmt.json_schema if isinstance(fmt, JSONSchemaFormat) else fmt
    where = f"{param}.json_schema.schema" if isinstance(fmt, JSONSchemaFormat) else f"{param}.schema"
    if spec.schema_ is None:
        raise APIError(400, f"{where} is required for a json_schema format", where, "invalid_value")
    return schema_spec(spec.schema_, where)


def _vllm_specs(body: SamplingFields) -> list[tuple[str, GrammarSpec]]:
    """(param, spec) for each of vLLM's structured-output fields the body sets."""
    found: list[tuple[str, GrammarSpec]] = []
    outputs = body.structured_outputs
    if outputs is not None:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(outputs, name) not in (None, False)]
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, json_object, regex, choice or grammar "
                                f"(given: {', '.join(n.rstrip('_') for n in given) or 'none'})",
                           "structured_outputs", "invalid_value")
        name = given[0]
        param = f"structured_outputs.{name.rstrip('_')}"
        found.append((param, _vllm_spec(name.rstrip("_"), getattr(outputs, name), param)))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", _vllm_spec(name, value, f"guided_{name}")))
    return found


def _vllm_spec(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return schema_spec(value, param)
    try:
        if kind == "json_object":
            return GrammarSpec(json_object=True)
        if kind == "choice":
            return GrammarSpec(choice=tuple(value))
        return GrammarSpec(**{kind: value})
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param, "invalid_value") from None


def structured_output_spec(body: SamplingFields, fmt: ResponseFormat | ResponsesTextFormat | None,
                           format_param: str) -> tuple[GrammarSpec | None, str]:
    """The grammar a request's structured-output fields ask for, and the field it came from (for errors): OpenAI's
    `fmt` (`response_format`, `text.format`) or vLLM's `structured_outputs` / `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar`. (None, format_param) for free text; APIError 400 for more than one."""
    found = _vllm_specs(body)
    spec = response_format_spec(fmt, format_param)
    if spec is not None:
        found.insert(0, (format_param, spec))
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise APIError(400, f"more than one structured output was asked for ({names}): send one", found[1][0],
                       "conflicting_parameters")
    return (found[0][1], found[0][0]) if found else (None, format_param)
