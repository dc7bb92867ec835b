"""`vlmcap worker`: the queue's consumer against any OpenAI-compatible server. It never loads the engine. Its
queue options are `QueueSettings`' fields (cli/declared.py), where finished jobs go `MemorySettings`' (the event
store, less the API keys' views of it) and `MqttSettings`', the others the captioner's and Redis's; every option
can also come from the environment variable named in its help. Finished jobs are kept and published as by the
server's own queue worker (memory/outputs.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import typer

from cli.declared import Rename, command, from_dataclass, hand_option, values_for
from cli.options import LOG_FORMAT, default, fail, run_until_signalled, stop_on_sigterm
from jobqueue.consumer import QueueWorker
from jobqueue.openai_captioner import OpenAICaptioner
from jobqueue.settings import QueueSettings
from memory.settings import MemorySettings, MqttSettings

RENAMES = {"caption_priority": Rename("--priority", "VLMCAP_PRIORITY")}
QUEUE = from_dataclass(QueueSettings)
# Which API key sees which camera's events is the server's business (it serves the store), not the worker's.
MEMORY = [s for s in from_dataclass(MemorySettings) if s.name not in ("events_shared", "events_key_cameras")]
MQTT = from_dataclass(MqttSettings)
DECLARED = QUEUE + MEMORY + MQTT
HAND = [
    hand_option("vlm_url", str, ..., "--vlm-url", envvar="VLMCAP_VLM_URL",
                help="Base URL of an OpenAI-compatible server (this project's, vLLM, ...), e.g. http://host:8000/v1."),
    hand_option("api_key", str | None, None, "--api-key", envvar="VLMCAP_API_KEY", help="Bearer token for it."),
    hand_option("model", str, default(OpenAICaptioner, "model"), "--model", envvar="VLMCAP_MODEL",
                help="Model name sent with each request."),
    hand_option("max_tokens", int, default(OpenAICaptioner, "max_tokens"), "--max-tokens", envvar="VLMCAP_MAX_TOKENS",
                help="Longest caption."),
    hand_option("redis_url", str | None, None, "--redis-url", envvar="REDIS_URL",
                help="Redis 6.2+ URL. Without it an embedded Redis is started and its URL logged."),
]


def run_worker(**options: Any) -> None:
    """Caption queued camera jobs through an OpenAI-compatible server.

    Each finished job is kept in the event store and published to MQTT (--mqtt-url) as the server's own queue
    worker does; its events carry no image embedding (the worker has no vision tower: they are found by camera,
    time, kind, fall and words, not by likeness)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    stop_on_sigterm()  # until the event loop's own handlers take over, and while the embedded Redis stops
    from jobqueue.alerts import AlertWebhook
    from jobqueue.connection import redis_url_or_embedded
    from memory.outputs import each, open_keeper, start_mqtt, stop_outputs

    try:
        queue = QueueSettings(**values_for(QUEUE, options))
        memory = MemorySettings(**values_for(MEMORY, options))
        mqtt = MqttSettings(**values_for(MQTT, options))
    except ValueError as err:
        raise fail(str(err)) from None

    async def main(url: str, stop: asyncio.Event) -> QueueWorker:
        captioner = OpenAICaptioner(options["vlm_url"], options["api_key"], options["model"], options["max_tokens"])
        webhook = AlertWebhook(queue.alert_webhook) if queue.alert_webhook else None
        keeper = await asyncio.to_thread(open_keeper, memory)
        publisher = start_mqtt(mqtt)
        queue_worker = QueueWorker(url, captioner, consumer_name=queue.consumer_name,
                                   claim_idle_seconds=queue.claim_idle_seconds, max_deliveries=queue.max_deliveries,
                                   caption_priority=queue.caption_priority, batch_size=queue.batch_size,
                                   fall_priority=queue.fall_priority, on_alert=webhook.notify if webhook else None,
                                   on_finished=each(keeper.on_finished if keeper else None,
                                                    publisher.on_finished if publisher else None))
        if webhook is not None:
            webhook.start()
        try:
            await queue_worker.run(stop)
        finally:
            if webhook is not None:
                await webhook.stop()
            # after the worker: its last jobs are published and written
            await asyncio.to_thread(stop_outputs, keeper, publisher)
            await captioner.aclose()
            await queue_worker.redis.aclose()
        return queue_worker

    try:
        with redis_url_or_embedded(options["redis_url"]) as url:
            stopped, _ = run_until_signalled(lambda stop: main(url, stop))
    except ValueError as err:
        raise fail(str(err)) from None
    typer.echo(f"worker {stopped.consumer_name} stopped: {stopped.stats}")


worker = command(run_worker, HAND, DECLARED, RENAMES)
worker.__name__ = "worker"
