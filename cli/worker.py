"""`vlmcap worker`: the queue's consumer against any OpenAI-compatible server. It never loads the engine. Its
queue options are `QueueSettings`' fields (cli/declared.py), the others the captioner's and Redis's; every
option can also come from the environment variable named in its help."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import typer

from cli.declared import Rename, command, from_dataclass, hand_option
from cli.options import LOG_FORMAT, default, fail, run_until_signalled, stop_on_sigterm
from jobqueue.consumer import QueueWorker
from jobqueue.openai_captioner import OpenAICaptioner
from jobqueue.settings import QueueSettings

RENAMES = {"caption_priority": Rename("--priority", "VLMCAP_PRIORITY")}
QUEUE = from_dataclass(QueueSettings)
DECLARED = QUEUE
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
    """Caption queued camera jobs through an OpenAI-compatible server."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    stop_on_sigterm()  # until the event loop's own handlers take over, and while the embedded Redis stops
    from jobqueue.alerts import AlertWebhook
    from jobqueue.connection import redis_url_or_embedded

    queue = QueueSettings(**{setting.name: options[setting.name] for setting in QUEUE})

    async def main(url: str, stop: asyncio.Event) -> QueueWorker:
        captioner = OpenAICaptioner(options["vlm_url"], options["api_key"], options["model"], options["max_tokens"])
        webhook = AlertWebhook(queue.alert_webhook) if queue.alert_webhook else None
        queue_worker = QueueWorker(url, captioner, consumer_name=queue.consumer_name,
                                   claim_idle_seconds=queue.claim_idle_seconds, max_deliveries=queue.max_deliveries,
                                   caption_priority=queue.caption_priority, batch_size=queue.batch_size,
                                   fall_priority=queue.fall_priority, on_alert=webhook.notify if webhook else None)
        if webhook is not None:
            webhook.start()
        try:
            await queue_worker.run(stop)
        finally:
            if webhook is not None:
                await webhook.stop()
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
