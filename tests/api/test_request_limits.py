"""Request-side security on a real uvicorn server (tiny model, real Redis, the official `openai` client): every
numeric field driven with extreme values answers 4xx in OpenAI's error body (or serves a value that is merely
odd) while a neighbour keeps its exact tokens; parameters honoured or refused by name; the priority floor;
grammars over their limits, crashing or slow answer 4xx and the server stays up; nothing is fetched for a schema
`$ref`; a job with a bad schema is dead-lettered at once; log-probabilities over HTTP; the role chunk goes with
the first token."""

from __future__ import annotations

import base64
import http.server
import json
import re
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import redis
from test_api_captions import BUS, PROMPT, poll

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig
from engine.grammar_limits import GrammarLimits
from engine.sampling import INT64_MAX, MAX_LOGPROBS, SAMPLING_RANGES
from jobqueue.contract import DEAD_STREAM, Detection, Job
from jobqueue.producer import JobProducer

pytest.importorskip("xgrammar")

MODEL = "tiny"
CAP = 8192  # the context (Limits().max_tokens_cap is None)
IMAGE = "data:image/jpeg;base64," + base64.b64encode(BUS).decode()
# Raw JSON literals: 10**400 and its negative, a float overflowing to infinity, NaN, a subnormal, -1.
EXTREMES = ["1" + "0" * 400, "-1" + "0" * 400, "1e999", "NaN", "1e-320", "-1"]


def api_range(name: str) -> tuple[float, float, bool, bool]:
    """(low, high, integer, low_open) a route accepts for a field."""
    if name in SAMPLING_RANGES:
        allowed = SAMPLING_RANGES[name]
        high = CAP if name == "max_tokens" else 2**63 - 1 if name == "seed" else allowed.high
        low = -(2**63) if name == "seed" else allowed.low
        return low, high, allowed.integer, allowed.low_open
    return {"priority": (0, 2**31 - 1, True, False), "n": (1, 1, True, False),
            "top_logprobs": (0, MAX_LOGPROBS, True, False)}[name]


def acceptable(name: str, literal: str) -> bool:
    value = json.loads(literal)
    low, high, integer, low_open = api_range(name.split(".")[-1].replace("max_completion_tokens", "max_tokens")
                                             .replace("max_output_tokens", "max_tokens"))
    if integer and not isinstance(value, int):
        return False
    if value != value or value in (float("inf"), float("-inf")):
        return False
    return (value > low if low_open else value >= low) and value <= high


CHAT_FIELDS = ["temperature", "top_p", "top_k", "seed", "priority", "max_tokens", "max_completion_tokens", "n",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "top_logprobs"]
RESPONSES_FIELDS = ["temperature", "top_p", "top_k", "seed", "priority", "max_output_tokens"]
CAPTION_FIELDS = ["max_tokens", "priority"]


def hostile_bodies() -> list[tuple[str, str, str]]:
    """(path, field, raw JSON body) for every numeric field and extreme value."""
    bodies = []
    for literal in EXTREMES:
        for name in CHAT_FIELDS:
            base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                    "logprobs": name == "top_logprobs", name: "@"}
            bodies.append(("/v1/chat/completions", name, json.dumps(base).replace('"@"', literal)))
        for name in RESPONSES_FIELDS:
            base = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, name: "@"}
            bodies.append(("/v1/responses", name, json.dumps(base).replace('"@"', literal)))
        for name in CAPTION_FIELDS:
            base = {"image": IMAGE, "max_tokens": 2, name: "@"}
            bodies.append(("/v1/captions?wait=true", name, json.dumps(base).replace('"@"', literal)))
    return bodies


@pytest.fixture(scope="module")
def server(module_redis_url):
    settings = ServerSettings(engine=EngineConfig(model=MODEL, max_num_batched_tokens=256),
                              redis_url=module_redis_url, caption_max_tokens=4, max_deliveries=3,
                              claim_idle_seconds=0.5)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def unlimited():
    """A server whose grammar limits let anything reach the compiler: only the child process and the deadline
    stand between a grammar and the server."""
    limits = GrammarLimits(max_regex_depth=10**7, max_regex_chars=10**7, max_properties=10**6, max_repetition=10**7,
                           max_schema_bytes=10**8, max_schema_depth=10**6, max_total_repetition=10**9,
                           compile_timeout_s=3.0, workers=1)
    settings = ServerSettings(engine=EngineConfig(model=MODEL, max_num_batched_tokens=256, grammar_limits=limits),
                              run_queue_worker=False)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def neighbour_tokens(client: openai.OpenAI) -> list[int]:
    """A greedy streamed chat's tokens (vlmcap's return_token_ids)."""
    tokens: list[int] = []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A street."}],
                                                max_tokens=24, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True, "ignore_eos": True}):
        if chunk.choices:
            tokens += chunk.choices[0].model_extra.get("token_ids") or []
    return tokens


