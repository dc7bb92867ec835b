"""The official clients against a real uvicorn server with the tiny model, as their users call them: instructor in
its default Mode.TOOLS (create, create_partial, create_iterable, with an image), langchain-openai's bind_tools and
with_structured_output (function_calling and json_schema), the openai SDK's completions (plain, stream,
echo+logprobs), models.retrieve, n=2, max_tokens near the context, tools and stored completions; litellm's
completion with tools, text_completion and streaming. The random-weight model writes nonsense unless constrained,
so every tool call's arguments must validate and every strict output parse."""

from __future__ import annotations

import base64
import json
from typing import Literal

import instructor
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from server_support import KEY, MODEL
from ultralytics.utils import ASSETS

BUS = ASSETS / "bus.jpg"
PROMPT = "User: What is in a street scene?<end_of_utterance>\nAssistant:"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    pose: Literal["standing", "sitting", "fallen"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat_model(server) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=300,
                      max_retries=0)


def image_messages(text: str) -> list[dict]:
    url = "data:image/jpeg;base64," + base64.b64encode(BUS.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


# -- instructor, Mode.TOOLS (its default) ----------------------------------------------------------------

def test_instructor_create_with_an_image(client):
    patched = instructor.from_openai(client)
    person = patched.chat.completions.create(model=MODEL, response_model=Person, max_tokens=300, temperature=0,
                                             max_retries=0, messages=image_messages("Who is in the picture?"))
    assert isinstance(person, Person)


def test_instructor_create_partial_streams_a_valid_object(client):
    patched = instructor.from_openai(client)
    parts = list(patched.chat.completions.create_partial(
        model=MODEL, response_model=Person, max_tokens=300, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "A person."}]))
    assert parts
    Person.model_validate(parts[-1].model_dump())


def test_instructor_create_iterable(client):
    patched = instructor.from_openai(client)
    people = list(patched.chat.completions.create_iterable(
        model=MODEL, response_model=Person, max_tokens=600, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "The people."}]))
    assert people and all(isinstance(p, Person) for p in people)


# -- langchain-openai -----------------------------------------------------------------------------------

class CountArgs(BaseModel):
    camera: Literal["door", "yard"]
    minimum: int = Field(ge=0, le=9)


@tool(args_schema=CountArgs)
def count_people(camera: str, minimum: int) -> str:
    """Count the people a camera sees."""
    return f"{camera}: {minimum}"


def test_langchain_bind_tools_gives_calls_whose_arguments_validate(chat_model):
    bound = chat_model.bind_tools([count_people], tool_choice="count_people")
    message = bound.invoke("How many people are at the door?")
    assert message.tool_calls
    for call in message.tool_calls:
        assert call["name"] == "count_people"
        count_people.args_schema.model_validate(call["args"])


def test_langchain_bind_tools_auto_answers_text_or_valid_calls(chat_model):
    message = chat_model.bind_tools([count_people]).invoke("How many people are at the door?")
    for call in message.tool_calls:
        count_people.args_schema.model_validate(call["args"])
    assert message.tool_calls or isinstance(message.content, str)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(Person, method=method)
    assert isinstance(structured.invoke("Describe a person."), Person)


# -- the openai SDK -------------------------------------------------------------------------------------

def test_openai_completions_plain_stream_and_echo_logprobs(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == plain.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                       logprobs=2)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == len(choice.logprobs.text_offset)


def test_openai_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_openai_n_2_on_completions_and_chat(client):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, seed=1, temperature=1)
    assert [c.index for c in answer.choices] == [0, 1]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          n=2, seed=1, temperature=1)
    assert [c.index for c in chat.choices] == [0, 1]


@pytest.fixture(scope="module")
def short_context(short_context_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{short_context_server.url}/v1", api_key="none", max_retries=0)


def test_openai_max_tokens_near_the_context(short_context):
    """max_tokens up to the context is accepted; the answer ends at the context ("length") or earlier ("stop")."""
    for create in (lambda n: short_context.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n,
                                                              temperature=0, extra_body={"ignore_eos": True}),
                   lambda n: short_context.chat.completions.create(
                       model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=n, temperature=0,
                       extra_body={"ignore_eos": True})):
        answer = create(90)
        assert answer.usage.total_tokens == 96 and answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        short_context.completions.create(model=MODEL, prompt=PROMPT, max_tokens=97)


def test_openai_tools_with_a_strict_function(client):
    schema = {"type": "object", "properties": {"camera": {"type": "string", "enum": ["door", "yard"]},
                                               "minimum": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["camera", "minimum"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=MODEL, max_tokens=200, temperature=0, messages=[{"role": "user", "content": "Count at the door."}],
        tools=[{"type": "function", "function": {"name": "count_people", "parameters": schema, "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "count_people"}})
    calls = answer.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "count_people"
    import jsonschema

    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_openai_stored_completions_retrieve_list_update_delete(client):
    """`store: true` as the SDK uses it: the completion (whole or streamed) read back by id, listed by metadata,
    its messages, its metadata updated, deleted; one sent without `store` is not kept."""
    ask = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, store=True,
                                           metadata={"camera": "door"})
    streamed_text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=4, store=True, metadata={"camera": "yard"}, stream=True,
        stream_options={"include_usage": True}) if c.choices)
    unstored = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4)
    got = client.chat.completions.retrieve(whole.id)
    assert got.choices[0].message.content == whole.choices[0].message.content and got.metadata == {"camera": "door"}
    listed = client.chat.completions.list(metadata={"camera": "yard"})
    assert [c.choices[0].message.content for c in listed.data] == [streamed_text]
    assert listed.data[0].usage.completion_tokens >= 1
    assert [m.content for m in client.chat.completions.messages.list(whole.id).data] == ["Hi"]
    assert client.chat.completions.update(whole.id, metadata={"camera": "gate"}).metadata == {"camera": "gate"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(unstored.id)
    assert client.chat.completions.delete(whole.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(whole.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, store=True,
                                       metadata={f"k{i}": "v" for i in range(17)})
    assert refused.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.list(limit=101)
    assert refused.value.body["param"] == "limit"


# -- litellm ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm(server):
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm")
    return litellm, {"api_base": f"{server.url}/v1", "api_key": KEY}


def test_litellm_completion_with_tools_whose_arguments_validate(litellm):
    lib, where = litellm
    schema = CountArgs.model_json_schema()
    answer = lib.completion(model=f"openai/{MODEL}", **where, max_tokens=200, temperature=0,
                            messages=[{"role": "user", "content": "How many people at the door?"}],
                            tools=[{"type": "function", "function": {"name": "count_people", "parameters": schema}}],
                            tool_choice="required")
    calls = answer.choices[0].message.tool_calls
    assert calls and answer.choices[0].finish_reason == "tool_calls"
    for call in calls:
        CountArgs.model_validate_json(call.function.arguments)


def test_litellm_text_completion_and_streaming(litellm, client):
    lib, where = litellm
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    text = lib.text_completion(model=f"text-completion-openai/{MODEL}", **where, prompt=PROMPT, max_tokens=8,
                               temperature=0)
    assert text.choices[0].text == plain
    chat = lib.completion(model=f"openai/{MODEL}", **where, max_tokens=8, temperature=0, stream=True,
                          messages=[{"role": "user", "content": "Hi"}])
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0).choices[0].message.content
    assert streamed == whole
