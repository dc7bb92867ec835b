"""Ollama's API on a real uvicorn server with the tiny model, driven by the official `ollama` client: chat and
generate with base64 images, streamed (NDJSON) equal to whole, `format` as "json" and as a JSON Schema (the output
parses and validates), tools (alone, in a history, beside a format: every call's arguments validate, every answer in
the format parses), options (seed, num_predict, stop), list/show/version, the API key, errors as
{"error": ...}."""

from __future__ import annotations

import base64
import json

import httpx
import jsonschema
import ollama
import pytest
from server_support import KEY, MODEL
from ultralytics.utils import ASSETS

BUS = ASSETS / "bus.jpg"
GREEDY = {"temperature": 0, "num_predict": 10}


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


def test_chat_with_an_image_whole_and_streamed(client):
    messages = [{"role": "user", "content": "Describe the people.", "images": [BUS.read_bytes()]}]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content and whole.eval_count and whole.eval_count <= 10 and whole.prompt_eval_count > 10
    parts = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == whole.eval_count


def test_generate_with_an_image_and_the_model_tag(client):
    b64 = base64.b64encode(BUS.read_bytes()).decode()
    one = client.generate(model=f"{MODEL}:latest", prompt="What is here?", images=[b64], options=GREEDY)
    two = client.generate(model=MODEL, prompt="What is here?", images=[BUS.read_bytes()], options=GREEDY,
                          keep_alive="5m")
    assert one.response and one.response == two.response and one.done
    streamed = "".join(p.response for p in client.generate(model=MODEL, prompt="What is here?", images=[b64],
                                                           options=GREEDY, stream=True))
    assert streamed == one.response


def test_format_json_and_a_json_schema_parse(client):
    schema = {"type": "object",
              "properties": {"people": {"type": "integer"}, "scene": {"type": "string", "maxLength": 20}},
              "required": ["people", "scene"], "additionalProperties": False}
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "Count."}], format=schema,
                         options={"temperature": 0, "num_predict": 200})
    jsonschema.validate(json.loads(answer.message.content), schema)
    loose = client.generate(model=MODEL, prompt="JSON please", format="json",
                            options={"temperature": 0, "num_predict": 60})
    # any JSON object: the random model may write one string past num_predict, but it starts as an object
    assert loose.response.startswith("{")
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.response), dict)


