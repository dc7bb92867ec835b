"""Bad input gets the right 4xx in OpenAI's error body and the server goes on serving; the queue limit
answers 429; a failing engine step fails only the requests in flight; a server whose model cannot load
answers 503; and a bounded schemathesis run over the OpenAPI schema never sees a 5xx."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from PIL import Image
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
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
def server(module_redis_url):
    """With Redis (results, cameras, frames and alerts are read from it), so every route does real work."""
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_seqs=1, max_model_len=512), limits=LIMITS,
                              caption_max_tokens=4, redis_url=module_redis_url)
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
    ("wrong type of messages", {"model": "tiny", "messages": "hi"}, 400, "messages", "messages"),
    ("wrong type of max_tokens", chat(max_tokens="many"), 400, "max_tokens", "max_tokens"),
    ("no messages", {"model": "tiny", "messages": []}, 400, "messages", "at least 1"),
    ("negative max_tokens", chat(max_tokens=-3), 400, "max_tokens", "greater than or equal to 1"),
    ("temperature out of range", chat(temperature=7), 400, "temperature", "less than or equal to 2"),
    ("n over the choices cap", chat(n=1000), 400, "n", "over 128 choices"),
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
     "messages[0].content[2].image_url", "more than max_images_per_request = 2"),
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
        (http.post("/v1/captions", json={"prompt": "hi"}), 400, "image"),
        (http.post("/v1/captions", json={"image": base64.b64encode(BUS[:5000]).decode()}), 400, "truncated"),
        (http.post("/v1/captions", json={"image": base64.b64encode(BUS).decode(), "camera_id": "a b"}), 400,
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
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("input")


def engine_of(server):
    return server.state.bridge.engine


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_full_queue_answers_429(server, http, monkeypatch):
    """max_num_seqs=1 and max_waiting_requests=1: one request runs, one waits, the next is refused."""
    monkeypatch.setattr(server.state.settings.limits, "max_tokens_cap", None)  # requests that outlast the test
    long = chat(max_tokens=480, ignore_eos=True, stream=True)
    bridge = server.state.bridge
    with httpx.Client(base_url=server.url, timeout=120) as other:
        with http.stream("POST", "/v1/chat/completions", json=long) as running:
            lines = running.iter_lines()  # keep a reference: a collected line iterator closes the stream
            next(lines)
            with other.stream("POST", "/v1/chat/completions", json=long) as waiting:
                wait_for(lambda: bridge.stats.num_waiting == 1)
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
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()

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


# The schema the server publishes at /openapi.json; building it needs no engine. The event streams never
# end: their refusals are tested below.
SCHEMA = schemathesis.openapi.from_dict(create_app(ServerSettings(limits=LIMITS)).openapi()).exclude(
    path_regex=r"/stream$")


def test_fuzzing_covers_every_route_but_the_endless_streams():
    published = create_app(ServerSettings(limits=LIMITS)).openapi()["paths"]
    fuzzed = {operation.path for operation in SCHEMA.get_all_operations() for operation in [operation.ok()]}
    assert fuzzed == {path for path in published if not path.endswith("/stream")}
    assert {"/v1/captions", "/v1/cameras", "/v1/captions/{caption_id}/image", "/v1/engine/stats",
            "/v1/responses"} <= fuzzed


@pytest.mark.parametrize("path", ["/v1/captions/stream", "/v1/alerts/stream"])
def test_event_streams_refuse_bad_parameters(http, path):
    reply = http.get(path, headers={"Last-Event-ID": "not-an-id"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "last-event-id"


@SCHEMA.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_a_5xx(case, server):
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, (case.path, case.body, response.text)


# -- hardening (issue 13) -----------------------------------------------------------------------------

def png_header_claiming(width: int, height: int) -> bytes:
    """A real PNG whose header claims `width` x `height` (the IHDR chunk rewritten, its CRC fixed): Pillow
    reads the size from the header and refuses it as a decompression bomb before any pixel."""
    data = bytearray(png(4, 4))
    ihdr = data[12:29]  # chunk type and data of IHDR, which follows the 8-byte signature and 4-byte length
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def gif_header_claiming(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("P", (4, 4)).save(out, format="GIF")
    data = bytearray(out.getvalue())
    data[6:10] = struct.pack("<HH", width, height)  # the logical screen size
    return bytes(data)


@pytest.mark.parametrize("bomb", [png_header_claiming(20000, 20000), gif_header_claiming(65535, 65535)],
                         ids=["png", "gif"])
def test_image_over_pillows_bomb_limit_answers_413(http, bomb):
    for reply in (http.post("/v1/chat/completions", json=chat(data_url(bomb, "image/png"))),
                  http.post("/v1/captions", files={"image": ("bomb.png", bomb)})):
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == "image_too_large"
    assert_serving(http)


def test_unknown_http_methods_share_one_metrics_label(server, http):
    def others() -> float:
        return server.state.metrics.registry.get_sample_value(
            "vlmcap_http_requests_total", {"method": "other", "route": "/v1/models", "status": "405"}) or 0.0

    before = others()
    for method in ("RANDOM123", "RANDOM456", "BREW"):
        assert http.request(method, "/v1/models").status_code in (400, 405)
    text = http.get("/metrics").text
    assert "RANDOM123" not in text and "BREW" not in text
    assert others() == before + 3


def test_deeply_nested_json_answers_400(http):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/captions", "/v1/chat/completions", "/v1/responses"):
        reply = http.post(path, content=b'{"image": ' + deep + b"}", headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, (path, reply.text)
    nan = http.post("/v1/captions", content=b'{"image": "x", "max_tokens": NaN}',
                    headers={"Content-Type": "application/json"})
    assert nan.status_code == 400 and "NaN is not JSON" in nan.json()["error"]["message"]
    assert_serving(http)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/captions"])
def test_oversized_chunked_body_answers_413(http, path):
    def body():  # no Content-Length: sent chunked, the limit is found while reading
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"x" * 100_000
        yield b'"}]}'

    reply = http.post(path, content=body(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == "body_too_large"
    assert_serving(http)


def test_static_page_has_the_pages_csp(http):
    for path in ("/", "/static/index.html"):
        reply = http.get(path)
        assert reply.status_code == 200
        assert "default-src 'none'" in reply.headers["content-security-policy"], path


def test_without_a_key_foreign_hosts_and_cross_site_posts_are_refused(server, http):
    port = server.url.rsplit(":", 1)[1]
    rebound = http.get("/v1/models", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    assert http.get("/ready", headers={"Host": "10.0.0.7:8000"}).status_code == 200  # probes: any address
    upload = {"files": {"image": ("bus.jpg", BUS)}}
    for headers in ({"Origin": "http://attacker.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": f"http://localhost:{int(port) + 1}"}):
        reply = http.post("/v1/captions", headers=headers, **upload)
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "cross_site_request", headers
    same_origin = http.post("/v1/captions", headers={"Origin": server.url, "Sec-Fetch-Site": "same-origin"},
                            **upload)
    assert same_origin.status_code == 202, same_origin.text


def test_allowed_hosts_extend_the_loopback_names():
    app = create_app(ServerSettings(limits=LIMITS, allowed_hosts=("vlm.internal",)))
    client = TestClient(app, base_url="http://vlm.internal:8000")  # no lifespan: no engine is loaded
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/openapi.json", headers={"Host": "other.internal"}).status_code == 403


def test_a_request_the_engine_fails_gets_an_error_and_is_counted(server, http):
    """A forward that raises inside the engine's step ends the requests it carried with an error (counted
    in vlmcap_engine_step_failures_total); the client gets an error, never a 200 with partial text, and
    the server goes on."""
    runner = engine_of(server).runner
    real_execute = runner.execute
    failures = server.state.metrics.registry.get_sample_value("vlmcap_engine_step_failures_total")

    def failing_execute(*args, **kwargs):
        runner.execute = real_execute
        raise RuntimeError("injected forward failure")

    runner.execute = failing_execute
    reply = http.post("/v1/chat/completions", json=chat())
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "engine_error", reply.text
    runner.execute = failing_execute
    streamed = http.post("/v1/chat/completions", json=chat(stream=True))
    events = [e for e in streamed.text.split("\n\n") if e]
    assert "engine_error" in events[-2] and events[-1] == "data: [DONE]"
    runner.execute = failing_execute
    caption = http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS)})
    assert caption.status_code == 200 and caption.json()["status"] == "failed", caption.text
    assert "engine failed" in caption.json()["error"]
    assert server.state.metrics.registry.get_sample_value("vlmcap_engine_step_failures_total") == failures + 3
    assert_serving(http)
