"""The fall-alert webhook against real local receivers that misbehave: one that is not HTTP (an SSH banner), one
that drips its answer a byte a second, one that redirects. Every such delivery fails, is counted and retried,
and the delivery task lives on to deliver the next alert; the total deadline cuts a dripping receiver off; no
redirect is followed; a delivery task that ends anyway is restarted, and `/ready` shows it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from queue_support import WebhookReceiver, wait_for

from jobqueue.alerts import AlertWebhook


class RawReceiver:
    """A TCP server on loopback that reads the request's first bytes and answers `reply` (bytes), `drip_s`
    seconds between bytes; it records how many bytes each client let it send before hanging up."""

    def __init__(self, reply: bytes, drip_s: float = 0.0) -> None:
        self.reply, self.drip_s = reply, drip_s
        self.sent: list[int] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/alerts"
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        sent = 0
        with conn:
            try:
                conn.recv(65536)
                chunks = [self.reply[i:i + 1] for i in range(len(self.reply))] if self.drip_s else [self.reply]
                for chunk in chunks:
                    conn.sendall(chunk)
                    sent += len(chunk)
                    if self.drip_s:
                        time.sleep(self.drip_s)
            except OSError:
                pass
            self.sent.append(sent)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


class Alert:
    def __init__(self, alert_id: str) -> None:
        self.id = alert_id

    def to_json(self) -> dict:
        return {"id": self.id}


async def deliver_all(webhook: AlertWebhook, ids: list[str]) -> None:
    webhook.start()
    for alert_id in ids:
        webhook.notify(Alert(alert_id))
    await asyncio.wait_for(webhook._pending.join(), 60)
    assert webhook.alive
    await webhook.stop()


def test_a_receiver_that_is_not_http_fails_each_alert_and_the_loop_lives_on():
    ssh = RawReceiver(b"SSH-2.0-OpenSSH_9.6\r\n")
    try:
        webhook = AlertWebhook(ssh.url, retries=1, backoff_s=0.01)
        asyncio.run(deliver_all(webhook, ["a1", "a2"]))
    finally:
        ssh.close()
    stats = webhook.stats
    assert (stats.sent, stats.failed, stats.failed_attempts, stats.restarts) == (0, 2, 4, 0)
    assert len(ssh.sent) == 4  # every attempt reached it: the second alert was tried after the first failed


def test_stop_tries_each_queued_alert_s_last_attempts_without_waiting_out_their_back_off():
    """A receiver that is not HTTP and a back-off far longer than the grace: stop() cuts the back-offs short, so
    each queued alert gets all its attempts before the process ends (a back-off sleeping through the grace would
    leave them unmade and the shutdown waiting the whole grace)."""
    ssh = RawReceiver(b"SSH-2.0-OpenSSH_9.6\r\n")

    async def scenario() -> AlertWebhook:
        webhook = AlertWebhook(ssh.url, retries=2, backoff_s=600.0)
        webhook.start()
        for alert_id in ("b1", "b2"):
            webhook.notify(Alert(alert_id))
        while webhook.stats.failed_attempts == 0:  # the first alert's first attempt failed: it is backing off
            await asyncio.sleep(0.01)
        await webhook.stop(timeout_s=20)
        return webhook

    try:
        webhook = asyncio.run(scenario())
    finally:
        ssh.close()
    stats = webhook.stats
    assert (stats.sent, stats.failed, stats.failed_attempts, webhook.health()["pending"]) == (0, 2, 6, 0)
    assert len(ssh.sent) == 6 and not webhook.alive


def test_a_dripping_receiver_is_cut_off_at_the_total_deadline():
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Slow: " + b"." * 40 + b"\r\n\r\n"
    drip = RawReceiver(answer, drip_s=1.0)
    try:
        webhook = AlertWebhook(drip.url, timeout_s=1.5, retries=0)
        delivered = asyncio.run(webhook.deliver({"id": "slow"}))
        wait_for(lambda: len(drip.sent) == 1, "the receiver to see the client hang up", timeout=30)
    finally:
        drip.close()
    assert delivered is False and webhook.stats.failed == 1
    assert drip.sent[0] < len(answer)  # hung up mid-answer, not after a timeout per byte read


def test_a_redirect_is_a_failure_and_is_not_followed():
    elsewhere = WebhookReceiver()
    redirecting = WebhookReceiver(status=302, headers={"Location": elsewhere.url})
    try:
        webhook = AlertWebhook(redirecting.url, retries=1, backoff_s=0.01)
        delivered = asyncio.run(webhook.deliver({"id": "moved"}))
    finally:
        redirecting.close()
        elsewhere.close()
    assert delivered is False and (webhook.stats.sent, webhook.stats.failed_attempts) == (0, 2)
    assert redirecting.statuses == [302, 302] and elsewhere.statuses == []


def test_a_delivery_task_that_ends_is_restarted_and_delivers():
    good = WebhookReceiver()

    async def scenario() -> AlertWebhook:
        webhook = AlertWebhook(good.url, backoff_s=0.01)
        webhook.start()
        webhook._task.cancel()  # the task ends without stop(), as a bug in it would end it
        while webhook.stats.restarts == 0 or not webhook.alive:
            await asyncio.sleep(0.05)
        assert webhook.health()["last_task_error"] == "cancelled"
        webhook.notify(Alert("after-restart"))
        await asyncio.wait_for(webhook._pending.join(), 30)
        await webhook.stop()
        return webhook

    try:
        webhook = asyncio.run(scenario())
    finally:
        good.close()
    assert (webhook.stats.sent, webhook.stats.restarts) == (1, 1) and good.bodies == [{"id": "after-restart"}]
    assert not webhook.alive  # stop() ends it for good


@pytest.mark.timeout(180)
def test_ready_shows_the_webhook_and_its_restarts(redis_url):
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig

    good = WebhookReceiver()
    settings = ServerSettings(engine=EngineConfig(model="tiny"), redis_url=redis_url, alert_webhook=good.url)
    try:
        with BackgroundServer(create_app(settings)) as server:
            body = httpx.get(f"{server.url}/ready", timeout=10).json()
            assert body["alert_webhook"]["running"] and body["alert_webhook"]["restarts"] == 0
            task = server.state.webhook._task
            task.get_loop().call_soon_threadsafe(task.cancel)

            def restarted() -> bool:
                shown = httpx.get(f"{server.url}/ready", timeout=10).json()["alert_webhook"]
                return shown["restarts"] == 1 and shown["running"]

            wait_for(restarted, "/ready to show the restarted webhook", timeout=30)
    finally:
        good.close()
