"""Camera summaries on a real server (tiny random model, real Redis): a window's captions and events become one
text prompt, decoded under the summary schema (grammar-constrained, so even random weights answer valid JSON),
cached per window; a window without captions answers an empty summary; with `summary_every` one summary per
camera and interval lands on `vlmcap:summaries:<camera>`."""

from __future__ import annotations

import json
import threading
import time

import cv2
import httpx
import jsonschema_rs
import numpy as np
import pytest
import redis

from api.background import BackgroundServer
from api.routes_summaries import SUMMARY_SCHEMA, caption_line, evenly, merged_lines, summary_prompt
from api.server import create_app
from api.settings import ServerSettings, parse_duration
from engine import EngineConfig
from jobqueue.contract import CaptionResult, Detection, Job, JobImage, camera_captions_stream, summaries_stream
from jobqueue.producer import JobProducer


def _jpeg(shade: int) -> bytes:
    return cv2.imencode(".jpg", np.full((48, 64, 3), shade, np.uint8))[1].tobytes()


@pytest.fixture(scope="module")
def server(module_redis_url):
    settings = ServerSettings(engine=EngineConfig(model="tiny"), caption_max_tokens=6, redis_url=module_redis_url,
                              summary_every="1s")
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.mark.timeout(300)
def test_summary_of_a_window_validates_is_cached_and_appended_periodically(server, module_redis_url):
    producer = JobProducer(module_redis_url)
    box = [Detection(1, 2, 30, 40, 0.9, 7, "person")]
    producer.submit(Job("yard", 1.0, "Who is there?", _jpeg(90), box, track_id=7))
    producer.submit(Job.of_frames("yard", "What did person 7 do?",
                                  [JobImage(_jpeg(90 + 20 * i), 1.0 + i, f"t=+{i}.0 s: person 7", box)
                                   for i in range(3)], kind="event", track_id=7))
    producer.close()
    with httpx.Client(base_url=server.url, timeout=240) as http:
        deadline = time.monotonic() + 240
        while len(http.get("/v1/captions", params={"camera": "yard"}).json()["data"]) < 2:
            assert time.monotonic() < deadline, "captions did not arrive"
            time.sleep(0.2)
        captions = http.get("/v1/captions", params={"camera": "yard"}).json()["data"]
        assert sorted(c["kind"] for c in captions) == ["event", "sighting"]
        event = next(c for c in captions if c["kind"] == "event")
        assert (event["track_id"], event["start_ts"], event["end_ts"], event["frame_count"]) == (7, 1.0, 3.0, 3)
        with http.stream("GET", "/v1/captions/stream", params={"camera": "yard"},
                         headers={"Last-Event-ID": "0"}) as stream:  # the SSE stream carries the same fields
            data = next(line for line in stream.iter_lines() if line.startswith("data: "))
        streamed = json.loads(data[len("data: "):])
        assert {k: streamed[k] for k in ("kind", "track_id", "start_ts", "end_ts", "frame_count")} in (
            {k: c[k] for k in ("kind", "track_id", "start_ts", "end_ts", "frame_count")} for c in captions)

        first = http.post("/v1/cameras/yard/summary", json={"window_s": 600})
        assert first.status_code == 200, first.text
        answer = first.json()
        assert (answer["captions"], answer["empty"], answer["cached"]) == (2, False, False)
        jsonschema_rs.validate(SUMMARY_SCHEMA, answer["summary"])
        window = {"start": answer["start"], "end": answer["end"]}
        again = http.post("/v1/cameras/yard/summary", json=window).json()
        assert again["cached"] and again["summary"] == answer["summary"]

        empty = http.post("/v1/cameras/nobody/summary").json()
        assert empty["empty"] and empty["captions"] == 0 and empty["summary"]["notable_events"] == []
        jsonschema_rs.validate(SUMMARY_SCHEMA, empty["summary"])
        bad = http.post("/v1/cameras/yard/summary", json={"start": 10.0, "end": 5.0})
        assert bad.status_code == 400 and "before it starts" in bad.json()["error"]["message"]
        too_long = http.post("/v1/cameras/yard/summary", json={"start": 0.0, "end": 1e9})
        assert too_long.status_code == 400 and "over the limit of 604800 s" in too_long.json()["error"]["message"]
        assert http.post("/v1/cameras/yard/summary", json={"window_s": -5}).status_code == 400
        assert http.post("/v1/cameras/no%20such/summary").status_code == 400

        client = redis.Redis.from_url(module_redis_url)
        while client.xlen(summaries_stream("yard")) == 0:
            assert time.monotonic() < deadline, "no periodic summary"
            time.sleep(0.2)
        client.close()
        periodic = http.get("/v1/cameras/yard/summaries", params={"limit": 1}).json()["data"]
        assert len(periodic) == 1 and periodic[0]["camera_id"] == "yard"
        jsonschema_rs.validate(SUMMARY_SCHEMA, periodic[0]["summary"])


