"""The OpenAI-compatible routes on a real uvicorn server (loopback, tiny model), driven by the official
`openai` client and by `ultralytics.LLM`: models, chat with an image (streamed and not), usage that
matches the tokens, the Responses API, the API key, concurrency with exact greedy tokens, and aborts of
clients that leave. The server is the session's shared keyed one (tests/api/conftest.py: the same settings this
module once started a server of its own with); what other modules asked of it before is not relied on: counts
are taken as differences, the engine is seen idle once this module's own requests end."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import openai
import pytest
from PIL import Image
from server_support import KEY, MODEL
from ultralytics import LLM
from ultralytics.utils import ASSETS

from engine import EngineStats

BUS = ASSETS / "bus.jpg"
ZIDANE = ASSETS / "zidane.jpg"


def data_url(path) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(text: str, *paths) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in paths]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def expected_prompt_tokens(server, messages: list[dict], images: list) -> int:
    """What the engine's own template and processor make of these messages (engine form)."""
    adapter = server.state.bridge.engine.adapter
    ids, _ = adapter.process(adapter.render_messages(messages), [Image.open(p).convert("RGB") for p in images])
    return len(ids)


def metric(server, name: str, **labels) -> float:
    return server.state.metrics.registry.get_sample_value(name, labels) or 0.0


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_wrong_or_missing_key_is_refused(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401
    assert "API key" in refused.value.body["message"]
    missing = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def test_chat_with_image_usage_matches_tokens(server, client):
    messages = image_message("Describe the people.", BUS)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = reply.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == 6 and choice.finish_reason == "length"
    assert choice.message.content == server.state.bridge.engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    engine_form = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the people."}]}]
    assert reply.usage.prompt_tokens == expected_prompt_tokens(server, engine_form, [BUS])
    assert reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_streamed_chat_equals_non_streamed(server, client):
    messages = [{"role": "system", "content": "Be brief."}, *image_message("What is here?", ZIDANE)]
    kwargs = {"model": MODEL, "messages": messages, "max_completion_tokens": 7, "temperature": 0}
    whole = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == \
        whole.usage.model_dump(exclude={"prompt_tokens_details"})
    # The same prompt again: its full blocks, the image's included, come from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    raw = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_responses_api(server, client):
    inputs = [{"role": "user", "content": [{"type": "input_text", "text": "Describe."},
                                           {"type": "input_image", "image_url": data_url(BUS)}]}]
    response = client.responses.create(model=MODEL, input=inputs, instructions="Be brief.",
                                       max_output_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    engine_form = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                   {"role": "user", "content": [{"type": "text", "text": "Describe."}, {"type": "image"}]}]
    assert response.usage.input_tokens == expected_prompt_tokens(server, engine_form, [BUS])
    with client.responses.stream(model=MODEL, input=inputs, instructions="Be brief.", max_output_tokens=5,
                                 temperature=0, extra_body={"ignore_eos": True}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds or final.output_text == ""
    assert final.output_text == response.output_text
    assert response.output_text == response.model_extra.get("output_text", response.output_text)


@pytest.mark.parametrize("api", ["responses", "chat.completions"])
def test_ultralytics_llm_describes_bus(server, api):
    model = LLM(MODEL, api=api, base_url=f"{server.url}/v1", api_key=KEY)
    limit = {"max_output_tokens": 4} if api == "responses" else {"max_tokens": 4}
    engine_form = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}, {"type": "image"}]}]
    expected = expected_prompt_tokens(server, engine_form, [BUS])
    image_work = ("vlmcap_vision_encoder_inputs_total", "vlmcap_vision_encoder_cache_hits_total",
                  "vlmcap_prefix_cache_hit_tokens_total")  # encoded, its features reused, or its KV blocks reused
    encoded = sum(metric(server, name) for name in image_work)
    replies = [model("Describe the image.", image=BUS, **limit),
               asyncio.run(model.async_call("Describe the image.", image=str(BUS), **limit))]
    for reply in replies:
        if api == "responses":
            assert isinstance(reply.output_text, str) and 1 <= reply.usage.output_tokens <= 4
            assert reply.usage.input_tokens == expected
        else:
            assert isinstance(reply.choices[0].message.content, str) and 1 <= reply.usage.completion_tokens <= 4
            assert reply.usage.prompt_tokens == expected
    assert sum(metric(server, name) for name in image_work) > encoded  # the image reached the model


# -- concurrency ------------------------------------------------------------------------------------------

PROMPTS = [
    ("Describe the people.", (BUS,)),
    ("Who is on the pitch?", (ZIDANE,)),
    ("Compare them.", (BUS, ZIDANE)),
    ("What happens next?", (BUS,)),
    ("Tell me about buses.", ()),
    ("A short story, please.", ()),
    ("Name three colours.", ()),
    ("What time is it?", ()),
]
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


async def stream_tokens(client: openai.AsyncOpenAI, text: str, paths, priority: int = 0, **sampling) -> list[int]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=image_message(text, *paths), max_tokens=8, stream=True,
        extra_body={"return_token_ids": True, "priority": priority, **sampling},
    )
    return [t async for chunk in stream if chunk.choices for t in chunk.choices[0].model_extra.get("token_ids") or []]


