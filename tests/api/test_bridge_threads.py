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