def assert_openai_error(reply: httpx.Response, sent: object = None) -> None:
    assert 400 <= reply.status_code < 500, (sent, reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def test_every_numeric_field_with_extreme_values_and_an_intact_neighbour(server, client):
    alone = neighbour_tokens(client)
    beside: list[int] = []
    neighbour = threading.Thread(target=lambda: beside.extend(neighbour_tokens(client)))
    neighbour.start()
    with httpx.Client(base_url=server.url, timeout=120, headers={"Content-Type": "application/json"}) as http:
        for path, name, body in hostile_bodies():
            reply = http.post(path, content=body)
            literal = body.split(f'"{name}": ')[1].split(",")[0].split("}")[0]
            if acceptable(name, literal):
                assert reply.status_code == 200, (path, name, literal, reply.text[:300])
            else:
                assert_openai_error(reply, (path, name, literal))
                error = reply.json()["error"]
                assert name in f"{error['message']} {error['param']}" or "NaN is not JSON" in error["message"], \
                    (path, reply.text)
    neighbour.join()
    assert beside == alone and len(alone) == 24
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_top_k_over_the_vocabulary_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="over the model's vocabulary"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=1.0, extra_body={"top_k": INT64_MAX})


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"n": 1000}, "n"),  # n > 1 is served, up to 128 choices
    ("/v1/chat/completions", {"logit_bias": {"17": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"metadata": {"camera": 5}}, "metadata.camera"),  # OpenAI's: string values
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/responses", {"store": True}, "store"),  # chat completions keep theirs (tests/api/test_compat_clients.py)
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", {"reasoning": {"effort": "high"}}, "reasoning"),
    ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
])
def test_unsupported_parameters_are_refused_by_name(server, path, extra, param):
    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]} if "chat" in path \
        else {"model": MODEL, "max_output_tokens": 2, "input": "Hi"}
    reply = httpx.post(f"{server.url}{path}", json={**base, **extra}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and param in reply.json()["error"]["message"]


def test_parameters_at_their_neutral_values_are_served(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           user="u1", metadata={"k": "v"}, store=False, tools=[], tool_choice="none",
                                           parallel_tool_calls=False)
    assert reply.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": "Hi"}),
    ("/v1/captions?wait=true", {"image": IMAGE, "max_tokens": 2}),
])
def test_a_priority_below_the_floor_is_a_400(server, path, body):
    low = httpx.post(f"{server.url}{path}", json={**body, "priority": -2147483648}, timeout=60)
    assert low.status_code == 400 and low.json()["error"]["code"] == "priority_too_low", low.text
    assert "min_client_priority" in low.json()["error"]["message"]
    assert httpx.post(f"{server.url}{path}", json={**body, "priority": 0}, timeout=60).status_code == 200


def test_logprobs_over_http_streamed_and_not(client):
    messages = [{"role": "user", "content": "A street."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    joined = "".join(entry.token for entry in content)  # special tokens (<row_1_col_1>) are left out of the text
    assert re.sub(r"<[a-z_0-9]+>", "", joined) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the likeliest token
        assert entry.bytes == list(entry.token.encode())
    streamed = [lp for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=2)


def test_penalties_change_the_output_over_http(client):
    messages = [{"role": "user", "content": "A street."}]

    def text(**kwargs) -> str:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True}, **kwargs).choices[0].message.content

    assert text(presence_penalty=2.0, frequency_penalty=2.0) != text()


def test_the_first_streamed_chunk_carries_the_role_and_the_first_token(client):
    chunks = [c for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
        extra_body={"return_token_ids": True}) if c.choices]
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and len(first.model_extra["token_ids"]) == 1
    assert [c.choices[0].delta.role for c in chunks[1:]] == [None] * (len(chunks) - 1)


def schema_request(schema: dict) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "JSON"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def chat_with_schema(url: str, schema: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=timeout, json=schema_request(schema))


