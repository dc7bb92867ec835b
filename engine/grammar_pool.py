"""Grammar compiling in supervised child processes: a grammar that crashes the compiler (SIGSEGV), or takes
past its deadline, ends its child, never the server.

Each worker is a child forked from the engine's process (so it starts at once, with xgrammar and the tokenizer
already loaded) that compiles one spec at a time and sends the compiled grammar back serialized. A compile
waits for an idle worker (GrammarBusy past `GrammarLimits.compile_timeout_s`), then for its answer until
`compile_timeout_s`; one past its deadline, or cancelled by its caller (a client that left), has its child
killed, and a dead child is replaced by a new one before the next compile. Compiles are fair between keys (a
client: its cache salt, API key or address, `GRAMMAR_KEY`): no key compiles on more than KEY_SHARE of the
workers at once, and the waiting compiles of keys under their share go first come, first served, so one client's
slow schemas do not hold up another client's small one. Callers block in the thread they call from: the server
calls from a pool of threads fair between its clients (api/pools.py, "schema"), else this pool's own
(`executor`), never from the one that admits requests.
"""

from __future__ import annotations

import contextvars
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.child_slots import kill_idle
from engine.grammar_limits import GrammarLimits

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting compile looks at its cancel event
NICE = 5  # the workers' CPU priority below the engine's (as the media box's children): a costly schema slows its
# own request first, not the steps of everyone's tokens
KEY_SHARE = 0.5  # the most of the workers one key compiles on at once (at least one worker)
DEFAULT_KEY = "server"  # the key of compiles no client's key comes with
# The key a compile is for, read by `GrammarPool.compile` (set with `keyed`).
GRAMMAR_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("vlmcap_grammar_key", default=None)
T = TypeVar("T")


