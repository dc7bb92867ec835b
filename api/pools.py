"""The server's blocking work, in bounded thread pools by kind, fair between clients.

Every piece of blocking work a request brings (its admission into the engine: template, tokens, image tiles;
decoding an image or a video; drawing a dashboard frame; reading a summary's window; checking a schema) runs in
the pool of its kind, never on asyncio's default executor: a kind that is busy (heavy media) holds only its own
threads, so admission never waits behind decoding. Within a pool the work waits in one queue per client key and
the keys take turns (round robin), and no key runs on more than its share of the pool's threads at once
(`ServerSettings.key_share`): a client that floods a pool waits behind its own work, not the others' behind it.
Each call has a deadline (`ServerSettings.work_deadline_s`) on its wait and its run: past it the caller gets a
503 (`code: "busy"`), and a run that is still going keeps its thread until it ends (so the bound holds).

A request's key is the name of the API key it came with (`api.guard`), else its client address; work outside a
request (the queue worker's jobs) passes its own (`camera:<id>`). `work_pools(holder)` gives the pools of one
server (kept on its app state or `ServerState`), made at first use from its settings.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from api.errors import APIError

log = logging.getLogger(__name__)
T = TypeVar("T")

# The threads of each kind of work (the machine's cores are shared with the engine's step thread: these are
# for waiting on slow work without holding up other kinds, not for more parallelism).
POOL_THREADS: dict[str, int] = {"admission": 4, "decode": 3, "render": 2, "summary": 2, "schema": 2}
# The key of work that no request's client owns.
SERVER_KEY = "server"
# The client key of the request being served (set by the guard middleware, read by `WorkPool.run`).
CLIENT_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("vlmcap_client_key", default=None)


class PoolBusy(APIError):
    """The work did not get a thread, or did not end, within its deadline (told to retry after that deadline: the
    work holding the threads has had it too)."""

    def __init__(self, kind: str, deadline_s: float, started: bool) -> None:
        what = "did not finish" if started else "found no free worker"
        super().__init__(503, f"the server's {kind} work {what} within {deadline_s:g} s (it is busy); retry later",
                         code="busy", retry_after_s=deadline_s)
        self.kind = kind


@dataclass
class _Ticket:
    key: str
    loop: asyncio.AbstractEventLoop
    granted: asyncio.Future


@dataclass
class PoolStats:
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    timed_out: int = 0


class WorkPool:
    """`threads` threads for one kind of blocking work; each key runs on at most `per_key` of them at once and
    the keys' waiting work takes turns. Safe to use from several event loops."""

    def __init__(self, kind: str, threads: int, deadline_s: float, per_key: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"a {kind} pool needs at least one thread, got {threads}")
        if deadline_s <= 0:
            raise ValueError(f"the {kind} pool's deadline must be positive, got {deadline_s}")
        per_key = threads if per_key is None else per_key
        if not 1 <= per_key <= threads:
            raise ValueError(f"the {kind} pool's per-key share must be 1-{threads} threads, got {per_key}")
        self.kind, self.threads, self.deadline_s, self.per_key = kind, threads, deadline_s, per_key
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"vlmcap-{kind}")
        self._lock = threading.Lock()
        self._busy = 0
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[_Ticket]] = {}
        self._turns = itertools.count()
        self._last_turn: dict[str, int] = {}  # when each key running or waiting last got a thread
        self.timed_out = 0

    async def run(self, fn: Callable[..., T], /, *args: Any, key: str | None = None,
                  deadline_s: float | None = None, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on one of the pool's threads, for `key` (default: the request's client key),
        within `deadline_s` (default: the pool's) from now; PoolBusy past it. The call's context (contextvars)
        goes with it."""
        key = key or CLIENT_KEY.get() or SERVER_KEY
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        ends = time.monotonic() + deadline_s
        loop = asyncio.get_running_loop()
        ticket = _Ticket(key, loop, loop.create_future())
        self._enter(ticket)
        try:
            await asyncio.wait_for(asyncio.shield(ticket.granted), deadline_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if not self._withdraw(ticket):  # granted meanwhile: the slot is ours to give back
                self._release(key)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.timed_out += 1
            raise PoolBusy(self.kind, deadline_s, started=False) from None
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        work = loop.run_in_executor(self._executor, self._call, key, call)
        try:
            return await asyncio.wait_for(asyncio.shield(work), max(0.0, ends - time.monotonic()))
        except TimeoutError:
            self.timed_out += 1
            log.warning("%s work of %s still running past its deadline of %g s", self.kind, key, deadline_s)
            raise PoolBusy(self.kind, deadline_s, started=True) from None

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(dict(self._running), {k: len(q) for k, q in self._waiting.items()}, self.timed_out)

    def __repr__(self) -> str:
        return f"WorkPool({self.kind!r}, threads={self.threads}, per_key={self.per_key}, deadline_s={self.deadline_s})"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the turns -----------------------------------------------------------------------------------------
    def _call(self, key: str, call: Callable[[], T]) -> T:
        try:
            return call()
        finally:
            self._release(key)

    def _enter(self, ticket: _Ticket) -> None:
        with self._lock:
            if not self._waiting and self._may_run(ticket.key):
                self._take(ticket.key)
                ticket.granted.set_result(None)
                return
            self._waiting.setdefault(ticket.key, deque()).append(ticket)
        self._grant()  # a key with no work waiting may run beside those that wait

    def _withdraw(self, ticket: _Ticket) -> bool:
        """Take a ticket out of the queue; False when it was granted already."""
        with self._lock:
            queue = self._waiting.get(ticket.key)
            if queue is None or ticket not in queue:
                return False
            queue.remove(ticket)
            if not queue:
                del self._waiting[ticket.key]
            return True

    def _may_run(self, key: str) -> bool:
        return self._busy < self.threads and self._running.get(key, 0) < self.per_key

    def _take(self, key: str) -> None:
        self._busy += 1
        self._running[key] = self._running.get(key, 0) + 1
        self._last_turn[key] = next(self._turns)

    def _release(self, key: str) -> None:
        with self._lock:
            self._busy -= 1
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
                if key not in self._waiting:
                    self._last_turn.pop(key, None)
        self._grant()

    def _grant(self) -> None:
        """Hand free threads to waiting keys, the one that got a thread longest ago first (a key new to the pool
        before all), each key's oldest ticket first."""
        granted = []
        with self._lock:
            while self._busy < self.threads:
                ready = [key for key in self._waiting if self._may_run(key)]
                if not ready:
                    break
                key = min(ready, key=lambda k: self._last_turn.get(k, -1))
                queue = self._waiting[key]
                ticket = queue.popleft()
                if not queue:
                    del self._waiting[key]
                self._take(key)
                granted.append(ticket)
        for ticket in granted:
            ticket.loop.call_soon_threadsafe(self._deliver, ticket)

    def _deliver(self, ticket: _Ticket) -> None:
        if ticket.granted.done():  # its caller left (deadline, cancelled) before the grant reached it
            self._release(ticket.key)
        else:
            ticket.granted.set_result(None)


class WorkPools:
    """One server's pools, one per kind in POOL_THREADS."""

    def __init__(self, deadline_s: float, key_share: float) -> None:
        if not 0 < key_share <= 1:
            raise ValueError(f"key_share must be over 0 and at most 1, got {key_share}")
        self.pools = {kind: WorkPool(kind, threads, deadline_s, max(1, math.floor(threads * key_share)))
                      for kind, threads in POOL_THREADS.items()}

    def __getitem__(self, kind: str) -> WorkPool:
        return self.pools[kind]

    async def run(self, kind: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the pool of `kind` (`WorkPool.run`'s `key=` and `deadline_s=` too)."""
        return await self.pools[kind].run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


_made = threading.Lock()


def work_pools(holder: Any) -> WorkPools:
    """The pools of one server, made at first use. `holder`: its `ServerState` or app state (anything with
    `settings`), its `ServerSettings`, or the `Limits` of those settings (what the media helpers have): the
    pools are kept on that `Limits`, so each of these finds the same ones. Made from the settings' deadline and
    key share where the holder has them, else the defaults."""
    settings = getattr(holder, "settings", None)
    if settings is None and hasattr(holder, "work_deadline_s"):
        settings = holder
    home = settings.limits if settings is not None else holder
    pools = getattr(home, "work_pools", None)
    if pools is None:
        with _made:
            pools = getattr(home, "work_pools", None)
            if pools is None:
                from api.settings import ServerSettings  # the defaults, where the holder has no settings

                settings = settings or ServerSettings()
                pools = WorkPools(settings.work_deadline_s, settings.key_share)
                home.work_pools = pools
    return pools
