"""The camera memory through a real server (tiny model, embedded Redis, the in-process queue worker): jobs that
the real producer sends become events in the SQLite store once each, found by camera, time, kind, fall and a word
of their caption, read with their frames, found by likeness (their own frames first), kept across a restart and
seen per key; POST /v1/embeddings in OpenAI's shape; hostile input answered with 4xx."""

from __future__ import annotations

import base64
import io
import struct
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from PIL import Image
from queue_support import enqueue, wait_for
from ultralytics.utils import ASSETS

from api.background import BackgroundServer
from api.server import create_app
from api.settings import Limits, ServerSettings
from engine import EngineConfig
from jobqueue.contract import JOBS_STREAM, Detection, Job, JobImage
from memory.jobs import spread
from memory.store import mean_unit

BUS, ZIDANE = ASSETS / "bus.jpg", ASSETS / "zidane.jpg"
NOW = time.time() - 600


def jpeg(path, size=(160, 120), crop: float = 1.0) -> bytes:
    image = Image.open(path).convert("RGB")
    image = image.crop((0, 0, int(image.width * crop), int(image.height * crop))).resize(size)
    out = io.BytesIO()
    image.save(out, format="JPEG")
    return out.getvalue()


def settings(data_dir, **extra) -> ServerSettings:
    return ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=8, data_dir=str(data_dir),
                          limits=Limits(max_image_bytes=200_000), **extra)


def jobs() -> list[Job]:
    box = [Detection(1, 2, 30, 40, 0.9, 3)]
    sighting = Job(camera_id="gate-1", frame_ts=NOW, prompt="Who is here?", image=jpeg(BUS), detections=box,
                   job_id="sighting-1", kind="sighting", track_id=3)
    frames = [JobImage(jpeg(ZIDANE, crop=c), NOW + 10 + i, note=f"t=+{i}.0 s: person 4") for i, c in
              enumerate((1.0, 0.8, 0.6, 0.5, 0.4))]
    event = Job.of_frames("gate-2", "What did person 4 do?", frames, job_id="event-1", kind="event", track_id=4)
    fall = Job(camera_id="gate-1", frame_ts=NOW + 30, prompt="Is someone on the ground?",
               image=jpeg(BUS, crop=0.5), detections=box, job_id="fall-1", fall=True, track_id=5)
    return [sighting, event, fall]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vlmcap-data")


@pytest.fixture(scope="module")
def redis_url(module_redis_url: str) -> str:
    return module_redis_url


@pytest.fixture(scope="module")
def server(redis_url, data_dir) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(settings(data_dir, redis_url=redis_url))) as running:
        enqueue(redis_url, jobs())
        with httpx.Client(base_url=running.url, timeout=60) as http:
            wait_for(lambda: len(http.get("/v1/events").json()["data"]) == 3, "the three jobs kept as events",
                     timeout=240)
        yield running


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def ids(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    return [event["id"] for event in answer.json()["data"]]


def assert_error(answer: httpx.Response, status: int, param: str | None = None) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_every_job_is_an_event_found_by_camera_time_kind_fall_and_a_word(http):
    assert ids(http.get("/v1/events")) == ["fall-1", "event-1", "sighting-1"]  # newest first
    assert set(ids(http.get("/v1/events", params={"camera": "gate-1"}))) == {"sighting-1", "fall-1"}
    assert ids(http.get("/v1/events", params={"fall": "true"})) == ["fall-1"]
    assert ids(http.get("/v1/events", params={"kind": "event"})) == ["event-1"]
    assert ids(http.get("/v1/events", params={"since": NOW + 5, "until": NOW + 20})) == ["event-1"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 25))
    assert ids(http.get("/v1/events", params={"since": iso})) == ["fall-1"]
    for event in http.get("/v1/events").json()["data"]:
        words = [w for w in event["caption"].split() if w.isalnum()]
        if words:  # the random-weight model's text: any of its words finds the event
            assert event["id"] in ids(http.get("/v1/events", params={"q": words[0], "limit": 200}))
    assert ids(http.get("/v1/events", params={"q": "gate-2 event"})) == ["event-1"]  # structured fields too


