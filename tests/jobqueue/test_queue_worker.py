"""The queue worker on a real Redis: every job ends in exactly one caption or one dead-letter entry;
redelivery never captions twice; a poison job is dead-lettered after N attempts while the queue goes on;
backpressure; the results reader API; the OpenAI-compatible captioner over HTTP."""

from __future__ import annotations

import asyncio

import pytest
import redis
from queue_support import ChatServer, DecodingCaptioner, enqueue, make_job, work_until_idle

from jobqueue.consumer import QueueWorker
from jobqueue.contract import (
    CAPTIONS_STREAM,
    CONSUMER_GROUP,
    DEAD_STREAM,
    JOBS_STREAM,
    Job,
    dead_letter_fields,
    result_key,
)
from jobqueue.openai_captioner import OpenAICaptioner
from jobqueue.producer import DROPPED_ERROR, Backpressure
from jobqueue.results import get_result, queue_stats, recent_captions, tail_captions

pytestmark = pytest.mark.timeout(60)


def test_every_job_gets_exactly_one_caption_and_results_are_readable(redis_url):
    jobs = [make_job("north", width=64 + i) for i in range(3)] + [make_job("south", width=80)]
    assert enqueue(redis_url, jobs).stats.enqueued == 4

    async def scenario() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        queued = await get_result(worker.redis, jobs[0].job_id)
        assert queued.status == "queued" and queued.caption is None
        await work_until_idle(worker)
        assert worker.stats.done == 4
        widths = {job.job_id: 64 + i for i, job in enumerate(jobs[:3])} | {jobs[3].job_id: 80}
        for job in jobs:
            result = await get_result(worker.redis, job.job_id)
            assert result.status == "done"
            assert result.caption == f"{widths[job.job_id]}x48: who is at {job.camera_id}?"
            assert (result.camera_id, result.person_count, result.frame_ts) == (job.camera_id, 1, 1.5)
            assert result.finished_at >= result.created_at
            assert result.consumer == worker.consumer_name
        north = await recent_captions(worker.redis, camera="north", limit=10)
        assert sorted(r.id for r in north) == sorted(job.job_id for job in jobs[:3])
        finished = [r.finished_at for r in north]
        assert finished == sorted(finished, reverse=True)  # newest first
        assert len(await recent_captions(worker.redis)) == 4
        assert await recent_captions(worker.redis, limit=2) == (await recent_captions(worker.redis))[:2]
        assert await queue_stats(worker.redis) == {"backlog": 0, "pending": 0, "dead": 0}
        assert await get_result(worker.redis, "no-such-job") is None
        await worker.redis.aclose()

    asyncio.run(scenario())


def test_redelivered_job_yields_no_second_caption(redis_url):
    job = make_job()
    enqueue(redis_url, [job])
    client = redis.Redis.from_url(redis_url)

    async def scenario() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)
        # The same job arrives again, e.g. re-added by hand or by a producer that lost its reply.
        client.xadd(JOBS_STREAM, job.to_fields())
        await work_until_idle(worker)
        assert (worker.stats.done, worker.stats.duplicates) == (1, 1)
        await worker.redis.aclose()

    asyncio.run(scenario())
    assert client.xlen(CAPTIONS_STREAM) == 1
    assert client.xlen(DEAD_STREAM) == 0
    # A producer re-sending a job it already enqueued is a no-op too.
    assert enqueue(redis_url, [job]).stats.enqueued == 0
    assert client.xlen(JOBS_STREAM) == 0
    client.close()


def test_poison_job_is_dead_lettered_after_max_deliveries_and_the_queue_goes_on(redis_url):
    poison = make_job("cam", image=b"this is not a jpeg")
    good = [make_job("cam", width=70), make_job("cam", width=71)]
    enqueue(redis_url, [good[0], poison, good[1]])

    async def scenario() -> None:
        captioner = DecodingCaptioner()
        worker = QueueWorker(redis_url, captioner, claim_idle_seconds=0, max_deliveries=3, block_seconds=0.1)
        await work_until_idle(worker)
        assert captioner.calls == 2 + 3  # the good ones once, the poison one three times
        assert (worker.stats.done, worker.stats.dead, worker.stats.failed_attempts) == (2, 1, 3)
        failed = await get_result(worker.redis, poison.job_id)
        assert failed.status == "failed" and failed.deliveries == 3
        assert "UndecodableImage" in failed.error
        for job in good:
            assert (await get_result(worker.redis, job.job_id)).status == "done"
        await worker.redis.aclose()

    asyncio.run(scenario())
    client = redis.Redis.from_url(redis_url)
    dead = client.xrange(DEAD_STREAM)
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"job_id"].decode() == poison.job_id
    assert fields[b"image"] == b"this is not a jpeg"
    assert fields[b"deliveries"] == b"3" and b"UndecodableImage" in fields[b"error"]
    assert client.xlen(JOBS_STREAM) == 0
    client.close()


