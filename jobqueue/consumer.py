"""The consumer half of the job queue, independent of the engine: a member of the consumer group that
reads camera jobs, captions them through any `Captioner` and finishes each job exactly once.

- New jobs come in batches through `XREADGROUP`; jobs left pending by a dead or stuck consumer (or by a
  failed attempt) are taken over with `XAUTOCLAIM` once idle for `claim_idle_seconds`.
- A job whose attempt fails is retried after that idle time; on its `max_deliveries`-th failed attempt,
  or when delivered more often than that without finishing (a consumer that keeps dying on it), it goes
  to the dead-letter stream with its error.
- Finishing (result, caption feeds, dead letter, `XACK`, `XDEL`) is one atomic script that writes the
  result only if the job has none yet, so a redelivered job never yields a second caption. Just before,
  the job's image and boxes are kept under the contract's frame key for viewers (idempotent per job).
- Redis errors never end the worker: it backs off and reconnects, and re-creates its group when a
  restarted Redis lost it.

Captioners: `api.captioner.EngineCaptioner` (the server's own engine, in-process) and
`jobqueue.openai_captioner.OpenAICaptioner` (any OpenAI-compatible server, for `vlmcap worker`). The readers of
what workers write are in `jobqueue.results`."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobqueue.checks import at_least, not_negative
from jobqueue.connection import connect
from jobqueue.contract import (
    CONSUMER_GROUP,
    DEAD_STREAM,
    DEAD_STREAM_MAXLEN,
    FRAME_TTL_SECONDS,
    JOBS_STREAM,
    CaptionResult,
    Job,
    JobStatus,
    as_text,
    dead_letter_fields,
    flag_text,
    flat,
    frame_key,
    result_key,
)
from jobqueue.finish import FAIL_SCRIPT, FINISH_RESULT_LUA, FinishedJob
from jobqueue.results import get_result
from jobqueue.settings import QueueSettings
from jobqueue.structured import SchemaRefused, caption_validator, structured_caption

log = logging.getLogger(__name__)

# The job the calling task captions (set by the worker around `caption_job`, in the job's own task): a captioner
# that shares blocking work between clients takes turns by it (api/captioner.py: the camera's key, an alert's own).
current_job: contextvars.ContextVar[Job | None] = contextvars.ContextVar("vlmcap_current_job", default=None)

DEFAULT_CAPTION_PRIORITY = QueueSettings.caption_priority
DEFAULT_FALL_PRIORITY = QueueSettings.fall_priority


class Captioner(Protocol):
    """What the worker hands each job to: one method per shape of job, each with the job's JSON schema (`schema`:
    JSON text under it is returned; None: a free caption) and cache salt (`cache_salt`: cached prefixes and image
    features shared only with requests of the same salt; None: the server's default). `caption_job` says which
    method a job goes to. Each raises for input it cannot use (an undecodable image, a model without a video path),
    which is the job's error."""

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        """The caption of a job of one JPEG image (`Job.image`)."""
        ...

    async def caption_frames(self, images: list[bytes], notes: list[str], prompt: str, priority: int,
                             schema: dict | None = None, cache_salt: str | None = None) -> str:
        """The caption of a job with several frames (`Job.frames`), as one multi-image prompt: each note (when
        not empty) then its image, in order, then `prompt` (`frame_parts`)."""
        ...

    async def caption_video(self, video: bytes, prompt: str, priority: int, schema: dict | None = None,
                            cache_salt: str | None = None) -> str:
        """The caption of a job's clip (`Job.video`): the clip, its frames sampled under the server's limits,
        then `prompt`."""
        ...


def frame_parts(notes: list[str], prompt: str, image_part: Callable[[int], dict]) -> list[dict]:
    """The content parts of a prompt of several frames: each note that is not empty as a text part, then frame
    i's part (`image_part(i)`), in order, then `prompt`."""
    parts: list[dict] = []
    for index, note in enumerate(notes):
        if note:
            parts.append({"type": "text", "text": note})
        parts.append(image_part(index))
    parts.append({"type": "text", "text": prompt})
    return parts


async def caption_job(captioner: Captioner, job: Job, priority: int) -> str:
    """A job's caption: a job with a clip through `caption_video`, one with frames through `caption_frames`, a
    one-image job (every producer's before several-frame jobs) through `caption`."""
    if job.video is not None:
        return await captioner.caption_video(job.video, job.prompt, priority, schema=job.schema,
                                             cache_salt=job.cache_salt)
    if job.frames:
        return await captioner.caption_frames([f.image for f in job.frames], [f.note for f in job.frames],
                                              job.prompt, priority, schema=job.schema, cache_salt=job.cache_salt)
    return await captioner.caption(job.image, job.prompt, priority, schema=job.schema, cache_salt=job.cache_salt)


# First-writer-wins finish (jobqueue/finish.py), atomic with the XACK/XDEL of the stream entry.
# KEYS: result key, jobs stream, dead-letter stream.
# ARGV: group, entry id, dead maxlen, number of result fields, result fields..., dead-letter fields (none when the
#       job is done).
FINISH_SCRIPT = FINISH_RESULT_LUA + """
local first = not is_finished(KEYS[1])
if first then
  local nresult = tonumber(ARGV[4]) * 2
  finish_result(KEYS[1], {unpack(ARGV, 5, 4 + nresult)})
  if #ARGV > 4 + nresult then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 5 + nresult, #ARGV))
  end
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
if first then return 1 end
return 0
"""

# Marks an attempt in the result unless the job is already finished (then returns 0).
# KEYS: result key. ARGV: field/value pairs.
ATTEMPT_SCRIPT = FINISH_RESULT_LUA + """
if is_finished(KEYS[1]) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


# Marks jobs claimed by this worker, each whose result exists and is not finished (a producer need not write one;
# a finished one stays as it is). KEYS: result keys. ARGV: consumer, claimed_at, then each key's deliveries.
CLAIM_SCRIPT = FINISH_RESULT_LUA + """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 and not is_finished(key) then
    redis.call('HSET', key, 'status', '""" + JobStatus.CLAIMED.value + """', 'consumer', ARGV[1], 'claimed_at', ARGV[2],
               'deliveries', ARGV[2 + i])
  end
end
return 1
"""

# Hands jobs this worker claimed and never started back to the queue's state (it stops): each result still
# claimed by this worker is queued again. KEYS: result keys. ARGV: consumer.
UNCLAIM_SCRIPT = """
for _, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'status') == '""" + JobStatus.CLAIMED.value + """'
      and redis.call('HGET', key, 'consumer') == ARGV[1] then
    redis.call('HSET', key, 'status', '""" + JobStatus.QUEUED.value + """')
    redis.call('HDEL', key, 'consumer', 'claimed_at')
  end
