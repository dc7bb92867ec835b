"""The one way a result is finished, whoever finishes it: the queue worker (a job captioned or dead-lettered),
the REST store (a caption asked over HTTP) and the producer (a job dropped by backpressure).

Finishing writes the result hash anew with `finished_at` from Redis's clock (so that a feed's order, newest
first, is the order of `finished_at` whichever process wrote it), gives it `RESULT_TTL_SECONDS`, and appends
it to the caption feed of all cameras, to its camera's feed when it has one, and to the alerts feed when it is
a fall alert's. It is written once, as the Lua function `finish_result` (`FINISH_RESULT_LUA`) that each
finishing script includes, so it runs inside the writer's own atomic step. A result field is added to
`CaptionResult` (jobqueue/contract.py) alone: the function copies whatever fields it is given.

A queue worker that finished a job first (its script said so) then calls its `FinishedJob` hook once with the job
and its result: the server's camera memory keeps the job as an event there (memory/jobs.py), keyed by the job's
id, so a redelivered job is kept once. The hook must not block: it hands the job to a writer thread.
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from jobqueue.contract import (
    ALERTS_STREAM,
    CAPTIONS_STREAM,
    CAPTIONS_STREAM_MAXLEN,
    RESULT_TTL_SECONDS,
    CaptionResult,
    Job,
    JobStatus,
    camera_captions_stream,
    flat,
    result_key,
)

# Called once for each job a worker finished first (done or dead-lettered), with the result it wrote (whose
# finished_at is the worker's clock; the hash holds Redis's). It returns at once (a writer thread does the work).
FinishedJob = Callable[[Job, CaptionResult], None]

# is_finished(key): the result is done or failed (finishing is first-writer-wins).
# finish_result(key, fields): `fields` a flat list of result field/value pairs (a finished_at in it is replaced).
# fail_result(key, fields): an existing result not yet finished gets `fields` (its status failed, the error)
#   and is finished with the fields it then has; 1 if it was, else 0.
FINISH_RESULT_LUA = f"""
local function is_finished(key)
  local status = redis.call('HGET', key, 'status')
  return status == '{JobStatus.DONE.value}' or status == '{JobStatus.FAILED.value}'
end
local function finish_result(key, fields)
  local now = redis.call('TIME')
  local stamp = now[1] .. '.' .. string.format('%06d', now[2])
  local camera, fall, stamped = nil, false, false
  for i = 1, #fields, 2 do
    if fields[i] == 'finished_at' then fields[i + 1] = stamp; stamped = true end
    if fields[i] == 'camera_id' and fields[i + 1] ~= '' then camera = fields[i + 1] end
    if fields[i] == 'fall' and fields[i + 1] == 'true' then fall = true end
  end
  if not stamped then table.insert(fields, 'finished_at'); table.insert(fields, stamp) end
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(fields))
  redis.call('EXPIRE', key, {RESULT_TTL_SECONDS})
  redis.call('XADD', '{CAPTIONS_STREAM}', 'MAXLEN', '~', {CAPTIONS_STREAM_MAXLEN}, '*', unpack(fields))
  if camera then
    redis.call('XADD', '{camera_captions_stream("")}' .. camera, 'MAXLEN', '~', {CAPTIONS_STREAM_MAXLEN}, '*',
               unpack(fields))
  end
  if fall then
    redis.call('XADD', '{ALERTS_STREAM}', 'MAXLEN', '~', {CAPTIONS_STREAM_MAXLEN}, '*', unpack(fields))
  end
end
local function fail_result(key, fields)
  if redis.call('EXISTS', key) == 0 or is_finished(key) then return 0 end
  redis.call('HSET', key, unpack(fields))
  finish_result(key, redis.call('HGETALL', key))
  return 1
end
"""

# KEYS: the result key. ARGV: its fields. Returns 1.
STORE_FINISH_SCRIPT = FINISH_RESULT_LUA + """
finish_result(KEYS[1], {unpack(ARGV)})
return 1
"""

# KEYS: the result key. ARGV: the fields it gets. Returns 1 if it was finished, 0 (untouched) if absent or finished.
FAIL_SCRIPT = FINISH_RESULT_LUA + """
return fail_result(KEYS[1], ARGV)
"""


async def finish_result(client: aioredis.Redis, result: CaptionResult) -> None:
    """Finish `result` from outside a job's stream entry (the REST store)."""
    await client.eval(STORE_FINISH_SCRIPT, 1, result_key(result.id), *flat(result.to_fields()))