def test_entry_that_is_not_a_job_is_dead_lettered_at_once(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.xadd(JOBS_STREAM, {"camera_id": "x", "garbage": "1"})

    async def scenario() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)
        assert worker.stats.dead == 1
        await worker.redis.aclose()

    asyncio.run(scenario())
    (_, fields), = client.xrange(DEAD_STREAM)
    assert b"lacks field" in fields[b"error"] and fields[b"garbage"] == b"1"
    client.close()


def test_skip_new_backpressure_keeps_the_queue_at_its_limit(redis_url):
    producer = enqueue(redis_url, [make_job() for _ in range(5)], stream_maxlen=3)
    assert (producer.stats.enqueued, producer.stats.skipped_backpressure) == (3, 2)
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(JOBS_STREAM) == 3
    client.close()


def test_drop_oldest_backpressure_dead_letters_only_unread_jobs(redis_url):
    first = [make_job(frame_ts=float(i)) for i in range(3)]
    enqueue(redis_url, first, stream_maxlen=3)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(JOBS_STREAM, CONSUMER_GROUP, id="0")
    client.xreadgroup(CONSUMER_GROUP, "busy", {JOBS_STREAM: ">"}, count=1)  # first[0] is being captioned
    later = [make_job(frame_ts=10.0 + i) for i in range(3)]
    producer = enqueue(redis_url, later, stream_maxlen=3, backpressure=Backpressure.DROP_OLDEST)
    assert (producer.stats.enqueued, producer.stats.dropped_backpressure) == (3, 3)

    in_stream = [Job.from_fields(f).job_id for _, f in client.xrange(JOBS_STREAM)]
    dead = [f[b"job_id"].decode() for _, f in client.xrange(DEAD_STREAM)]
    assert in_stream[0] == first[0].job_id  # the job being read was not pulled away
    assert sorted(dead) == sorted([first[1].job_id, first[2].job_id, later[0].job_id])
    # Every job is in exactly one place.
    assert sorted(in_stream + dead) == sorted(j.job_id for j in first + later)
    assert client.hget(result_key(first[1].job_id), "status") == b"failed"
    # The enqueue script writes the dead-letter fields the contract defines, nothing spelled on its own.
    for _, fields in client.xrange(DEAD_STREAM):
        assert set(dead_letter_fields({}, DROPPED_ERROR, 0)) <= {name.decode() for name in fields}
        assert (fields[b"error"], fields[b"deliveries"]) == (DROPPED_ERROR.encode(), b"0")
        assert Job.from_fields(fields).job_id in dead
    client.close()


def test_tail_captions_yields_new_results_as_they_finish(redis_url):
    enqueue(redis_url, [make_job("a")])

    async def scenario() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), block_seconds=0.1)
        await work_until_idle(worker)  # this one finished before the tail started: not yielded
        jobs = [make_job("a"), make_job("b")]
        tail = tail_captions(worker.redis, block_seconds=0.2)
        first = asyncio.ensure_future(tail.__anext__())
        # The tail has taken its starting point once it blocks in XREAD (nothing else here blocks).
        while (await worker.redis.info("clients"))["blocked_clients"] < 1:
            await asyncio.sleep(0.01)
        enqueue(redis_url, jobs)
        await work_until_idle(worker)
        got = [(await first)[1].id, (await tail.__anext__())[1].id]
        assert sorted(got) == sorted(j.job_id for j in jobs)
        only_b = tail_captions(worker.redis, camera="b", after="0-0", block_seconds=0.2)
        assert (await only_b.__anext__())[1].id == jobs[1].job_id
        await tail.aclose()
        await only_b.aclose()
        await worker.redis.aclose()

    asyncio.run(scenario())


