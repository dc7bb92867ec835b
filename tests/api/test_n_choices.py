"""n choices on `/v1/completions` share the prompt's KV blocks: the prompt is computed once (the others hit the
prefix cache for its full blocks), each choice samples on its own, streamed with each chunk's index."""

from __future__ import annotations

import openai
import pytest

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig

MODEL = "vlmcap-tiny"


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256), served_model_name=MODEL)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_prompt_is_computed_once_for_n_choices(client, server, stream):
    engine = server.state.bridge.engine
    prompt = f"User: Describe a street scene with {'many' if stream else 'few'} buses and people walking by the " \
             "station in the rain, slowly.<end_of_utterance>\nAssistant:"
    prompt_tokens = len(engine.adapter.process(prompt, [], [], None)[0])
    block = engine.pool.block_size
    full = (prompt_tokens - 1) // block * block  # the blocks a later request can reuse (its last token is computed)
    assert full >= block
    before = engine.stats()
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=3, seed=5, temperature=1,
                                       stream=stream)
    if stream:
        texts: dict[int, str] = {}
        for chunk in answer:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert sorted(texts) == [0, 1, 2]
    else:
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert answer.usage.prompt_tokens == prompt_tokens  # the prompt counted once
    after = engine.stats()
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 2 * full
    assert after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens >= 3 * full


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me of buses."}],
                                          max_tokens=8, temperature=1, **kwargs)


def test_chat_n_choices_with_a_seed_equal_one_by_one_requests(client, server):
    alone = [chat(client, seed=11 + i).choices[0].message.content for i in range(3)]
    assert len(set(alone)) > 1
    before = server.state.bridge.engine.stats()
    together = chat(client, n=3, seed=11)
    after = server.state.bridge.engine.stats()
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.message.content for c in together.choices] == alone
    single = chat(client, seed=11)
    assert together.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert together.usage.completion_tokens >= 3 * 1
    assert after.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens  # the choices found the prompt cached


def test_chat_n_choices_streamed_with_each_chunks_index(client):
    alone = [chat(client, seed=21 + i).choices[0].message.content for i in range(2)]
    texts: dict[int, str] = {}
    usage = None
    ids = set()
    for chunk in chat(client, n=2, seed=21, stream=True, stream_options={"include_usage": True}):
        ids.add(chunk.id)
        if chunk.usage is not None and not chunk.choices:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert [texts[0], texts[1]] == alone
    assert usage is not None and usage.completion_tokens >= 2
    assert len(ids) == 1  # one answer, one id, as OpenAI streams it


def test_non_streamed_chat_choices_run_beside_the_first(client, server):
    """The other choices are submitted once the first has its prompt computed, not once it has ended: n choices of
    12 tokens each take far fewer steps than n x 12."""
    engine = server.state.bridge.engine
    before = engine.stats()
    answer = chat(client, n=3, seed=3, extra_body={"ignore_eos": True, "max_tokens": 12})
    steps = engine.stats().num_steps - before.num_steps
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage.completion_tokens == 3 * 12
    assert steps < 2 * 12
