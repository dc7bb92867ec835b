"""Server-sent events and client disconnects.

A client that leaves must abort its engine request at once, not when the next token fails to send:
`SSEResponse` listens for the disconnect while it streams and cancels the event generator (whose
`finally` aborts the request); `until_disconnect` does the same for a non-streamed answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

# What str.splitlines takes for a line's end and JSON leaves as it is: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR (the
# other line ends are control characters, which JSON escapes). Readers that split a stream with it (httpx's
# `iter_lines`, as many SSE clients and this server's own fan-in of choices do) would cut an event whose text holds
# one (a model can write any of them); as JSON escapes they read back the same.
_LINE_ENDS_ESCAPED = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: Any, event: str | None = None, event_id: str | None = None) -> str:
    """One server-sent event; `data` is JSON-encoded (strictly: NaN or Infinity raise ValueError, they are not
    JSON; every character a reader may take for a line's end escaped) unless it is already a string."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False,
                                                         allow_nan=False).translate(_LINE_ENDS_ESCAPED)
    head = (f"id: {event_id}\n" if event_id else "") + (f"event: {event}\n" if event else "")
    return f"{head}data: {text}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:  # the client went away while we wrote
                pass
            tasks.cancel_scope.cancel()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tasks.cancel_scope.cancel()


class ClientDisconnected(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        raise ClientDisconnected()
    return task.result()