end
return 1
"""


@dataclass
class WorkerStats:
    done: int = 0
    dead: int = 0
    failed_attempts: int = 0
    duplicates: int = 0  # deliveries of jobs already finished, acknowledged without work
    claimed: int = 0
    redis_errors: int = 0
    errors: int = 0  # unexpected errors, each logged with its job or round; the worker went on


def is_alert(fields: dict) -> bool:
    """Whether a job's stream entry is a fall alert (`Job.fall`: its fall flag, or its kind), read without
    decoding the job."""
    def value(name: str) -> str:
        raw = fields.get(name.encode(), fields.get(name, b""))
        try:
            return as_text(raw) if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:  # a malformed entry: an ordinary job, dead-lettered when decoded
            return ""
    return value("fall") == flag_text(True) or value("kind") == "fall"


def _job_id(fields: dict) -> str | None:
    """A stream entry's job id as text, read without decoding the job (None when it has none)."""
    job_id = fields.get(b"job_id", fields.get("job_id"))
    if isinstance(job_id, bytes):
        job_id = job_id.decode(errors="replace")
    return job_id or None


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class QueueWorker:
    def __init__(
        self,
        redis_client: aioredis.Redis | str,
        captioner: Captioner,
        consumer_name: str | None = QueueSettings.consumer_name,
        claim_idle_seconds: float = QueueSettings.claim_idle_seconds,
        max_deliveries: int = QueueSettings.max_deliveries,
        caption_priority: int = QueueSettings.caption_priority,
        batch_size: int = QueueSettings.batch_size,
        block_seconds: float = 1.0,
        max_backoff_seconds: float = 10.0,
        fall_priority: int = QueueSettings.fall_priority,
        on_alert: Callable[[CaptionResult], None] | None = None,
        on_finished: FinishedJob | None = None,
    ) -> None:
        """`fall_priority` is the engine priority of fall jobs (`Job.fall`); `on_alert` is called, without
        waiting on it, with the stored result of each fall job this worker finishes first (e.g.
        `AlertWebhook.notify`); `on_finished` with each job it finishes first and its result (the event store)."""
        at_least("max_deliveries", max_deliveries, 1)
        not_negative("claim_idle_seconds", claim_idle_seconds)
        at_least("batch_size", batch_size, 1)
        self.redis = connect(redis_client, block_seconds) if isinstance(redis_client, str) else redis_client
        self.captioner = captioner
        self.consumer_name = consumer_name or default_consumer_name()
        self.claim_idle_seconds = claim_idle_seconds
        self.max_deliveries = max_deliveries
        self.caption_priority = caption_priority
        self.fall_priority = fall_priority
        self.on_alert = on_alert
        self.on_finished = on_finished
        self.batch_size = batch_size
        self.block_ms = int(block_seconds * 1000)
        self.max_backoff_seconds = max_backoff_seconds
        self.stats = WorkerStats()
        self._finish = self.redis.register_script(FINISH_SCRIPT)
        self._attempt = self.redis.register_script(ATTEMPT_SCRIPT)
        self._claim = self.redis.register_script(CLAIM_SCRIPT)
        self._unclaim = self.redis.register_script(UNCLAIM_SCRIPT)
        self._fail = self.redis.register_script(FAIL_SCRIPT)
        self._group_ready = False
        self._claim_cursor = "0-0"
        self._stop_event: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._redis_down_since: float | None = None
        # The flow of `run`: jobs claimed and not started yet (alerts first), the jobs running (alerts apart, so
        # they never wait for a slot behind other jobs), and the ids of both (a job claimed again is not run twice).
        self._waiting: list[tuple[str, dict, int]] = []
        self._running: dict[bool, set[asyncio.Task]] = {True: set(), False: set()}
        self._claimed: set[str] = set()
        self._claimed_at: dict[str, float] = {}  # entry id -> when this worker claimed it (until its job ends)
        self._failures: list[BaseException] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Run in the background of the running event loop (e.g. a FastAPI lifespan)."""
        self._stop_event = asyncio.Event()
        self._task = asyncio.create_task(self.run(self._stop_event),
                                         name=f"queue-worker-{self.consumer_name}")
        self._task.add_done_callback(self._ended)
        return self._task

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop after the jobs in progress (cancelled after `timeout`; its jobs, and those claimed but not
        started, stay pending and are reclaimed by another consumer)."""
        if self._task is None or self._stop_event is None:
            return
        self._stop_event.set()
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            log.warning("queue worker %s did not stop within %.0f s; cancelled", self.consumer_name, timeout)
        self._task = None

    @property
    def alive(self) -> bool:
        """Started and still running (a worker that was never started, stopped or died is not)."""
        return self._task is not None and not self._task.done()

    @property
    def jobs_in_hand(self) -> dict[str, int]:
        """The jobs this worker holds now: `claimed` (read, waiting for one of its slots) and `running`."""
        return {"claimed": len(self._waiting), "running": sum(len(tasks) for tasks in self._running.values())}

    @property
    def redis_reachable(self) -> bool:
        """False from a Redis error until the next round that reaches Redis."""
        return self._redis_down_since is None

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("queue worker %s stopped by an error", self.consumer_name, exc_info=task.exception())

    async def _pause(self, stop_event: asyncio.Event, seconds: float) -> None:
        try:
            await asyncio.wait_for(stop_event.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Hands each job on to the captioner as it is claimed, until `stop_event` is set: at most `batch_size`
        jobs run at once, fall alerts apart (at most `batch_size` more), so an alert claimed behind slow jobs
        starts at once; alerts first among the jobs claimed together. No error ends it: Redis errors back off
        and reconnect, any other error is logged and the loop goes on (a job that failed that way stays
        pending, is reclaimed and, past `max_deliveries`, dead-lettered)."""
        stop_event = stop_event or asyncio.Event()
        log.info("queue worker %s joined group %s on %s", self.consumer_name, CONSUMER_GROUP, JOBS_STREAM)
        try:
            await self._run(stop_event)
        finally:  # the jobs in progress end (a cancelled stop cancels them: they stay pending)
            running = [task for tasks in self._running.values() for task in tasks]
            if running:
                try:
                    await asyncio.gather(*running, return_exceptions=True)
                finally:
                    for task in running:
                        task.cancel()
            await self._hand_back(self._waiting)
            self._waiting.clear()
            self._claimed.clear()
            self._claimed_at.clear()

    async def _run(self, stop_event: asyncio.Event) -> None:
        backoff = 0.0
        while not stop_event.is_set():
            try:
                await self._feed()
                backoff = 0.0
                self._redis_down_since = None
            except (RedisConnectionError, RedisTimeoutError, OSError) as err:
                self.stats.redis_errors += 1
                self._group_ready = False
                if self._redis_down_since is None:
                    self._redis_down_since = time.monotonic()
                backoff = min(self.max_backoff_seconds, backoff * 2 or 0.1)
                log.warning("queue worker %s: Redis unreachable (%s); retrying in %.1f s",
                            self.consumer_name, err, backoff)
                await self._pause(stop_event, backoff)
            except ResponseError as err:
                self._group_ready = False
                if "NOGROUP" in str(err):
                    log.warning("queue worker %s: consumer group missing (Redis restarted empty?); recreating",
                                self.consumer_name)
                    continue
                self.stats.errors += 1
                log.error("queue worker %s: Redis refused a command (%s); retrying", self.consumer_name, err)
                await self._pause(stop_event, self.max_backoff_seconds)
            except Exception:
                self.stats.errors += 1
                log.exception("queue worker %s: unexpected error in a round; going on", self.consumer_name)
                await self._pause(stop_event, min(1.0, self.max_backoff_seconds))

    async def run_once(self) -> int:
        """One round: take over stale jobs, else wait up to `block_seconds` for new ones; process them.
        Returns how many entries were handled."""
        await self._ensure_group()
        entries = await self._claim_stale()
        if not entries:
            entries = await self._read_new()
        if entries:
            await self._mark_claimed(entries)
            await asyncio.gather(*(self._process_guarded(entry_id, fields, deliveries)
                                   for entry_id, fields, deliveries in entries))
        return len(entries)

    async def _feed(self) -> None:
        """One step of `run`: a Redis error of a job that ended goes up (the loop's backoff); claimed jobs start
        where a slot is free; then stale or new jobs are claimed while fewer than `batch_size` wait, else the
        step waits for a job to end."""
        if self._failures:
            failure, self._failures = self._failures[0], []
            raise failure
        await self._ensure_group()
        self._start_waiting()
        room = self.batch_size - len(self._waiting)
        if room <= 0:
            running = self._running[True] | self._running[False]
            if running:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            return
        entries = await self._claim_stale(room)
        if not entries:
            entries = await self._read_new(room)
        for entry_id, _, _ in entries:
            self._claimed.add(entry_id)
        await self._mark_claimed(entries)
        self._waiting.extend(entries)
        self._waiting.sort(key=lambda entry: not is_alert(entry[1]))  # stable: alerts first, else in claim order
        self._start_waiting()

    def _start_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for entry in waiting:
            tasks = self._running[is_alert(entry[1])]
            if len(tasks) >= self.batch_size:
                self._waiting.append(entry)
                continue
            task = asyncio.create_task(self._process_guarded(*entry), name=f"job-{entry[0]}")
            tasks.add(task)
            task.add_done_callback(lambda done, entry_id=entry[0], tasks=tasks: self._job_ended(done, entry_id,
                                                                                                tasks))

    def _job_ended(self, task: asyncio.Task, entry_id: str, tasks: set[asyncio.Task]) -> None:
        tasks.discard(task)
        self._claimed.discard(entry_id)
        if not task.cancelled() and task.exception() is not None:
            self._failures.append(task.exception())

    async def _mark_claimed(self, entries: list[tuple[str, dict, int]]) -> None:
        """The results of jobs just claimed say so: `claimed`, by this worker, when, delivered how often (shown
        until a slot takes the job: `running`). An entry without a job id is left to `_process` (dead-lettered)."""
        now = time.time()
        keys, deliveries = [], []
        for entry_id, fields, delivered in entries:
            self._claimed_at[entry_id] = now
            job_id = _job_id(fields)
            if job_id:
                keys.append(result_key(job_id))
                deliveries.append(delivered)
        if keys:
            await self._claim(keys=keys, args=[self.consumer_name, repr(now), *deliveries])

    async def _hand_back(self, entries: list[tuple[str, dict, int]]) -> None:
        """Results of jobs claimed and never started say `queued` again (the worker stops; the entries stay pending
        and are claimed by another consumer after `claim_idle_seconds`). Best effort: Redis may be gone."""
        keys = [result_key(job_id) for job_id in (_job_id(fields) for _, fields, _ in entries) if job_id]
        if not keys:
            return
        try:
            await self._unclaim(keys=keys, args=[self.consumer_name])
        except Exception as err:  # the results say claimed until another consumer claims the jobs
            log.warning("queue worker %s: could not hand %d claimed jobs back (%s)", self.consumer_name, len(keys),
                        err)

    # -- reading -----------------------------------------------------------------------------------

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self.redis.xgroup_create(JOBS_STREAM, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
        self._group_ready = True

    async def _read_new(self, count: int | None = None) -> list[tuple[str, dict, int]]:
        reply = await self.redis.xreadgroup(CONSUMER_GROUP, self.consumer_name, {JOBS_STREAM: ">"},
                                            count=count or self.batch_size, block=self.block_ms)
        return [(as_text(entry_id), fields, 1) for _, entries in reply or [] for entry_id, fields in entries]

    async def _claim_stale(self, count: int | None = None) -> list[tuple[str, dict, int]]:
        reply = await self.redis.xautoclaim(JOBS_STREAM, CONSUMER_GROUP, self.consumer_name,
                                            min_idle_time=int(self.claim_idle_seconds * 1000),
                                            start_id=self._claim_cursor, count=count or self.batch_size)
        self._claim_cursor = as_text(reply[0])
        claimed = [(as_text(entry_id), fields) for entry_id, fields in reply[1] if entry_id is not None]
        if len(claimed) < len(reply[1]):
            # Redis 6.2 returns deleted entries as nil and keeps them pending; drop them from our list.
            await self._ack_deleted_pending()
        claimed = [(entry_id, fields) for entry_id, fields in claimed if entry_id not in self._claimed]  # ours
        if not claimed:
            return []
        self.stats.claimed += len(claimed)
        pending = await self.redis.xpending_range(JOBS_STREAM, CONSUMER_GROUP, min=claimed[0][0],
                                                  max=claimed[-1][0], count=len(claimed) * 4,
                                                  consumername=self.consumer_name)
        deliveries = {as_text(p["message_id"]): p["times_delivered"] for p in pending}
        return [(entry_id, fields, deliveries.get(entry_id, 1)) for entry_id, fields in claimed]

    async def _ack_deleted_pending(self) -> None:
        pending = await self.redis.xpending_range(JOBS_STREAM, CONSUMER_GROUP, min="-", max="+",
                                                  count=1000, consumername=self.consumer_name)
        for item in pending:
            entry_id = as_text(item["message_id"])
            if not await self.redis.xrange(JOBS_STREAM, entry_id, entry_id):
                await self.redis.xack(JOBS_STREAM, CONSUMER_GROUP, entry_id)

    # -- processing --------------------------------------------------------------------------------

    async def _process_guarded(self, entry_id: str, fields: dict, deliveries: int) -> None:
        """One job; an unexpected error stays with it (logged, the entry left pending: reclaimed after
        `claim_idle_seconds`, dead-lettered past `max_deliveries`), never with the jobs beside it. Redis
        errors go up to the loop's backoff."""
        try:
            await self._process(entry_id, fields, deliveries)
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError):
            raise
        except Exception:
            self.stats.errors += 1
            log.exception("stream entry %s, delivery %d: unexpected error; left pending for another attempt",
                          entry_id, deliveries)
        finally:
            self._claimed_at.pop(entry_id, None)

    async def _process(self, entry_id: str, fields: dict, deliveries: int) -> None:
        try:
            job = Job.from_fields(fields)
        except ValueError as err:
            await self._dead_letter_malformed(entry_id, fields, deliveries, str(err))
            return
        key = result_key(job.job_id)
        if deliveries > self.max_deliveries:
            last_error = await self.redis.hget(key, "error")
            error = f"delivered {deliveries} times without finishing"
            if last_error:
                error += f"; last error: {as_text(last_error)}"
            await self._finish_job(entry_id, job, deliveries, error=error)
            return
        started_at = time.time()
        started = await self._attempt(keys=[key], args=[
            "status", JobStatus.RUNNING.value, "deliveries", deliveries, "consumer", self.consumer_name,
            "started_at", repr(started_at), "id", job.job_id, "camera_id", job.camera_id,
            "created_at", repr(job.created_at), "frame_ts", repr(job.frame_ts),
            "person_count", job.person_count,
        ])
        if not started:  # finished by an earlier delivery whose acknowledgement was lost
            await self._acknowledge(entry_id)
            self.stats.duplicates += 1
            return
        structured = None
        try:
            if job.schema is not None:  # a schema no caption can satisfy is refused before any captioning
                await asyncio.to_thread(caption_validator, job.schema)
            current_job.set(job)  # this task's own context: the job's work takes turns by it
            caption = await caption_job(self.captioner, job, self.fall_priority if job.fall else self.caption_priority)
            if job.schema is not None:
                structured = await asyncio.to_thread(structured_caption, caption, job.schema)
        except SchemaRefused as err:  # no attempt can succeed: dead-lettered now, once
            self.stats.failed_attempts += 1
            await self._finish_job(entry_id, job, deliveries, error=f"{type(err).__name__}: {err}",
                                   started_at=started_at)
            return
        except Exception as err:  # any captioner failure is the job's error, recorded and retried
            error = f"{type(err).__name__}: {err}"
            self.stats.failed_attempts += 1
            log.warning("job %s attempt %d/%d failed: %s", job.job_id, deliveries, self.max_deliveries, error)
            if deliveries >= self.max_deliveries:
                await self._finish_job(entry_id, job, deliveries, error=error, started_at=started_at)
            else:
                await self._attempt(keys=[key], args=["status", JobStatus.QUEUED.value, "error", error])
            return
        await self._finish_job(entry_id, job, deliveries, caption=caption, structured=structured,
                               started_at=started_at)

    async def _finish_job(self, entry_id: str, job: Job, deliveries: int, caption: str | None = None,
                          error: str | None = None, structured: dict | None = None,
                          started_at: float | None = None) -> None:
        result = job.queued_result()
        result.claimed_at, result.started_at = self._claimed_at.get(entry_id), started_at
        result.status = JobStatus.FAILED.value if error is not None else JobStatus.DONE.value
        result.caption, result.error, result.structured = caption, error, structured
        # finished_at is set from Redis's clock (jobqueue/finish.py); this value only holds the field's place.
        result.finished_at, result.deliveries, result.consumer = time.time(), deliveries, self.consumer_name
        result_fields = result.to_fields()
        dead = dead_letter_fields(job.to_fields(), error, deliveries) if error is not None else {}
        try:
            await self._keep_frame(job)
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError):
            raise
        except Exception:  # the frame is for viewers only: the job still finishes
            self.stats.errors += 1
            log.exception("job %s: keeping its frame for viewers failed", job.job_id)
        first = await self._finish(
            keys=[result_key(job.job_id), JOBS_STREAM, DEAD_STREAM],
            args=[CONSUMER_GROUP, entry_id, DEAD_STREAM_MAXLEN, len(result_fields), *flat(result_fields), *flat(dead)],
        )
        if not first:
            self.stats.duplicates += 1
        elif error is not None:
            self.stats.dead += 1
            log.error("job %s dead-lettered after %d deliveries: %s", job.job_id, deliveries, error)
        else:
            self.stats.done += 1
        if first and self.on_finished is not None:
            try:
                self.on_finished(job, result)
            except Exception:  # the job is finished: a hook's failure is logged, never the job's
                log.exception("job %s: the finish hook failed", job.job_id)
        if first and job.fall and self.on_alert is not None:
            stored = await get_result(self.redis, job.job_id)
            if stored is not None:
                self.on_alert(stored)

    async def _keep_frame(self, job: Job) -> None:
        """The job's images and boxes for viewers (every frame of a job with several), written before its
        result so a viewer that sees the caption finds the frames."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for index, frame in enumerate(job.frame_views()):
                key = frame_key(job.job_id, index)
                pipe.hset(key, mapping=frame.to_fields())
                pipe.expire(key, FRAME_TTL_SECONDS)
            await pipe.execute()

    async def _acknowledge(self, entry_id: str, dead_fields: dict | None = None) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            if dead_fields:
                pipe.xadd(DEAD_STREAM, dead_fields, maxlen=DEAD_STREAM_MAXLEN, approximate=True)
            pipe.xack(JOBS_STREAM, CONSUMER_GROUP, entry_id)
            pipe.xdel(JOBS_STREAM, entry_id)
            await pipe.execute()

    async def _dead_letter_malformed(self, entry_id: str, fields: dict, deliveries: int, error: str) -> None:
        """An entry that is not a valid job cannot be retried into one: dead-letter it at once (the
        dead-letter entry, XACK and XDEL in one transaction, so it is dead-lettered once). A result the
        producer wrote for it says failed, with the error."""
        await self._acknowledge(entry_id, dead_letter_fields(fields, error, deliveries))
        job_id = _job_id(fields)
        if job_id:
            await self._fail(keys=[result_key(job_id)], args=[
                "status", JobStatus.FAILED.value, "error", error, "deliveries", deliveries,
                "consumer", self.consumer_name])
        self.stats.dead += 1
        log.error("stream entry %s is not a valid job (%s); dead-lettered", entry_id, error)
