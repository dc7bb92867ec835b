"""OpenAI's stored chat completions: a chat completion sent with `store: true` is kept (api/completion_store.py,
per client key, bounded) and read back: `GET /v1/chat/completions` (a cursor page: `after`, `limit`, `order`,
`model`, `metadata[k]=v`), `GET /v1/chat/completions/{id}`, its `messages`, `POST` its `metadata`, `DELETE` it."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from api.completion_store import check_metadata, completion_store, page, storing
from api.errors import APIError
from api.pools import CLIENT_KEY, SERVER_KEY
from api.state import ServerState, server_state

router = APIRouter(prefix="/v1/chat/completions")
METADATA_QUERY = re.compile(r"^metadata\[(.{1,64})\]$")


def client_key() -> str:
    return CLIENT_KEY.get() or SERVER_KEY


def keep(response: Response, body: Any, metadata: dict[str, str] | None, request: Request,
         state: ServerState) -> None:
    """Store the answer of a chat completion sent with `store: true` (once finished, when streamed), with its
    messages, for the request's client key; an answer that is not a completion (an error) is not kept."""
    if response.status_code != 200:
        return
    store = completion_store(request.app.state, state.settings)
    key = client_key()

    def put(completion: dict[str, Any]) -> None:
        messages = [{"id": f"{completion['id']}-{i}", **message.model_dump(exclude_none=True)}
                    for i, message in enumerate(body.messages)]
        store.put(key, completion, messages, metadata)

    if isinstance(response, StreamingResponse):
        response.body_iterator = storing(response.body_iterator, put)
    else:
        put(json.loads(response.body))


@router.get("")
async def list_stored(request: Request, after: str | None = None, limit: int = 20, order: str = "asc",
                      model: str | None = None, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    wanted = {match.group(1): value for name, value in request.query_params.items()
              if (match := METADATA_QUERY.match(name))}
    items = completion_store(request.app.state, state.settings).completions(client_key(), model, wanted)
    return page(items, after, limit, order)


@router.get("/{completion_id}")
async def get_stored(completion_id: str, request: Request,
                     state: ServerState = Depends(server_state)) -> dict[str, Any]:
    return completion_store(request.app.state, state.settings).get(client_key(), completion_id).completion


@router.post("/{completion_id}")
async def update_stored(completion_id: str, request: Request,
                        state: ServerState = Depends(server_state)) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise APIError(400, "the body is not valid JSON", None, "invalid_json") from None
    if not isinstance(body, dict) or set(body) - {"metadata"}:
        raise APIError(400, "the body is {\"metadata\": {...}}", next(iter(set(body) - {"metadata"}), None)
                       if isinstance(body, dict) else None, "unknown_parameter")
    metadata = check_metadata(body.get("metadata"))
    return completion_store(request.app.state, state.settings).update(client_key(), completion_id, metadata)


@router.delete("/{completion_id}")
async def delete_stored(completion_id: str, request: Request,
                        state: ServerState = Depends(server_state)) -> dict[str, Any]:
    completion_store(request.app.state, state.settings).delete(client_key(), completion_id)
    return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}


@router.get("/{completion_id}/messages")
async def stored_messages(completion_id: str, request: Request, after: str | None = None, limit: int = 20,
                          order: str = "asc", state: ServerState = Depends(server_state)) -> dict[str, Any]:
    stored = completion_store(request.app.state, state.settings).get(client_key(), completion_id)
    return page(stored.messages, after, limit, order)
