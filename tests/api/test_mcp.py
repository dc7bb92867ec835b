"""The MCP server on the app (/v1/mcp, streamable HTTP) with the `mcp` SDK's own client against a real uvicorn
server (tiny random model) over a camera memory filled beforehand (tests/camera_memory_support.py): the four
tools and their schemas, answers from the store (search with words, camera, fall and a cursor; an event's frames
as images, the very bytes of GET /v1/events/{id}/frames/{i}; a camera's latest frame; a window's summary under the
summary schema with the events it read), errors as tool errors, the server's keys (401 without one; a named key
sees its cameras only), and the same tools as chat function tools (`function_tools`, `call_function_tool`)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator

import httpx
import httpx2
import jsonschema_rs
import openai
import pytest
from camera_memory_support import NOW, frames, known_events, seed
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from starlette.requests import Request

from api.background import BackgroundServer
from api.guard import KEY_NAME_SCOPE
from api.mcp_server import MCP_PATH, call_function_tool, function_tools
from api.routes_summaries import SUMMARY_SCHEMA
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from memory import Event

TOOLS = {"search_events", "get_event", "camera_summary", "latest_frame"}
KEYS = {"alice": "key-a", "ops": "key-o", "night": "key-n"}
BUSY = 220  # events of the camera "busy" (seen by the key "night" only), more lines than a summary's prompt takes


def busy_events() -> list[Event]:
    """BUSY events an hour before the known ones, a second apart, each saying something else but for a run of five
    near-identical ones (events 10 to 14)."""
    start = NOW - 3600
    return [Event(id=f"busy-{i}", camera_id="busy", kind="event", start_ts=start + i, end_ts=start + i,
                  finished_at=start + i, caption="a guard walks the corridor" if 10 <= i < 15
                  else f"person number {i} crosses the hall", track_id=7, frames=frames(start + i, 1, 90))
            for i in range(BUSY)]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[BackgroundServer]:
    data_dir = seed(tmp_path_factory.mktemp("mcp") / "data", known_events() + busy_events())
    settings = ServerSettings(engine=EngineConfig(model="tiny"), data_dir=str(data_dir), api_keys=KEYS,
                              events_key_cameras=("alice:gate-1", "ops:gate-1,gate-2", "night:busy"))
    with BackgroundServer(create_app(settings)) as running:
        yield running


async def session_calls(url: str, key: str | None, calls: list[tuple[str, dict]]) -> tuple[list, list]:
    """The tools listed and the result of each call, in one MCP session of the SDK's client."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx2.AsyncClient(headers=headers, timeout=300) as client, \
            streamable_http_client(url + MCP_PATH, http_client=client) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        tools = (await session.list_tools()).tools
        return tools, [await session.call_tool(name, args) for name, args in calls]


def run(server, calls: list[tuple[str, dict]], key: str | None = "key-o") -> tuple[list, list]:
    return asyncio.run(session_calls(server.url, key, calls))


def payload(result) -> dict:
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


def connection(key_name: str) -> Request:
    """A chat request's connection under a key name, as the guard leaves it."""
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
                    KEY_NAME_SCOPE: key_name})


def test_the_tools_answer_from_the_store(server):
    tools, (words, falls, first, second, event, latest) = run(server, [
        ("search_events", {"query": "delivery van"}),
        ("search_events", {"fall": True}),
        ("search_events", {"limit": 1}),
        ("search_events", {"cameras": ["gate-1"], "since": str(NOW + 10)}),
        ("get_event", {"event_id": "van", "frames": 3}),
        ("latest_frame", {"camera": "gate-1"}),
    ])
    assert {t.name for t in tools} == TOOLS
    schema = {t.name: t.input_schema for t in tools}
    assert {"query", "cameras", "since", "until", "kind", "fall", "limit", "cursor"} <= set(
        schema["search_events"]["properties"])
    assert schema["get_event"]["required"] == ["event_id"]
    assert [e["id"] for e in payload(words)["events"]] == ["van"]
    assert [e["id"] for e in payload(falls)["events"]] == ["fall"]
    page = payload(first)
    assert [e["id"] for e in page["events"]] == ["dog"] and page["next_cursor"]
    assert [e["id"] for e in payload(second)["events"]] == ["dog"]

    described = payload(event)
    assert (described["id"], described["camera_id"], described["frame_count"]) == ("van", "gate-2", 4)
    images = [c for c in event.content if c.type == "image"]
    assert len(images) == 3 and all(c.mime_type == "image/jpeg" for c in images)
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-o"}) as http:
        for index, image in enumerate(images):
            assert base64.b64decode(image.data) == http.get(f"/v1/events/van/frames/{index}").content
        dog_last = http.get("/v1/events/dog/frames/1").content
    assert payload(latest)["event"]["id"] == "dog" and payload(latest)["frame_index"] == 1
    assert base64.b64decode(latest.content[1].data) == dog_last

    _, (next_page,) = run(server, [("search_events", {"limit": 1, "cursor": page["next_cursor"]})])
    assert [e["id"] for e in payload(next_page)["events"]] == ["fall"]


