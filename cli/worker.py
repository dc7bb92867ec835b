"""`vlmcap worker`: the queue's consumer against any OpenAI-compatible server. It never loads the engine.
Every option can also come from the environment variable named in its help."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

from cli.options import LOG_FORMAT, default, fail, stop_on_sigterm
from jobqueue.consumer import QueueWorker
from jobqueue.openai_captioner import OpenAICaptioner


def worker(
    vlm_url: Annotated[str, typer.Option(envvar="VLMCAP_VLM_URL", help=(
        "Base URL of an OpenAI-compatible server (this project's, vLLM, ...), e.g. http://host:8000/v1."))],
    api_key: Annotated[str | None, typer.Option(envvar="VLMCAP_API_KEY", help="Bearer token for it.")] = None,
    model: Annotated[str, typer.Option(envvar="VLMCAP_MODEL", help="Model name sent with each request.")] = (
        default(OpenAICaptioner, "model")),
    redis_url: Annotated[str | None, typer.Option(envvar="REDIS_URL", help=(
        "Redis 6.2+ URL. Without it an embedded Redis is started and its URL logged."))] = None,
    consumer_name: Annotated[str | None, typer.Option(envvar="VLMCAP_CONSUMER_NAME", help=(
        "Name in the consumer group; default host-pid."))] = None,
    claim_idle_seconds: Annotated[float, typer.Option(envvar="VLMCAP_CLAIM_IDLE_SECONDS", help=(
        "Take over (and retry) jobs pending this long at another or a failed consumer."))] = default(
        QueueWorker, "claim_idle_seconds"),
    max_deliveries: Annotated[int, typer.Option(envvar="VLMCAP_MAX_DELIVERIES", help=(
        "Attempts before a job goes to the dead-letter stream."))] = default(QueueWorker, "max_deliveries"),
    priority: Annotated[int, typer.Option(envvar="VLMCAP_PRIORITY", help=(
        "Request priority (lower first; chat is 0). 0 is not sent, for servers without priorities."))] = default(
        QueueWorker, "priority"),
    batch_size: Annotated[int, typer.Option(envvar="VLMCAP_BATCH_SIZE", help=(
        "Jobs read at once and captioned concurrently."))] = default(QueueWorker, "batch_size"),
    max_tokens: Annotated[int, typer.Option(envvar="VLMCAP_MAX_TOKENS", help="Longest caption.")] = default(
        OpenAICaptioner, "max_tokens"),
    fall_priority: Annotated[int, typer.Option(envvar="VLMCAP_FALL_PRIORITY", help=(
        "Request priority of fall alerts' captions (lower first; chat is 0)."))] = default(
        QueueWorker, "fall_priority"),
    alert_webhook: Annotated[str | None, typer.Option(envvar="VLMCAP_ALERT_WEBHOOK", help=(
        "POST each fall alert's result as JSON to this URL (retried with backoff, never delaying "
        "captions)."))] = None,
) -> None:
    """Caption queued camera jobs through an OpenAI-compatible server."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    stop_on_sigterm()  # until the event loop's own handlers take over, and while the embedded Redis stops
    from jobqueue.alerts import AlertWebhook
    from jobqueue.connection import redis_url_or_embedded

    async def main(url: str) -> QueueWorker:
        captioner = OpenAICaptioner(vlm_url, api_key, model, max_tokens)
        webhook = AlertWebhook(alert_webhook) if alert_webhook else None
        queue_worker = QueueWorker(url, captioner, consumer_name, claim_idle_seconds, max_deliveries, priority,
                                   batch_size, fall_priority=fall_priority,
                                   on_alert=webhook.notify if webhook else None)
        if webhook is not None:
            webhook.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await queue_worker.run(stop)
        finally:
            if webhook is not None:
                await webhook.stop()
            await captioner.aclose()
            await queue_worker.redis.aclose()
        return queue_worker

    try:
        with redis_url_or_embedded(redis_url) as url:
            stopped = asyncio.run(main(url))
    except ValueError as err:
        raise fail(str(err)) from None
    typer.echo(f"worker {stopped.consumer_name} stopped: {stopped.stats}")
