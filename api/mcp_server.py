"""The camera memory's tools for agents, written once and offered two ways:

- an MCP server on the same app (the `mcp` SDK's `MCPServer`, streamable HTTP, stateless) at `/v1/mcp`: behind
  the server's API keys like every `/v1` route (api/guard.py), each key seeing the events it sees over HTTP;
- the same tools as OpenAI function tools that a chat request can opt into: `function_tools(app)` gives their
  definitions (the MCP tools' own input schemas) and `call_function_tool(app, connection, name, arguments)` runs
  one call and gives the tool message's content (JSON text; frames as their URLs, not as images).

The tools: `search_events` (camera, time, kind, fall, words; a page with a cursor), `get_event` (one event with
its frames as images), `camera_summary` (a camera's kept events over a window, summarized under the schema of
POST /v1/cameras/{id}/summary), `latest_frame` (a camera's newest kept frame, as an image)."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Annotated, Any, Literal

import mcp.types as mcp_types
from fastapi import FastAPI
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import Field
from starlette.requests import HTTPConnection

from api.errors import APIError
from api.guard import cache_salt
from api.pools import work_pools
from api.routes_events import CameraMemory, event_json, timestamp, visible_query
from api.routes_summaries import DEFAULT_WINDOW_S, MAX_WINDOW_S, summary_of
from api.state import ServerState
from jobqueue.contract import CAPTIONS_STREAM_MAXLEN, CaptionResult
from memory.store import (
    EVENT_KINDS,
    MAX_CAMERAS,
    MAX_CURSOR_CHARS,
    MAX_PAGE,
    MAX_QUERY_CHARS,
    Event,
    EventPage,
    EventQuery,
)

MCP_PATH = "/v1/mcp"
DEFAULT_SEARCH_LIMIT = 10
MAX_TOOL_FRAMES = 8  # frames one get_event answers with
# The most kept events a summary reads of its window, newest first (as many as a camera summary reads of the feed).
MAX_SUMMARY_EVENTS = CAPTIONS_STREAM_MAXLEN
INSTRUCTIONS = ("Tools over this server's camera memory: every captioned camera event (sightings, events of a "
                "tracked person, fall alerts, video clips) with its caption and frames. Search by camera, time, "
                "kind, fall and words; read an event with its frames; summarize a camera's window; look at a "
                "camera's latest frame.")

# The connection a function tool runs for (a chat request's); an MCP call's is its own HTTP request.
CALLER: ContextVar[HTTPConnection | None] = ContextVar("vlmcap_tool_caller", default=None)

# Every string argument bounded (a model's call under the schema's grammar ends; a client's is refused at once).
Time = Annotated[str | None, Field(max_length=64, description="seconds since the epoch or an ISO 8601 time "
                                                              "('2026-12-03T10:00Z')")]
CameraArg = Annotated[str, Field(min_length=1, max_length=128, description="the camera's id")]


class CameraTools:
    """The tools' work on one app's state: what every tool calls, whichever way it was called."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def _memory(self) -> CameraMemory:
        memory = getattr(self.app.state, "memory", None)
        if memory is None:
            raise ToolError("the event store is off on this server, or the model is still loading")
        return memory

    def _state(self) -> ServerState:
        state = getattr(self.app.state, "vlmcap", None)
        if state is None:
            raise ToolError("the model is still loading")
        return state

    async def _read(self, memory: CameraMemory, call: Any, *args: Any) -> Any:
        """A store read in the summary pool (as the events routes read), off the event loop."""
        return await work_pools(memory.settings).run("summary", call, *args)

    async def _search(self, memory: CameraMemory, query: EventQuery) -> EventPage:
        return await self._read(memory, memory.store.search, query)

    async def search(self, connection: HTTPConnection, query: str, cameras: list[str], since: str | None,
                     until: str | None, kind: str | None, fall: bool | None, limit: int,
                     cursor: str | None) -> dict[str, Any]:
        memory = self._memory()
        found = visible_query(connection, memory.settings, cameras=cameras, since=timestamp(since, "since"),
                              until=timestamp(until, "until"), kind=kind, fall=fall, q=query or None, cursor=cursor,
                              limit=limit)
        if found is None:
            return {"events": [], "next_cursor": None}
        page = await self._search(memory, found)
        scores = page.scores or [None] * len(page.events)
        return {"events": [event_json(e, s) for e, s in zip(page.events, scores)], "next_cursor": page.next_cursor}

    async def visible_event(self, connection: HTTPConnection, event_id: str) -> Event:
        memory = self._memory()
        event = await self._read(memory, memory.store.get, event_id[:128])
        query = None if event is None else visible_query(connection, memory.settings, cameras=(event.camera_id,))
        if event is None or query is None or (query.owner is not None and event.owner not in (None, query.owner)):
            raise ToolError(f"no event {event_id[:128]!r}")
        return event

    async def latest(self, connection: HTTPConnection, camera: str) -> Event:
        memory = self._memory()
        query = visible_query(connection, memory.settings, cameras=(camera,), limit=1)
        page = None if query is None else await self._search(memory, query)
        if page is None or not page.events:
            raise ToolError(f"no kept event of camera {camera[:128]!r}")
        return await self.visible_event(connection, page.events[0].id)

    async def window_events(self, memory: CameraMemory, query: EventQuery) -> list[Event]:
        """The query's events, oldest first: pages read newest first, at most MAX_SUMMARY_EVENTS of them."""
        events: list[Event] = []
        while len(events) < MAX_SUMMARY_EVENTS:
            page = await self._search(memory, query)
            events.extend(page.events)
            if page.next_cursor is None:
                break
            query = replace(query, cursor=page.next_cursor)
        return sorted(events[:MAX_SUMMARY_EVENTS], key=lambda e: (e.start_ts, e.id))

    async def summary(self, connection: HTTPConnection, camera: str, since: str | None, until: str | None,
                      window_s: float) -> dict[str, Any]:
        """The camera's summary over a window from its kept events, made as camera summaries are (their prompt,
        condensed to the context, and schema: api/routes_summaries.py `summary_of`), with the ids of the events its
        lines stand for (a run of near-identical events by its first)."""
        memory, state = self._memory(), self._state()
        end = timestamp(until, "until") or time.time()
        start = timestamp(since, "since")
        start = end - window_s if start is None else start
        if end <= start or end - start > MAX_WINDOW_S:
            raise ToolError(f"the window must end after it starts and last at most {MAX_WINDOW_S:.0f} s, got "
                            f"{start} to {end}")
        query = visible_query(connection, memory.settings, cameras=(camera,), since=start, until=end,
                              limit=MAX_PAGE)
        if query is None:
            raise ToolError(f"camera {camera[:128]!r} is not one this key sees")
        results = [as_result(e) for e in await self.window_events(memory, query)]
        summary, shown = await summary_of(state, camera, start, end, results,
                                          cache_salt(connection, state.settings, None))
        return {"object": "camera.summary", "camera_id": camera, "start": start, "end": end,
                "captions": len(results), "empty": not results, "created_at": time.time(),
                "event_ids": [r.id for r in shown], "summary": summary}


