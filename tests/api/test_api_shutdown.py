"""Graceful shutdown of the engine bridge: work that finishes within the grace period finishes, the rest
is aborted with its KV blocks freed, new work is refused, and the log says how many of each."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from api.bridge import EngineBridge
from api.errors import APIError
from engine import Engine, EngineConfig, SamplingParams

PROMPT = "User: Tell me a story.<end_of_utterance>\nAssistant:"


@pytest.mark.timeout(120)
def test_shutdown_finishes_short_work_aborts_long_work_and_says_so(caplog):
    engine = Engine(EngineConfig(model="tiny", max_num_batched_tokens=64, max_num_seqs=4))
    # No step runs until shutdown has counted the work in flight (else a fast machine finishes the short
    # request first), and each step takes at least 10 ms, so 4000 tokens cannot fit in the grace period.
    shutdown_began = threading.Event()
    real_step = engine.step

    def held_step():
        shutdown_began.wait()
        time.sleep(0.01)
        return real_step()

    engine.step = held_step
    bridge = EngineBridge(engine, max_waiting_requests=8)
    bridge.start()

    async def scenario() -> tuple[str | None, str | None]:
        short = await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
        endless = await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=4000, ignore_eos=True))
        finals = asyncio.gather(short.final(), endless.final())
        with caplog.at_level(logging.INFO, logger="api.bridge"):
            shutdown = asyncio.create_task(bridge.shutdown(grace_s=1.0))
            await asyncio.sleep(0)  # shutdown runs up to its first wait: the in-flight count is taken
            shutdown_began.set()
            await shutdown
        with pytest.raises(APIError) as refused:
            await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=2))
        assert refused.value.status == 503
        short_final, endless_final = await finals
        return short_final.finish_reason, endless_final.finish_reason

    assert asyncio.run(scenario()) == ("length", "abort")
    assert "2 request(s) in flight at shutdown, 1 finished, 1 aborted" in caplog.text
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()
