"""Structured output over HTTP (real uvicorn server, tiny random-weight model, the official `openai` client):
`response_format` on chat completions (parsed by the SDK's `parse` into a pydantic model, streamed), `text.format`
on the Responses API, and OpenAI's error body for a schema that cannot be compiled."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_support import KEY, MODEL

from engine.grammar import GrammarCompiler, GrammarSpec

pytest.importorskip("xgrammar")

MAX_TOKENS = 320  # the models below are bounded (strings, arrays, numbers), so the grammar ends well within this


class Person(BaseModel):
    action: Literal["standing", "walking", "sitting", "lying"]
    x: int = Field(ge=0, le=9)


class Scene(BaseModel):
    count: int = Field(ge=0, le=20)
    people: list[Person] = Field(max_length=2)
    fallen: bool
    summary: str = Field(max_length=16)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe scene {i} as JSON."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_completions_parse_returns_the_pydantic_object(client, temperature):
    completion = client.chat.completions.parse(model=MODEL, messages=ask(1), response_format=Scene,
                                               max_tokens=MAX_TOKENS, temperature=temperature, seed=7)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Scene)
    assert Scene.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_constrained_stream_concatenates_to_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask(2), max_tokens=MAX_TOKENS, temperature=1.0, seed=3, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "scene", "schema": Scene.model_json_schema(), "strict": True}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert chunks[-1].choices[0].finish_reason == "stop"
    Scene.model_validate(json.loads(text))


def test_json_object_mode_holds_the_output_to_json(server, client):
    """Any JSON object is unbounded, so a random model runs to max_tokens: every token is still one the JSON
    object grammar accepts, in order."""
    reply = client.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=40, temperature=1.0, seed=5,
                                           response_format={"type": "json_object"},
                                           extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert choice.message.content.startswith("{")
    engine = server.state.bridge.engine
    matcher = GrammarCompiler(engine.tokenizer, engine.adapter.lm_head.weight.shape[0],
                              sorted(engine.eos_token_ids)).matcher(GrammarSpec(json_object=True))
    assert all(matcher.accept(token) for token in choice.model_extra["token_ids"])
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_responses_text_format_parses(client):
    response = client.responses.parse(model=MODEL, input="Describe scene 4 as JSON.", text_format=Scene,
                                      max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Scene)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "response_format,param,message",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
         None, "bogus"),
        ({"type": "json_schema", "json_schema": {"name": "x"}},
         "response_format.json_schema.schema", "is required"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"$ref": "#/$defs/missing"}}}}},
         None, "could not be compiled"),
    ],
)
def test_a_schema_that_cannot_be_used_is_400_with_openais_error_body(server, response_format, param, message):
    body = {"model": MODEL, "messages": ask(5), "max_tokens": 8, "response_format": response_format}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]
    if param:
        assert error["param"] == param
    assert server.state.bridge.engine.stats()["num_waiting"] == 0