def test_an_event_with_its_frames(http):
    event = http.get("/v1/events/event-1").json()
    assert (event["camera_id"], event["kind"], event["track_id"], event["fall"]) == ("gate-2", "event", 4, False)
    assert event["frame_count"] == 4 and len(event["frames"]) == 4  # --events-frames of the job's 5, spread
    assert [f["ts"] for f in event["frames"]] == [NOW + 10, NOW + 11, NOW + 13, NOW + 14]
    assert event["start_ts"] == NOW + 10 and event["end_ts"] == NOW + 14 and event["caption"]
    frame = http.get(event["frames"][0]["url"])
    assert frame.headers["content-type"] == "image/jpeg"
    assert max(Image.open(io.BytesIO(frame.content)).size) <= 320
    assert_error(http.get("/v1/events/event-1/frames/9"), 404, "index")
    assert_error(http.get("/v1/events/nope"), 404, "event_id")
    assert_error(http.get("/v1/events/" + "x" * 300), 404)


def test_a_redelivered_job_is_kept_once(http, redis_url):
    client = redis.Redis.from_url(redis_url)
    try:
        client.xadd(JOBS_STREAM, jobs()[0].to_fields())  # the same job id again, as a redelivery brings it
        wait_for(lambda: client.xlen(JOBS_STREAM) == 0, "the duplicate acknowledged")
    finally:
        client.close()
    assert ids(http.get("/v1/events")).count("sighting-1") == 1


def test_an_events_own_frames_make_it_first_of_its_similar(http):
    for event_id in ("sighting-1", "event-1", "fall-1"):
        found = http.get(f"/v1/events/{event_id}/similar").json()["data"]
        assert found[0]["id"] == event_id and found[0]["score"] == pytest.approx(1.0, abs=1e-4)
        assert [f["score"] for f in found] == sorted((f["score"] for f in found), reverse=True)
    frame = http.get("/v1/events/sighting-1/frames/0").content
    by_upload = http.post("/v1/events/similar", files={"image": ("f.jpg", frame, "image/jpeg")})
    assert ids(by_upload)[0] == "sighting-1"
    data_url = "data:image/jpeg;base64," + base64.b64encode(frame).decode()
    assert ids(http.post("/v1/events/similar", json={"image": data_url}))[0] == "sighting-1"
    assert ids(http.post("/v1/events/similar", params={"camera": "gate-2"}, json={"image": data_url})) == ["event-1"]


def test_an_events_vector_is_its_frames_embeddings_from_its_caption(server, http):
    """An event's vector is the mean of its kept frames' embeddings, each what POST /v1/embeddings gives for that
    frame as the job sent it: an event's frames (one encoder input each) from its caption's own encoder run, the
    writer running no tower for them; the sighting's and the fall's (whose captions tiled their image) from the
    tower."""
    memory = server.app.state.memory
    assert memory.frames_reused >= 4 and memory.frames_embedded >= 2  # event-1's 4 kept; the two tiled images
    sent = {job.job_id: job for job in jobs()}
    for event_id, kept in (("event-1", [sent["event-1"].frames[i].image for i in spread(5, 4)]),
                           ("sighting-1", [sent["sighting-1"].image])):
        urls = ["data:image/jpeg;base64," + base64.b64encode(frame).decode() for frame in kept]
        vectors = [d["embedding"] for d in http.post("/v1/embeddings", json={"input": urls}).json()["data"]]
        stored = memory.store.get(event_id).embedding
        assert max(abs(a - b) for a, b in zip(stored, mean_unit(vectors))) < 1e-6, event_id


