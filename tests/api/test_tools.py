"""Tool calling over HTTP (real uvicorn server, tiny random-weight model, the official `openai` client): with
random weights only the grammar can make a call's arguments valid, so every call validating under its function's
schema is the constraint at work. Chat completions (whole and streamed as `tool_calls` deltas), the Responses API
(`function_call` items, `function_call_output` inputs), histories with calls, and the refusals."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_support import KEY, MODEL

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig

jsonschema_rs = pytest.importorskip("jsonschema_rs")
pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the forecast", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
VALIDATORS = {"weather": jsonschema_rs.validator_for(WEATHER), "clock": jsonschema_rs.validator_for(CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def valid(name: str, arguments: str) -> None:
    VALIDATORS[name].validate(json.loads(arguments))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_named_function_gives_one_valid_call(client, seed):
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "clock"}},
        temperature=1.0, seed=seed, max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "clock" and call.id.startswith("call_")
    valid("clock", call.function.arguments)


def test_required_without_parallel_calls_gives_one_call_of_any_tool(client):
    names = set()
    for seed in range(4):
        completion = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=False, temperature=1.0, seed=seed,
                                                    max_tokens=120)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        valid(call.function.name, call.function.arguments)
        names.add(call.function.name)
    assert names <= {"weather", "clock"}


def test_streamed_calls_equal_the_whole_answer(client):
    """Greedy: the streamed deltas (id and name first, then argument chunks) add up to the unstreamed call."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                                        "function": {"name": "weather"}},
                  temperature=0.0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None  # the id and name come once, first
                    call.update(id=delta.id, name=delta.function.name)
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "weather" and calls[0]["arguments"] == whole.message.tool_calls[0].function.arguments
    valid("weather", calls[0]["arguments"])


def test_streamed_auto_tools_as_frigate_sends_them_equal_the_whole_answer(client):
    """Frigate 0.18's chat: tools with `tool_choice: "auto"`, streamed. With a seed the deltas (text, then each
    call's id and name once, then its argument chunks) add up to the unstreamed answer; every call validates."""
    for seed in range(2):
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed,
                      max_tokens=120)
        whole = client.chat.completions.create(**kwargs).choices[0]
        text, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                text += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                    if delta.id:
                        assert call["id"] is None
                        call.update(id=delta.id, name=delta.function.name)
                    call["arguments"] += delta.function.arguments or ""
        assert finish == whole.finish_reason and text == (whole.message.content or "")
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
        if finish == "tool_calls":
            for name, arguments in expected:
                valid(name, arguments)


def test_auto_lets_the_model_write_text_or_valid_calls(client):
    for seed in range(3):
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                                max_tokens=60).choices[0]
        for call in choice.message.tool_calls or []:
            if choice.finish_reason == "tool_calls":
                valid(call.function.name, call.function.arguments)
        assert choice.finish_reason in ("stop", "length", "tool_calls")


SCENE = {"type": "object", "properties": {"people": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "summary": {"type": "string", "maxLength": 12}},
         "required": ["people", "summary"], "additionalProperties": False}


def test_auto_tools_with_a_response_format_call_or_answer_in_its_schema(client):
    """As OpenAI answers it: the model calls a tool (valid arguments) or answers JSON that the schema validates;
    `required` with a response_format makes calls only."""
    scene = jsonschema_rs.validator_for(SCENE)
    fmt = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCENE, "strict": True}}
    kinds = set()
    for seed in range(2):  # which branch a random-weight model takes is its own: the grammar test below has both
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, response_format=fmt,
                                                parallel_tool_calls=False, temperature=1.0, seed=seed,
                                                max_tokens=200).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            for call in choice.message.tool_calls:
                valid(call.function.name, call.function.arguments)
            kinds.add("calls")
        else:
            assert choice.finish_reason == "stop", choice
            scene.validate(json.loads(choice.message.content))
            kinds.add("answer")
    assert kinds  # with random weights either may come; each is held to its grammar
    forced = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, response_format={"type": "json_object"},
                                            max_tokens=200).choices[0]
    assert forced.finish_reason == "tool_calls"
    for call in forced.message.tool_calls:
        valid(call.function.name, call.function.arguments)


@pytest.mark.parametrize("text,held", [
    ('{"people": 3, "summary": "two walk"}', True),
    ('<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>', True),
    ('{"people": 3}', False),  # the schema's answer, incomplete
    ("It is sunny.", False),  # free text is not an answer in the format
])
def test_the_grammar_of_auto_tools_with_a_format_holds_calls_or_the_answer(server, text, held):
    from api.tools import Function, calls_or_answer, tool_plan
    from engine.grammar import GrammarSpec

    engine = server.state.bridge.engine
    plan = tool_plan([Function("weather", None, WEATHER), Function("clock", None, CLOCK)], "auto", None, False)
    matcher = engine.grammars.matcher(calls_or_answer(plan, GrammarSpec.from_schema(SCENE)))
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    accepted = all(matcher.accept(token) for token in ids)
    ended = accepted and matcher.accept(engine.tokenizer.eos_token_id)
    assert ended == held


