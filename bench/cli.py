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
    budget: int = typer.Option(256, help="max_num_batched_tokens of the chunked runs."),
    encoder_budget: int = typer.Option(1, help="Encoder inputs (tiles) per step in the 'chunked' run."),
    after_steps: int = typer.Option(8, help="Steps measured after the image prompt's first token."),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw the chats' token timeline here."),
) -> None:
    """Chat inter-token latency while a long image prompt is prefilled: chunked vs unchunked."""
    from bench.stall import StallConfig, run_stall, save, summary

    cfg = StallConfig(model=model, device=device, dtype=dtype, chats=chats, images=images, budget=budget,
                      encoder_budget=encoder_budget, after_steps=after_steps, threads=threads)
    result = run_stall(cfg)
    save(result, json_path, png_path)
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
    json_path: str = typer.Option(None, "--json", help="Write the results here."),
    png_path: str = typer.Option(None, "--png", help="Draw throughput and latency bars here."),
) -> None:
    """Throughput and latency: this engine vs transformers' generate and generate_batch."""
    from bench.peers import PeersConfig, run_peers, save, summary

    cfg = PeersConfig(model=model, device=device, dtype=dtype, requests=requests, input_len=input_len,
                      output_len=output_len, range_ratio=range_ratio, seed=seed, hf_batch_size=hf_batch_size,
                      budget=budget, threads=threads)
    result = run_peers(cfg)
    save(result, json_path, png_path)
    typer.echo(summary(result))