def test_pages_follow_their_cursor(http):
    first = http.get("/v1/events", params={"limit": 2}).json()
    assert first["has_more"] and len(first["data"]) == 2
    second = http.get("/v1/events", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert [e["id"] for e in first["data"] + second["data"]] == ["fall-1", "event-1", "sighting-1"]
    assert second["next_cursor"] is None
    assert_error(http.get("/v1/events", params={"limit": 2, "cursor": first["next_cursor"], "fall": "true"}), 400,
                 "cursor")


@pytest.mark.parametrize("params, param", [
    ({"cursor": "garbage"}, "cursor"), ({"cursor": "x" * 2000}, "cursor"), ({"since": "yesterday"}, "since"),
    ({"since": "1e300"}, "since"), ({"since": "nan"}, "since"), ({"since": NOW + 50, "until": NOW}, "until"),
    ({"limit": 0}, "limit"), ({"limit": 100000}, "limit"), ({"kind": "party"}, "kind"), ({"q": "a" * 600}, "q"),
    ({"camera": "../../etc"}, "camera"), ({"camera": ["c"] * 65}, "camera"), ({"limit": "ten"}, "limit"),
])
def test_bad_filters_are_400_naming_them(http, params, param):
    assert_error(http.get("/v1/events", params=params), 400, param)


SIMILAR_BAD = [({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"limit": "ten"}, "limit"),
               ({"limit": "1e9"}, "limit"), ({"camera": "../../etc"}, "camera"), ({"camera": ["c"] * 65}, "camera"),
               ({"since": "yesterday"}, "since"), ({"until": "nan"}, "until"), ({"since": "-1"}, "since"),
               ({"since": NOW + 50, "until": NOW}, "until")]


@pytest.mark.parametrize("route", ["by-id", "by-upload-json", "by-upload-multipart"])
@pytest.mark.parametrize("params, param", SIMILAR_BAD)
def test_bad_filters_of_the_similar_routes_are_400_naming_them(http, route, params, param):
    """Before any event is read or image embedded: the filters of GET /v1/events/{id}/similar and POST
    /v1/events/similar answer 400 in OpenAI's error body naming the parameter (never 422 or 500)."""
    frame = jpeg(BUS, size=(64, 48))
    if route == "by-id":
        answer = http.get("/v1/events/sighting-1/similar", params=params)
    elif route == "by-upload-json":
        data_url = "data:image/jpeg;base64," + base64.b64encode(frame).decode()
        answer = http.post("/v1/events/similar", params=params, json={"image": data_url})
    else:
        answer = http.post("/v1/events/similar", params=params, files={"image": ("f.jpg", frame, "image/jpeg")})
    assert_error(answer, 400, param)


def test_similar_events_within_a_time_range(http):
    assert ids(http.get("/v1/events/event-1/similar", params={"since": NOW + 5, "until": NOW + 20})) == ["event-1"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 25))
    assert ids(http.get("/v1/events/sighting-1/similar", params={"since": iso})) == ["fall-1"]
    frame = http.get("/v1/events/sighting-1/frames/0").content
    found = ids(http.post("/v1/events/similar", params={"until": NOW + 1},
                          files={"image": ("f.jpg", frame, "image/jpeg")}))
    assert found == ["sighting-1"]


@pytest.mark.parametrize("q", ['"', "red OR", "NEAR(a b)", "caption:x", "* ) (", "'; DROP TABLE events; --",
                               "^a", "a\u0000b", "\U0001f642", "-", "AND", "{camera_id} : x"])
def test_full_text_syntax_in_a_query_is_only_words(http, q):
    answer = http.get("/v1/events", params={"q": q})
    assert answer.status_code == 200, answer.text


def test_hostile_uploads(http):
    big = jpeg(BUS, size=(2000, 2000)) + b"\0" * 200_000
    assert_error(http.post("/v1/events/similar", files={"image": ("f.jpg", big, "image/jpeg")}), 413, "image")
    assert_error(http.post("/v1/events/similar", files={"image": ("f.jpg", b"not an image", "image/jpeg")}), 400,
                 "image")
    assert_error(http.post("/v1/events/similar", json={"image": "%%%"}), 400, "image")
    assert_error(http.post("/v1/events/similar", content=b"x", headers={"content-type": "text/plain"}), 415)
    assert_error(http.post("/v1/embeddings", json={"input": "data:text/plain;base64,aGk="}), 400, "input")
    assert_error(http.post("/v1/embeddings", json={"input": []}), 400, "input")
    assert_error(http.post("/v1/embeddings", json={"input": ["a"] * 65}), 400, "input")
    assert_error(http.post("/v1/embeddings", json={"input": "a", "encoding_format": "int8"}), 400, "encoding_format")


