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
    """While a request with an image is being preprocessed on a machine whose cores the step's threads fill, the
    steps run on one thread fewer, and on all of them again once it is in (the threads the step saw, recorded)."""
    import asyncio

    from PIL import Image

    from api.bridge import EngineBridge
    from engine import SamplingParams

    engine = build_engine(EngineConfig(model="tiny", num_threads=2))
    seen: list[int] = []
    real_step, real_preprocess = engine.step, engine.preprocess_request
    preprocessing, release = threading.Event(), threading.Event()

    def recording_step():
        seen.append(torch.get_num_threads())
        return real_step()

    def held_preprocess(**request):
        if request["sampling"].max_tokens == 3:  # the one held in preprocessing
            preprocessing.set()
            release.wait(30)
        return real_preprocess(**request)

    engine.step, engine.preprocess_request = recording_step, held_preprocess
    bridge = EngineBridge(engine, max_waiting_requests=8)
    bridge.cores = 2  # this test's machine, whatever the one it runs on
    assert bridge.step_threads() == 2
    bridge.start()

    async def scenario() -> str | None:
        endless = await bridge.add(prompt="a story", sampling=SamplingParams(max_tokens=4000, ignore_eos=True))
        held = asyncio.create_task(bridge.add(prompt="<image> a caption", images=[Image.new("RGB", (64, 48))],
                                              sampling=SamplingParams(max_tokens=3)))
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


def test_a_text_prompt_s_preprocessing_takes_no_thread_from_the_steps():
    """A text prompt's preprocessing (template and tokens: a millisecond or a few) is not work beside the steps:
    chats added while steps run leave the steps all their threads (on two cores a step that started meanwhile
    would otherwise run on one for all of its length)."""
    import asyncio

    from api.bridge import EngineBridge
    from engine import SamplingParams

    engine = build_engine(EngineConfig(model="tiny", num_threads=2))
    bridge = EngineBridge(engine, max_waiting_requests=16)
    bridge.cores = 2
    seen: list[int] = []  # the next step's threads, while each chat is preprocessed
    real_preprocess = engine.preprocess_request

    def recording_preprocess(**request):
        seen.append(bridge.step_threads())
        return real_preprocess(**request)

    engine.preprocess_request = recording_preprocess
    bridge.start()

    async def scenario() -> list[str | None]:
        endless = await bridge.add(prompt="a story", sampling=SamplingParams(max_tokens=4000, ignore_eos=True))
        streams = await asyncio.gather(*[
            bridge.add(prompt=f"chat {i}", sampling=SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(6)])
        finals = [(await s.final()).finish_reason for s in streams]
        bridge.abort(endless.request_id)
        await bridge.shutdown(grace_s=1.0)
        return finals

    assert asyncio.run(scenario()) == ["length"] * 6
    assert seen == [2] * 7


def test_an_event_s_embedding_waits_for_fall_alerts_then_runs_beside_the_steps(tmp_path):
    """The event store's writer running the vision tower for an event's frames is background work
    (`EngineBridge.background`): it waits while a request with an inter-token target of its own (a fall alert's
    caption) is in flight, then counts as work beside the steps: they give up a thread while it runs, and its own
    torch runs on one."""
    import io
    import time

    from PIL import Image

    from api.bridge import EngineBridge
    from api.routes_events import CameraMemory
    from api.settings import ServerSettings
    from memory.sqlite import SQLiteEventStore

    engine = build_engine(EngineConfig(model="tiny", num_threads=2))
    bridge = EngineBridge(engine, max_waiting_requests=8)
    bridge.cores = 2
    seen: list = []
    real_embed = engine.embed

    def recording_embed(**inputs):
        seen.append((bridge.step_threads(), torch.get_num_threads()))
        return real_embed(**inputs)

    engine.embed = recording_embed
    memory = CameraMemory(SQLiteEventStore(tmp_path / "events.db"), ServerSettings(), bridge)
    jpeg = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 30)).save(jpeg, "JPEG")
    with bridge._cond:  # a fall alert's caption in flight
        bridge._streams["alert"] = object()
        bridge._urgent["alert"] = 5
    thread = threading.Thread(target=lambda: seen.append(memory.embed_frames([jpeg.getvalue()]) is not None))
    thread.start()
    time.sleep(0.5)
    assert seen == [] and thread.is_alive()  # held back while the alert runs
    bridge._forget("alert")
    thread.join(10)
    assert seen == [(1, 1), True]
    assert bridge.step_threads() == 2 and not bridge._urgent


def test_a_camera_caption_behind_a_fall_alert_is_preprocessed_after_it():
    """A request with an inter-token target of its own (a fall alert's caption) is urgent while in flight: a request
    of a priority value at least its own and no target (a camera caption) is preprocessed once it has ended, one
    more urgent (a chat) at once."""
    import asyncio
    import math

    from api.bridge import EngineBridge
    from engine import SamplingParams

    engine = build_engine(EngineConfig(model="tiny", num_threads=1))
    added: dict[str, bool] = {}  # each prompt: whether the alert was still in the engine when it was added
    real_preprocess = engine.preprocess_request

    def recording_preprocess(**request):
        added[request["prompt"]] = engine.has_unfinished_requests()
        return real_preprocess(**request)

    engine.preprocess_request = recording_preprocess
    bridge = EngineBridge(engine, max_waiting_requests=8)
    bridge.start()

    async def scenario() -> tuple[dict, bool, str | None]:
        alert = await bridge.add(prompt="a fall", sampling=SamplingParams(max_tokens=40, ignore_eos=True),
                                 priority=5, itl_target_ms=30.0)
        urgent = dict(bridge._urgent)
        caption = asyncio.create_task(bridge.add(prompt="a caption", priority=10,
                                                 sampling=SamplingParams(max_tokens=2, ignore_eos=True)))
        chat = await bridge.add(prompt="a chat", sampling=SamplingParams(max_tokens=2, ignore_eos=True))
        final = await alert.final()
        await (await caption).final()
        await chat.final()
        with bridge._cond:
            left = bridge._urgent_before(math.inf)
        await bridge.shutdown(grace_s=1.0)
        return urgent == {alert.request_id: 5}, left, final.finish_reason

    assert asyncio.run(scenario()) == (True, False, "length")
    assert added == {"a fall": False, "a chat": True, "a caption": False}