def test_the_sdks_parse_with_tools_and_a_response_model(client):
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=8)

    class Scene(BaseModel):
        people: int = Field(ge=0, le=9)

    message = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(
        Weather)], response_format=Scene, parallel_tool_calls=False, temperature=1.0, seed=0,
        max_tokens=200).choices[0].message
    if message.tool_calls:
        assert all(isinstance(call.function.parsed_arguments, Weather) for call in message.tool_calls)
    else:
        assert isinstance(message.parsed, Scene)


def test_a_history_with_calls_and_results_renders(client):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                                      "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    completion = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                max_tokens=4)
    assert completion.choices[0].message.tool_calls is None
    # the result and the call are in the prompt: a longer prompt than without them
    short = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert completion.usage.prompt_tokens > short.usage.prompt_tokens + 10


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "frobnicate": 1}}]},
     "tools[0].function.frobnicate"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "weather", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tools_answer_400_naming_the_field(http, body, param):
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_many_or_huge_tools_are_refused_by_the_grammar_limits(http):
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(10)}}}} for i in range(40)]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": many,
                                                    "tool_choice": "required", "max_tokens": 4})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "grammar_too_large", reply.text
    huge = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "description": "x" * 100_000}}}]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": huge,
                                                    "tool_choice": "auto", "max_tokens": 4})
    assert reply.status_code == 413, reply.text


RESPONSES_TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True},
                   {"type": "function", "name": "clock", "parameters": CLOCK}]


def test_responses_function_call_items_validate(client):
    response = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=RESPONSES_TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                       max_output_tokens=120)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    valid(calls[0].name, calls[0].arguments)
    # ... and the call and its output sent back render as history
    follow = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"}],
        tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=4)
    assert follow.output[0].type == "message"


def test_responses_streamed_call_arguments(client):
    kwargs = dict(model=MODEL, input="Time?", tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "clock"},
                  temperature=0.0, max_output_tokens=120)
    whole = client.responses.create(**kwargs)
    deltas = ""
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas += event.delta
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.arguments == deltas == [i for i in whole.output if i.type == "function_call"][0].arguments
    valid("clock", call.arguments)


def test_a_call_cut_at_max_tokens_keeps_its_arguments_without_the_marker():
    from api.tools import ToolCallParser

    parser = ToolCallParser(("clock",))
    text = '<tool_call>\n{"name": "clock", "arguments": {"zone": "CET"}}\n</too'
    events = [e for i in range(len(text)) for e in parser.feed(text[i], final=i == len(text) - 1)]
    assert [e[0] for e in events][0] == "call" and parser.text == ""
    assert parser.calls[0].arguments == '{"zone": "CET"}' and not parser.calls[0].complete


# A Hermes-style template that renders tools, calls and results itself (as Qwen2.5-VL's does), for the tiny model.
NATIVE_TEMPLATE = (
    "{% if tools %}<|tools|>{% for tool in tools %}{{ tool.function.name }}={{ tool.function.parameters | tojson }};"
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'text' %}{{ p.text }}{% else %}<image>{% endif %}{% endfor %}{% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.role == 'tool' %}[for {{ m.tool_call_id }}]{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


def test_a_template_that_takes_tools_renders_them_itself():
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256,
                                                  chat_template=NATIVE_TEMPLATE), api_key=KEY, served_model_name=MODEL)
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "12:00"}]
    with BackgroundServer(create_app(settings)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0)
        completion = client.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "clock"}},
            max_tokens=120, extra_body={"return_token_ids": True})
        prompt = running.state.bridge.engine.tokenizer.decode(completion.model_extra["prompt_token_ids"])
    assert '<|tools|>weather={"type": "object"' in prompt and "clock=" in prompt
    assert '[call clock {"zone": "UTC"}]' in prompt and "tool: 12:00[for call_9]" in prompt
    assert "You can call these functions" not in prompt  # not the generic rendering
    [call] = completion.choices[0].message.tool_calls
    valid("clock", call.function.arguments)


def test_tool_choice_none_applies_no_grammar(client):
    """With tools and tool_choice "none", the greedy answer is the plain answer to the same rendered prompt (the
    generic system turn sent as text): no grammar touches it, so it is generate's greedy tokens as every path is."""
    from api.tools import Function, generic_tools_turn

    functions = tuple(Function(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"])
                      for t in TOOLS)
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": [{"type": "text", "text": generic_tools_turn(functions)}]},
                               *ASK], temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens
