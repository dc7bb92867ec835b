"""How a queue worker reads, retries and prioritises jobs: the settings `vlmcap worker` and `vlmcap serve` (its
in-process worker) share, declared once. Each `name: help` entry below is its option's help."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class QueueSettings:
    """The queue worker's settings.

    consumer_name: the queue worker's name in the consumer group (default: host-pid).
    claim_idle_seconds: take over jobs pending this long at another consumer (keep it above a batch's time).
    max_deliveries: attempts before a job goes to the dead-letter stream.
    batch_size: jobs read at once and captioned concurrently.
    caption_priority: priority of captions (lower first; chat is 0; a worker does not send 0, for servers without
        priorities).
    fall_priority: priority of fall alerts' captions (lower first; chat is 0).
    alert_webhook: POST each fall alert's result as JSON to this URL (retried with backoff, never delaying captions).
    """

    consumer_name: str | None = None
    claim_idle_seconds: float = 60.0
    max_deliveries: int = 3
    batch_size: int = 8
    caption_priority: int = 10  # chat requests default to 0, so captions yield to chat
    fall_priority: int = 5  # fall alerts go before other camera jobs, still after chat
    alert_webhook: str | None = None