def test_a_summary_of_the_kept_events(server):
    _, (summary, empty) = run(server, [
        ("camera_summary", {"camera": "gate-2", "since": str(NOW - 10), "until": str(NOW + 1000)}),
        ("camera_summary", {"camera": "gate-2", "since": str(NOW + 5000), "until": str(NOW + 6000)}),
    ])
    answer = payload(summary)
    assert answer["object"] == "camera.summary" and answer["event_ids"] == ["van", "fall"]
    assert not answer["empty"] and answer["captions"] == 2
    jsonschema_rs.validate(SUMMARY_SCHEMA, answer["summary"])  # grammar-held, even from random weights
    assert payload(empty)["empty"] and payload(empty)["event_ids"] == []


def test_a_busy_window_is_condensed_as_camera_summaries_are(server):
    """More events than a summary's prompt takes (read in pages): near-identical runs merged, lines sampled evenly
    (the first and the last kept) within the context; the ids are those of the lines' first events, oldest first."""
    _, (summary,) = run(server, [("camera_summary", {"camera": "busy", "since": str(NOW - 3700),
                                                     "until": str(NOW - 3000)})], key="key-n")
    answer = payload(summary)
    assert answer["captions"] == BUSY and not answer["empty"]
    ids = [int(i.removeprefix("busy-")) for i in answer["event_ids"]]
    assert 1 < len(ids) <= BUSY - 4 and ids == sorted(ids) and ids[0] == 0 and ids[-1] == BUSY - 1
    assert not set(ids) & {11, 12, 13, 14}, "a run of near-identical events is one line, by its first"
    jsonschema_rs.validate(SUMMARY_SCHEMA, answer["summary"])


def test_errors_are_tool_errors(server):
    _, results = run(server, [
        ("get_event", {"event_id": "no-such-event"}),
        ("search_events", {"since": "yesterday"}),
        ("search_events", {"kind": "parade"}),
        ("search_events", {"cursor": "forged"}),
        ("search_events", {"limit": 10_000}),
        ("latest_frame", {"camera": "nowhere"}),
        ("camera_summary", {"camera": "gate-2", "window_s": -1}),
    ])
    for result in results:
        assert result.is_error and result.content[0].text, result


