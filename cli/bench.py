"""`vlmcap bench …`: each benchmark's options are the fields of its settings (`bench.configs`, built by
cli/declared.py), plus where it writes its JSON and PNG. The command line starts without loading torch; the
benchmarks themselves are imported inside the commands."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import typer

from bench.cameras import CamerasConfig
from bench.configs import (
    SAMPLE_VIDEO,
    GrammarBenchConfig,
    HostConfig,
    HttpStallConfig,
    OverheadConfig,
    PeersConfig,
    PipelineBenchConfig,
    PrefixConfig,
    SamplerConfig,
    ServeConfig,
    SoakConfig,
    StallConfig,
)
from bench.events_store import EventsBenchConfig
from cli.declared import Declared, Rename, command, from_dataclass, hand_option, values_for
from cli.options import default, stop_on_sigterm

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks, side by side in one run (see BENCHMARKS.md).")


@bench_app.callback()
def _before_each_benchmark() -> None:
    stop_on_sigterm()  # a benchmark stopped by SIGTERM stops the servers and Redis it started, as on Ctrl-C
# The benchmarks read no environment variable of their own but the server's key and Redis's URL.
RENAMES = {"detectors": Rename("--detector"), "api_key": Rename(envvar="VLMCAP_API_KEY"),
           "redis_url": Rename(envvar="REDIS_URL")}
DECLARED: dict[str, list[Declared]] = {}  # each command's options built from settings fields


def outputs(what: str, json_path: str | None = None) -> list[inspect.Parameter]:
    return [hand_option("json_path", str | None, json_path, "--json", help="Write the results here."),
            hand_option("png_path", str | None, None, "--png", help=f"Draw {what} here.")]


def fields(config: type, exclude: tuple[str, ...] = ()) -> list[Declared]:
    return [s for s in from_dataclass(config) if s.name not in exclude]


def report(module_name: str, run: str, result_of: Callable[[Any], dict], options: dict[str, Any],
           summary: str = "summary") -> None:
    """Run the benchmark, write its JSON and figure where asked, and print its summary."""
    from bench.report import save

    module = importlib.import_module(f"bench.{module_name}")
    result = result_of(getattr(module, run))
    save(result, options["json_path"], options["png_path"], module.plot)
    typer.echo(getattr(module, summary)(result))


def register(name: str, config: type, module_name: str, run: str, what: str, doc: str,
             hand: list[inspect.Parameter] = (), exclude: tuple[str, ...] = (),
             build: Callable[[dict[str, Any]], Any] | None = None, json_path: str | None = None) -> None:
    """`vlmcap bench <name>`: `config`'s fields as options (less `exclude`, plus `hand`), then `bench.<module>.<run>`
    on the config they build (`build`, when the options need more than the fields); its JSON goes to `json_path`
    unless --json says otherwise."""
    declared = fields(config, exclude)
    DECLARED[name] = declared

    def run_bench(**options: Any) -> None:
        try:
            cfg = build(options) if build else config(**values_for(declared, options))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        report(module_name, run, lambda runner: runner(cfg), options)

    run_bench.__name__, run_bench.__doc__ = name, doc
    bench_app.command(name)(command(run_bench, [*hand, *outputs(what, json_path)], declared, RENAMES, envvars=False))


register("peers", PeersConfig, "peers", "run_peers", "throughput and latency bars",
         "Throughput and latency: this engine vs transformers' generate and generate_batch.")
register("host", HostConfig, "host", "run_host", "the phases of a step",
         "A decode step's host time by phase, aten ops and read-backs per step, against a bare transformers forward.")
register("sampler", SamplerConfig, "sampler", "run_sampler", "each case's time a call",
         "What sampling a step's rows costs: greedy, temperature 1, Ollama's defaults and top_p over peaked to flat "
         "logits, on the CPU kernel's path and on torch's, in turn.")
register("overhead", OverheadConfig, "overhead", "run_overhead", "tokens/s and ITL",
         "What serving over HTTP costs: the same chats through `vlmcap serve` (its own process) and the engine alone.")
register("grammar", GrammarBenchConfig, "grammar", "run_grammar_bench", "each run's throughput",
         "What structured output costs: decode throughput with every request under a JSON schema vs none.")
register("prefix", PrefixConfig, "prefix", "run_prefix", "each turn's time to first token",
         "A chat's next turns over one photo: time to first token, tokens computed and vision-tower runs per turn, "
         "with prefix caching on and off.")
register("events", EventsBenchConfig, "events_store", "run_events_bench", "each search's latency",
         "The camera memory: write cost per job and search latency (text, filters, similar) at --events events.")
register("soak", SoakConfig, "soak", "run_soak", "memory over time and requests by kind",
         "A bounded soak on loopback: its own Redis and server, chats, captions and camera jobs with hostile inputs "
         "mixed in; requests by status, jobs done/dead/lost, memory, ITL.")


register("cameras", CamerasConfig, "cameras", "run_cameras", "caption latency and chat gaps by camera count",
         "The camera operator's figure: N cameras (the pipeline's jobs of a recorded clip) and streaming chats "
         "against one backend (vlmcap, or any OpenAI-compatible server through `vlmcap worker`), N ramped until "
         "alerts, captions or chats miss their target.",
         json_path="bench/results/cameras.json")


def pipeline_config(options: dict[str, Any]) -> PipelineBenchConfig:
    values = values_for(DECLARED["pipeline"], options)
    return PipelineBenchConfig(source=options["source"] or str(SAMPLE_VIDEO), **values)


register("pipeline", PipelineBenchConfig, "pipeline", "run_pipeline_bench", "per-stage time per frame",
         "Frames per second through capture, detector, gate and enqueue, per stage.",
         hand=[hand_option("source", str | None, None, "--source",
                           help="Video file or camera (default: samples/people.mp4).")],
         exclude=("source",), build=pipeline_config)


def serve_config(options: dict[str, Any]) -> ServeConfig:
    from bench.serve import parse_slo

    values = values_for(DECLARED["serve"], options)
    num_requests = options["num_requests"]
    if num_requests is None and values["duration"] is None:
        num_requests = default(ServeConfig, "num_requests")
    return ServeConfig(**values, num_requests=num_requests, slo=parse_slo(options["slo_text"]))


register("serve", ServeConfig, "serve", "run_serve", "latency distributions",
         "Load an OpenAI-compatible server with streaming chat and captioning requests.",
         hand=[hand_option("num_requests", int | None, None, "--num-requests",
                           help=f"Requests to send (default {default(ServeConfig, 'num_requests')} unless "
                                "--duration)."),
               hand_option("slo_text", str | None, None, "--slo",
                           help="Goodput SLOs in ms, e.g. ttft=500,itl=100 (also tpot, e2e).")],
         exclude=("num_requests", "slo"), build=serve_config)

# bench stall: in process (StallConfig), or over HTTP against a server with --url (HttpStallConfig's other fields).
STALL_HTTP = fields(HttpStallConfig, exclude=("url", "model", "chats", "images", "after_tokens", "video"))


def run_stall(**options: Any) -> None:
    """Chat inter-token latency while a long image prompt is prefilled: chunked vs unchunked (or one server)."""
    if options["url"] is None:
        cfg = StallConfig(**values_for(DECLARED["stall"], options))
        report("stall", "run_stall", lambda run: run(cfg), options)
        return
    http = HttpStallConfig(url=options["url"], model=options["served_model"], chats=options["chats"],
                           images=options["images"], after_tokens=options["after_steps"], video=options["video"],
                           **values_for(STALL_HTTP, options))
    report("stall", "run_stall_http", lambda run: run(http), options, summary="summary_http")


DECLARED["stall"] = fields(StallConfig)
bench_app.command("stall")(command(run_stall, [
    hand_option("url", str | None, None, "--url",
                help="Run the scenario over HTTP against this OpenAI-compatible server instead (vlmcap serve, vLLM, "
                     "...); the engine options above are then the server's."),
    hand_option("served_model", str | None, None, "--served-model",
                help="With --url: the model id to ask for (default: the first of /v1/models)."),
    *outputs("the chats' token timeline"),
], DECLARED["stall"] + STALL_HTTP, RENAMES, envvars=False))