def keyed(key: str | None, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` with `GRAMMAR_KEY` set to `key`, in a context of its own (a pool thread's context is kept
    from one call to the next)."""
    def call() -> T:
        GRAMMAR_KEY.set(key)
        return fn(*args)
    return contextvars.Context().run(call)


class GrammarTimeout(ValueError):
    """A compile ran past `GrammarLimits.compile_timeout_s` (its child was killed)."""

    limit = "compile_timeout_s"


class GrammarBusy(GrammarTimeout):
    """No worker was free for the compile's key within its wait (the workers are busy: retry later, after
    `retry_after_s`)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GrammarCancelled(ValueError):
    """The caller gave up on the compile (its child was killed)."""


def _close_inherited(keep: int) -> None:
    """Close what the child inherited from the server but its own pipe: listening sockets, other children's pipes,
    the pipes by which helpers (an embedded Redis) learn that the server ended; stdin from /dev/null."""
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _serve(conn: Any, info: Any, compile_one: Any) -> None:
    """A worker's loop: (kind, text) in, ("ok", serialized) or ("error", message) out, until the pipe closes."""
    _close_inherited(conn.fileno())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; the child ends when its pipe does
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.nice(NICE)
    import xgrammar

    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            conn.send(("ok", compile_one(xgrammar, compiler, kind, text).serialize_json()))
        except Exception as exc:  # xgrammar raises RuntimeError (and others) from its C++ core
            conn.send(("error", str(exc)))


class _Worker:
    def __init__(self, context: Any, info: Any, compile_one: Any) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, info, compile_one), daemon=True,
                                       name="vlmcap-grammar")
        self.process.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.exit_code()
        self.conn.close()

    def exit_code(self, wait_s: float = 5.0) -> int | None:
        """The child's exit code (negative: the signal that ended it), waiting for it to be reaped. The child
        closed the pipes multiprocessing's `join` waits on (`_close_inherited`), so this polls."""
        deadline = time.monotonic() + wait_s
        while self.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.process.exitcode


class GrammarPool:
    """`limits.workers` supervised children that compile grammars for one tokenizer (`info`, an xgrammar
    TokenizerInfo). `compile_one(xgrammar, compiler, kind, text)` runs in the child and returns a compiled
    grammar; `compile` returns it deserialized in the caller's process."""

    START_TIMEOUT_S = 60.0

    def __init__(self, info: Any, limits: GrammarLimits, compile_one: Any) -> None:
        self.info = info
        self.limits = limits
        self.compile_one = compile_one
        self._context = multiprocessing.get_context("fork")
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(limits.workers):
            self._idle.put(None)  # a slot: its worker is started at first use
        self.per_key = max(1, int(limits.workers * KEY_SHARE))
        self._turns = threading.Condition()
        self._running: dict[str, int] = {}  # workers each key compiles on
        self._tickets: deque[tuple[str, object]] = deque()  # the waiting compiles, oldest first
        self.executor = ThreadPoolExecutor(max_workers=limits.workers + 2, thread_name_prefix="vlmcap-grammar")
        self.restarts = 0  # children killed (deadline, cancel) or found dead (crash)
        self.started = 0  # children started

    def compile(self, kind: str, text: str, cancelled: threading.Event | None = None, key: str | None = None,
                wait_s: float | None = None) -> Any:
        """The compiled grammar of (kind, text) for `key` (default: `GRAMMAR_KEY`'s); ValueError for one that does
        not compile, GrammarBusy when no worker was free for it within `wait_s` (default: compile_timeout_s),
        GrammarTimeout past the deadline, GrammarCancelled when `cancelled` is set first, ValueError when the
        compiler crashed."""
        key = key or GRAMMAR_KEY.get() or DEFAULT_KEY
        slot = self._take(cancelled, key, self.limits.compile_timeout_s if wait_s is None else wait_s)
        worker = None
        try:
            worker = self._started(slot)
            worker.conn.send((kind, text))
            status, payload = self._answer(worker, cancelled)
        except BaseException:
            if worker is not None:
                worker.kill()
                self.restarts += 1
            self._give_back(None, key)
            raise
        self._give_back(worker, key)
        if status != "ok":
            raise ValueError(payload)
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(payload, self.info)

    def waiting(self) -> dict[str, int]:
        """The compiles waiting for a worker, by key."""
        with self._turns:
            counts: dict[str, int] = {}
            for key, _ in self._tickets:
                counts[key] = counts.get(key, 0) + 1
            return counts

    def running(self) -> dict[str, int]:
        """The workers compiling, by key."""
        with self._turns:
            return dict(self._running)

    def _take(self, cancelled: threading.Event | None, key: str, wait_s: float) -> _Worker | None:
        """An idle worker slot, when this compile's turn comes: the oldest waiting compile whose key is under its
        share. GrammarBusy past `wait_s`, GrammarCancelled once `cancelled` is set."""
        ends = time.monotonic() + wait_s
        ticket = (key, object())
        with self._turns:
            self._tickets.append(ticket)
            try:
                while True:
                    if cancelled is not None and cancelled.is_set():
                        raise GrammarCancelled("the grammar's compile was cancelled")
                    if not self._idle.empty() and self._next_turn() is ticket:
                        self._running[key] = self._running.get(key, 0) + 1
                        return self._idle.get_nowait()
                    left = ends - time.monotonic()
                    if left <= 0:
                        raise GrammarBusy(f"no grammar compiler was free within {wait_s:g} s (compile_timeout_s): "
                                          "the server is busy compiling; retry later", wait_s)
                    self._turns.wait(min(POLL_S, left))
            finally:
                self._tickets.remove(ticket)
                self._turns.notify_all()

    def _next_turn(self) -> tuple[str, object] | None:
        return next((t for t in self._tickets if self._running.get(t[0], 0) < self.per_key), None)

    def _give_back(self, worker: _Worker | None, key: str) -> None:
        with self._turns:
            self._idle.put(worker)
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
            self._turns.notify_all()

    def _started(self, worker: _Worker | None) -> _Worker:
        if worker is not None and worker.process.is_alive():
            return worker
        if worker is not None:
            worker.kill()
        worker = _Worker(self._context, self.info, self.compile_one)
        self.started += 1
        if not worker.conn.poll(self.START_TIMEOUT_S):
            raise RuntimeError("a grammar compiler process did not start")
        worker.conn.recv()
        return worker

    def _answer(self, worker: _Worker, cancelled: threading.Event | None) -> tuple[str, str]:
        deadline = time.monotonic() + self.limits.compile_timeout_s
        while not worker.conn.poll(POLL_S):
            if cancelled is not None and cancelled.is_set():
                raise GrammarCancelled("the grammar's compile was cancelled")
            if time.monotonic() > deadline:
                raise GrammarTimeout(f"the grammar took longer than {self.limits.compile_timeout_s:g} s to compile "
                                     "(compile_timeout_s)")
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            code = worker.exit_code()
            why = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            log.error("a grammar compiler process died (%s); it is replaced", why)
            raise ValueError(f"the grammar crashed the compiler ({why}); it cannot be used") from None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        kill_idle(self._idle)
