"""Fall alerts. A camera job marked `fall` (see `jobqueue.contract.Job.fall`) is captioned at its own
priority; when it finishes, the queue worker's finish script appends its result to the alerts feed
(`ALERTS_STREAM`, read by `/v1/alerts` and `/v1/alerts/stream`), and the worker hands the result to an
`AlertWebhook`, which POSTs it as JSON to a URL from a task of its own, never in the way of captioning (a full
queue of alerts drops the newest, counted).

Each delivery attempt has one total deadline (connect, send, every read together: a receiver that drips a byte
a second is cut off at the deadline, not after a timeout per read); only a 2xx answer counts as delivered, and
no redirect is followed (a 3xx is a failure: the webhook URL is the one place alerts may go). Any error, a
protocol one included (a receiver that is not HTTP), is logged, counted and retried with exponential backoff
(cut short once `stop()` has begun: the process is ending, and what is queued gets its attempts one after the
other within the grace instead of a back-off outlasting it); the delivery task outlives every error, and should
it end anyway it is restarted (counted in `restarts`, shown in `/ready`'s body)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from jobqueue.checks import at_least, not_negative, positive
from jobqueue.contract import CaptionResult

log = logging.getLogger(__name__)

DEFAULT_WEBHOOK_TIMEOUT_S = 5.0
DEFAULT_WEBHOOK_RETRIES = 3
DEFAULT_WEBHOOK_BACKOFF_S = 1.0
DEFAULT_WEBHOOK_MAX_PENDING = 100
RESTART_DELAY_S = 1.0  # before a delivery task that ended is started again


@dataclass
class WebhookStats:
    sent: int = 0  # alerts the webhook accepted (a 2xx answer)
    failed: int = 0  # alerts given up after every retry
    failed_attempts: int = 0  # attempts that failed (each retried until the retries are spent)
    dropped: int = 0  # alerts not queued because `max_pending` were already waiting
    restarts: int = 0  # times the delivery task ended unexpectedly and was started again


class WebhookRefused(Exception):
    """The receiver answered, but not with a 2xx (a redirect included)."""


async def _post(client: httpx.AsyncClient, url: str, body: bytes) -> int:
    response = await client.post(url, content=body, headers={"Content-Type": "application/json",
                                                            "User-Agent": "vlmcap-alerts"})
    if not 200 <= response.status_code < 300:
        where = f" to {response.headers.get('location', '')[:200]!r}" if response.is_redirect else ""
        raise WebhookRefused(f"answered {response.status_code}{where} (only a 2xx counts; redirects are not "
                             "followed)")
    return response.status_code


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
        positive("alert webhook timeout", timeout_s)
        not_negative("alert webhook retries", retries)
        not_negative("alert webhook backoff", backoff_s)
        at_least("alert webhook max_pending", max_pending, 1)
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.stats = WebhookStats()
        self._pending: asyncio.Queue[dict] = asyncio.Queue(max_pending)
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._draining = asyncio.Event()  # set by stop(): back-offs end at once
        self._last_task_error: str | None = None

    def notify(self, result: CaptionResult) -> None:
        """Queue an alert (the fall job's result, as GET /v1/captions/{id} answers it) for delivery;
        returns at once."""
        try:
            self._pending.put_nowait(result.to_json())
        except asyncio.QueueFull:
            self.stats.dropped += 1
            log.error("alert webhook: %d alerts already waiting; alert %s dropped", self._pending.maxsize,
                      result.id)

    @property
    def alive(self) -> bool:
        """The delivery task runs (after `start()`, until `stop()`)."""
        return self._task is not None and not self._task.done()

    def health(self) -> dict:
        """What `/ready` shows: whether deliveries run, the counters, the last error of a delivery task."""
        return {"running": self.alive, "pending": self._pending.qsize(), **vars(self.stats),
                "last_task_error": self._last_task_error}

    def start(self) -> asyncio.Task:
        self._stopping = False
        if self._task is None:
            # a first start, or one after stop(): a new event (an event binds to the loop of its first wait); a
            # restart (`_ended`) keeps the one that a stop() in progress may have set
            self._draining = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="alert-webhook")
        self._task.add_done_callback(self._ended)
        return self._task

    def _ended(self, task: asyncio.Task) -> None:
        """Supervision: a delivery task that ended without `stop()` (it never should) is started again."""
        if self._stopping or task is not self._task:
            return
        error = None if task.cancelled() else task.exception()
        self._last_task_error = "cancelled" if error is None else f"{type(error).__name__}: {error}"
        self.stats.restarts += 1
        log.error("alert webhook: the delivery task ended (%s); restarting it in %.1f s", self._last_task_error,
                  RESTART_DELAY_S)
        asyncio.get_running_loop().call_later(RESTART_DELAY_S, self._restart)

    def _restart(self) -> None:
        if not self._stopping and not self.alive:
            self.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (within `timeout_s`, retries without their back-off), then stop."""
        if self._task is None:
            return
        self._draining.set()
        try:
            await asyncio.wait_for(self._pending.join(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("alert webhook: %d alerts undelivered at shutdown", self._pending.qsize())
        self._stopping = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        while True:
            payload = await self._pending.get()
            try:
                await self.deliver(payload)
            except Exception:  # deliver handles its own errors; anything else must not end deliveries either
                log.exception("alert webhook: delivering alert %s failed", payload.get("id"))
            finally:
                self._pending.task_done()

    async def attempt(self, body: bytes) -> int:
        """One POST within the total deadline `timeout_s`; the status of a 2xx answer, else it raises."""
        async with asyncio.timeout(self.timeout_s):
            async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s) as client:
                return await _post(client, self.url, body)

    async def deliver(self, payload: dict) -> bool:
        """POST one alert, retrying with exponential backoff; True when the webhook accepted it."""
        body = json.dumps(payload).encode()
        for attempt in range(self.retries + 1):
            try:
                await self.attempt(body)
            except Exception as err:  # refused, redirected, not HTTP, too slow, unreachable: all retried
                self.stats.failed_attempts += 1
                why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                if attempt < self.retries:
                    delay = self.backoff_s * 2 ** attempt
                    log.warning("alert webhook: alert %s attempt %d failed (%s); retrying in %.1f s",
                                payload.get("id"), attempt + 1, why, delay)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._draining.wait(), delay)
                    continue
                self.stats.failed += 1
                log.error("alert webhook: alert %s not delivered after %d attempts: %s", payload.get("id"),
                          attempt + 1, why)
                return False
            self.stats.sent += 1
            return True
        return False
