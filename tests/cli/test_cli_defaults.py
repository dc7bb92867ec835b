"""The commands' defaults are those of the settings they build: `vlmcap serve` with no option builds the default
`ServerSettings` (its engine the default `EngineConfig`), `vlmcap pipeline` the default `PipelineConfig`,
`vlmcap worker` the default `QueueWorker` and `OpenAICaptioner`."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

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


def test_serve_without_options_builds_the_default_settings(monkeypatch, clean_env, served_settings):
    built = served_settings
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 0, result.output
    (settings,) = built
    assert settings == replace(ServerSettings(), allowed_hosts=("127.0.0.1",))  # --host is a name clients use
    assert settings.engine == EngineConfig()


def test_zero_turns_the_encoder_limits_off(monkeypatch, clean_env, served_settings):
    built = served_settings
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
        def __init__(self, url, captioner, **kwargs) -> None:
            seen["worker"] = kwargs
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
    for name in ("claim_idle_seconds", "max_deliveries", "caption_priority", "batch_size", "fall_priority"):
        assert seen["worker"][name] == default(QueueWorker, name)


# -- options built from the declarations -------------------------------------------------------------------
def command_params(name: str) -> dict[str, object]:
    """The click parameters of `vlmcap <name>`, by Python name."""
    import typer.main

    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


def test_every_engine_field_is_an_option_with_the_help_written_beside_it():
    import dataclasses

    from cli.declared import NOT_OPTIONS, TYPES, engine_fields, first_sentence

    fields = dataclasses.fields(EngineConfig)
    assert all(f.metadata.get("help") for f in fields), "an EngineConfig field has no help beside it"
    assert [(s.name, s.default, s.help) for s in engine_fields()] == [
        (f.name, f.default, first_sentence(f.metadata["help"])) for f in fields if f.type in TYPES]
    assert {s.name for s in engine_fields()} >= {"attention_backend", "cpu_linear", "cuda_graphs", "seed"}
    nested = {f.name for f in fields if f.type not in TYPES}
    assert nested == {"grammar_limits"}, "a new nested setting needs its options in cli/serve.py"
    assert "EngineConfig.grammar_limits" in NOT_OPTIONS


def test_a_field_of_a_type_no_option_takes_is_refused_by_name():
    from dataclasses import dataclass, field

    from cli.declared import from_dataclass

    @dataclass
    class Odd:
        """count: how many."""

        count: int = 1
        weights: dict[str, float] = field(default_factory=dict)

    with pytest.raises(TypeError, match=r"Odd\.weights is of type 'dict\[str, float\]'"):
        from_dataclass(Odd)


def test_each_field_named_in_not_options_exists_and_is_not_an_option():
    import dataclasses

    from api.settings import Limits
    from bench.configs import ServeConfig
    from cli.declared import NOT_OPTIONS, TYPES

    classes = {cls.__name__: cls for cls in (EngineConfig, ServerSettings, Limits, PipelineConfig, ServeConfig)}
    for name in NOT_OPTIONS:
        owner, _, field_name = name.partition(".")
        types = {f.name: f.type for f in dataclasses.fields(classes[owner])}
        assert field_name in types and types[field_name] not in TYPES, name


def check_declared(params: dict, declared: list, renames: dict, envvars: bool = True) -> None:
    """Each declared setting is an option with the field's default, its variable and a help line."""
    from cli.declared import envvar

    assert declared
    for setting in declared:
        param = params[setting.name]
        default = list(setting.default) if isinstance(setting.default, tuple) else setting.default
        assert param.required if default is ... else param.default == default, setting.name
        assert param.envvar == envvar(setting, renames, envvars), setting.name
        assert setting.help, f"{setting.owner}.{setting.name} has no `name: help` entry in its docstring"


@pytest.mark.parametrize("command", ["serve", "worker", "pipeline"])
def test_each_option_has_its_fields_default_environment_variable_and_help(command):
    import importlib

    module = importlib.import_module({"pipeline": "cli.camera"}.get(command, f"cli.{command}"))
    check_declared(command_params(command), module.DECLARED, module.RENAMES)


@pytest.mark.parametrize("name", ["cameras", "grammar", "host", "overhead", "peers", "pipeline", "prefix", "serve",
                                  "soak", "stall"])
def test_each_bench_option_has_its_fields_default_and_help(name):
    import typer.main

    from cli.bench import DECLARED, RENAMES

    params = {p.name: p for p in typer.main.get_command(app).commands["bench"].commands[name].params}
    check_declared(params, DECLARED[name], RENAMES, envvars=False)


def test_existing_option_names_and_environment_variables_keep_working(monkeypatch, clean_env, served_settings):
    built = served_settings
    monkeypatch.setenv("VLMCAP_PREFIX_CACHING", "false")
    monkeypatch.setenv("VLMCAP_BATCH_SIZE", "3")
    argv = ["serve", "--no-chunked-prefill", "--claim-idle-seconds", "5", "--attention-backend", "reference",
            "--no-cpu-linear", "--seed", "7", "--remote-image-host", "a.example", "--shutdown-grace", "2"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    settings = built[0]
    engine = settings.engine
    assert (engine.enable_chunked_prefill, engine.enable_prefix_caching) == (False, False)
    assert (engine.attention_backend, engine.cpu_linear, engine.seed) == ("reference", False, 7)
    assert (settings.batch_size, settings.claim_idle_seconds, settings.shutdown_grace_s) == (3, 5.0, 2.0)
    assert settings.limits.remote_image_hosts == ("a.example",)


def test_grammar_limits_are_serve_options(monkeypatch, clean_env, served_settings):
    built = served_settings
    result = CliRunner().invoke(app, ["serve", "--max-schema-bytes", "1000", "--grammar-workers", "1"])
    assert result.exit_code == 0, result.output
    limits = built[0].engine.grammar_limits
    assert (limits.max_schema_bytes, limits.workers) == (1000, 1)
    result = CliRunner().invoke(app, ["serve", "--grammar-workers", "0"])
    assert result.exit_code != 0 and "GrammarLimits.workers must be a positive number" in result.output


def test_the_worker_and_the_server_share_the_queues_declarations():
    from cli.serve import SERVER
    from cli.worker import MEMORY, MQTT, QUEUE

    # The queue's, the event store's and MQTT's settings: one declaration each, the worker's and the server's.
    for declared, owner in ((QUEUE, "QueueSettings"), (MEMORY, "MemorySettings"), (MQTT, "MqttSettings")):
        assert declared and set(declared) <= {replace(s, owner=owner) for s in SERVER}


def test_help_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys; from typer.testing import CliRunner; from cli.main import app; " \
           "r = CliRunner().invoke(app, ['serve', '--help']); assert r.exit_code == 0, r.output; " \
           "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_configuration_reference_is_up_to_date():
    from pathlib import Path

    from cli.reference import markdown

    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == markdown(), "run: python -m cli.reference > docs/configuration.md"


def test_serve_on_a_port_in_use_ends_before_loading_the_server():
    """The port is bound first: one in use ends `vlmcap serve` with uvicorn's start-up failure status (3), naming
    the address, before torch or transformers is imported (seconds) or the model loaded."""
    from cli_support import held_port, run_command

    with held_port() as port:
        ended, run = run_command(["serve", "--model", "tiny", "--port", str(port)], ("torch", "transformers"))
    assert ended == ["exit", "3", "False", "False"], run.stdout + run.stderr
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in run.stderr