def test_embeddings_in_openais_shape(server, http):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    answer = client.embeddings.create(model=model, input=["a person in a red coat", "a dog"])
    assert [d.index for d in answer.data] == [0, 1]
    size = len(answer.data[0].embedding)
    assert size > 0 and answer.data[0].embedding != answer.data[1].embedding
    assert sum(v * v for v in answer.data[0].embedding) == pytest.approx(1.0, rel=1e-4)
    assert answer.usage.prompt_tokens > 0
    frame = http.get("/v1/events/sighting-1/frames/0").content
    data_url = "data:image/jpeg;base64," + base64.b64encode(frame).decode()
    image = http.post("/v1/embeddings", json={"input": [data_url, "text", {"type": "image_url",
                                                                           "image_url": {"url": data_url}}]}).json()
    vectors = [d["embedding"] for d in image["data"]]
    assert vectors[0] == vectors[2] and len(vectors[0]) == size
    similar = http.get("/v1/events/sighting-1/similar").json()["data"]
    assert similar[0]["id"] == "sighting-1"
    as_base64 = client.embeddings.create(model=model, input="a dog", encoding_format="base64")
    decoded = struct.unpack(f"<{size}f", base64.b64decode(as_base64.data[0].embedding))  # little-endian float32
    assert decoded == pytest.approx(answer.data[1].embedding, abs=1e-6)
    assert_error(http.post("/v1/embeddings", json={"input": "a", "model": "other"}), 404, "model")


def test_a_second_server_on_the_store_and_each_key_sees_its_cameras(server, data_dir):
    """A second server on the same data directory (the first still running: WAL lets both in), with keys."""
    keyed = settings(data_dir, api_keys={"ward-a": "key-a", "ward-b": "key-b"}, api_key="admin-key",
                     events_key_cameras=("ward-a:gate-1",))
    with BackgroundServer(create_app(keyed)) as second:
        def seen(key: str, **params) -> list[str]:
            return ids(httpx.get(f"{second.url}/v1/events", params=params,
                                 headers={"Authorization": f"Bearer {key}"}, timeout=60))

        assert seen("admin-key") == ["fall-1", "event-1", "sighting-1"]
        assert seen("key-a") == ["fall-1", "sighting-1"]
        assert seen("key-a", camera="gate-2") == []
        assert seen("key-b") == []
        answer = httpx.get(f"{second.url}/v1/events/event-1", headers={"Authorization": "Bearer key-a"}, timeout=60)
        assert_error(answer, 404)
        similar = httpx.get(f"{second.url}/v1/events/sighting-1/similar", headers={"Authorization": "Bearer key-a"},
                            timeout=60)
        assert "event-1" not in ids(similar)
        assert_error(httpx.get(f"{second.url}/v1/events", timeout=60), 401)


# -- the dashboard in Chromium ------------------------------------------------------------------------------
from tests.api.test_dashboard import browser, page, wait_until_loaded  # noqa: E402, F401 (fixtures)


def test_the_dashboard_searches_events_and_shows_an_events_page(server, http, page):  # noqa: F811
    from playwright.sync_api import expect

    page.goto(server.url)
    items = page.locator("#events > li")
    expect(items).to_have_count(3)  # the newest events, on arrival
    page.fill("#events-q", "gate-2")  # a structured field's word: the camera
    page.click("#events-search")
    expect(items).to_have_count(1)
    expect(items.first).to_have_attribute("data-id", "event-1")
    page.fill("#events-q", "")
    page.check("#events-fall")
    page.click("#events-search")
    expect(items).to_have_count(1)
    expect(items.first).to_have_attribute("data-id", "fall-1")
    page.uncheck("#events-fall")
    page.fill("#events-q", '"NEAR( <b>x</b>')  # syntax and markup are words: no match, no error
    page.click("#events-search")
    expect(page.locator("#events-empty")).to_be_visible()

    page.goto(f"{server.url}/#event=event-1")  # the event's page, by its address
    dialog = page.locator("#event-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#event-title")).to_have_text("Event at gate-2")
    expect(page.locator("#event-caption")).to_have_text(http.get("/v1/events/event-1").json()["caption"])
    frames = page.locator("#event-frames img")
    expect(frames).to_have_count(4)
    for index in range(4):
        wait_until_loaded(frames.nth(index))
    similar = page.locator("#event-similar > li")
    expect(similar.first).to_have_attribute("data-id", "event-1")  # its own frames: first of its similar
    expect(similar.first).to_have_class("event-item current")
    expect(page.locator("#event-timeline > li.current")).to_have_attribute("data-id", "event-1")
    page.locator("#event-similar > li[data-id='sighting-1']").click()  # a similar event opens its page
    expect(page.locator("#event-title")).to_have_text("Event at gate-1")
    expect(page.locator("#event-timeline > li")).to_have_count(2)  # gate-1's sighting and fall
    page.click("#event-close")
    expect(dialog).to_be_hidden()