def as_result(event: Event) -> CaptionResult:
    """An event as the finished result it was kept from (what a summary's prompt lines are made of)."""
    return CaptionResult(id=event.id, status="done", camera_id=event.camera_id, created_at=event.start_ts,
                         frame_ts=event.start_ts, person_count=event.person_count, caption=event.caption,
                         finished_at=event.finished_at, fall=event.fall, structured=event.structured,
                         kind=event.kind, track_id=event.track_id, start_ts=event.start_ts, end_ts=event.end_ts,
                         frame_count=max(1, len(event.frames)))


def _frames(event: Event, limit: int) -> list[mcp_types.ContentBlock]:
    return [mcp_types.ImageContent(type="image", data=base64.b64encode(f.jpeg).decode(), mime_type="image/jpeg")
            for f in event.frames[:limit]]


def _text(value: Any) -> mcp_types.TextContent:
    return mcp_types.TextContent(type="text", text=json.dumps(value, ensure_ascii=False))


def _caller(ctx: Context) -> HTTPConnection:
    """The HTTP connection a tool call came on: an MCP request's own, or the chat request's (`CALLER`)."""
    try:
        request = ctx.request_context.request
    except ValueError:
        request = None
    connection = request if isinstance(request, HTTPConnection) else CALLER.get()
    if connection is None:
        raise ToolError("a tool call outside a request")
    return connection


def _tool_errors(error: APIError) -> ToolError:
    return ToolError(error.message)


