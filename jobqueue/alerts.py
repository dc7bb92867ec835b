"""Fall alerts. A camera job marked `fall` (see `jobqueue.contract.Job.fall`) is captioned at its own
priority; when it finishes, the queue worker's finish script appends its result to the alerts feed
(`ALERTS_STREAM`, read by `/v1/alerts` and `/v1/alerts/stream`), and the worker hands the result to an
`AlertWebhook`, which POSTs it as JSON to a URL from a task of its own: with a timeout, retries with
exponential backoff, failures counted, and never in the way of captioning (a full queue of alerts drops the
newest, counted)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from jobqueue.contract import CaptionResult

log = logging.getLogger(__name__)

DEFAULT_WEBHOOK_TIMEOUT_S = 5.0
DEFAULT_WEBHOOK_RETRIES = 3
DEFAULT_WEBHOOK_BACKOFF_S = 1.0
DEFAULT_WEBHOOK_MAX_PENDING = 100


@dataclass
class WebhookStats:
    sent: int = 0  # alerts the webhook accepted (a 2xx answer)
    failed: int = 0  # alerts given up after every retry
    failed_attempts: int = 0  # attempts that failed (each retried until the retries are spent)
    dropped: int = 0  # alerts not queued because `max_pending` were already waiting


def _post(url: str, body: bytes, timeout_s: float) -> int:
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "vlmcap-alerts"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # raises HTTPError for 4xx and 5xx
        return response.status


def validate_webhook_url(url: str) -> str:
    """The URL itself; ValueError naming it unless it is http(s) with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"alert webhook must be an http:// or https:// URL with a host, got {url!r}")
    return url


class AlertWebhook:
    """POSTs each alert to `url` in order, from a task started with `start()` in the running event loop."""

    def __init__(self, url: str, timeout_s: float = DEFAULT_WEBHOOK_TIMEOUT_S,
                 retries: int = DEFAULT_WEBHOOK_RETRIES, backoff_s: float = DEFAULT_WEBHOOK_BACKOFF_S,
                 max_pending: int = DEFAULT_WEBHOOK_MAX_PENDING) -> None:
        validate_webhook_url(url)
        if timeout_s <= 0:
            raise ValueError(f"alert webhook timeout must be positive, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"alert webhook retries must not be negative, got {retries}")
        if backoff_s < 0:
            raise ValueError(f"alert webhook backoff must not be negative, got {backoff_s}")
        if max_pending < 1:
            raise ValueError(f"alert webhook max_pending must be at least 1, got {max_pending}")
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.stats = WebhookStats()
        self._pending: asyncio.Queue[dict] = asyncio.Queue(max_pending)
        self._task: asyncio.Task | None = None

    def notify(self, result: CaptionResult) -> None:
        """Queue an alert (the fall job's result, as GET /v1/captions/{id} answers it) for delivery;
        returns at once."""
        try:
            self._pending.put_nowait(result.to_json())
        except asyncio.QueueFull:
            self.stats.dropped += 1
            log.error("alert webhook: %d alerts already waiting; alert %s dropped", self._pending.maxsize,
                      result.id)

    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self._run(), name="alert-webhook")
        return self._task

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (within `timeout_s`), then stop."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._pending.join(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("alert webhook: %d alerts undelivered at shutdown", self._pending.qsize())
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        while True:
            payload = await self._pending.get()
            try:
                await self.deliver(payload)
            finally:
                self._pending.task_done()

    async def deliver(self, payload: dict) -> bool:
        """POST one alert, retrying with exponential backoff; True when the webhook accepted it."""
        body = json.dumps(payload).encode()
        for attempt in range(self.retries + 1):
            try:
                await asyncio.to_thread(_post, self.url, body, self.timeout_s)
            except (OSError, urllib.error.URLError, ValueError) as err:  # HTTPError, timeouts, refused connections
                self.stats.failed_attempts += 1
                if attempt < self.retries:
                    delay = self.backoff_s * 2 ** attempt
                    log.warning("alert webhook: alert %s attempt %d failed (%s); retrying in %.1f s",
                                payload.get("id"), attempt + 1, err, delay)
                    await asyncio.sleep(delay)
                    continue
                self.stats.failed += 1
                log.error("alert webhook: alert %s not delivered after %d attempts: %s", payload.get("id"),
                          attempt + 1, err)
                return False
            self.stats.sent += 1
            return True
        return False
