"""Fall alerts over HTTP: the recent ones and a server-sent event stream of new ones, read from the alerts
feed (`jobqueue.contract.ALERTS_STREAM`) that queue workers append each finished fall job's result to.
A server without Redis has no camera jobs, so no alerts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Header, Query

from api.routes_captions import result_json
from api.state import ServerState, server_state
from api.streaming import SSEResponse, sse
from jobqueue.contract import ALERTS_STREAM
from jobqueue.results import recent_captions

router = APIRouter(prefix="/v1")


@router.get("/alerts")
async def list_alerts(limit: int = Query(50, ge=1, le=1000),
                      state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Fall alerts (the caption results of fall jobs: `fall` true, `classes` the class of each box),
    newest first."""
    redis = state.redis
    results = await recent_captions(redis, limit=limit, feed=ALERTS_STREAM) if redis is not None else []
    return {"object": "list", "data": [result_json(r) for r in results]}


@router.get("/alerts/stream", response_class=SSEResponse, status_code=200,
            responses={200: {"content": {"text/event-stream": {}}}})
async def stream_alerts(last_event_id: str | None = Header(None, pattern=r"^[0-9]{1,20}(-[0-9]{1,20})?$"),
                        state: ServerState = Depends(server_state)) -> SSEResponse:
    """Fall alerts as server-sent events (`event: alert`) as they are finished; resumes after
    `Last-Event-ID`. 503 when the server's event streams are all taken."""
    redis = state.redis

    async def events() -> AsyncIterator[str]:
        yield ": connected\n\n"
        if redis is None:
            await asyncio.Event().wait()  # no Redis, no alerts: keep the stream open until the client leaves
        async for position, result in state.feeds.tail(ALERTS_STREAM, last_event_id):
            yield sse(result_json(result), event="alert", event_id=position)

    return state.feeds.response(events)
