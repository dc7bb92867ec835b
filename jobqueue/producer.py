"""The producer half of the queue: jobs go to Redis from a sender thread, so a slow or absent Redis
never blocks capture. While Redis is unreachable jobs wait in a small local buffer (oldest dropped
first, counted) and the sender reconnects with capped exponential backoff."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum

import redis

from jobqueue.checks import at_least
from jobqueue.connection import connect_sync
from jobqueue.contract import (
    CONSUMER_GROUP,
    DEAD_STREAM,
    DEAD_STREAM_MAXLEN,
    DEFAULT_STREAM_MAXLEN,
    JOBS_STREAM,
    RESULT_KEY_PREFIX,
    RESULT_TTL_SECONDS,
    Job,
    JobStatus,
    dead_letter_fields,
    flat,
    result_key,
)
from jobqueue.finish import FINISH_RESULT_LUA

log = logging.getLogger(__name__)


class Backpressure(str, Enum):
    """What to do when the job stream already holds `stream_maxlen` outstanding jobs."""

    SKIP_NEW = "skip-new"
    DROP_OLDEST = "drop-oldest"


# Atomic enqueue with backpressure. The stream holds only outstanding jobs (workers delete finished
# ones), so XLEN is the backlog. drop-oldest removes only jobs no worker has read yet (ids after the
# group's last-delivered-id), so a job being captioned is never pulled away; each removed job is
# finished as failed (jobqueue/finish.py: its feeds too) and dead-lettered, keeping the rule that every
# queued job ends in exactly one caption or one dead-letter entry. A job_id already known is not enqueued
# twice (a retried call whose first reply was lost). MAXLEN ~ on XADD is a safety net for producers that
# skip this script. Every field it writes comes from the contract, flattened by the caller.
# KEYS: jobs stream, result key of the new job, dead-letter stream.
# ARGV: maxlen, policy, group, result ttl, dead maxlen, result key prefix, then the numbers of field pairs
#       of: the job, a dropped job's failed result, a dropped job's dead-letter additions; then those fields,
#       then the new job's queued result fields.
ENQUEUE_SCRIPT = FINISH_RESULT_LUA + """
local maxlen = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then return {2, 0} end
local njob, nfailed, ndead = tonumber(ARGV[7]) * 2, tonumber(ARGV[8]) * 2, tonumber(ARGV[9]) * 2
local at = 10
local job_fields = {unpack(ARGV, at, at + njob - 1)}
at = at + njob
local failed_fields = {unpack(ARGV, at, at + nfailed - 1)}
at = at + nfailed
local dead_fields = {unpack(ARGV, at, at + ndead - 1)}
local result_fields = {unpack(ARGV, at + ndead, #ARGV)}
local dropped = 0
local backlog = redis.call('XLEN', KEYS[1])
if backlog >= maxlen then
  if ARGV[2] ~= 'drop-oldest' then return {0, 0} end
  local start = '-'
  if backlog > 0 then
    for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
      for i = 1, #group, 2 do
        if group[i] == 'name' and group[i + 1] == ARGV[3] then
          for j = 1, #group, 2 do
            if group[j] == 'last-delivered-id' then start = '(' .. group[j + 1] end
          end
        end
      end
    end
  end
  local victims = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', backlog - maxlen + 1)
  if #victims == 0 then return {0, 0} end
  for _, entry in ipairs(victims) do
    local fields = entry[2]
    local job_id
    for i = 1, #fields, 2 do
      if fields[i] == 'job_id' then job_id = fields[i + 1] end
    end
    redis.call('XDEL', KEYS[1], entry[1])
    if job_id then fail_result(ARGV[6] .. job_id, failed_fields) end
    for _, item in ipairs(dead_fields) do table.insert(fields, item) end
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', unpack(fields))
    dropped = dropped + 1
  end
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', unpack(job_fields))
redis.call('HSET', KEYS[2], unpack(result_fields))
redis.call('EXPIRE', KEYS[2], ARGV[4])
return {1, dropped}
"""
DROPPED_ERROR = "dropped by backpressure (drop-oldest)"


@dataclass
class ProducerStats:
    enqueued: int = 0
    skipped_backpressure: int = 0
    dropped_backpressure: int = 0
    dropped_offline: int = 0
    redis_errors: int = 0
    rejected: int = 0


class JobProducer:
    """`submit()` never blocks; a sender thread writes jobs to Redis in order."""

    def __init__(
        self,
        redis_url: str,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        backpressure: Backpressure | str = Backpressure.SKIP_NEW,
        buffer_size: int = 64,
        max_backoff_seconds: float = 10.0,
    ) -> None:
        at_least("stream_maxlen", stream_maxlen, 1)
        self.stream_maxlen = stream_maxlen
        self.backpressure = Backpressure(backpressure)
        self.max_backoff_seconds = max_backoff_seconds
        self.stats = ProducerStats()
        self._redis = connect_sync(redis_url)  # outages are handled by the sender's own backoff
        self._enqueue = self._redis.register_script(ENQUEUE_SCRIPT)
        self._buffer: deque[Job] = deque(maxlen=buffer_size)
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._send_loop, name="vlmcap-producer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if len(self._buffer) == self._buffer.maxlen:
                self.stats.dropped_offline += 1
            self._buffer.append(job)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._buffer)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is buffered (waiting up to `timeout` seconds for Redis), then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            if self._buffer:
                log.warning("producer closed with %d jobs unsent (Redis unreachable)", len(self._buffer))
                self.stats.dropped_offline += len(self._buffer)
                self._buffer.clear()
            self._closing = True
        self._redis.close()

    def _send_loop(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._buffer and not self._closing:
                    self._cond.wait()
                if not self._buffer:
                    return
                job = self._buffer[0]
            try:
                self._send(job)
            except (redis.ConnectionError, redis.TimeoutError) as err:
                self.stats.redis_errors += 1
                backoff = min(self.max_backoff_seconds, backoff * 2 or 0.1)
                log.warning("Redis unreachable (%s); retrying in %.1f s", err, backoff)
                # close() joins with a timeout; a daemon thread still retrying then ends with the process.
                time.sleep(backoff)
                continue
            except redis.ResponseError as err:
                # Redis refused this job (out of memory, a key of the wrong type): retrying will not help.
                self.stats.rejected += 1
                log.error("Redis rejected job %s: %s", job.job_id, err)
            backoff = 0.0
            with self._cond:
                if self._buffer and self._buffer[0] is job:
                    self._buffer.popleft()

    def _send(self, job: Job) -> None:
        job_fields = job.to_fields()
        failed = {"status": JobStatus.FAILED.value, "error": DROPPED_ERROR}
        dead = dead_letter_fields({}, DROPPED_ERROR, 0)
        outcome, dropped = self._enqueue(
            keys=[JOBS_STREAM, result_key(job.job_id), DEAD_STREAM],
            args=[
                self.stream_maxlen, self.backpressure.value, CONSUMER_GROUP, RESULT_TTL_SECONDS, DEAD_STREAM_MAXLEN,
                RESULT_KEY_PREFIX, len(job_fields), len(failed), len(dead),
                *flat(job_fields), *flat(failed), *flat(dead), *flat(job.queued_result().to_fields()),
            ],
        )
        self.stats.dropped_backpressure += dropped
        if outcome == 0:
            self.stats.skipped_backpressure += 1
        elif outcome == 1:
            self.stats.enqueued += 1