def test_openai_captioner_over_http_with_priority(redis_url):
    server = ChatServer()
    try:
        enqueue(redis_url, [make_job("web", width=90), make_job("web", image=b"\x00broken")])

        async def scenario() -> None:
            captioner = OpenAICaptioner(server.url.removesuffix("/v1"), model="m")
            worker = QueueWorker(redis_url, captioner, claim_idle_seconds=0, max_deliveries=1, caption_priority=7,
                                 block_seconds=0.1)
            await work_until_idle(worker)
            done, dead = sorted(await recent_captions(worker.redis), key=lambda r: r.status)
            assert done.caption == "90x48: who is at web?"
            assert dead.status == "failed" and "invalid image" in dead.error
            await captioner.aclose()
            await worker.redis.aclose()

        asyncio.run(scenario())
        assert server.priorities == [7, 7]
    finally:
        server.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_deliveries": 0}, "max_deliveries"),
    ({"claim_idle_seconds": -1}, "claim_idle_seconds"),
    ({"batch_size": 0}, "batch_size"),
])
def test_bad_worker_settings_are_named(redis_url, kwargs, message):
    with pytest.raises(ValueError, match=message):
        QueueWorker(redis_url, DecodingCaptioner(), **kwargs)


def test_bad_vlm_url_is_named():
    with pytest.raises(ValueError, match="ftp://x"):
        OpenAICaptioner("ftp://x")


def test_job_whose_consumers_keep_dying_is_dead_lettered_without_another_attempt(redis_url):
    job = make_job()
    enqueue(redis_url, [job])
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(JOBS_STREAM, CONSUMER_GROUP, id="0")
    (_, [(entry_id, _)]), = client.xreadgroup(CONSUMER_GROUP, "ghost-1", {JOBS_STREAM: ">"})
    for ghost in ("ghost-2", "ghost-3"):  # two more consumers took it over and died too
        client.xclaim(JOBS_STREAM, CONSUMER_GROUP, ghost, 0, [entry_id])

    async def scenario() -> None:
        captioner = DecodingCaptioner()
        worker = QueueWorker(redis_url, captioner, claim_idle_seconds=0, max_deliveries=3, block_seconds=0.1)
        await work_until_idle(worker)
        assert captioner.calls == 0 and worker.stats.dead == 1
        result = await get_result(worker.redis, job.job_id)
        assert result.status == "failed" and result.error == "delivered 4 times without finishing"
        await worker.redis.aclose()

    asyncio.run(scenario())
    assert client.xlen(DEAD_STREAM) == 1
    client.close()


