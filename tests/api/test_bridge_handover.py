"""The step thread hands each step's outputs to the event loop and starts the next step once the loop has run
the streams they woke (so the loop's work falls between steps, not inside them), but never waits on a loop
that is busy elsewhere for longer than `EngineBridge.HANDOVER_S`."""

from __future__ import annotations

import asyncio
import time

import pytest

from api.bridge import EngineBridge
from engine import Engine, EngineConfig, SamplingParams

PROMPT = "User: Tell me a story.<end_of_utterance>\nAssistant:"


def _engine_with_log(events: list) -> Engine:
    engine = Engine(EngineConfig(model="tiny", max_num_batched_tokens=64, max_num_seqs=4))
    real_step = engine.step

    def logged_step():
        events.append("step")
        return real_step()

    engine.step = logged_step
    return engine


@pytest.mark.timeout(120)
def test_each_step_starts_after_the_stream_got_the_last_one_s_output():
    events: list = []
    bridge = EngineBridge(_engine_with_log(events), max_waiting_requests=8)
    bridge.HANDOVER_S = 30.0  # no timeout on a slow machine: the order below is the handover's, not luck's
    bridge.start()

    async def scenario() -> None:
        stream = await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=6, ignore_eos=True))
        async for output in stream:
            events.append(len(output.token_ids))
        await bridge.shutdown(grace_s=1.0)

    asyncio.run(scenario())
    tokens = [e for e in events if e != "step"]
    assert tokens == [1, 2, 3, 4, 5, 6]
    # Once the stream awaits its outputs, every step comes right after the stream saw the previous step's token.
    # Only the first output may find it not yet awaiting (still returning from `add`): then the loop had nothing
    # woken to run, the next step started, and the stream reads both tokens at once.
    first_step = events.index("step", events.index(1))
    seen = events[first_step - 1]
    assert seen <= 2, events
    after = events[first_step - 1:]
    assert after == [item for n in range(seen, 7) for item in ([n, "step"] if n < 6 else [n])], events


@pytest.mark.timeout(120)
def test_a_busy_event_loop_does_not_stop_the_steps():
    events: list = []
    bridge = EngineBridge(_engine_with_log(events), max_waiting_requests=8)
    bridge.start()

    async def scenario() -> int:
        stream = await bridge.add(prompt=PROMPT, sampling=SamplingParams(max_tokens=200, ignore_eos=True))
        iterator = stream.__aiter__()
        await iterator.__anext__()
        before = events.count("step")
        time.sleep(0.5)  # the loop does something else for a while (blocking on purpose)
        during = events.count("step") - before
        bridge.abort(stream.request_id)
        await bridge.shutdown(grace_s=1.0)
        return during

    assert asyncio.run(scenario()) >= 2  # at most HANDOVER_S (20 ms) lost per step, not the whole 0.5 s