async def caption(server, path) -> dict:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
        reply = await http.post(f"{server.url}/v1/captions?wait=true",
                                files={"image": (path.name, path.read_bytes(), "image/jpeg")})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_concurrent_streams_give_the_tokens_they_get_alone(server):
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        alone = [await stream_tokens(client, text, paths, temperature=0) for text, paths in PROMPTS]
        seeded_alone = await stream_tokens(client, "Invent a name.", (), **SEEDED)
        captions_alone = [await caption(server, path) for path in (BUS, ZIDANE)]

        greedy = [stream_tokens(client, text, paths, priority=i % 3, temperature=0)
                  for i, (text, paths) in enumerate(PROMPTS * 4)]
        seeded = [stream_tokens(client, "Invent a name.", (), **SEEDED) for _ in range(2)]
        captions = [caption(server, path) for path in (BUS, ZIDANE, BUS)]
        results = await asyncio.gather(*greedy, *seeded, *captions)
        await client.close()

        assert results[:32] == alone * 4
        assert results[32:34] == [seeded_alone, seeded_alone]
        assert all(len(tokens) >= 1 for tokens in alone)
        done = results[34:]
        assert [c["status"] for c in done] == ["done"] * 3
        assert [c["caption"] for c in done] == [captions_alone[0]["caption"], captions_alone[1]["caption"],
                                                captions_alone[0]["caption"]]

    asyncio.run(run())
    stats = server.state.bridge.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0


def wait_until_idle(server, timeout_s: float = 60.0) -> EngineStats:
    """Poll until the engine holds no request (a deadline against hanging, not a timing assertion)."""
    engine = server.state.bridge.engine
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.stats()


def wait_until_running(server, timeout_s: float = 60.0) -> None:
    engine = server.state.bridge.engine
    deadline = time.monotonic() + timeout_s
    while engine.stats().num_generated_tokens == 0 or not engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


LONG = {"model": MODEL, "messages": image_message("Go on and on.", BUS), "max_tokens": 4000,
        "ignore_eos": True, "temperature": 0}


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server):
    aborted = metric(server, "vlmcap_requests_aborted_total")
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG, "stream": True}) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk
            assert server.state.bridge.engine.has_unfinished_requests()
        # leaving the with-block closes the connection mid-stream
    stats = wait_until_idle(server)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert metric(server, "vlmcap_requests_aborted_total") == aborted + 1


def test_disconnected_non_streamed_request_is_aborted(server):
    aborted = metric(server, "vlmcap_requests_aborted_total")

    async def run() -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            request = asyncio.create_task(http.post(f"{server.url}/v1/chat/completions", json=LONG))
            await asyncio.to_thread(wait_until_running, server)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(run())
    stats = wait_until_idle(server)
    assert stats.kv_blocks_used == 0
    assert metric(server, "vlmcap_requests_aborted_total") == aborted + 1


def test_metrics_count_requests_and_latencies(server, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   extra_body={"ignore_eos": True})
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # a server with a key keeps its metrics behind it
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'vlmcap_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert 'route="/v1/models",status="401"' in text
    for name in ("vlmcap_time_to_first_token_seconds_count", "vlmcap_inter_token_latency_seconds_count",
                 "vlmcap_e2e_request_latency_seconds_count", "vlmcap_step_num_tokens_count"):
        assert metric(server, name) > 0, name
    for name in ("vlmcap_num_requests_running", "vlmcap_kv_cache_usage_ratio", "vlmcap_num_preemptions_total",
                 "vlmcap_vision_encoder_seconds_total"):
        assert f"\n{name} " in text, name


def test_api_docs_need_the_key(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        refused = httpx.get(f"{server.url}{path}")
        assert refused.status_code == 401, path
    schema = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert httpx.get(f"{server.url}/").status_code == 200  # the dashboard page itself is public


EXTREME_SAMPLING = [{"temperature": 1e-300}, {"top_p": 1e-320}, {"temperature": 1e-40, "top_k": 5}]


@pytest.mark.parametrize("extreme", EXTREME_SAMPLING, ids=[str(s) for s in EXTREME_SAMPLING])
def test_extreme_sampling_values_touch_no_other_request(server, extreme):
    """Three greedy streams and one request with sampling values at the edge of what floats hold, in one
    batch: the greedy streams get the tokens they get alone; the extreme one finishes or gets its own 400,
    and no step failed."""
    failures = metric(server, "vlmcap_engine_step_failures_total")

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        prompts = PROMPTS[3:6]
        alone = [await stream_tokens(client, text, paths, temperature=0) for text, paths in prompts]

        async def extreme_request() -> list[int] | openai.BadRequestError:
            try:
                return await stream_tokens(client, "Invent a name.", (), **extreme)
            except openai.BadRequestError as refused:
                return refused

        *together, odd = await asyncio.gather(
            *(stream_tokens(client, text, paths, temperature=0) for text, paths in prompts), extreme_request())
        await client.close()
        assert together == alone
        if isinstance(odd, openai.BadRequestError):
            assert odd.status_code == 400
        else:
            assert len(odd) >= 1

    asyncio.run(run())
    assert metric(server, "vlmcap_engine_step_failures_total") == failures