class HeldCaptioner(DecodingCaptioner):
    """Holds every job but fall alerts until `release` is set, and records the order captions finish in."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.finished: list[str] = []

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        if "fall" not in prompt:
            await asyncio.wait_for(self.release.wait(), 30)  # a worker that waits for them fails, not hangs
        self.finished.append(prompt)
        return await super().caption(image_jpeg, prompt, priority)


def test_a_fall_alert_claimed_behind_slow_jobs_is_captioned_without_waiting_for_them(redis_url):
    slow = [make_job(f"slow{i}") for i in range(8)]
    alert = Job(camera_id="hall", frame_ts=2.0, prompt="did someone fall?", image=slow[0].image,
                detections=slow[0].detections, fall=True)
    enqueue(redis_url, [*slow, alert])

    async def scenario() -> None:
        captioner = HeldCaptioner()
        worker = QueueWorker(redis_url, captioner, block_seconds=0.1, batch_size=8)
        worker.start()
        for _ in range(600):
            result = await get_result(worker.redis, alert.job_id)
            if result is not None and result.status == "done":
                break
            await asyncio.sleep(0.05)
        assert captioner.finished == [alert.prompt]  # the 8 jobs claimed before it are all still held
        for job in slow:
            assert (await get_result(worker.redis, job.job_id)).status in ("queued", "claimed", "running")
        captioner.release.set()
        for _ in range(600):
            if await queue_stats(worker.redis) == {"backlog": 0, "pending": 0, "dead": 0}:
                break
            await asyncio.sleep(0.05)
        await worker.stop()
        for job in [*slow, alert]:
            assert (await get_result(worker.redis, job.job_id)).status == "done"
        assert sorted(captioner.finished[1:]) == sorted(job.prompt for job in slow) and captioner.calls == 9
        assert worker.stats.done == 9
        await worker.redis.aclose()

    asyncio.run(scenario())


def test_alerts_are_recognised_from_their_stream_entry():
    from jobqueue.consumer import is_alert

    job = make_job()
    assert not is_alert(job.to_fields())
    job.fall = True
    assert is_alert(job.to_fields()) and is_alert({b"kind": b"fall"}) and not is_alert({b"fall": b"\xff"})


def test_jobs_claimed_ahead_say_claimed_by_their_worker_until_a_slot_starts_them(redis_url):
    """The result of each job shows where it is: running at the worker (2 slots), claimed there and waiting for a
    slot (2 claimed ahead), or still queued on the stream (2 unread). A worker that stops hands the jobs it claimed
    and never started back (queued again); another worker claims and captions them, and each finished result
    keeps when it was claimed and started."""
    jobs = [make_job(f"cam{i}") for i in range(6)]
    enqueue(redis_url, jobs)

    async def statuses(client: redis.asyncio.Redis) -> list[tuple[str, str | None]]:
        results = [await get_result(client, job.job_id) for job in jobs]
        return [(result.status, result.consumer) for result in results]

    async def scenario() -> None:
        captioner = HeldCaptioner()
        first = QueueWorker(redis_url, captioner, consumer_name="first", block_seconds=0.1, batch_size=2)
        first.start()
        expected = [("claimed", "first")] * 2 + [("queued", None)] * 2 + [("running", "first")] * 2
        for _ in range(600):
            if sorted(await statuses(first.redis)) == expected:
                break
            await asyncio.sleep(0.05)
        assert sorted(await statuses(first.redis)) == expected
        for job in jobs:
            result = await get_result(first.redis, job.job_id)
            if result.status == "claimed":
                assert result.claimed_at is not None and result.started_at is None and result.deliveries == 1
                assert result.to_json()["status"] == "claimed"  # as GET /v1/captions/{id} answers it
            elif result.status == "running":
                assert result.started_at >= result.claimed_at
        assert first._stop_event is not None
        first._stop_event.set()  # it stops: the two it runs end, the two it claimed go back
        captioner.release.set()
        await first.stop()
        after_stop = sorted(await statuses(first.redis))
        assert after_stop == [("done", "first")] * 2 + [("queued", None)] * 4
        for job in jobs:
            result = await get_result(first.redis, job.job_id)
            if result.status == "queued":
                assert result.claimed_at is None
        second = QueueWorker(redis_url, captioner, consumer_name="second", block_seconds=0.1, batch_size=2,
                             claim_idle_seconds=0)
        await work_until_idle(second)
        finished = [await get_result(second.redis, job.job_id) for job in jobs]
        assert sorted(r.consumer for r in finished) == ["first"] * 2 + ["second"] * 4
        for result in finished:
            assert result.status == "done"
            assert result.claimed_at <= result.started_at <= result.finished_at
        assert sorted(r.deliveries for r in finished) == [1, 1, 1, 1, 2, 2]  # the two handed back: delivered again
        await first.redis.aclose()
        await second.redis.aclose()

    asyncio.run(scenario())


def test_a_claim_writes_no_result_where_the_producer_wrote_none_and_never_reopens_a_finished_one(redis_url):
    done = make_job("finished")
    enqueue(redis_url, [done])

    async def scenario() -> None:
        worker = QueueWorker(redis_url, DecodingCaptioner(), consumer_name="w", block_seconds=0.1)
        await work_until_idle(worker)
        stored = await get_result(worker.redis, done.job_id)
        assert stored.status == "done"
        await worker._mark_claimed([("0-1", {b"job_id": done.job_id.encode()}, 5), ("0-2", {b"job_id": b"none"}, 1)])
        assert await get_result(worker.redis, done.job_id) == stored  # a late claim does not reopen it
        assert await worker.redis.exists(result_key("none")) == 0  # nor makes a result a producer did not write
        await worker.redis.aclose()

    asyncio.run(scenario())