def test_options_seed_stop_and_num_predict(client):
    def sampled(seed):
        return client.generate(model=MODEL, prompt="Hello", options={"seed": seed, "num_predict": 8}).response

    assert sampled(3) == sampled(3)
    whole = client.generate(model=MODEL, prompt="Hello", options={"temperature": 0, "num_predict": 24}).response
    stop = whole[len(whole) // 2: len(whole) // 2 + 2]
    cut = client.generate(model=MODEL, prompt="Hello", options={"temperature": 0, "num_predict": 24, "stop": [stop]})
    assert cut.response == whole[: whole.index(stop)] and cut.done_reason == "stop"
    short = client.generate(model=MODEL, prompt="Hello", options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"


def test_list_show_version(client, server):
    names = [m.model for m in client.list().models]
    assert names == [f"{MODEL}:latest"]
    shown = client.show(MODEL)
    assert "vision" in shown.capabilities
    assert shown.modelinfo["vlm.context_length"] == server.state.bridge.engine.max_model_len
    assert httpx.get(f"{server.url}/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]


def test_errors_in_ollamas_body(client, server):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 404 and "nope" in caught.value.error
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in ({"model": MODEL, "prompt": "hi", "options": {"temperature": 5}},
                 {"model": MODEL, "prompt": "hi", "images": ["***not base64***"]},
                 {"model": MODEL, "prompt": "hi", "options": {"made_up": 1}},
                 {"model": MODEL, "prompt": "hi", "format": {"type": "nonsense"}}):
        response = httpx.post(f"{server.url}/api/generate", json={**body, "stream": False}, headers=headers, timeout=60)
        assert response.status_code == 400, body
        assert set(response.json()) == {"error"} and response.json()["error"]
    assert httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "prompt": "hi"}).status_code == 401


# Only what the `ollama` client sends of a tool's schema (its Tool model keeps a property's type, items, description
# and enum, and drops the rest: `minimum`, `maximum`, `additionalProperties`...), so that the server's grammar holds
# the arguments to this schema itself; bounds are enums.
COUNT_TOOL = {"type": "function", "function": {"name": "count_people", "description": "Count people at a camera.",
              "parameters": {"type": "object", "required": ["camera", "minimum"], "properties": {
                  "camera": {"type": "string", "enum": ["door", "yard"]},
                  "minimum": {"type": "integer", "enum": list(range(10))}}}}}


def test_the_tool_schema_reaches_the_server_whole():
    sent = ollama._types.Tool.model_validate(COUNT_TOOL).model_dump(exclude_none=True, by_alias=True)
    assert sent == COUNT_TOOL


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_tools_gives_calls_whose_arguments_validate(client, stream):
    schema = COUNT_TOOL["function"]["parameters"]
    calls, content = [], ""
    for seed in range(4):
        options = {"seed": seed, "temperature": 1.0, "num_predict": 120}
        replies = client.chat(model=MODEL, messages=[{"role": "user", "content": "How many at the door?"}],
                              tools=[COUNT_TOOL], options=options, stream=stream)
        for reply in (replies if stream else [replies]):
            content += reply.message.content or ""
            calls += reply.message.tool_calls or []
    for call in calls:
        assert call.function.name == "count_people"
        jsonschema.validate(dict(call.function.arguments), schema)
    assert calls or content
    # with vlmcap's tool_choice extension a call is certain, and its arguments follow the schema
    forced = httpx.post(f"{client._client.base_url}/api/chat", headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "How many?"}], "tools": [COUNT_TOOL],
        "tool_choice": "required", "stream": stream, "options": {"temperature": 1.0, "seed": 1, "num_predict": 200}},
        timeout=120)
    lines = [json.loads(line) for line in forced.text.splitlines() if line]
    forced_calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert forced_calls and lines[-1]["done"]
    for call in forced_calls:
        assert call["function"]["name"] == "count_people"
        jsonschema.validate(call["function"]["arguments"], schema)


def test_chat_with_a_tool_history(client):
    messages = [{"role": "user", "content": "How many at the door?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "count_people", "arguments": {"camera": "door", "minimum": 1}}}]},
                {"role": "tool", "content": "3", "tool_name": "count_people"}]
    reply = client.chat(model=MODEL, messages=messages, tools=[COUNT_TOOL], options=GREEDY)
    assert reply.done


SCENE = {"type": "object", "properties": {"people": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "summary": {"type": "string", "maxLength": 12}},
         "required": ["people", "summary"], "additionalProperties": False}


def replies(client: ollama.Client, stream: bool, **call) -> tuple[str, list, str]:
    """The content, tool calls and done_reason of one chat, streamed or whole."""
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": "How many at the door?"}], stream=stream,
                         **call)
    parts = list(answer) if stream else [answer]
    assert parts[-1].done
    return ("".join(p.message.content or "" for p in parts), [c for p in parts for c in p.message.tool_calls or []],
            parts[-1].done_reason)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_tools_and_a_format_calls_or_answers_in_the_format(client, server, stream):
    """As Ollama answers it: with `tools` and `format` the model calls a tool (its arguments valid) or answers in the
    format (the schema validates). Which one a random model takes is its own, so vlmcap's `tool_choice` pins each
    branch once: `required` calls (the format holds no call), `none` answers in the format."""
    arguments = COUNT_TOOL["function"]["parameters"]
    options = {"temperature": 1.0, "num_predict": 200}
    kinds = set()
    for seed in range(3):
        content, calls, done = replies(client, stream, tools=[COUNT_TOOL], format=SCENE,
                                       options={**options, "seed": seed})
        for call in calls:
            assert call.function.name == "count_people"
            jsonschema.validate(dict(call.function.arguments), arguments)
        if not calls and done == "stop":  # else cut by num_predict (calls in parallel may go on)
            jsonschema.validate(json.loads(content), SCENE)
        kinds.add("calls" if calls else "answer")
    assert kinds
    headers = {"Authorization": f"Bearer {KEY}"}
    for choice, calls_wanted in (("required", True), ("none", False)):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "How many?"}], "tools": [COUNT_TOOL],
                "format": SCENE, "tool_choice": choice, "stream": stream, "options": {**options, "seed": 5}}
        lines = [json.loads(line) for line in httpx.post(f"{server.url}/api/chat", json=body, headers=headers,
                                                         timeout=120).text.splitlines() if line]
        calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
        content = "".join(line["message"]["content"] for line in lines)
        assert lines[-1]["done"] and bool(calls) == calls_wanted, lines[-1]
        for call in calls:
            jsonschema.validate(call["function"]["arguments"], arguments)
        if not calls_wanted:
            jsonschema.validate(json.loads(content), SCENE)


