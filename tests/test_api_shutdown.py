"""Graceful shutdown of the engine bridge: work that finishes within the grace period finishes, the rest
is aborted with its KV blocks freed, new work is refused, and the log says how many of each."""

from __future__ import annotations

import asyncio
import logging

import pytest

from api.bridge import AsyncEngine
from api.errors import APIError
from engine import Engine, EngineConfig, SamplingParams

PROMPT = "User: Tell me a story.<end_of_utterance>\nAssistant:"


@pytest.mark.timeout(120)
def test_shutdown_finishes_short_work_aborts_long_work_and_says_so(caplog):
    engine = Engine(EngineConfig(model="tiny", max_num_batched_tokens=64, max_num_seqs=4))
    bridge = AsyncEngine(engine, max_waiting_requests=8)
    bridge.start()

    async def scenario() -> tuple[str | None, str | None]:
        short = await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
        endless = await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=4000, ignore_eos=True))
        finals = asyncio.gather(short.final(), endless.final())
        with caplog.at_level(logging.INFO, logger="api.bridge"):
            await bridge.shutdown(grace_s=1.0)
        with pytest.raises(APIError) as refused:
            await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=2))
        assert refused.value.status == 503
        short_final, endless_final = await finals
        return short_final.finish_reason, endless_final.finish_reason

    assert asyncio.run(scenario()) == ("length", "abort")
    assert "2 request(s) in flight at shutdown, 1 finished, 1 aborted" in caplog.text
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()
