"""The single `vlmcap` command line. Each subcommand imports its layer lazily, so a camera node
running `vlmcap pipeline` never loads the engine."""

import typer

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Captions for camera streams on a shared VLM engine."
)


from api.cli_demo import demo  # noqa: E402 - the command modules import their layers lazily
from api.cli_serve import serve  # noqa: E402

app.command()(serve)
app.command()(demo)


from bench.cli import bench_app  # noqa: E402 - typer only; each benchmark imports its layers lazily

app.add_typer(bench_app, name="bench")


from api.cli_pipeline import pipeline, worker  # noqa: E402 - the commands import their layers lazily

app.command()(pipeline)
app.command()(worker)
