"""The API tests' shared servers: the tiny model behind real uvicorn servers started once per session, for the
modules that need nothing else of a server (each keeps its own clients; a module that needs other settings starts
its own server, and a module fixture of the same name overrides these). Their tests must not rely on a cache being
empty or on what other modules asked before them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_support import KEY, MODEL, SHORT_CONTEXT

from api.background import BackgroundServer
from api.server import create_app
from api.settings import Limits, ServerSettings
from engine import EngineConfig


@pytest.fixture(scope="session")
def server() -> Iterator[BackgroundServer]:
    """The tiny model served as `MODEL` behind one API key (`KEY`), a step budget of 256 tokens, max_tokens capped
    at 4,096 (under the tiny model's context)."""
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256), api_key=KEY,
                              served_model_name=MODEL, limits=Limits(max_tokens_cap=4096))
    with BackgroundServer(create_app(settings)) as running:
        yield running


@pytest.fixture(scope="session")
def short_context_server() -> Iterator[BackgroundServer]:
    """The tiny model served as `MODEL` with a context of `SHORT_CONTEXT` tokens and no API key, for what happens
    at the context's end."""
    settings = ServerSettings(engine=EngineConfig(model="tiny", max_num_batched_tokens=256,
                                                  max_model_len=SHORT_CONTEXT), served_model_name=MODEL)
    with BackgroundServer(create_app(settings)) as running:
        yield running
