"""The server's threads and torch's: the engine is built on a thread that ends, the step thread runs torch on
the engine's threads, request preprocessing on one (EngineBridge's docstring says why)."""

from __future__ import annotations

import threading

import pytest
import torch

from api.bridge import build_engine, one_thread_here
from engine import EngineConfig


def test_one_thread_here_changes_only_the_calling_thread():
    before = torch.get_num_threads()
    seen: dict[str, int] = {}

    def preprocessing() -> None:
        one_thread_here()
        seen["here"] = torch.get_num_threads()

    thread = threading.Thread(target=preprocessing)
    thread.start()
    thread.join()
    assert seen["here"] == 1
    assert torch.get_num_threads() == before


def test_the_engine_is_built_on_a_thread_that_ends():

    engine = build_engine(EngineConfig(model="tiny", num_threads=1))
    assert engine.num_threads == 1
    assert not any(t.name == "vlmcap-engine-load" for t in threading.enumerate())


def test_building_errors_reach_the_caller():
    config = EngineConfig(model="tiny", max_model_len=10**9)  # valid alone; the model's limit is lower
    with pytest.raises(ValueError, match="max_model_len"):
        build_engine(config)


def test_a_step_beside_preprocessing_runs_on_the_cores_left():
    """While a request is being preprocessed on a machine whose cores the step's threads fill, the steps run
    on one thread fewer, and on all of them again once it is in (the threads the step saw, recorded)."""
    import asyncio

    from api.bridge import EngineBridge
    from engine import SamplingParams

    engine = build_engine(EngineConfig(model="tiny", num_threads=2))
    seen: list[int] = []
    real_step, real_add = engine.step, engine.add_request
    preprocessing, release = threading.Event(), threading.Event()

    def recording_step():
        seen.append(torch.get_num_threads())
        return real_step()

    def held_add(**request):
        if request["sampling"].max_tokens == 3:  # the one held in preprocessing
            preprocessing.set()
            release.wait(30)
        return real_add(**request)

    engine.step, engine.add_request = recording_step, held_add
    bridge = EngineBridge(engine, max_waiting_requests=8)
    bridge.cores = 2  # this test's machine, whatever the one it runs on
    assert bridge.step_threads() == 2
    bridge.start()

    async def scenario() -> str | None:
        endless = await bridge.add(prompt="a story", sampling=SamplingParams(max_tokens=4000, ignore_eos=True))
        held = asyncio.create_task(bridge.add(prompt="a caption", sampling=SamplingParams(max_tokens=3)))
        await asyncio.to_thread(preprocessing.wait, 30)
        assert bridge.step_threads() == 1
        before = len(seen)
        while len(seen) < before + 3:  # steps of the endless request, taken beside the preprocessing
            await asyncio.sleep(0.01)
        beside = seen[before + 1:]
        release.set()
        short = await held
        final = await short.final()
        after = len(seen)
        while len(seen) < after + 3:
            await asyncio.sleep(0.01)
        bridge.abort(endless.request_id)
        await bridge.shutdown(grace_s=1.0)
        assert set(beside) == {1}, seen
        assert set(seen[after + 1:]) == {2}, seen
        return final.finish_reason

    assert asyncio.run(scenario()) == "length"