def test_format_json_with_tools_answers_an_object(client):
    content, calls, _ = replies(client, False, tools=[COUNT_TOOL], format="json",
                                options={"temperature": 0, "num_predict": 200})
    for call in calls:
        jsonschema.validate(dict(call.function.arguments), COUNT_TOOL["function"]["parameters"])
    if not calls:
        assert content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_num_predict_is_content_not_a_call(server, stream):
    """A call whose arguments num_predict cut has no arguments to give (Ollama's are an object): its text is the
    content, done_reason "length"; never a 500."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "How many?"}], "tools": [COUNT_TOOL],
            "tool_choice": "required", "stream": stream, "options": {"temperature": 0, "num_predict": 60}}
    response = httpx.post(f"{server.url}/api/chat", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120)
    assert response.status_code == 200
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    assert lines[-1]["done_reason"] == "length"
    assert not any(line["message"].get("tool_calls") for line in lines)
    content = "".join(line["message"]["content"] for line in lines)
    assert content.startswith('<tool_call>\n{"name": "count_people", "arguments": {')


def many_tools(count: int, properties: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "integer"} for j in range(properties)}}}} for i in range(count)]


@pytest.mark.parametrize("tools,fmt,status,named", [
    (many_tools(80, 2), SCENE, 400, "max_properties"),  # the tools' schemas count together with the format's
    ([COUNT_TOOL], {"type": "object", "description": "x" * 200_000}, 413, "max_schema_bytes"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "x" * 200_000}}}],
     "json", 413, "max_schema_bytes"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}}}}}], SCENE, 400, "max_regex"),
])
def test_hostile_tools_with_a_format_are_refused_by_the_grammar_limits(server, tools, fmt, status, named):
    """Tools beside a format go through the same limits as either alone, before anything is compiled."""
    response = httpx.post(f"{server.url}/api/chat", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "format": fmt,
        "stream": False})
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and named in response.json()["error"]


OLLAMA_SOAK_CASES = ["ollama_bad_options", "ollama_unknown_model", "ollama_bomb_image",
                     "ollama_tools_many_with_format", "ollama_tools_huge_with_format"]


def test_the_soaks_ollama_cases_here(server):
    """`vlmcap bench soak`'s Ollama cases against this server: the hostile ones each a 4xx; the good tools beside a
    format (streamed and not) 200, each call valid and each finished answer in the format (else counted 500)."""
    import asyncio
    import random

    from bench.configs import SoakConfig
    from bench.soak import HOSTILE_REQUESTS, Client, Tally

    async def send() -> list:
        tally = Tally()
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            client = Client(http, SoakConfig(max_tokens=4), [], MODEL)
            for name in OLLAMA_SOAK_CASES:
                await client._record(tally, f"hostile:{name}", HOSTILE_REQUESTS[name](client))
            for seed in range(2):  # one streamed, one whole
                await client.ollama_tools(tally, random.Random(seed))
        return tally.outcomes

    outcomes = asyncio.run(send())
    hostile = {o.kind.removeprefix("hostile:"): o.status for o in outcomes if o.kind.startswith("hostile:")}
    assert set(hostile) == set(OLLAMA_SOAK_CASES)
    assert all(status is not None and 400 <= status < 500 for status in hostile.values()), hostile
    good = [o for o in outcomes if o.kind == "ollama"]
    assert len(good) == 2 and all(o.status == 200 for o in good), good