def build_mcp(app: FastAPI) -> MCPServer:
    """The app's MCP server with the camera tools (its HTTP transport is made by `mount_mcp`)."""
    tools = CameraTools(app)
    server = MCPServer(name="vlmcap", instructions=INSTRUCTIONS)

    @server.tool(description="Search the camera memory's events, newest first or, with words, by relevance. "
                             "Returns events (id, camera_id, kind, start_ts, end_ts, caption, structured, fall, "
                             "track_id, frame_count) and next_cursor for the next page.")
    async def search_events(
        ctx: Context,
        query: Annotated[str, Field(max_length=MAX_QUERY_CHARS,
                                    description="words that must all be in the caption or its fields")] = "",
        cameras: Annotated[list[CameraArg] | None, Field(max_length=MAX_CAMERAS, description="only these cameras")]
        = None,
        since: Time = None,
        until: Time = None,
        kind: Annotated[Literal[EVENT_KINDS] | None, Field(description=f"one of {', '.join(EVENT_KINDS)}")] = None,
        fall: Annotated[bool | None, Field(description="only fall alerts (true) or none of them (false)")] = None,
        limit: Annotated[int, Field(ge=1, le=MAX_PAGE, description="events a page")] = DEFAULT_SEARCH_LIMIT,
        cursor: Annotated[str | None, Field(max_length=MAX_CURSOR_CHARS,
                                            description="next_cursor of the previous page")] = None,
    ) -> dict[str, Any]:
        try:
            return await tools.search(_caller(ctx), query, cameras or [], since, until, kind, fall, limit, cursor)
        except APIError as exc:
            raise _tool_errors(exc) from None

    @server.tool(description="One event of the camera memory: its caption and fields as JSON, then its kept frames "
                             "as JPEG images.")
    async def get_event(
        ctx: Context,
        event_id: Annotated[str, Field(min_length=1, max_length=128,
                                       description="the event's id (search_events gives it)")],
        frames: Annotated[int, Field(ge=0, le=MAX_TOOL_FRAMES, description="frames to include")] = 4,
    ) -> list[mcp_types.ContentBlock]:
        event = await tools.visible_event(_caller(ctx), event_id)
        return [_text(event_json(event, frames=True)), *_frames(event, frames)]

    @server.tool(description="A camera's kept events over a time window (default: the last hour) summarized: "
                             "title, summary, notable events with their times, threat level 0-2 (a busy window "
                             "condensed to the context: runs of near-identical events merged, then sampled evenly), "
                             "and the ids of the events its lines stand for.")
    async def camera_summary(
        ctx: Context,
        camera: CameraArg,
        since: Time = None,
        until: Time = None,
        window_s: Annotated[float, Field(gt=0, le=MAX_WINDOW_S, description="window length without since")]
        = DEFAULT_WINDOW_S,
    ) -> dict[str, Any]:
        try:
            return await tools.summary(_caller(ctx), camera, since, until, window_s)
        except APIError as exc:
            raise _tool_errors(exc) from None

    @server.tool(description="The newest kept frame of a camera (its latest event's last frame) as a JPEG image, "
                             "after that event as JSON.")
    async def latest_frame(ctx: Context, camera: CameraArg) -> list[mcp_types.ContentBlock]:
        try:
            event = await tools.latest(_caller(ctx), camera)
        except APIError as exc:
            raise _tool_errors(exc) from None
        if not event.frames:
            raise ToolError(f"the latest event of camera {camera[:128]!r} kept no frame")
        frame = event.frames[-1]
        return [_text({"event": event_json(event), "frame_index": len(event.frames) - 1, "ts": frame.ts}),
                mcp_types.ImageContent(type="image", data=base64.b64encode(frame.jpeg).decode(),
                                       mime_type="image/jpeg")]

    return server


def mount_mcp(app: FastAPI) -> MCPServer:
    """Serve the app's MCP server at MCP_PATH (its session manager runs for the app's lifespan); kept on
    `app.state.mcp`."""
    server = build_mcp(app)
    # The app's guard checks Host, Origin and keys on every /v1 path: the SDK's own DNS-rebinding check (loopback
    # Host names only) would refuse the names --allowed-host lets in.
    transport = server.streamable_http_app(
        streamable_http_path=MCP_PATH, stateless_http=True, json_response=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    for route in transport.routes:
        app.router.routes.append(route)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(target: FastAPI) -> AsyncIterator[Any]:
        async with server.session_manager.run(), inner(target) as state:
            yield state

    app.router.lifespan_context = lifespan
    app.state.mcp = server
    return server


# -- the same tools for chat requests ----------------------------------------------------------------------
async def function_tools(app: FastAPI) -> list[dict[str, Any]]:
    """The camera tools as OpenAI function tools (`{"type": "function", "function": {name, description,
    parameters}}`), for a chat request that opts into them."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in await app.state.mcp.list_tools()]


async def call_function_tool(app: FastAPI, connection: HTTPConnection, name: str,
                             arguments: str | dict[str, Any]) -> str:
    """Run one function call of a chat request (`connection`: its request, whose key decides what it sees) and
    give the tool message's content: the tool's JSON, or `{"error": ...}`; images are left out (the JSON has
    each frame's URL)."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    except json.JSONDecodeError as exc:
        return json.dumps({"error": f"the arguments are not JSON: {exc}"})
    if not isinstance(args, dict):
        return json.dumps({"error": "the arguments must be a JSON object"})
    token = CALLER.set(connection)
    try:
        result = await app.state.mcp.call_tool(name, args)
    except ToolError as exc:
        return json.dumps({"error": str(exc)})
    finally:
        CALLER.reset(token)
    texts = [block.text for block in result.content if isinstance(block, mcp_types.TextContent)]
    if result.is_error:
        return json.dumps({"error": " ".join(texts)})
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return texts[0] if len(texts) == 1 else json.dumps([json.loads(t) for t in texts])
