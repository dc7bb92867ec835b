"""Bad input gets the right 4xx in OpenAI's error body and the server goes on serving; the queue limit
answers 429; a failing engine step fails only the requests in flight; a server whose model cannot load
answers 503; and a bounded schemathesis run over the OpenAPI schema never sees a 5xx."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from PIL import Image
from ultralytics.utils import ASSETS

from api.server import BackgroundServer, create_app
from api.settings import Limits, ServerSettings
from engine import EngineConfig

BUS = (ASSETS / "bus.jpg").read_bytes()
LIMITS = Limits(max_body_bytes=2_000_000, max_image_pixels=1_000_000, max_images_per_request=2, max_tokens_cap=16,
                default_max_tokens=4, max_waiting_requests=1)


def data_url(data: bytes, media: str = "image/jpeg") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_seqs=1, max_model_len=512), limits=LIMITS,
                              caption_max_tokens=4)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def chat(image_url: str | None = None, text: str = "Describe.", **extra) -> dict:
    content = [{"type": "text", "text": text}]
    if image_url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def assert_serving(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json=chat(data_url(BUS), ignore_eos=True))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


BAD_CHATS = [
    ("wrong type of messages", {"model": "tiny", "messages": "hi"}, 422, "messages", "messages"),
    ("wrong type of max_tokens", chat(max_tokens="many"), 422, "max_tokens", "max_tokens"),
    ("no messages", {"model": "tiny", "messages": []}, 422, "messages", "at least 1"),
    ("negative max_tokens", chat(max_tokens=-3), 422, "max_tokens", "greater than or equal to 1"),
    ("temperature out of range", chat(temperature=7), 422, "temperature", "less than or equal to 2"),
    ("n=2", chat(n=2), 400, "n", "n=2 is not supported"),
    ("unknown model", {**chat(), "model": "gpt-9"}, 404, "model", "does not exist"),
    ("max_tokens over the cap", chat(max_tokens=17), 400, "max_tokens", "over this server's cap of 16"),
    ("a data URL that is not an image", chat(data_url(b"hello", "text/plain")), 400,
     "messages[0].content[0].image_url", "not an image"),
    ("image bytes that are not an image", chat(data_url(b"hello there")), 400,
     "messages[0].content[0].image_url", "not a readable image"),
    ("invalid base64", chat("data:image/jpeg;base64,@@@@"), 400, "messages[0].content[0].image_url", "base64"),
    ("a truncated JPEG", chat(data_url(BUS[: len(BUS) // 2])), 400, "messages[0].content[0].image_url", "truncated"),
    ("an image over the pixel limit", chat(data_url(png(1500, 1000), "image/png")), 413,
     "messages[0].content[0].image_url", "over the limit of 1000000"),
    ("a remote image URL (disabled)", chat("http://127.0.0.1/x.jpg"), 400, "messages[0].content[0].image_url",
     "remote image URLs are disabled"),
    ("too many images", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(BUS)}} for _ in range(3)]}]}, 400,
     "messages[0].content[2].image_url", "more than 2 images"),
    ("an image marker without an image", chat(text="Look: <image>"), 400, None, "marker"),
    ("a prompt over max_model_len", chat(text="walking people " * 400), 400, None, "max_model_len 512"),
    ("an empty stop string", chat(stop=[""]), 400, None, "stop"),
]


@pytest.mark.parametrize(("case", "body", "status", "param", "message"), BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_requests(http, case, body, status, param, message):
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_malformed_json_and_oversized_body(http):
    reply = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                      headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    big = http.post("/v1/chat/completions", json=chat(data_url(b"x" * 2_000_000)))
    assert big.status_code == 413 and "over the limit of 2000000 bytes" in big.json()["error"]["message"]
    assert_serving(http)


def test_bad_caption_requests(http):
    cases = [
        (http.post("/v1/captions", content=b"raw", headers={"Content-Type": "text/plain"}), 415, "multipart"),
        (http.post("/v1/captions", json={"image": "@@@"}), 400, "base64"),
        (http.post("/v1/captions", json={"prompt": "hi"}), 422, "image"),
        (http.post("/v1/captions", json={"image": base64.b64encode(BUS[:5000]).decode()}), 400, "truncated"),
        (http.post("/v1/captions", json={"image": base64.b64encode(BUS).decode(), "camera_id": "a b"}), 422,
         "camera_id"),
        (http.post("/v1/captions", files={"file": ("x.jpg", BUS)}), 400, "field named 'image'"),
        (http.get("/v1/captions/nope"), 404, "no caption"),
    ]
    for reply, status, message in cases:
        assert reply.status_code == status, reply.text
        assert message in reply.json()["error"]["message"]
    assert_serving(http)


def test_bad_responses_requests(http):
    image = {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}
    reply = http.post("/v1/responses", json={"model": "tiny", "input": [image]})
    assert reply.status_code == 400 and "file_id" in reply.json()["error"]["message"]
    reply = http.post("/v1/responses", json={"model": "tiny", "input": 3})
    assert reply.status_code == 422 and reply.json()["error"]["param"].startswith("input")


def engine_of(server):
    return server.state.bridge.engine


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_full_queue_answers_429(server, http, monkeypatch):
    """max_num_seqs=1 and max_waiting_requests=1: one request runs, one waits, the next is refused."""
    monkeypatch.setattr(server.state.settings.limits, "max_tokens_cap", 4000)  # requests that outlast the test
    long = chat(max_tokens=4000, ignore_eos=True, stream=True)
    bridge = server.state.bridge
    with httpx.Client(base_url=server.url, timeout=120) as other:
        with http.stream("POST", "/v1/chat/completions", json=long) as running:
            lines = running.iter_lines()  # keep a reference: a collected line iterator closes the stream
            next(lines)
            with other.stream("POST", "/v1/chat/completions", json=long) as waiting:
                wait_for(lambda: bridge.stats["num_waiting"] == 1)
                refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat())
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "queue_full"
                assert waiting.status_code == 200
    wait_for(lambda: not engine_of(server).has_unfinished_requests())
    assert_serving(http)


def test_failing_step_fails_the_requests_in_flight_only(server, http):
    engine = engine_of(server)
    real_step = engine.step

    def failing_step():
        engine.step = real_step
        raise RuntimeError("injected failure")

    engine.step = failing_step
    reply = http.post("/v1/chat/completions", json=chat())
    assert reply.status_code == 500 and "injected failure" in reply.json()["error"]["message"]
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()

    engine.step = failing_step
    streamed = http.post("/v1/chat/completions", json=chat(stream=True))
    events = [e for e in streamed.text.split("\n\n") if e]
    assert "injected failure" in events[-2] and events[-1] == "data: [DONE]"
    assert server.state.metrics.registry.get_sample_value("vlmcap_engine_step_failures_total") == 2
    assert http.get("/ready").status_code == 200
    assert_serving(http)


def test_model_that_cannot_load_answers_503(tmp_path):
    app = create_app(ServerSettings(engine=EngineConfig(model=str(tmp_path / "missing"))))
    with TestClient(app, base_url="http://localhost") as client:
        wait_for(lambda: client.get("/health").status_code == 503)
        assert "cannot load model" in client.get("/health").json()["error"]
        assert client.get("/ready").status_code == 503
        reply = client.get("/v1/models")
        assert reply.status_code == 503 and "failed to load" in reply.json()["error"]["message"]


# The schema the server publishes at /openapi.json; building it needs no engine.
SCHEMA = schemathesis.openapi.from_dict(create_app(ServerSettings(limits=LIMITS)).openapi()).exclude(
    path="/v1/captions/stream"  # an endless event stream
)


@SCHEMA.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_a_5xx(case, server):
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, (case.path, case.body, response.text)
