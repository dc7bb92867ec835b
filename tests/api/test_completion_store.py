"""The stored completions' bounds and isolation (api/completion_store.py): a key reads only its own; each key keeps
at most its count and bytes (the oldest go first) for its age; pages follow OpenAI's cursors."""

from __future__ import annotations

import pytest

from api.completion_store import CompletionStore, page
from api.errors import APIError


def completion(i: int, text: str = "x") -> dict:
    return {"id": f"chatcmpl-{i}", "model": "m", "choices": [{"message": {"content": text}}]}


def test_a_key_reads_only_its_own_completions():
    store = CompletionStore(max_completions=8, max_bytes=1 << 20, max_age_s=60)
    store.put("alice", completion(1), [], {"cam": "door"})
    with pytest.raises(APIError) as missing:
        store.get("bob", "chatcmpl-1")
    assert missing.value.status == 404
    assert store.completions("bob") == [] and [c["id"] for c in store.completions("alice")] == ["chatcmpl-1"]


def test_each_key_keeps_at_most_its_count_bytes_and_age():
    store = CompletionStore(max_completions=3, max_bytes=1 << 20, max_age_s=60)
    for i in range(5):
        store.put("alice", completion(i), [], None)
    assert [c["id"] for c in store.completions("alice")] == ["chatcmpl-2", "chatcmpl-3", "chatcmpl-4"]
    small = CompletionStore(max_completions=100, max_bytes=1000, max_age_s=60)
    for i in range(5):
        small.put("alice", completion(i, "y" * 300), [], None)
    assert len(small.completions("alice")) == 2  # ~400 bytes each: the newest that fit
    small.put("alice", completion(9, "z" * 2000), [], None)  # larger than the whole bound: not kept
    assert "chatcmpl-9" not in [c["id"] for c in small.completions("alice")]
    old = CompletionStore(max_completions=100, max_bytes=1 << 20, max_age_s=1e-9)
    old.put("alice", completion(1), [], None)
    assert old.completions("alice") == []


def test_pages_follow_openais_cursors_and_refuse_bad_bounds():
    items = [{"id": f"c{i}"} for i in range(5)]
    first = page(items, None, 2, "asc")
    assert [i["id"] for i in first["data"]] == ["c0", "c1"] and first["has_more"] and first["last_id"] == "c1"
    assert [i["id"] for i in page(items, "c1", 10, "asc")["data"]] == ["c2", "c3", "c4"]
    assert [i["id"] for i in page(items, None, 2, "desc")["data"]] == ["c4", "c3"]
    for args, param in (((None, 0, "asc"), "limit"), ((None, 2, "up"), "order"), (("nope", 2, "asc"), "after")):
        with pytest.raises(APIError) as refused:
            page(items, *args)
        assert refused.value.param == param
