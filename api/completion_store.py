"""Stored chat completions (OpenAI's `store: true`): the completions a client asked to keep, with the messages they
answered, read back by `GET /v1/chat/completions/{id}`, listed, their metadata updated, deleted.

Kept in the server's memory, per client key (api/pools.py `CLIENT_KEY`: an API key's name, else the client's
address): a key sees only its own. Each key keeps at most `store_max_completions` completions and
`store_max_bytes` bytes of them (their JSON), for `store_max_age_s` seconds; past a bound the oldest go first. A
restart forgets them (OpenAI keeps them 30 days; a client that needs them longer keeps its own copy).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from api.errors import APIError

MAX_METADATA_PAIRS = 16  # OpenAI's bounds of `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_LIST_LIMIT = 100


def check_metadata(metadata: Any, param: str = "metadata") -> dict[str, str] | None:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512; APIError 400
    naming the field otherwise."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"{param} must be an object of at most {MAX_METADATA_PAIRS} string pairs, got "
                            f"{str(metadata)[:80]!r}", param, "invalid_value")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(400, f"{param}.{key[:64]}: keys are strings of at most {MAX_METADATA_KEY} characters and "
                                f"values of at most {MAX_METADATA_VALUE}", f"{param}.{key[:64]}", "invalid_value")
    return dict(metadata)


@dataclass
class Stored:
    completion: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int
    stored_at: float


@dataclass
class CompletionStore:
    """The stored completions of one server, per client key, bounded in count, bytes and age per key."""

    max_completions: int
    max_bytes: int
    max_age_s: float
    _keys: dict[str, OrderedDict[str, Stored]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, key: str, completion: dict[str, Any], messages: list[dict[str, Any]],
            metadata: dict[str, str] | None) -> None:
        """Keep `completion` (its `id`) with the `messages` it answered; one over a bound drops the key's oldest
        (a completion larger than the whole byte bound is not kept)."""
        completion = {**completion, "metadata": metadata or {}}
        size = len(json.dumps(completion)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return
        with self._lock:
            kept = self._expire(key)
            kept[completion["id"]] = Stored(completion, messages, size, time.monotonic())
            total = sum(s.size for s in kept.values())
            while len(kept) > self.max_completions or total > self.max_bytes:
                _, dropped = kept.popitem(last=False)
                total -= dropped.size

    def get(self, key: str, completion_id: str) -> Stored:
        with self._lock:
            stored = self._expire(key).get(completion_id)
        if stored is None:
            raise APIError(404, f"no stored chat completion has the id {completion_id[:80]!r}", "completion_id",
                           "not_found")
        return stored

    def update(self, key: str, completion_id: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        stored = self.get(key, completion_id)
        with self._lock:
            stored.completion = {**stored.completion, "metadata": metadata or {}}
        return stored.completion

    def delete(self, key: str, completion_id: str) -> None:
        self.get(key, completion_id)
        with self._lock:
            self._keys.get(key, OrderedDict()).pop(completion_id, None)

    def completions(self, key: str, model: str | None = None,
                    metadata: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The key's completions, oldest first, of `model` and with every pair of `metadata` where given."""
        with self._lock:
            kept = list(self._expire(key).values())
        return [s.completion for s in kept if (model is None or s.completion.get("model") == model)
                and all(s.completion["metadata"].get(k) == v for k, v in (metadata or {}).items())]

    def _expire(self, key: str) -> OrderedDict[str, Stored]:
        kept = self._keys.setdefault(key, OrderedDict())
        oldest = time.monotonic() - self.max_age_s
        while kept and next(iter(kept.values())).stored_at < oldest:
            kept.popitem(last=False)
        return kept


def page(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's cursor page of `items` (each with an `id`, oldest first): `order` asc or desc, the items after
    the one whose id is `after`, at most `limit`."""
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order[:40]!r}", "order", "invalid_value")
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be 1 to {MAX_LIST_LIMIT}, got {limit}", "limit", "invalid_value")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after names no item of this list: {after[:80]!r}", "after", "invalid_value")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def streamed_completion(chunks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The chat completion a stream of chunks makes (their text, tool calls, finish reasons and usage put back
    together), as `store` keeps a streamed answer; None if the stream ended in an error."""
    if not chunks or any("choices" not in chunk for chunk in chunks):
        return None
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for part in chunk["choices"]:
            choice = choices.setdefault(part["index"], {"index": part["index"], "message": {
                "role": "assistant", "content": None}, "finish_reason": None, "logprobs": None})
            delta, message = part.get("delta") or {}, choice["message"]
            if delta.get("content"):
                message["content"] = (message["content"] or "") + delta["content"]
            for call in delta.get("tool_calls") or []:
                calls = choice.setdefault("calls", {})
                if call.get("id"):
                    calls[call["index"]] = {"id": call["id"], "type": "function", "function": {
                        "name": call["function"]["name"], "arguments": ""}}
                if call["index"] in calls:
                    calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments") or ""
            choice["finish_reason"] = part.get("finish_reason") or choice["finish_reason"]
    for choice in choices.values():
        calls = choice.pop("calls", None)
        if calls:
            choice["message"]["tool_calls"] = [calls[i] for i in sorted(calls)]
    first = chunks[0]
    return {"id": first["id"], "object": "chat.completion", "created": first["created"], "model": first["model"],
            "choices": [choices[i] for i in sorted(choices)], "usage": usage}


_made = threading.Lock()


def completion_store(app_state: Any, settings: Any) -> CompletionStore:
    """The server's store (kept on its app's state), made at first use from its settings."""
    store = getattr(app_state, "completion_store", None)
    if store is None:
        with _made:
            store = getattr(app_state, "completion_store", None)
            if store is None:
                store = CompletionStore(settings.store_max_completions, settings.store_max_bytes,
                                        settings.store_max_age_s)
                app_state.completion_store = store
    return store


async def storing(events: AsyncIterator[str], keep: Any) -> AsyncIterator[str]:
    """The event stream as it is, then `keep(completion)` with the completion its chunks make."""
    chunks: list[dict[str, Any]] = []
    async for event in events:
        yield event
        for line in event.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    completion = streamed_completion(chunks)
    if completion is not None:
        keep(completion)
