"""Ollama's API on a real uvicorn server with the tiny model, driven by the official `ollama` client: chat and
generate with base64 images, streamed (NDJSON) equal to whole, `format` as "json" and as a JSON Schema (the output
parses and validates), options (seed, num_predict, stop), list/show/version, the API key, errors as
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


COUNT_TOOL = {"type": "function", "function": {"name": "count_people", "description": "Count people at a camera.",
              "parameters": {"type": "object", "properties": {
                  "camera": {"type": "string", "enum": ["door", "yard"]},
                  "minimum": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["camera", "minimum"], "additionalProperties": False}}}


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
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=MODEL, messages=messages[:1], tools=[COUNT_TOOL], format="json")
    assert caught.value.status_code == 400
