"""Nothing is lost when things die: a worker process killed mid-job (SIGKILL) leaves its jobs pending and
a second consumer reclaims and finishes them; Redis restarted under a running pipeline and worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
from queue_support import ChatServer, DecodingCaptioner, enqueue, make_job, wait_for, work_until_idle

from jobqueue.connection import EmbeddedRedis
from jobqueue.consumer import QueueWorker
from jobqueue.contract import CAPTIONS_STREAM, CONSUMER_GROUP, DEAD_STREAM, JOBS_STREAM, CaptionResult, result_key
from jobqueue.openai_captioner import OpenAICaptioner
from jobqueue.results import get_result, queue_stats
from pipeline.runner import CameraPipeline, PipelineConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_worker_killed_mid_job_loses_nothing(redis_url):
    server = ChatServer()
    server.hold.set()  # the first worker's requests hang: it dies with jobs in flight
    jobs = [make_job("k", width=60 + i) for i in range(6)]
    enqueue(redis_url, jobs)
    doomed = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import app; app()", "worker", "--vlm-url", server.url,
         "--redis-url", redis_url, "--consumer-name", "doomed", "--batch-size", "2"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    client = redis.Redis.from_url(redis_url)
    try:
        def running() -> int:
            return sum(client.hget(f"vlmcap:result:{j.job_id}", "status") == b"running" for j in jobs)

        wait_for(lambda: server.received == 2 and running() == 2 or doomed.poll() is not None,
                 "the worker to start two jobs", timeout=60)
        assert doomed.poll() is None, doomed.stderr.read().decode()[-2000:]
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        pending = client.xpending(JOBS_STREAM, CONSUMER_GROUP)
        # Two running and two claimed ahead (the worker reads on while its jobs run, for alerts behind them).
        assert pending["pending"] == 4 and pending["consumers"] == [{"name": b"doomed", "pending": 4}]
        assert running() == 2  # still shown as running: nobody has finished them

        server.hold.clear()

        async def rescue() -> tuple[QueueWorker, list[CaptionResult]]:
            captioner = OpenAICaptioner(server.url)
            rescuer = QueueWorker(redis_url, captioner, consumer_name="rescuer", claim_idle_seconds=0.3,
                                  block_seconds=0.1)
            await work_until_idle(rescuer, max_rounds=200)
            assert await queue_stats(rescuer.redis) == {"backlog": 0, "pending": 0, "dead": 0}
            results = [await get_result(rescuer.redis, j.job_id) for j in jobs]
            await captioner.aclose()
            await rescuer.redis.aclose()
            return rescuer, results

        rescuer, results = asyncio.run(rescue())
        assert rescuer.stats.claimed == 4 and rescuer.stats.done == 6
        for width, result in enumerate(results, start=60):
            assert (result.status, result.caption) == ("done", f"{width}x48: who is at k?")
        # The four the dead worker held were delivered twice; exactly one caption per job on the feed.
        assert sorted(r.deliveries for r in results) == [1, 1, 2, 2, 2, 2]
        feed = [CaptionResult.from_fields(f).id for _, f in client.xrange(CAPTIONS_STREAM)]
        assert sorted(feed) == sorted(j.job_id for j in jobs)
        assert client.xlen(DEAD_STREAM) == 0
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()
        client.close()
        server.close()


@pytest.mark.timeout(180)
def test_redis_restart_under_running_pipeline_and_worker(tmp_path, sample_video):
    """A fresh Redis on a fixed port and data dir, restarted while a looping camera pipeline and a worker
    run against it: both ride out the outage and captions resume for jobs made after the restart."""
    if os.environ.get("REDIS_URL"):
        pytest.skip("restarts its own embedded Redis; REDIS_URL names an external one")
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    port, url = server.port, server.url
    stop_pipeline = threading.Event()
    pipeline = CameraPipeline(PipelineConfig(
        source=str(sample_video), camera_id="restart", redis_url=url, detector="hog", loop=True,
        track_cooldown_seconds=2.0, max_backoff_seconds=0.5,
    ))
    outcome: dict[str, object] = {}

    def run_pipeline() -> None:
        try:
            outcome["pipeline"] = pipeline.run(stop_pipeline)
        except BaseException as err:  # reported by the assertion below
            outcome["pipeline"] = err

    worker_loop = asyncio.new_event_loop()
    worker = QueueWorker(url, DecodingCaptioner(), block_seconds=0.2, max_backoff_seconds=0.5)
    stop_worker = asyncio.Event()

    def run_worker() -> None:
        try:
            worker_loop.run_until_complete(worker.run(stop_worker))
            outcome["worker"] = "stopped"
        except BaseException as err:
            outcome["worker"] = err

    threads = [threading.Thread(target=run_pipeline), threading.Thread(target=run_worker)]
    for thread in threads:
        thread.start()
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        wait_for(lambda: worker.stats.done >= 1, "a first caption", timeout=60)
        server.close()
        wait_for(lambda: pipeline.producer.stats.redis_errors >= 1 and worker.stats.redis_errors >= 1,
                 "both sides to notice the outage", timeout=60)
        restarted_at = time.time()
        server = EmbeddedRedis(port=port, data_dir=tmp_path / "redis")

        def captioned_after_restart() -> bool:
            results = [CaptionResult.from_fields(f) for _, f in client.xrange(CAPTIONS_STREAM)]
            return any(r.status == "done" and r.created_at > restarted_at for r in results)

        wait_for(captioned_after_restart, "a caption of a job made after the restart", timeout=90)
    finally:
        stop_pipeline.set()
        worker_loop.call_soon_threadsafe(stop_worker.set)
        for thread in threads:
            thread.join(30)
        worker_loop.run_until_complete(worker.redis.aclose())
        worker_loop.close()
        client.close()
        server.close()
    assert isinstance(outcome["pipeline"], dict), outcome["pipeline"]
    assert outcome["worker"] == "stopped"
    assert outcome["pipeline"]["redis_errors"] >= 1


def _raw_entry(client: redis.Redis, job, **overrides: str) -> None:
    """A job entry as a producer in another language might write it, with some fields overridden, and its
    queued result."""
    client.xadd(JOBS_STREAM, {**job.to_fields(), **overrides})
    client.hset(result_key(job.job_id), mapping=job.queued_result().to_fields())


BAD_JOB_FIELDS = [
    ({"image_origin": "[1, 2, 3]"}, "image_origin must be a JSON list of two integers"),
    ({"image_origin": "[]"}, "image_origin must be a JSON list of two integers"),
    ({"detections": '[{"x1": "a", "y1": 2, "x2": 30, "y2": 40, "confidence": 0.9}]'}, "detections[0].x1"),
    ({"detections": '[{"x1": 30, "y1": 2, "x2": 1, "y2": 40, "confidence": 0.9}]'}, "reversed box"),
    ({"detections": '[{"x1": 1, "y1": 2, "x2": 30, "y2": 40, "confidence": NaN}]'}, "NaN, which is not JSON"),
    ({"detections": "[" * 50_000 + "]" * 50_000}, "nested too deeply"),  # within MAX_BOXES_JSON_CHARS
    ({"detections": "[" * 100_000 + "]" * 100_000}, "over the limit of"),
    ({"frame_ts": "nan"}, "frame_ts must be a finite number"),
    ({"created_at": "inf"}, "created_at must be a finite number"),
    ({"prompt": ""}, "prompt must be a non-empty string"),
]


@pytest.mark.timeout(60)
def test_bad_jobs_are_dead_lettered_once_and_the_worker_goes_on(redis_url):
    """Each malformed job is dead-lettered once, with an error naming its field, its result says failed;
    the good jobs around it are captioned, and the worker keeps running."""
    client = redis.Redis.from_url(redis_url)
    good = [make_job("good", width=60 + i) for i in range(3)]
    bad = [make_job("bad") for _ in BAD_JOB_FIELDS]
    _raw_entry(client, good[0])
    for job, (overrides, _) in zip(bad, BAD_JOB_FIELDS, strict=True):
        _raw_entry(client, job, **overrides)
    _raw_entry(client, good[1])
    _raw_entry(client, good[2])

    async def scenario() -> QueueWorker:
        worker = QueueWorker(redis_url, DecodingCaptioner(), claim_idle_seconds=0.2, max_deliveries=2,
                             block_seconds=0.1, batch_size=4)
        worker.start()
        for _ in range(600):
            if await worker.redis.xlen(JOBS_STREAM) == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a few more rounds: nothing is redelivered
        assert worker.alive and worker.redis_reachable
        await worker.stop()
        await worker.redis.aclose()
        return worker

    worker = asyncio.run(scenario())
    assert (worker.stats.done, worker.stats.dead, worker.stats.errors) == (3, len(bad), 0)
    dead = {f[b"job_id"].decode(): f for _, f in client.xrange(DEAD_STREAM)}
    assert len(dead) == client.xlen(DEAD_STREAM) == len(bad)
    for job, (_, message) in zip(bad, BAD_JOB_FIELDS, strict=True):
        assert message in dead[job.job_id][b"error"].decode(), dead[job.job_id][b"error"]
        assert dead[job.job_id][b"deliveries"] == b"1"
        result = CaptionResult.from_fields(client.hgetall(result_key(job.job_id)))
        assert result.status == "failed" and message in result.error
    for width, job in enumerate(good, start=60):
        result = CaptionResult.from_fields(client.hgetall(result_key(job.job_id)))
        assert (result.status, result.caption) == ("done", f"{width}x48: who is at good?")
    client.close()


@pytest.mark.timeout(60)
def test_worker_survives_an_unexpected_error_in_one_job(redis_url, caplog):
    """An error the worker does not expect (here: finishing the job raises once) stays with that job: it
    is logged, the job is reclaimed and captioned once, the job beside it is unaffected."""
    jobs = [make_job("odd", width=70), make_job("odd", width=71)]
    enqueue(redis_url, jobs)

    async def scenario() -> QueueWorker:
        worker = QueueWorker(redis_url, DecodingCaptioner(), claim_idle_seconds=0.2, block_seconds=0.1)
        real_finish = worker._finish_job
        failures = []

        async def finish_failing_once(entry_id, job, *args, **kwargs):
            if job.job_id == jobs[0].job_id and not failures:
                failures.append(job.job_id)
                raise RuntimeError("injected failure")
            await real_finish(entry_id, job, *args, **kwargs)

        worker._finish_job = finish_failing_once
        worker.start()
        for _ in range(600):
            if await worker.redis.xlen(JOBS_STREAM) == 0:
                break
            await asyncio.sleep(0.05)
        assert worker.alive
        await worker.stop()
        results = [await get_result(worker.redis, j.job_id) for j in jobs]
        assert [(r.status, r.deliveries) for r in results] == [("done", 2), ("done", 1)]
        await worker.redis.aclose()
        return worker

    worker = asyncio.run(scenario())
    assert (worker.stats.done, worker.stats.errors, worker.stats.dead) == (2, 1, 0)
    assert "injected failure" in caplog.text


@pytest.mark.timeout(180)
def test_redis_down_answers_503_and_ready_follows_redis_and_the_worker(tmp_path):
    """While Redis is down the caption and camera routes answer 503 with Retry-After (not 500) and /ready
    answers 503; once Redis is back, both recover. A queue worker that stopped makes /ready 503 too."""
    import httpx

    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig

    if os.environ.get("REDIS_URL"):
        pytest.skip("stops its own embedded Redis; REDIS_URL names an external one")
    redis_server = EmbeddedRedis(data_dir=tmp_path / "redis")
    port = redis_server.port
    settings = ServerSettings(engine=EngineConfig(model="tiny"), redis_url=redis_server.url, caption_max_tokens=2)
    image = make_job().image
    try:
        with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/ready").status_code == 200
            redis_server.close()
            for reply in (http.post("/v1/captions", files={"image": ("x.jpg", image)}),
                          http.get("/v1/captions"), http.get("/v1/captions/some-id"), http.get("/v1/cameras"),
                          http.get("/v1/captions/stream")):
                assert reply.status_code == 503, reply.text
                assert reply.headers["retry-after"].isdigit()
                assert reply.json()["error"]["code"] == "store_unavailable"
            not_ready = http.get("/ready")
            assert not_ready.status_code == 503 and "Redis" in not_ready.json()["reason"]
            assert server.state.bridge.engine.stats().kv_blocks_used == 0  # the refused caption was aborted

            redis_server = EmbeddedRedis(port=port, data_dir=tmp_path / "redis")
            wait_for(lambda: http.get("/ready").status_code == 200, "ready again once Redis is back")
            done = http.post("/v1/captions?wait=true", files={"image": ("x.jpg", image)})
            assert done.status_code == 200 and done.json()["status"] == "done"

            worker = server.state.worker
            asyncio.run_coroutine_threadsafe(worker.stop(0), worker._task.get_loop()).result(30)
            stopped = http.get("/ready")
            assert stopped.status_code == 503 and "queue worker" in stopped.json()["reason"]
    finally:
        redis_server.close()
