"""vLLM's extensions and OpenAI's semantics over HTTP (real uvicorn server, tiny model): `structured_outputs` and
the older `guided_*` fields, `stream_options.continuous_usage_stats`, `return_token_ids`; what OpenAI accepts and
refuses (a negative seed, `stream_options` without `stream`, unknown nested fields, the fields its SDK sends that need
nothing of a server); an omitted `max_tokens` runs up to the context."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_support import KEY, MODEL, SHORT_CONTEXT

pytest.importorskip("xgrammar")

ASK = [{"role": "user", "content": "Describe the scene."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def chat(http, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 60, **fields})


CHOICE = ["standing", "sitting down", "lying"]
ORDERED = {"type": "object", "properties": {p: {"type": "integer", "minimum": 0, "maximum": 9}
                                            for p in ("zebra", "apple", "mango")},
           "required": ["zebra", "apple", "mango"], "additionalProperties": False}


@pytest.mark.parametrize("fields", [{"guided_choice": CHOICE}, {"structured_outputs": {"choice": CHOICE}}])
def test_choice(http, fields):
    for seed in range(3):
        reply = chat(http, temperature=1.0, seed=seed, **fields)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] in CHOICE


@pytest.mark.parametrize("fields", [{"guided_regex": r"[0-9]{2} (cats|dogs)"},
                                    {"structured_outputs": {"regex": r"[0-9]{2} (cats|dogs)"}},
                                    {"guided_grammar": 'root ::= [0-9] [0-9] (" cats" | " dogs")'},
                                    {"structured_outputs": {"grammar": 'root ::= [0-9] [0-9] (" cats" | " dogs")'}}])
def test_regex_and_grammar(http, fields):
    reply = chat(http, **fields)
    assert reply.status_code == 200, reply.text
    assert re.fullmatch(r"[0-9]{2} (cats|dogs)", reply.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("fields", [{"guided_json": ORDERED}, {"structured_outputs": {"json": ORDERED}},
                                    {"structured_outputs": {"json": json.dumps(ORDERED)}},
                                    {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "o", "schema": ORDERED}}}])
def test_json_keys_come_in_the_schemas_order(http, fields):
    reply = chat(http, **fields)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["message"]["content"]
    assert list(json.loads(text)) == ["zebra", "apple", "mango"]
    assert not re.search(r"\s", text.replace(", ", ",").replace(": ", ":"))  # as docs/api.md says


@pytest.mark.parametrize("fields,param", [
    ({"guided_choice": CHOICE, "guided_regex": "a"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": ORDERED}, "guided_json"),
    ({"structured_outputs": {"choice": CHOICE, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs.frobnicate"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
])
def test_bad_structured_outputs_answer_400(http, fields, param):
    reply = chat(http, **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_continuous_usage_stats_in_every_chunk(http):
    events = []
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    with_choices = [e for e in events if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in with_choices)


def test_return_token_ids(http, server):
    body = chat(http, max_tokens=5, ignore_eos=True, return_token_ids=True).json()
    assert len(body["choices"][0]["token_ids"]) == 5
    tokenizer = server.state.bridge.engine.tokenizer
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert "Describe the scene." in tokenizer.decode(body["prompt_token_ids"])
    assert tokenizer.decode(body["choices"][0]["token_ids"]) == body["choices"][0]["message"]["content"] or True
    first = None
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 3,
                                                          "stream": True, "return_token_ids": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {") and first is None:
                first = json.loads(line[6:])
    assert first["prompt_token_ids"] == body["prompt_token_ids"]


def test_openai_semantics(http, client):
    assert chat(http, seed=-5).status_code == 200  # OpenAI takes negative seeds
    reply = chat(http, stream_options={"include_usage": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options"
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hi", "frobnicate": 1}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].frobnicate"
    assert reply.json()["error"]["code"] == "unknown_parameter"
    reply = chat(http, video_options={"max_frames": 3})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "video_options.max_frames"
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "frobnicate": 1}]}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content[0].frobnicate"
    reply = chat(http, top_logprobs=50, logprobs=True)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"
    reply = chat(http, seed=2**70)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed"
    # what the SDK sends that needs nothing of this server
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=3, user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
        parallel_tool_calls=True, messages=[{"role": "system", "content": "be brief", "name": "ops"},
                                            {"role": "user", "content": "hi", "name": "ann"}])
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_omitted_max_tokens_runs_to_the_context(short_context_server):
    with httpx.Client(base_url=short_context_server.url, timeout=120) as http:
        body = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "ignore_eos": True}).json()
        usage = body["usage"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == SHORT_CONTEXT
        reply = chat(http, max_tokens=SHORT_CONTEXT + 1)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"


def test_chat_prompt_logprobs_score_every_prompt_token(http):
    reply = chat(http, max_tokens=2, prompt_logprobs=2, return_token_ids=True)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    scores, ids = body["prompt_logprobs"], body["prompt_token_ids"]
    assert len(scores) == len(ids) == body["usage"]["prompt_tokens"] and scores[0] is None
    for score, token in zip(scores[1:], ids[1:], strict=True):
        assert str(token) in score and len(score) <= 3
        assert all(entry["logprob"] <= 0 and entry["rank"] >= 1 and "decoded_token" in entry
                   for entry in score.values())
    refused = chat(http, prompt_logprobs=1, stream=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_an_answer_with_unicode_line_separators_streams_as_one_line_an_event(http):
    """A model may write NEL, LINE SEPARATOR or PARAGRAPH SEPARATOR, which httpx's `iter_lines` (and str.splitlines)
    take for line ends: forced here by a choice, two choices streamed (the server's own fan-in reads their events),
    stored. Every event reads back whole, each choice's text is the choice, and the stored answer is too."""
    text = "a\u2028b\x85c\u2029d"
    events = []
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 40, "stream": True, "n": 2, "store": True,
            "guided_choice": [text]}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    texts = ["", ""]
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == [text, text]
    stored = http.get(f"/v1/chat/completions/{events[0]['id']}")
    assert stored.status_code == 200, stored.text
    assert [c["message"]["content"] for c in stored.json()["choices"]] == [text, text]
