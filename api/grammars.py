"""Structured output's grammars compiled before a request reaches the engine: on the grammar compiler's own
threads and child processes (engine/grammar_pool.py), never on the executor that admits requests and decodes
images, and cancelled when the client leaves. The request's `add_request` then finds its grammar compiled."""

from __future__ import annotations

import asyncio
import threading

from fastapi import Request

from api.errors import APIError
from api.streaming import until_disconnect
from engine import Engine
from engine.grammar import GrammarSpec
from engine.grammar_limits import GrammarLimitError
from engine.grammar_pool import GrammarTimeout
from jobqueue.structured import SchemaRefused


class GrammarRefused(APIError, SchemaRefused):
    """A grammar the server will never compile: a 4xx for a client, a dead letter for a job."""


async def compile_ahead(engine: Engine, spec: GrammarSpec | None, param: str, request: Request | None = None) -> None:
    """Compile `spec` into the engine's grammar cache. GrammarRefused: 413 for a schema over its size limit,
    400 over another limit, past the deadline or for a grammar that does not compile. ClientDisconnected (the
    compile cancelled) when `request`'s client leaves first."""
    if spec is None:
        return
    try:
        compiler = engine.grammars
    except ValueError as exc:  # xgrammar is not installed
        raise GrammarRefused(400, f"{param}: {exc}", param, "unsupported_value") from None
    cancelled = threading.Event()
    work = asyncio.get_running_loop().run_in_executor(compiler.executor, compiler.compile, spec, cancelled)
    try:
        await (work if request is None else until_disconnect(request, work))
    except BaseException as exc:
        cancelled.set()  # a client that left, a cancelled task: the child compiling it is stopped
        if isinstance(exc, GrammarLimitError):
            status = 413 if exc.limit == "max_schema_bytes" else 400
            raise GrammarRefused(status, f"{param}: {exc}", param, "grammar_too_large") from None
        if isinstance(exc, GrammarTimeout):
            raise GrammarRefused(400, f"{param}: {exc}", param, "grammar_timeout") from None
        if isinstance(exc, ValueError):
            raise GrammarRefused(400, f"{param}: {exc}", param, "invalid_json_schema") from None
        raise
