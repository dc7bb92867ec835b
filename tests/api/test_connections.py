"""Slow and piling connections on a real uvicorn server with the tiny model (api/connections.py): 200
connections that never finish their headers are closed at the header timeout and `/ready` and a chat answer
meanwhile; a body dripping a byte at a time is cut at the body timeout while a plain chat gets its tokens; past
`max_connections` the oldest header-less connection makes room for the new one; the access log keeps to its
rate and counts what it left out."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from api.background import BackgroundServer
from api.connections import RateLimitedLog, connection_class
from api.server import create_app
from api.settings import ServerSettings
from engine import EngineConfig

SLOW = 200
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0}


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(engine=EngineConfig(model="tiny"), header_timeout_s=2.0, body_timeout_s=2.0,
                              max_connections=SLOW + 40)
    with BackgroundServer(create_app(settings)) as running:
        yield running


def open_slow(url: str, count: int, start: bytes) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(start)
        sockets.append(sock)
    return sockets


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True once the server has closed `sock` (EOF or a reset), waiting at most `within_s`."""
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def chat_text(url: str) -> str:
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


@pytest.mark.timeout(300)
def test_unfinished_headers_are_closed_and_ready_answers_meanwhile(server):
    alone = chat_text(server.url)
    slow = open_slow(server.url, SLOW, b"GET /ready HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
    try:
        assert httpx.get(f"{server.url}/ready", timeout=60).status_code == 200
        assert chat_text(server.url) == alone
    finally:
        closed = [closed_by_server(sock, 60) for sock in slow]
    assert all(closed), f"{closed.count(False)} of {SLOW} slow connections left open"
    assert httpx.get(f"{server.url}/ready", timeout=60).status_code == 200


@pytest.mark.timeout(300)
def test_a_dripping_body_is_cut_while_a_plain_chat_gets_its_tokens(server):
    alone = chat_text(server.url)
    host, port = server.url.removeprefix("http://").split(":")
    drip = socket.create_connection((host, int(port)))
    drip.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    cut = False
    try:
        for _ in range(200):  # a byte every 0.1 s: far past the 2 s body timeout unless the server cuts it
            drip.sendall(b" ")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        cut = True
    assert chat_text(server.url) == alone
    assert cut or closed_by_server(drip, 30)


@pytest.mark.timeout(300)
def test_past_the_connection_limit_the_oldest_header_less_connection_makes_room(server):
    slow = open_slow(server.url, SLOW + 60, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
    try:
        assert httpx.get(f"{server.url}/ready", timeout=60).status_code == 200
        oldest = slow[0]
        assert closed_by_server(oldest, 30)
    finally:
        for sock in slow:
            sock.close()


def test_each_server_s_connection_class_has_its_own_settings():
    one = connection_class(ServerSettings(header_timeout_s=3.0, max_connections=7))
    two = connection_class(ServerSettings())
    assert (one.header_timeout_s, one.max_connections) == (3.0, 7)
    assert two.max_connections == ServerSettings.max_connections and one.awaiting_headers is not two.awaiting_headers
    for bad in ({"header_timeout_s": 0.0}, {"body_timeout_s": float("nan")}, {"max_connections": 0},
                {"access_log_per_s": -1.0}, {"key_share": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerSettings(**bad)


def test_the_access_log_keeps_to_its_rate_and_counts_what_it_left_out():
    """On a clock of its own: `time.monotonic` patched for the whole process froze the module's server thread's event
    loop in a wait that outlasted the test, and its shutdown took the fixture's whole minute."""
    now = [100.0]
    limit = RateLimitedLog(5.0, clock=lambda: now[0])
    records = [logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "GET / %d", (i,), None)
               for i in range(100)]
    passed = [r for r in records if limit.filter(r)]
    assert len(passed) == 5
    now[0] += 1.0  # a second later: room for five more, the first says how many were left out
    later = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "GET / %d", (100,), None)
    assert limit.filter(later) and "95 lines like this left out" in later.getMessage()


def test_listeners_are_bound_before_they_listen_and_a_port_in_use_is_named():
    """`bind_listeners` (what `vlmcap serve` holds before its imports): listening at once, so the port is its own (a
    second bind fails, naming the address) and a client connecting before anything accepts waits to be answered;
    a failure leaves none of the other sockets bound."""
    import errno

    from api.connections import bind_listeners

    (sock,) = bind_listeners("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        early = socket.create_connection(("127.0.0.1", port), timeout=5)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1 port {port}: ") as taken:
            bind_listeners("127.0.0.1", port)
        assert taken.value.errno == errno.EADDRINUSE
        accepted, _ = sock.accept()  # the early client, from the backlog
        early.sendall(b"hi")
        assert accepted.recv(2) == b"hi"
        accepted.close()
        early.close()
    finally:
        sock.close()
    with pytest.raises(OSError, match="cannot listen on 'no-such-host.invalid' port 0: "):
        bind_listeners("no-such-host.invalid", 0)
    every = bind_listeners("", 0)  # all addresses: one socket for each family the machine has
    try:
        families = {s.family for s in every}
        assert socket.AF_INET in families and families <= {socket.AF_INET, socket.AF_INET6}
        assert all(s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) for s in every if s.family == socket.AF_INET6)
    finally:
        for s in every:
            s.close()
    # All addresses asked for with the last one's port held: the sockets bound before the failure are closed again
    infos = socket.getaddrinfo(None, 0, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    last = infos[-1]
    holder = socket.socket(last[0], socket.SOCK_STREAM)
    if last[0] == socket.AF_INET6:
        holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    holder.bind(last[4])
    held = holder.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"port {held}: ") as refused:  # its traceback held: closed, not collected
            bind_listeners("", held)
        assert refused.value.errno == errno.EADDRINUSE
        for family, _, _, _, address in infos[:-1]:  # each free again: binding it without SO_REUSEADDR succeeds
            again = socket.socket(family, socket.SOCK_STREAM)
            if family == socket.AF_INET6:
                again.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            again.bind((address[0], held, *address[2:]))
            again.close()
    finally:
        holder.close()