@pytest.mark.parametrize("schema,status,limit", [
    ({"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}, 400, "max_regex_chars"),
    ({"type": "string", "pattern": "(" * 100 + "a" + ")" * 100}, 400, "max_regex_depth"),
    ({"type": "string", "pattern": "a{1,8000}"}, 400, "max_repetition"),
    ({"enum": [f"value {i}" for i in range(100_000)]}, 413, "max_schema_bytes"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}, 400, "max_properties"),
])
def test_grammars_over_their_limits_answer_naming_the_limit(server, schema, status, limit):
    reply = chat_with_schema(server.url, schema)
    assert reply.status_code == status and limit in reply.json()["error"]["message"], reply.text[:300]
    assert reply.json()["error"]["code"] == "grammar_too_large"


def test_a_grammar_that_crashes_or_overruns_the_compiler_leaves_the_server_up(unlimited):
    crashed = chat_with_schema(unlimited.url, {"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000})
    assert crashed.status_code == 400 and "crashed the compiler (signal SIGSEGV)" in crashed.text, crashed.text
    slow = chat_with_schema(unlimited.url, {"type": "object",
                                            "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}})
    assert slow.status_code == 400 and slow.json()["error"]["code"] == "grammar_timeout", slow.text
    assert "compile_timeout_s" in slow.json()["error"]["message"]
    assert chat_with_schema(unlimited.url, {"type": "integer"}).status_code == 200
    assert unlimited.state.bridge.engine.grammars.pool.restarts == 2


def test_a_client_that_leaves_cancels_its_compile(unlimited):
    """A client that hangs up while its grammar compiles has the compile's child killed, before the compile's own
    3 s deadline would have. The client leaves once the pool runs its compile (on a loaded machine the request can
    take longer than any fixed wait to reach the pool; leaving before then is cancelled while it waits, no child to
    kill)."""
    pool = unlimited.state.bridge.engine.grammars.pool
    restarts = pool.restarts
    schema = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(1000)}}
    body = json.dumps(schema_request(schema))
    address = urlsplit(unlimited.url)
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: "
                       f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        began = time.monotonic()
        while not pool.running() and time.monotonic() < began + 60:
            time.sleep(0.01)
        assert pool.running(), "the compile never reached the pool"
        compiling_since = time.monotonic()
    while pool.restarts == restarts and time.monotonic() < compiling_since + 2.5:  # its own deadline: 3 s
        time.sleep(0.05)
    assert pool.restarts == restarts + 1


class SlowSchemaServer(http.server.ThreadingHTTPServer):
    """Serves a schema after 8 s and counts the requests it got."""

    def __init__(self) -> None:
        self.hits = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                time.sleep(8)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"type": "integer"}')

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def slow_schema_url():
    slow = SlowSchemaServer()
    thread = threading.Thread(target=slow.serve_forever, daemon=True)
    thread.start()
    yield slow, f"http://127.0.0.1:{slow.server_address[1]}/schema.json"
    slow.shutdown()


def test_nothing_is_fetched_for_a_schema_ref(server, tmp_path, slow_schema_url):
    secret = tmp_path / "key.json"
    secret.write_text(json.dumps({"private_key": "S3CRET-VALUE"}))
    slow, slow_url = slow_schema_url
    for ref in (f"file://{secret}#/private_key", slow_url):
        schema = {"type": "object", "properties": {"a": {"not": {"$ref": ref}}}}
        began = time.monotonic()
        caption = httpx.post(f"{server.url}/v1/captions?wait=true", json={"image": IMAGE, "schema": schema},
                             timeout=60)
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
        assert time.monotonic() - began < 5  # not the slow server's 8 s
        assert caption.status_code == 400 and "outside" in caption.text and "S3CRET" not in caption.text, caption.text
        chat = chat_with_schema(server.url, schema)
        assert chat.status_code == 400 and "outside the schema" in chat.text and "S3CRET" not in chat.text
    assert slow.hits == 0


def test_a_job_with_a_bad_schema_is_dead_lettered_once_at_its_first_delivery(module_redis_url, server):
    producer = JobProducer(module_redis_url)
    jobs = [Job(camera_id="hostile", frame_ts=1.0, prompt=PROMPT, image=BUS,
                detections=[Detection(10, 20, 110, 220, 0.9)], schema=schema)
            for schema in ({"not": {"$ref": "file:///etc/passwd"}}, {"type": "string", "pattern": "a{1,8000}"})]
    for job in jobs:
        producer.submit(job)
    producer.close()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        results = [poll(http, job.job_id) for job in jobs]
    assert [r["status"] for r in results] == ["failed", "failed"], results
    assert "outside itself" in results[0]["error"] and "root:" not in results[0]["error"]
    assert "max_repetition" in results[1]["error"]
    client = redis.Redis.from_url(module_redis_url)
    try:
        dead = [fields for _, fields in client.xrange(DEAD_STREAM) if fields[b"camera_id"] == b"hostile"]
    finally:
        client.close()
    assert len(dead) == 2 and {int(fields[b"deliveries"]) for fields in dead} == {1}


def test_vlmcap_worker_dead_letters_a_schema_the_server_refuses_at_once(redis_url, server):
    """`vlmcap worker`'s path: the server's 400 for the schema ends the job at its first delivery."""
    from queue_support import caption_remotely

    job = Job(camera_id="remote", frame_ts=1.0, prompt=PROMPT, image=BUS, detections=[Detection(10, 20, 110, 220, 0.9)],
              schema={"type": "string", "pattern": "a{1,8000}"})
    result = caption_remotely(redis_url, server.url, MODEL, job, max_tokens=8)
    assert result.status == "failed" and result.deliveries == 1, result
    assert "SchemaRefused" in result.error and "max_repetition" in result.error
