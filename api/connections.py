"""The server's connections under uvicorn: header and body timeouts, a limit on open connections, and a
rate-limited access log, so that slow or piling clients cannot hold the server's sockets and descriptors.

- A connection gets `header_timeout_s` for each request's line and headers (the first one from its accept, the
  next ones from the end of the previous response), and `body_timeout_s` for its body once the headers are in:
  past either, it is closed (a body's route sees the client gone). A request whose body is in runs as long as
  it takes (streams, long generations).
- At most `max_connections` connections are open: one more closes the oldest that has not sent its headers yet
  (a slowloris holds no place a real client needs), else is itself closed at once, before it holds a descriptor
  for long (uvicorn's own `limit_concurrency` is not used: it answers 503 to every request, a probe's too,
  while slow connections fill it).
- The access log and asyncio's accept errors write at most `access_log_per_s` lines a second; what is left out
  is counted in the next line that is written.

`uvicorn_config(app, settings, ...)` is the one place these reach uvicorn (`vlmcap serve`, `BackgroundServer`).
`bind_listeners` gives `vlmcap serve` its sockets before it imports the server (torch, transformers: seconds), so
that a port in use stops it at once; `ListeningServer` serves on them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.settings import ServerSettings

log = logging.getLogger(__name__)
RATE_LIMITED_LOGGERS = ("uvicorn.access", "asyncio", __name__)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the timeouts and the connection limit of `connection_class`'s settings."""

    header_timeout_s: float = ServerSettings.header_timeout_s
    body_timeout_s: float = ServerSettings.body_timeout_s
    max_connections: int = ServerSettings.max_connections
    # Connections waiting for a request's headers, oldest first (per server: `connection_class` makes the set).
    awaiting_headers: dict[GuardedH11Protocol, None]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._await_headers()
        if len(self.connections) > self.max_connections:
            open_now = sum(not c.transport.is_closing() for c in self.connections)
            if open_now > self.max_connections:
                oldest = next((c for c in self.awaiting_headers if c is not self), None)
                victim = oldest or self
                log.warning("%d connections open, the limit (max_connections): closing %s", open_now,
                            "the oldest that has sent no headers" if oldest else "the new one")
                victim._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.awaiting_headers.pop(self, None)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY and self.awaiting_headers.pop(self, ...) is None:
            self._arm(self.body_timeout_s, "its body")  # headers in: the body's deadline starts now
        elif state is not h11.IDLE and state is not h11.SEND_BODY:
            self.awaiting_headers.pop(self, None)
            self._disarm()  # the request is in: it runs as long as it takes

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()  # the next request's headers (uvicorn's keep-alive timeout may close it first)

    # -- deadlines ---------------------------------------------------------------------------------------------
    def _await_headers(self) -> None:
        self.awaiting_headers[self] = None
        self._arm(self.header_timeout_s, "its headers")

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, what: str, seconds: float) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info("closing a connection from %s: %s did not come within %g s", _peer(self.client), what, seconds)
            self._close()

    def _close(self) -> None:
        self._disarm()
        self.awaiting_headers.pop(self, None)
        self.transport.close()


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def connection_class(settings: ServerSettings) -> type[GuardedH11Protocol]:
    """The protocol class of one server, with its settings and its own set of connections awaiting headers."""
    return type("ServerH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": settings.header_timeout_s, "body_timeout_s": settings.body_timeout_s,
        "max_connections": settings.max_connections, "awaiting_headers": {}})


class RateLimitedLog(logging.Filter):
    """Lets at most `per_s` records a second through (a token bucket of one second's worth); the next record
    let through after some were dropped says how many. `clock`: the seconds it reads (tests give their own, so that
    nothing else in the process sees a changed `time.monotonic`)."""

    def __init__(self, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if per_s <= 0:
            raise ValueError(f"access_log_per_s must be positive, got {per_s}")
        self.per_s = per_s
        self._clock = clock
        self._tokens = max(1.0, per_s)
        self._last = clock()
        self._lock = threading.Lock()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(max(1.0, self.per_s), self._tokens + (now - self._last) * self.per_s)
            self._last = now
            if self._tokens < 1:
                self.dropped += 1
                return False
            self._tokens -= 1
            dropped, self.dropped = self.dropped, 0
        if dropped:
            record.msg = f"{record.msg} ({dropped} lines like this left out, over access_log_per_s)"
        return True


def limit_logs(per_s: float) -> RateLimitedLog:
    """Put one rate limit on the access log and asyncio's errors (replacing one put there before)."""
    limit = RateLimitedLog(per_s)
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RateLimitedLog)]:
            logger.removeFilter(old)
        logger.addFilter(limit)
    return limit


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """uvicorn's options for the connection settings of `settings` (the log's rate limit put in place now)."""
    limit_logs(settings.access_log_per_s)
    return {"http": connection_class(settings)}


def uvicorn_config(app: Any, settings: ServerSettings, **options: Any) -> Any:
    """uvicorn's Config for `app` with the connection settings of `settings` (`options`: uvicorn's others)."""
    return uvicorn.Config(app, **uvicorn_options(settings), **options)


def bind_listeners(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """A listening socket on `port` at each address `host` stands for, as asyncio's `create_server` binds them (a
    name or "" can stand for IPv4 and IPv6 addresses, each IPv6 socket for IPv6 only; uvicorn's backlog). Listening
    at once holds the port (Linux lets two sockets with SO_REUSEADDR bind one port until one listens); a client that
    connects before the server has started waits in the backlog and is answered then. OSError naming the address
    where one cannot be had (a port in use, a name that does not resolve), none of them left open."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:  # a name that does not resolve
        raise OSError(exc.errno, f"cannot listen on {host!r} port {port}: {exc.strerror}") from None
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                sock.listen(backlog)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {address[0]} port {address[1]}: {exc.strerror}") from None
            sock.set_inheritable(True)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


def socket_url(sock: socket.socket) -> str:
    """The http URL of a listening socket's address (an IPv6 address in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class ListeningServer(uvicorn.Server):
    """uvicorn's Server for sockets bound beforehand (`bind_listeners`), saying where it listens once started, as
    uvicorn says it of the sockets it binds itself."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in (sockets or []) if self.started else []:
            logging.getLogger("uvicorn.error").info("vlmcap listening on %s (Press CTRL+C to quit)", socket_url(sock))
