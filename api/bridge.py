"""The bridge between the event loop and the engine.

One dedicated thread runs the engine's step loop; it sleeps on a condition while there is no work.
Each request gets its own asyncio queue, fed from the step thread with `loop.call_soon_threadsafe`, so
the event loop never waits on a step. Aborts are handed to the step thread and done between steps, so an
aborted request's KV blocks are free before the next step runs. A step that raises fails the requests
in flight (their streams get an `EngineFailure`), and the loop goes on with new work.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from api.errors import APIError
from api.metrics import Metrics
from api.pools import POOL_THREADS, WorkPool
from engine import Engine, EngineStats, RequestOutput, SamplingParams
from engine.cpu.build import usable_cores
from engine.request import Preprocessed

log = logging.getLogger(__name__)

URGENT_POLL_S = 0.05  # how often work held back for an urgent request looks again


class EngineFailure(RuntimeError):
    """The engine failed while running this request; the request was aborted."""


class RequestStream:
    """The outputs of one request, in order, as the step thread produces them."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, metrics: Metrics | None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last: RequestOutput | None = None

    def push(self, item: RequestOutput | EngineFailure) -> None:
        """Called from the step thread (or from `EngineBridge.abort`)."""
        if isinstance(item, RequestOutput):
            self.last = item
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    @staticmethod
    def push_step(items: list[tuple[RequestStream, RequestOutput]]) -> list[threading.Event]:
        """A step's outputs, from the step thread: one wake-up of each event loop for all of them (a wake-up
        per output had the loop take the GIL from the step thread once per stream and step). Returns an event
        per loop, set once that loop has run the streams these outputs woke up (see `EngineBridge._run`)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for stream, output in items:
            stream.last = output
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        handled = []
        for loop, queued in by_loop.items():
            event = threading.Event()
            loop.call_soon_threadsafe(_put_all, loop, queued, event)
            handled.append(event)
        return handled

    def push_abort(self) -> None:
        last = self.last
        self.push(RequestOutput(self.request_id, last.token_ids if last else [], last.text if last else "",
                                True, "abort", last.num_prompt_tokens if last else 0,
                                last.num_cached_tokens if last else 0))

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        last_time, last_count = self.arrival, 0
        while True:
            item = await self.queue.get()
            if isinstance(item, EngineFailure):
                raise item
            now = time.perf_counter()
            new_tokens = len(item.token_ids) - last_count
            if self.metrics is not None and new_tokens > 0:
                self.metrics.recent_output_tokens.add(new_tokens)
                if last_count == 0:
                    self.metrics.ttft.observe(now - self.arrival)
                else:
                    self.metrics.observe_itl((now - last_time) / new_tokens)
            last_time, last_count = now, len(item.token_ids)
            if item.finished:
                if self.metrics is not None:
                    self.metrics.e2e.observe(now - self.arrival)
                    self.metrics.finished.labels(item.finish_reason or "unknown").inc()
            yield item
            if item.finished:
                return

    async def final(self) -> RequestOutput:
        """The last output, once the request has finished."""
        last = None
        async for last in self:  # noqa: B007 - only the final output is wanted
            pass
        assert last is not None
        return last


def _put_all(loop: asyncio.AbstractEventLoop, queued: list[tuple[asyncio.Queue, RequestOutput]],
             handled: threading.Event) -> None:
    for queue, output in queued:
        queue.put_nowait(output)
    # The streams just woken run before callbacks scheduled after them: by the time this one runs, each has
    # written its chunk and awaits the next output.
    loop.call_soon(handled.set)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (None where there is none to find)."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def set_threads_here(threads: int) -> None:
    """Torch's parallel regions started on this thread (and the CPU kernels, which ask torch) run on `threads`.
    Only OpenMP's setting for this thread changes (`torch.set_num_threads` would also change MKL's, which is
    the whole process's)."""
    torch.get_num_threads()  # torch sets this thread's OpenMP threads at its first use: before, not after us
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(threads)


def one_thread_here() -> None:
    """Torch's parallel regions started on this thread run on it alone (`set_threads_here`)."""
    set_threads_here(1)


def build_engine(config: Any) -> Engine:
    """`Engine(config)` built on a thread of its own that then ends, taking its OpenMP thread pool with it: the
    step thread's pool is then the only one the process keeps (see `EngineBridge`)."""
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["engine"] = Engine(config)
        except BaseException as exc:  # re-raised on the caller's thread
            built["error"] = exc

    thread = threading.Thread(target=build, name="vlmcap-engine-load")
    thread.start()
    thread.join()
    if "error" in built:
        raise built["error"]
    return built["engine"]


