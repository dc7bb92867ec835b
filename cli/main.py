"""The single `vlmcap` command line (the console script). Each command imports its layer inside the command,
so a camera node running `vlmcap pipeline` never loads the engine."""

import typer

from cli.bench import bench_app
from cli.camera import pipeline
from cli.demo import demo
from cli.serve import serve
from cli.worker import worker

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Captions for camera streams on a shared VLM engine."
)
app.command()(serve)
app.command()(demo)
app.add_typer(bench_app, name="bench")
app.command()(pipeline)
app.command()(worker)
