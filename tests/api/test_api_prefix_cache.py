"""Prefix caching as clients see it, on a real uvicorn server (tiny model) driven by the official `openai`
client: a chat's second turn over one photo reports `usage.prompt_tokens_details.cached_tokens` (Responses:
`input_tokens_details`), streamed or not, and runs no vision tower; `/metrics` shows the hit rate (the
dashboard's panel: tests/test_dashboard.py); `vlmcap serve --no-prefix-caching` turns caching off, and then
the same turns give the same tokens with nothing cached."""

from __future__ import annotations

import httpx
import openai
import pytest
from PIL import Image
from typer.testing import CliRunner
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from cli.main import app
from engine import EngineConfig
from tests.api.test_api_openai import data_url

BUS = ASSETS / "bus.jpg"
ZIDANE = ASSETS / "zidane.jpg"
MODEL = "vlmcap-tiny"


def first_turn(system: str, path) -> list[dict]:
    """A system message of its own (so that no other test's prompt shares its first block), then a photo."""
    return [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(path)}},
                                         {"type": "text", "text": "Describe the people."}]}]


def next_turn(messages: list[dict], answer: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def start(caching: bool) -> BackgroundServer:
    engine = EngineConfig(model="tiny", max_num_batched_tokens=64, enable_prefix_caching=caching)
    return BackgroundServer(create_app(ServerSettings(engine=engine, served_model_name=MODEL)))


@pytest.fixture(scope="module")
def server():
    with start(caching=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def metric(server, name: str) -> float | None:
    return server.state.metrics.registry.get_sample_value(name)


def first_image_token(server, system: str) -> int:
    """Position of the photo's first placeholder in the first turn's prompt, as the engine processes it."""
    adapter = server.state.bridge.engine.adapter
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the people."}]}]
    _, mm = adapter.process(adapter.render_messages(messages), [Image.open(BUS).convert("RGB")])
    return mm.placeholder_positions[0]


def chat_turns(client: openai.OpenAI, system: str, model: str = MODEL) -> list:
    """Two turns over bus.jpg (the second streamed, usage in its last chunk): each turn's (token ids, usage)."""
    messages = first_turn(system, BUS)
    sampling = {"model": model, "max_tokens": 6, "temperature": 0}
    first = client.chat.completions.create(messages=messages, **sampling,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(client.chat.completions.create(
        messages=next_turn(messages, first.choices[0].message.content, "And what colour is the bus?"), **sampling,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True}))
    second_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    return [(first.choices[0].model_extra["token_ids"], first.usage), (second_ids, chunks[-1].usage)]


def test_a_chats_second_turn_over_one_photo_is_served_from_the_cache(server, client):
    engine = server.state.bridge.engine
    before = engine.stats()
    (_, first), (_, second) = chat_turns(client, "You are test one.")
    assert first.prompt_tokens_details.cached_tokens == 0
    encoded = engine.stats().encoder_inputs_encoded
    assert encoded > before["encoder_inputs_encoded"]
    cached = second.prompt_tokens_details.cached_tokens
    # The cached prefix reaches into the photo's span, in whole blocks, and the last prompt token was computed.
    assert first_image_token(server, "You are test one.") < cached < second.prompt_tokens
    assert cached % engine.pool.block_size == 0
    after = engine.stats()
    # The second turn ran no vision tower: the photo's features came from the encoder cache where the cached
    # prefix does not cover its whole span.
    assert after["encoder_inputs_encoded"] == encoded
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == cached

    # /metrics: the counters and the hit-rate gauge read the engine's figures.
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vlmcap_prefix_cache_hit_rate", "vlmcap_vision_encoder_cache_hits_total"):
        assert f"\n{name} " in text, name
    assert metric(server, "vlmcap_prefix_cache_hit_tokens_total") == after["prefix_cache_hit_tokens"]
    assert metric(server, "vlmcap_prefix_cache_queried_tokens_total") == after["prefix_cache_queried_tokens"]
    assert metric(server, "vlmcap_prefix_cache_hit_rate") == pytest.approx(after["prefix_cache_hit_rate"])
    assert 0 < after["prefix_cache_hit_rate"] < 1


def test_responses_report_cached_input_tokens(server, client):
    inputs = [{"role": "system", "content": "You are test two."},
              {"role": "user", "content": [{"type": "input_text", "text": "Describe."},
                                           {"type": "input_image", "image_url": data_url(ZIDANE)}]}]
    sampling = {"model": MODEL, "max_output_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.responses.create(input=inputs, **sampling)
    assert first.usage.input_tokens_details.cached_tokens == 0
    second_input = [*inputs, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Who is on the left?"}]
    with client.responses.stream(input=second_input, **sampling) as stream:
        final = stream.get_final_response()
    assert 0 < final.usage.input_tokens_details.cached_tokens < final.usage.input_tokens
    again = client.responses.create(input=second_input, **sampling)  # the same prompt once more, not streamed
    assert again.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens_details.cached_tokens
    assert again.output_text == final.output_text


def test_serve_options_and_variables_set_caching_and_the_defaults_are_the_engines(monkeypatch, served_settings):
    built = served_settings
    runner = CliRunner()
    for argv, env in ((["serve"], {}), (["serve", "--no-prefix-caching"], {}),
                      (["serve"], {"VLMCAP_PREFIX_CACHING": "0"}), (["serve", "--prefix-caching"], {}),
                      (["serve", "--encoder-cache-tokens", "0"], {}),
                      (["serve"], {"VLMCAP_ENCODER_CACHE_TOKENS": "64"})):
        result = runner.invoke(app, argv, env=env)
        assert result.exit_code == 0, result.output
    default = EngineConfig()
    assert [s.engine.enable_prefix_caching for s in built] == [default.enable_prefix_caching, False, False, True,
                                                              default.enable_prefix_caching,
                                                              default.enable_prefix_caching]
    assert [s.engine.encoder_cache_tokens for s in built] == [default.encoder_cache_tokens] * 4 + [0, 64]


def test_without_caching_the_same_turns_give_the_same_tokens_and_report_none(server, client):
    cached_turns = chat_turns(client, "You are test four.")
    with start(caching=False) as uncached:
        plain = openai.OpenAI(base_url=f"{uncached.url}/v1", api_key="unused", max_retries=0)
        plain_turns = chat_turns(plain, "You are test four.")
        assert uncached.state.bridge.engine.stats().prefix_cache_hit_tokens == 0
    assert [usage.prompt_tokens_details.cached_tokens for _, usage in plain_turns] == [0, 0]
    assert cached_turns[1][1].prompt_tokens_details.cached_tokens > 0
    assert [ids for ids, _ in plain_turns] == [ids for ids, _ in cached_turns]
    assert [u.prompt_tokens for _, u in plain_turns] == [u.prompt_tokens for _, u in cached_turns]
