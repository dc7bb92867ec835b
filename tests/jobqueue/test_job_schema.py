"""The job contract written down for other producers, jobqueue/job.schema.json, holds to the code: every
field the producer writes is described, the entries a real camera pipeline writes and the results a real
worker writes validate against it, its Redis names are the contract's, and entries it refuses are
dead-lettered by the worker's own check."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from jsonschema import Draft202012Validator
from queue_support import DecodingCaptioner, enqueue, make_job, work_until_idle

from jobqueue import contract
from jobqueue.consumer import QueueWorker
from jobqueue.contract import CAPTIONS_STREAM, JOBS_STREAM, CaptionResult, Job, result_key
from pipeline.runner import CameraPipeline, PipelineConfig


def _refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object_pairs_hook: json.loads keeps the last of repeated keys silently, a reader of the file would
    not know which one holds."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"repeated keys {repeated}")
    return dict(pairs)


SCHEMA = json.loads(contract.JOB_SCHEMA_PATH.read_text(), object_pairs_hook=_refuse_repeated_keys)
Draft202012Validator.check_schema(SCHEMA)
ENTRY = Draft202012Validator(SCHEMA)
RESULT = Draft202012Validator({"$defs": SCHEMA["$defs"], "$ref": "#/$defs/result"})
# The fields holding JSON, each with the schema of its content (a validator only annotates those).
CONTENT = {name: Draft202012Validator({"$defs": SCHEMA["$defs"], **spec["contentSchema"]})
           for name, spec in SCHEMA["properties"].items() if "contentSchema" in spec}


def schema_errors(fields: dict) -> list[str]:
    """The entry's errors against the schema, its JSON fields checked against their content schemas."""
    entry = {k.decode(): v.decode("latin-1") if contract.is_image_field(k.decode()) else v.decode()
             for k, v in fields.items()}
    errors = [e.message for e in ENTRY.iter_errors(entry)]
    for name, validator in CONTENT.items():
        if name in entry:
            try:
                errors += [f"{name}: {e.message}" for e in validator.iter_errors(json.loads(entry[name]))]
            except ValueError as err:
                errors.append(f"{name}: {err}")
    return errors


def test_schema_repeats_no_key():
    with pytest.raises(ValueError, match="repeated keys"):
        json.loads('{"a": {"b": 1, "b": 2}}', object_pairs_hook=_refuse_repeated_keys)
    json.loads(contract.JOB_SCHEMA_PATH.read_text(), object_pairs_hook=_refuse_repeated_keys)


def test_schema_names_the_contracts_keys_and_describes_every_field():
    assert SCHEMA["x-redis"] == {
        "jobs_stream": contract.JOBS_STREAM, "consumer_group": contract.CONSUMER_GROUP,
        "dead_letter_stream": contract.DEAD_STREAM, "result_key_prefix": contract.RESULT_KEY_PREFIX,
        "captions_feed": contract.CAPTIONS_STREAM, "camera_feed_prefix": contract.camera_captions_stream(""),
        "alerts_feed": contract.ALERTS_STREAM,
    }
    job = make_job()
    job.fall, job.schema, job.cache_salt = True, {"type": "object"}, "tenant-1"
    assert set(job.to_fields()) <= set(SCHEMA["properties"]), "document new job fields in job.schema.json"
    result = job.queued_result()
    result.caption, result.error, result.finished_at, result.consumer = "c", "e", 1.0, "w"
    result.structured = {"people": 1}
    result_fields = set(result.to_fields()) | {"started_at"}
    assert result_fields <= set(SCHEMA["$defs"]["result"]["properties"]), "document new result fields"


@pytest.mark.timeout(120)
def test_real_producer_entries_and_worker_results_validate(redis_url, sample_video):
    CameraPipeline(PipelineConfig(source=str(sample_video), camera_id="schema-cam", redis_url=redis_url,
                                  detector="hog")).run()
    crop = make_job("schema-crop")
    crop.image_origin, crop.fall = (5, 7), True
    enqueue(redis_url, [crop])
    client = redis.Redis.from_url(redis_url)
    entries = [fields for _, fields in client.xrange(JOBS_STREAM)]
    assert len(entries) >= 2
    for fields in entries:
        assert schema_errors(fields) == []
        Job.from_fields(fields)  # and the worker's check agrees

    async def work() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)
        await worker.redis.aclose()

    asyncio.run(work())
    feed = [fields for _, fields in client.xrange(CAPTIONS_STREAM)]
    job_ids = [Job.from_fields(f).job_id for f in entries]
    stored = [client.hgetall(result_key(job_id)) for job_id in job_ids]
    for fields in feed + stored:
        result = {k.decode(): v.decode() for k, v in fields.items()}
        assert [e.message for e in RESULT.iter_errors(result)] == []
        assert CaptionResult.from_fields(fields).status == "done"
    client.close()


BAD = [
    {"frame_ts": "nan"},
    {"detections": '[{"x1": "a", "y1": 1, "x2": 2, "y2": 3, "confidence": 0.5}]'},
    {"image_origin": "[1, 2, 3]"},
    {"fall": "maybe"},
    {"job_id": ""},
    {"schema": "[1, 2]"},
    {"cache_salt": ""},
    {"cache_salt": "s" * 257},
]


@pytest.mark.parametrize("override", BAD, ids=[next(iter(b)) for b in BAD])
def test_entries_the_schema_refuses_the_worker_refuses(override):
    fields = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in make_job().to_fields().items()}
    assert schema_errors(fields) == []
    bad = {**fields, **{k.encode(): v.encode() for k, v in override.items()}}
    assert schema_errors(bad) != []
    with pytest.raises(ValueError):
        Job.from_fields(bad)
