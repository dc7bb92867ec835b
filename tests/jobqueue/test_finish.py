"""One finish path (jobqueue/finish.py) for the three writers: the queue worker, the REST store and a job dropped
by backpressure each leave the same thing behind: the result with Redis's `finished_at`, the result TTL, and an
entry on the caption feeds (the camera's too)."""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis

from api.caption_store import RedisCaptionStore
from jobqueue.consumer import QueueWorker
from jobqueue.contract import (
    ALERTS_STREAM,
    CAPTIONS_STREAM,
    CONSUMER_GROUP,
    JOBS_STREAM,
    RESULT_TTL_SECONDS,
    CaptionResult,
    JobStatus,
    camera_captions_stream,
    result_key,
)
from jobqueue.producer import DROPPED_ERROR, Backpressure
from tests.queue_support import DecodingCaptioner, enqueue, make_job, work_until_idle


def finished(client: redis.Redis, job_id: str, camera: str) -> dict[str, str]:
    """The stored result, checked to be finished the one way: TTL, Redis's clock, on both feeds."""
    fields = {k.decode(): v.decode() for k, v in client.hgetall(result_key(job_id)).items()}
    assert fields["status"] in (JobStatus.DONE.value, JobStatus.FAILED.value)
    assert RESULT_TTL_SECONDS - 60 < client.ttl(result_key(job_id)) <= RESULT_TTL_SECONDS
    seconds, micros = client.time()
    assert 0 <= seconds + micros / 1e6 - float(fields["finished_at"]) < 60  # Redis's clock, not the writer's
    for feed in (CAPTIONS_STREAM, camera_captions_stream(camera)):
        ids = [f[b"id"].decode() for _, f in client.xrange(feed)]
        assert ids.count(job_id) == 1, feed
    return fields


def test_the_worker_the_rest_store_and_a_dropped_job_finish_the_same_way(redis_url):
    client = redis.Redis.from_url(redis_url)
    # A dropped job: drop-oldest with room for one, a worker group that has read nothing.
    client.xgroup_create(JOBS_STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    dropped, kept = make_job("cam-a"), make_job("cam-a")
    enqueue(redis_url, [dropped, kept], stream_maxlen=1, backpressure=Backpressure.DROP_OLDEST)
    assert finished(client, dropped.job_id, "cam-a")["error"] == DROPPED_ERROR

    async def work_and_store() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)
        await worker.redis.aclose()
        rest = CaptionResult(id="rest-1", status=JobStatus.DONE.value, camera_id="cam-b", created_at=time.time(),
                             frame_ts=0.0, person_count=1, caption="two people", finished_at=0.0)
        async_client = aioredis.Redis.from_url(redis_url)
        await RedisCaptionStore(async_client).finish(rest)
        await async_client.aclose()

    asyncio.run(work_and_store())
    assert finished(client, kept.job_id, "cam-a")["status"] == JobStatus.DONE.value
    assert finished(client, "rest-1", "cam-b")["caption"] == "two people"
    assert client.xlen(ALERTS_STREAM) == 0  # none was a fall alert
    client.close()


def test_a_fall_alerts_result_also_reaches_the_alerts_feed(redis_url):
    job = make_job("cam-f")
    job.fall = True
    enqueue(redis_url, [job])

    async def work() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)
        await worker.redis.aclose()

    asyncio.run(work())
    client = redis.Redis.from_url(redis_url)
    finished(client, job.job_id, "cam-f")
    assert [f[b"id"].decode() for _, f in client.xrange(ALERTS_STREAM)] == [job.job_id]
    client.close()