def test_the_server_s_keys(server):
    with pytest.raises(Exception) as refused:  # the SDK raises when the server answers 401
        run(server, [("search_events", {})], key=None)
    assert "401" in repr(refused.value) or "Unauthorized" in repr(refused.value) or refused.value
    with httpx.Client(base_url=server.url) as http:
        answer = http.post(MCP_PATH, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    _, (mine, theirs, latest) = run(server, [
        ("search_events", {}), ("get_event", {"event_id": "van"}), ("latest_frame", {"camera": "gate-2"})],
        key="key-a")
    assert {e["camera_id"] for e in payload(mine)["events"]} == {"gate-1"}
    assert theirs.is_error and latest.is_error, "alice sees gate-1 only"


def test_the_same_tools_as_chat_function_tools(server):
    app = server.app
    definitions = asyncio.run(function_tools(app))
    assert {d["function"]["name"] for d in definitions} == TOOLS
    assert all(d["type"] == "function" and d["function"]["parameters"]["type"] == "object" for d in definitions)

    async def calls() -> list[str]:
        return [await call_function_tool(app, connection("ops"), "search_events", '{"query": "warehouse"}'),
                await call_function_tool(app, connection("alice"), "search_events", {"fall": True}),
                await call_function_tool(app, connection("ops"), "get_event", {"event_id": "fall"}),
                await call_function_tool(app, connection("ops"), "get_event", "{not json"),
                await call_function_tool(app, connection("ops"), "no_such_tool", {}),
                await call_function_tool(app, connection("ops"), "search_events", {"limit": "many"})]

    found, hidden, event, bad_json, unknown, bad_arg = [json.loads(c) for c in asyncio.run(calls())]
    assert [e["id"] for e in found["events"]] == ["fall"]
    assert hidden["events"] == [], "alice's key does not see gate-2's fall"
    assert event["id"] == "fall" and event["frames_url"] == "/v1/events/fall/frames"
    assert "error" in bad_json and "error" in unknown and "error" in bad_arg


# -- the same tools run by the server inside a chat completion (api/server_tools.py) ------------------------------
# Named without parameters: the server's tool. latest_frame's one argument is bounded (128 characters), so the
# random model's forced call ends within max_tokens.
SERVER_LATEST = {"type": "function", "function": {"name": "latest_frame"}}
FORCED = {"type": "function", "function": {"name": "latest_frame"}}
ASKED = [{"role": "user", "content": "What did the gate camera see last?"}]


def openai_client(server, key: str) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
    return client, client.models.list().data[0].id


def test_a_chat_runs_the_servers_tools_with_the_callers_key(server):
    """A forced call to the server's latest_frame is run by the server for the caller's key, its result fed back
    and the answer made after it (the last round without tools): the result is what the tool gives that key for
    the model's own arguments; usage counts every round; the schema the model was held to is the server's."""
    for key, name in (("key-a", "alice"), ("key-o", "ops")):
        client, model = openai_client(server, key)
        answer = client.chat.completions.create(model=model, messages=ASKED, temperature=0.0, max_tokens=200,
                                                tools=[SERVER_LATEST], tool_choice=FORCED)
        message = answer.choices[0].message
        ran = message.model_extra["server_tool_calls"]
        assert ran and {call["name"] for call in ran} == {"latest_frame"}, ran
        assert not message.tool_calls and answer.choices[0].finish_reason in ("stop", "length")
        for call in ran:
            assert len(json.loads(call["arguments"])["camera"]) <= 128
            direct = asyncio.run(call_function_tool(server.app, connection(name), call["name"], call["arguments"]))
            assert call["content"] == direct or "[cut:" in call["content"]
        assert answer.usage.prompt_tokens > answer.usage.completion_tokens > 0


def test_the_servers_tools_streamed_and_the_clients_own_stay_the_clients(server):
    client, model = openai_client(server, "key-o")
    chunks = list(client.chat.completions.create(
        model=model, messages=ASKED, temperature=0.0, max_tokens=200, stream=True,
        stream_options={"include_usage": True}, tools=[SERVER_LATEST], tool_choice=FORCED))
    ran = [c.choices[0].delta.model_extra.get("server_tool_calls") for c in chunks if c.choices]
    assert any(ran) and chunks[-1].usage.total_tokens > 0
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    own = {"type": "function", "function": {"name": "latest_frame", "parameters": {
        "type": "object", "properties": {"where": {"enum": ["gate-1", "gate-2"]}}, "required": ["where"]}}}
    mine = client.chat.completions.create(model=model, messages=ASKED, temperature=0.0, max_tokens=200,
                                          tools=[own], tool_choice="required")
    assert "server_tool_calls" not in (mine.choices[0].message.model_extra or {})
    assert mine.choices[0].message.tool_calls[0].function.name == "latest_frame"  # the client runs its own
    for refused_param, extra in (("n", {"n": 2}), ("logprobs", {"logprobs": True})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=ASKED, tools=[SERVER_LATEST], **extra)
        assert refused.value.body["param"] == refused_param


def test_a_huge_tool_result_is_cut_to_the_context(server):
    """The night key's search of its busy camera (200 events a page) is over the result bound: it is cut, to at
    most the tokens left for it, with a note; a small result is kept whole."""
    from api.server_tools import MAX_TOOL_RESULT_CHARS, cut

    tokenizer = server.app.state.vlmcap.bridge.engine.tokenizer
    huge = asyncio.run(call_function_tool(server.app, connection("night"), "search_events", {"limit": 200}))
    assert len(json.loads(huge)["events"]) == 200 and len(huge) > MAX_TOOL_RESULT_CHARS
    for tokens in (50, 400, 10**6):
        shown = cut(huge, tokens, tokenizer)
        assert "[cut:" in shown and len(shown) <= MAX_TOOL_RESULT_CHARS + 120
        assert tokens == 10**6 or len(tokenizer(shown, add_special_tokens=False)["input_ids"]) <= tokens
    small = asyncio.run(call_function_tool(server.app, connection("alice"), "search_events", {"fall": True}))
    assert cut(small, 400, tokenizer) == small
