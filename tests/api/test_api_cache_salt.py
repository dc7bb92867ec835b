"""Cache isolation as clients see it, on a real uvicorn server (tiny model) with several named API keys, driven
by the official `openai` client: a prompt one key sent is cached for that key (its `cached_tokens` grows) and
never for another key, nor for the same key under another `cache_salt`; the tokens are the same in every case.
Chat completions, Responses and captions all take `cache_salt`."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.guard import cache_salt
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig

MODEL = "vlmcap-tiny"
KEYS = {"alice": "key-alice", "bob": "key-bob"}
# Long enough for several 16-token blocks; a text of its own, so no other test's prompt shares its blocks.
SYSTEM = "You answer questions about cache isolation between the tenants of one shared server, briefly. " * 3


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256), api_keys=KEYS,
                              served_model_name=MODEL)
    with BackgroundServer(create_app(settings)) as running:
        yield running


def client_of(server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[name], max_retries=0)


def chat(client: openai.OpenAI, question: str, **extra) -> tuple[int, list[int]]:
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, messages=[{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": question}],
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].model_extra["token_ids"]


def test_a_prompt_is_cached_for_its_key_and_salt_only(server):
    alice, bob = client_of(server, "alice"), client_of(server, "bob")
    cached, tokens = chat(alice, "Who shares my blocks?")
    assert cached == 0
    again, same = chat(alice, "Who shares my blocks?")
    assert again > 0 and same == tokens
    assert chat(bob, "Who shares my blocks?") == (0, tokens)  # another key: nothing cached, same tokens
    assert chat(alice, "Who shares my blocks?", cache_salt="tenant-2") == (0, tokens)  # another salt
    assert chat(alice, "Who shares my blocks?", cache_salt="tenant-2")[0] > 0
    assert chat(bob, "Who shares my blocks?", cache_salt="tenant-2")[0] == 0  # the same salt, another key


def test_responses_take_a_cache_salt(server):
    alice = client_of(server, "alice")

    def respond(salt: str) -> int:
        reply = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Salted responses?",
                                       max_output_tokens=3, temperature=0, extra_body={"cache_salt": salt})
        return reply.usage.input_tokens_details.cached_tokens

    assert respond("r1") == 0
    assert respond("r1") > 0
    assert respond("r2") == 0


def test_captions_take_a_cache_salt(server):
    bus = (ASSETS / "bus.jpg").read_bytes()
    before = server.state.bridge.engine.stats()["encoder_inputs_encoded"]

    def caption(salt: str) -> None:
        reply = httpx.post(f"{server.url}/v1/captions?wait=true", headers={"Authorization": "Bearer key-bob"},
                           files={"image": ("bus.jpg", bus)}, data={"cache_salt": salt, "max_tokens": "2"},
                           timeout=300)
        assert reply.status_code == 200 and reply.json()["status"] == "done", reply.text

    caption("c1")
    encoded = server.state.bridge.engine.stats()["encoder_inputs_encoded"]
    assert encoded > before
    caption("c1")
    assert server.state.bridge.engine.stats()["encoder_inputs_encoded"] == encoded  # features shared
    caption("c2")
    assert server.state.bridge.engine.stats()["encoder_inputs_encoded"] > encoded  # another salt: encoded again


@pytest.mark.parametrize("salt", ["", "x" * 257, 5])
def test_a_bad_salt_is_refused(server, salt):
    reply = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer key-alice"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
    assert reply.status_code in (400, 422) and "cache_salt" in reply.text


def test_the_operator_can_share_the_cache_between_keys():
    """The rule itself: per key unless shared; a keyless server leaves the client's salt as it is."""
    from starlette.requests import HTTPConnection

    from api.guard import KEY_NAME_SCOPE

    def connection(name: str | None) -> HTTPConnection:
        scope = {"type": "http", "headers": []}
        if name is not None:
            scope[KEY_NAME_SCOPE] = name
        return HTTPConnection(scope)

    isolated, shared = ServerSettings(api_keys=KEYS), ServerSettings(api_keys=KEYS, share_prefix_cache=True)
    assert cache_salt(connection("alice"), isolated, None) != cache_salt(connection("bob"), isolated, None)
    assert cache_salt(connection("alice"), isolated, "s") != cache_salt(connection("alice"), isolated, None)
    assert cache_salt(connection("alice"), shared, None) is None
    assert cache_salt(connection("alice"), shared, "s") == cache_salt(connection("bob"), shared, "s") == "s"
    assert cache_salt(connection(None), ServerSettings(), "s") == "s"


def test_a_jobs_cache_salt_travels_from_its_entry_to_the_engine(server):
    """A job's `cache_salt` survives the stream entry and reaches the engine through the worker's captioner."""
    from jobqueue.consumer import caption_job
    from jobqueue.contract import Job

    bus = (ASSETS / "bus.jpg").read_bytes()
    job = Job(camera_id="cam", frame_ts=1.0, prompt="Who?", image=bus, detections=[], cache_salt="tenant-j")
    fields = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in job.to_fields().items()}
    decoded = Job.from_fields(fields)
    assert decoded.cache_salt == "tenant-j"
    engine = server.state.bridge.engine

    def encoded_after(salted_job: Job) -> int:
        asyncio.run(caption_job(server.state.captioner, salted_job, 0))
        return engine.stats()["encoder_inputs_encoded"]

    first = encoded_after(decoded)
    assert encoded_after(decoded) == first  # the same salt: the photo's features were reused
    decoded.cache_salt = "tenant-k"
    assert encoded_after(decoded) > first  # another tenant's salt: encoded again