class EngineBridge:
    """Runs `engine` on its own thread and serves its outputs to coroutines.

    The step thread is the process's one thread that runs torch and the CPU kernels on several threads
    (`Engine.num_threads`); every other thread that reaches torch runs it on one (`one_thread_here`). Each thread
    that starts parallel work keeps an OpenMP pool of its own, and while more pool threads live than the machine has
    cores, OpenMP's barriers stop spinning: every parallel region of the step then waits on the kernel
    (`build_engine` keeps the loading thread's pool from living on). Likewise while other threads run torch beside
    the steps (`beside`: a request's preprocessing, an event's embedding, an ask's prompt): where the step's threads
    and those would be more than the cores, a step runs on one thread fewer for each (`step_threads`), since a
    parallel region waits for its slowest thread, and one that shares a core waits for a time slice in every region
    of the step (what that costs: BENCHMARKS.md, the stall benchmark).

    After each step the thread waits (at most `HANDOVER_S`) until the event loop has sent what the step
    produced, and only then starts the next one: the loop's work for a step (events, JSON, socket writes)
    then runs between steps instead of inside the next one, where it would take a core from the step's
    threads and hold up all of them at their next barrier (what it costs without the wait: `vlmcap bench
    overhead`, BENCHMARKS.md)."""

    HANDOVER_S = 0.02
    BACKGROUND_WAIT_S = 30.0  # the longest `background` work waits for urgent requests to finish

    def __init__(self, engine: Engine, max_waiting_requests: int, metrics: Metrics | None = None,
                 admission: WorkPool | None = None) -> None:
        """`admission`: the pool requests are preprocessed in (default: its own, of the default settings), apart
        from every other kind of blocking work, so that admission never waits behind decoding."""
        self.engine = engine
        if admission is None:
            from api.settings import ServerSettings

            threads = POOL_THREADS["admission"]
            admission = WorkPool("admission", threads, ServerSettings.work_deadline_s,
                                 max(1, int(threads * ServerSettings.key_share)))
        self.admission = admission
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._streams: dict[str, RequestStream] = {}
        self._aborts: list[str] = []
        self._beside = 0  # threads running torch beside the steps now (`beside`: the step gives up threads for them)
        # Requests added with an inter-token target of their own, by priority (`background`, `_after_urgent`).
        self._urgent: dict[str, int] = {}
        self._entering = 0  # requests between `add` and the engine's queue (their turn, then preprocessing)
        self._cond = threading.Condition()
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.stats: EngineStats = engine.stats()
        self.num_threads = getattr(engine, "num_threads", None) or torch.get_num_threads()
        self.cores = usable_cores()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vlmcap-step-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._draining

    async def shutdown(self, grace_s: float) -> None:
        """Refuse new work, give in-flight requests `grace_s` seconds to finish, abort the rest, stop."""
        self._draining = True
        in_flight = len(self._streams)
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for request_id in left:
            self.abort(request_id)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.engine.close()  # the grammar compiler's child processes
        log.info("engine stopped: %d request(s) in flight at shutdown, %d finished, %d aborted",
                 in_flight, in_flight - len(left), len(left))

    # -- requests -------------------------------------------------------------------------------
    async def add(
        self,
        *,
        sampling: SamplingParams,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        videos: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
        embed_images: bool = False,
        itl_target_ms: float | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream. Raises APIError: 400 for a request the engine refuses,
        429 when the waiting queue is full, 503 while shutting down."""
        if not self.alive:
            raise APIError(503, "the engine is not running (starting or shutting down)", code="not_ready")
        if self.stats.num_waiting + self._entering >= self.max_waiting_requests:
            raise APIError(429, f"too many requests are waiting (limit {self.max_waiting_requests}); retry later",
                           code="queue_full")
        loop = asyncio.get_running_loop()
        stream = RequestStream(uuid.uuid4().hex, loop, self.metrics)
        with self._cond:
            self._streams[stream.request_id] = stream

        def add() -> None:
            def preprocess() -> Preprocessed:
                return self.engine.preprocess_request(
                    prompt=prompt, messages=messages, images=images, sampling=sampling, priority=priority,
                    request_id=stream.request_id, cache_salt=cache_salt, videos=videos,
                    mm_processor_kwargs=mm_processor_kwargs, prompt_token_ids=prompt_token_ids,
                    embed_images=embed_images, itl_target_ms=itl_target_ms)

            # Preprocessing with images or videos (tiles, frames: tens to hundreds of milliseconds of torch work) is
            # work beside the steps. A text prompt's (template and tokens: a millisecond or a few) is not counted:
            # a step that started meanwhile would give up a thread for all of its length, for the core that work
            # takes for a few milliseconds of it.
            if images or videos:
                with self.beside():
                    preprocessed = preprocess()
            else:
                one_thread_here()
                preprocessed = preprocess()
            self.engine.enqueue(preprocessed)  # waits for no step
            with self._cond:
                if itl_target_ms is not None:
                    self._urgent[stream.request_id] = priority
                self._cond.notify()

        # Preprocessing (template, tokens, image tiles) runs in the admission pool, the client key's turn. A
        # client leaving meanwhile, or a deadline passed, leaves no request behind: aborted here if it is in the
        # engine already, else its first output finds no stream and aborts it (`_deliver`).
        self._entering += 1  # counted as waiting from here, also while it waits for its turn
        try:
            if itl_target_ms is None:
                await self._after_urgent(priority)
            await self.admission.run(add)
        except ValueError as exc:
            self._forget(stream.request_id)
            raise APIError(400, str(exc), code="invalid_request") from None
        except BaseException:
            self.abort(stream.request_id)
            raise
        finally:
            self._entering -= 1
        return stream

    @contextmanager
    def beside(self) -> Iterator[None]:
        """Torch work on this thread beside the steps (a request's preprocessing, an event's embedding): it runs on
        one thread (`one_thread_here`) and is counted while it runs, so that the steps give up a thread for it where
        the cores are short (`step_threads`). Uncounted at its end, on this thread: the next step does not wait for
        the event loop to count it out."""
        one_thread_here()
        with self._cond:
            self._beside += 1
        try:
            yield
        finally:
            with self._cond:
                self._beside -= 1
                self._cond.notify()

    def _urgent_before(self, priority: float) -> bool:
        """Whether a request with an inter-token target of its own, of a priority value at most `priority`, is in
        flight (held under `_cond`)."""
        for request_id in [r for r in self._urgent if r not in self._streams]:  # finished, aborted or failed
            del self._urgent[request_id]
        return any(value <= priority for value in self._urgent.values())

    @contextmanager
    def background(self, lock: AbstractContextManager | None = None,
                   max_wait_s: float = BACKGROUND_WAIT_S) -> Iterator[None]:
        """`beside`, for work nobody waits on (an event's embedding): it first waits, at most `max_wait_s`, until no
        request that keeps an inter-token target of its own (a fall alert's caption) is in flight, so that it never
        takes a core from one; then takes `lock` (work that runs one at a time), and only then counts as work
        beside the steps, so that waiting for either takes no thread from them."""
        deadline = time.monotonic() + max_wait_s
        with self._cond:
            while self._urgent_before(math.inf) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, URGENT_POLL_S))
        with lock or nullcontext(), self.beside():
            yield

    async def _after_urgent(self, priority: int) -> None:
        """A request of a priority value at least an urgent one's in flight (a camera caption behind a fall alert's)
        could not be prefilled while that one decodes anyway (engine/scheduler.py): it is preprocessed after it, at
        most `BACKGROUND_WAIT_S` later, instead of taking a core from it now."""
        deadline = time.monotonic() + self.BACKGROUND_WAIT_S
        while time.monotonic() < deadline:
            with self._cond:
                if not self._urgent_before(priority):
                    return
            await asyncio.sleep(URGENT_POLL_S)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its stream ends with finish_reason "abort".
        Safe from any thread."""
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            self._aborts.append(request_id)
            self._cond.notify()
        stream.push_abort()
        if self.metrics is not None:
            self.metrics.aborted.inc()

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._streams.pop(request_id, None)

    # -- the step thread ------------------------------------------------------------------------
    def step_threads(self) -> int:
        """The threads of the next step: the engine's, less one for each thread working beside it (`beside`)
        beyond the cores the step's threads leave free (at least one)."""
        preparing = self._beside
        if not preparing:
            return self.num_threads
        spare = max(0, self.cores - self.num_threads)
        return max(1, self.num_threads - max(0, preparing - spare))

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        threads = self.num_threads
        log.info("step loop started")
        while True:
            with self._cond:
                while not (self._stopping or self._aborts or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                aborts, self._aborts = self._aborts, []
                if self._stopping and not aborts:
                    break
            for request_id in aborts:
                self._safe_abort(request_id)
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.stats()
                continue
            wanted = self.step_threads()
            if wanted != threads:
                threads = wanted
                set_threads_here(threads)
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine's state for these requests is unknown: fail them
                if self.metrics is not None:
                    self.metrics.step_failures.inc()
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            finally:
                self.stats = self.engine.stats()
            if self.metrics is not None:
                self.metrics.observe_step_tokens(self.stats.last_step_num_tokens)
            for handled in self._deliver(outputs):
                handled.wait(self.HANDOVER_S)
        log.info("step loop stopped")

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("aborting request %s failed", request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> list[threading.Event]:
        with self._cond:
            streams = [(self._streams.get(o.request_id), o) for o in outputs]
            for output in outputs:
                if output.finished:
                    self._streams.pop(output.request_id, None)
        handled = RequestStream.push_step([(stream, output) for stream, output in streams if stream is not None])
        for stream, output in streams:
            if stream is None and not output.finished:  # its client left while it was being added
                self._safe_abort(output.request_id)
        return handled

    def _fail_all(self, exc: Exception) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._safe_abort(request_id)
            stream.push(EngineFailure(f"the engine failed while running this request: {type(exc).__name__}: {exc}"))
