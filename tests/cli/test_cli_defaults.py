"""The commands' defaults are those of the settings they build: `vlmcap serve` with no option builds the default
`ServerSettings` (its engine the default `EngineConfig`), `vlmcap pipeline` the default `PipelineConfig`,
`vlmcap worker` the default `QueueWorker` and `OpenAICaptioner`."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

import api.server
import cli.worker
import pipeline.runner
from api.settings import ServerSettings
from cli.main import app
from cli.options import default
from engine import EngineConfig
from jobqueue.consumer import QueueWorker
from jobqueue.openai_captioner import OpenAICaptioner
from pipeline.runner import PipelineConfig


@pytest.fixture
def clean_env(monkeypatch):
    """No VLMCAP_ or REDIS_URL variable of the machine reaches the commands."""
    import os

    for name in list(os.environ):
        if name.startswith("VLMCAP_") or name == "REDIS_URL":
            monkeypatch.delenv(name)


def test_serve_without_options_builds_the_default_settings(monkeypatch, clean_env):
    built: list[ServerSettings] = []
    monkeypatch.setattr(api.server, "create_app", lambda settings: built.append(settings))
    monkeypatch.setattr("uvicorn.run", lambda *args, **kwargs: None)
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 0, result.output
    (settings,) = built
    assert settings == replace(ServerSettings(), allowed_hosts=("127.0.0.1",))  # --host is a name clients use
    assert settings.engine == EngineConfig()


def test_zero_turns_the_encoder_limits_off(monkeypatch, clean_env):
    built: list[ServerSettings] = []
    monkeypatch.setattr(api.server, "create_app", lambda settings: built.append(settings))
    monkeypatch.setattr("uvicorn.run", lambda *args, **kwargs: None)
    argv = ["serve", "--max-encoder-tokens-per-step", "0", "--encoder-slices-per-step", "0", "--max-num-seqs", "3"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    engine = built[0].engine
    assert (engine.max_encoder_tokens_per_step, engine.encoder_slices_per_step, engine.max_num_seqs) == (None, None, 3)


def test_pipeline_without_options_builds_the_default_config(monkeypatch, clean_env, redis_url):
    configs: list[PipelineConfig] = []

    class Recorded:
        def __init__(self, config: PipelineConfig) -> None:
            configs.append(config)

        def run(self, stop) -> dict[str, int]:
            return {}

    monkeypatch.setattr(pipeline.runner, "CameraPipeline", Recorded)
    result = CliRunner().invoke(app, ["pipeline", "--source", "cam.mp4", "--camera-id", "c1", "--redis-url",
                                      redis_url])
    assert result.exit_code == 0, result.output
    assert configs == [PipelineConfig(source="cam.mp4", camera_id="c1", redis_url=redis_url)]


@pytest.mark.timeout(60)
def test_worker_without_options_uses_the_workers_defaults(monkeypatch, clean_env, redis_url):
    seen: dict[str, dict] = {}

    class Captioner:
        def __init__(self, *args) -> None:
            seen["captioner"] = dict(zip(("base_url", "api_key", "model", "max_tokens"), args, strict=True))

        async def aclose(self) -> None:
            pass

    class Worker:
        def __init__(self, url, captioner, *args, **kwargs) -> None:
            names = ("consumer_name", "claim_idle_seconds", "max_deliveries", "priority", "batch_size")
            seen["worker"] = {**dict(zip(names, args, strict=True)), **kwargs}
            self.consumer_name, self.stats = "w", {}

            class Redis:
                async def aclose(self) -> None:
                    pass

            self.redis = Redis()

        async def run(self, stop) -> None:
            pass

    monkeypatch.setattr(cli.worker, "OpenAICaptioner", Captioner)
    monkeypatch.setattr(cli.worker, "QueueWorker", Worker)
    result = CliRunner().invoke(app, ["worker", "--vlm-url", "http://127.0.0.1:1/v1", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    for name in ("model", "max_tokens"):
        assert seen["captioner"][name] == default(OpenAICaptioner, name)
    for name in ("claim_idle_seconds", "max_deliveries", "priority", "batch_size", "fall_priority"):
        assert seen["worker"][name] == default(QueueWorker, name)