def test_summary_prompt_lists_captions_oldest_first_with_kind_person_and_span():
    results = [CaptionResult("a", "done", "yard", 3600.0, 1.0, 1, caption="a person walks", kind="event",
                             track_id=3, start_ts=1.0, end_ts=5.2, frame_count=6),
               CaptionResult("b", "done", "yard", 3605.0, 9.0, 1, structured={"title": "x"}, kind="fall")]
    assert caption_line(results[0]) == "01:00:00 event person 3 (4.2 s, 6 frames): a person walks"
    assert caption_line(results[1]) == '01:00:05 fall: {"title": "x"}'
    prompt = summary_prompt("yard", 3600.0, 7200.0, results)
    assert prompt.startswith("Camera yard, 01:00:00 to 02:00:00 UTC.") and prompt.index("walks") < prompt.index("x")


def test_durations_and_bad_settings_are_named():
    assert [parse_duration(t) for t in ("90", "90s", "15m", "2h", "1d")] == [90, 90, 900, 7200, 86400]
    with pytest.raises(ValueError, match="got '15 minutes'"):
        ServerSettings(engine=EngineConfig(model="tiny"), summary_every="15 minutes")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body", ['{"start": NaN}', '{"end": Infinity}', '{"start": -Infinity, "end": 5}',
                                  '{"window_s": NaN}'])
def test_a_window_bound_that_is_not_finite_is_refused_beside_a_plain_window(server, body):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        refused = http.post("/v1/cameras/quiet/summary", content=body, headers={"Content-Type": "application/json"})
        assert 400 <= refused.status_code < 500, refused.text
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        plain = http.post("/v1/cameras/quiet/summary", json={"window_s": 60})
        assert plain.status_code == 200 and plain.json()["empty"] is True


def test_near_identical_captions_in_a_row_merge_with_their_count_and_sampling_keeps_the_ends():
    def result(n: int, caption: str) -> CaptionResult:
        return CaptionResult(f"r{n}", "done", "yard", 3600.0 + n, 1.0, 1, caption=caption, kind="sighting")

    results = [result(0, "The yard is empty."), result(1, "the yard  is EMPTY."), result(2, "the yard is empty."),
               result(3, "A dog runs."), result(4, "The yard is empty.")]
    lines = merged_lines(results)
    assert len(lines) == 3 and lines[0].endswith("[x3, until 01:00:02]") and "dog" in lines[1]
    assert "[x" not in lines[2]
    assert evenly(list("abcdefghij"), 4) == ["a", "d", "g", "j"] and evenly(list("abc"), 5) == list("abc")


@pytest.mark.timeout(600)
def test_a_window_of_ten_thousand_captions_is_condensed_and_answers_beside_a_chat(server, module_redis_url):
    client = redis.Redis.from_url(module_redis_url)
    now = time.time()
    pipe = client.pipeline(transaction=False)
    for n in range(10_000):  # runs of a quiet yard between 5,000 different sightings, oldest first
        caption = f"Person {n} crosses the yard carrying box {n}." if n % 2 else "The yard is quiet."
        result = CaptionResult(f"crowd-{n}", "done", "crowd", now - 3000 + n * 0.25, 1.0, 1, caption=caption,
                               finished_at=now, kind="sighting")
        pipe.xadd(camera_captions_stream("crowd"), result.to_fields())
    pipe.execute()
    client.close()
    answers: dict[str, httpx.Response] = {}

    def post(name: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=server.url, timeout=500) as http:
            answers[name] = http.post(path, json=body)

    summary = threading.Thread(target=post, args=("summary", "/v1/cameras/crowd/summary", {"window_s": 3600}))
    summary.start()
    post("chat", "/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "hello"}]})
    summary.join(500)
    assert answers["chat"].status_code == 200, answers["chat"].text
    assert answers["summary"].status_code == 200, answers["summary"].text
    answer = answers["summary"].json()
    assert (answer["captions"], answer["empty"]) == (10_000, False)
    jsonschema_rs.validate(SUMMARY_SCHEMA, answer["summary"])


@pytest.mark.timeout(300)
def test_a_checkpoint_without_a_chat_template_summarizes_within_a_small_context(redis_url, tmp_path):
    from engine.presets import preset_checkpoint, reshape_checkpoint

    bare = str(reshape_checkpoint(preset_checkpoint("tiny"), tmp_path, "no_chat_template"))
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    for n in range(300):
        client.xadd(camera_captions_stream("porch"), CaptionResult(
            f"porch-{n}", "done", "porch", now - 600 + n, 1.0, 1, caption=f"A visitor number {n} rings the bell.",
            finished_at=now, kind="sighting").to_fields())
    client.close()
    settings = ServerSettings(engine=EngineConfig(model=bare, max_model_len=2048), redis_url=redis_url,
                              run_queue_worker=False)  # 768 summary tokens leave the prompt 1280
    with BackgroundServer(create_app(settings)) as running, httpx.Client(base_url=running.url, timeout=240) as http:
        answer = http.post("/v1/cameras/porch/summary", json={"window_s": 900})
        assert answer.status_code == 200, answer.text  # its prompt condensed, through plain_prompt
        assert answer.json()["captions"] == 300
        jsonschema_rs.validate(SUMMARY_SCHEMA, answer.json()["summary"])
