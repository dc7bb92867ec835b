"""Structured captions: a camera job (or a REST upload) carries a JSON schema, the server's queue worker decodes
under it on its own engine (tiny random-weight model, so only the constraint makes the caption valid) and stores
the parsed object as `structured` beside the text, in the result, the feeds and the SSE stream; a job whose
schema cannot be used, or whose caption does not parse, is dead-lettered saying why."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import jsonschema_rs
import pytest
import redis
from test_api_captions import BUS, PROMPT, next_caption_event, poll

from api.background import BackgroundServer
from api.server import create_app
from api.settings import ServerSettings
from cli.camera import read_caption_schema
from engine import EngineConfig
from jobqueue.contract import DEAD_STREAM, CaptionResult, Detection, Job
from jobqueue.producer import JobProducer

pytest.importorskip("xgrammar")

SAMPLE_SCHEMA_PATH = Path(__file__).resolve().parents[2] / "samples" / "caption.schema.json"
SAMPLE_SCHEMA = json.loads(SAMPLE_SCHEMA_PATH.read_text())


@pytest.fixture(scope="module")
def server(module_redis_url):
    settings = ServerSettings(engine=EngineConfig(model="tiny"), redis_url=module_redis_url, caption_max_tokens=6,
                              max_deliveries=1, claim_idle_seconds=0.5)
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


def camera_job(camera_id: str, schema: dict | None) -> Job:
    return Job(camera_id=camera_id, frame_ts=3.0, prompt=PROMPT, image=BUS,
               detections=[Detection(10, 20, 110, 220, 0.9)], schema=schema)


def test_the_sample_schema_is_a_valid_bounded_json_schema():
    assert read_caption_schema(SAMPLE_SCHEMA_PATH) == SAMPLE_SCHEMA
    assert set(SAMPLE_SCHEMA["required"]) == {"people_count", "people", "anyone_on_ground", "summary"}


def test_a_job_schema_travels_in_the_job_entry():
    job = camera_job("cam", SAMPLE_SCHEMA)
    assert Job.from_fields(job.to_fields()).schema == SAMPLE_SCHEMA
    assert "schema" not in camera_job("cam", None).to_fields()  # older workers see the entries they know
    fields = {**job.to_fields(), "schema": "[1, 2]"}
    with pytest.raises(ValueError, match="schema must be a JSON object"):
        Job.from_fields(fields)


def test_camera_job_with_a_schema_gets_a_valid_structured_caption_in_result_feed_and_stream(
        module_redis_url, server, http):
    with http.stream("GET", "/v1/captions/stream", params={"camera": "yard"}) as events:
        lines = events.iter_lines()
        assert next(lines) == ": connected"
        producer = JobProducer(module_redis_url)
        job = camera_job("yard", SAMPLE_SCHEMA)
        producer.submit(job)
        producer.close()
        _, streamed = next_caption_event(lines)
    result = poll(http, job.job_id)
    assert result["status"] == "done", result
    jsonschema_rs.validate(SAMPLE_SCHEMA, result["structured"])
    assert json.loads(result["caption"]) == result["structured"]
    assert streamed["structured"] == result["structured"]
    listed = http.get("/v1/captions", params={"camera": "yard"}).json()["data"]
    assert listed[0]["structured"] == result["structured"]


def test_a_job_whose_schema_cannot_compile_is_dead_lettered_saying_why(module_redis_url, server, http):
    producer = JobProducer(module_redis_url)
    job = camera_job("yard-bad", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5,
                                                                        "maximum": 1}}})
    producer.submit(job)
    producer.close()
    result = poll(http, job.job_id)
    assert result["status"] == "failed" and result["structured"] is None
    assert "could not be compiled" in result["error"], result["error"]
    client = redis.Redis.from_url(module_redis_url)
    try:
        dead = [fields for _, fields in client.xrange(DEAD_STREAM) if fields[b"job_id"] == job.job_id.encode()]
    finally:
        client.close()
    assert len(dead) == 1 and b"could not be compiled" in dead[0][b"error"]


def test_rest_upload_with_a_schema_json_and_multipart(http):
    image = "data:image/jpeg;base64," + base64.b64encode(BUS).decode()
    by_json = http.post("/v1/captions?wait=true", json={"image": image, "schema": SAMPLE_SCHEMA}).json()
    assert by_json["status"] == "done", by_json
    jsonschema_rs.validate(SAMPLE_SCHEMA, by_json["structured"])
    by_form = http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS)},
                        data={"schema": json.dumps(SAMPLE_SCHEMA)}).json()
    assert by_form["structured"] == by_json["structured"]  # greedy: same image, same schema, same answer


def test_rest_caption_cut_at_max_tokens_fails_saying_so(http):
    cut = http.post("/v1/captions?wait=true", files={"image": ("bus.jpg", BUS)},
                    data={"schema": json.dumps(SAMPLE_SCHEMA), "max_tokens": "3"}).json()
    assert cut["status"] == "failed" and "cut at max_tokens" in cut["error"], cut


@pytest.mark.parametrize("schema,status,message", [
    ("{not json", 400, "schema is not valid JSON"),
    (json.dumps({"type": "string", "minLength": 4, "maxLength": 2}), 400, "could not be compiled"),
])
def test_rest_upload_with_an_unusable_schema_is_refused(http, schema, status, message):
    reply = http.post("/v1/captions", files={"image": ("bus.jpg", BUS)}, data={"schema": schema})
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]


def test_caption_result_round_trips_structured():
    result = CaptionResult(id="a", status="done", camera_id="c", created_at=1.0, frame_ts=2.0, person_count=1,
                           caption='{"n": 1}', structured={"n": 1})
    assert CaptionResult.from_fields(result.to_fields()) == result


def test_bad_caption_schema_files_are_named(tmp_path):
    path = tmp_path / "schema.json"
    for text, message in [("{x", "not valid JSON"), ("[1]", "must be a JSON object"),
                          ('{"type": 5}', "not a valid JSON Schema")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_caption_schema(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_caption_schema(tmp_path / "missing.json")


def test_the_openai_captioner_asks_for_the_schema_over_http(redis_url, server):
    """`vlmcap worker`'s path: the job's schema goes to the server as response_format."""
    from queue_support import caption_remotely

    job = camera_job("remote", SAMPLE_SCHEMA)
    result = caption_remotely(redis_url, server.url, server.state.settings.model_name, job)
    assert result.status == "done", result.error
    jsonschema_rs.validate(SAMPLE_SCHEMA, result.structured)
