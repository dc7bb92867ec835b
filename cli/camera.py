"""`vlmcap pipeline`: one camera (capture, detect, gate, enqueue). It never loads the engine. Its options are
`PipelineConfig`'s fields (cli/declared.py), each also read from the environment variable named in its help."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import typer

from cli.declared import Rename, command, docstring_entries, from_dataclass, hand_option, values_for
from cli.options import LOG_FORMAT, default, fail
from pipeline.runner import PipelineConfig


def read_caption_schema(path: Path) -> dict:
    """A caption schema file: a JSON Schema object that is valid as a schema (and refers only within itself:
    nothing is fetched); ValueError saying why not."""
    from jobqueue.structured import caption_validator

    try:
        schema = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read the caption schema {str(path)!r}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"the caption schema {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"the caption schema {str(path)!r} must be a JSON object (a JSON Schema)")
    try:
        caption_validator(schema)
    except ValueError as err:
        raise ValueError(f"the caption schema {str(path)!r} cannot be used: {err}") from None
    return schema


RENAMES = {
    "max_frame_age_seconds": Rename("--max-frame-age", "VLMCAP_MAX_FRAME_AGE"),
    "track_cooldown_seconds": Rename("--track-cooldown", "VLMCAP_TRACK_COOLDOWN"),
    "fall_cooldown_seconds": Rename("--fall-cooldown", "VLMCAP_FALL_COOLDOWN"),
}
PIPELINE = [setting for setting in from_dataclass(PipelineConfig) if setting.name != "redis_url"]
DECLARED = PIPELINE
HAND = [
    hand_option("redis_url", str | None, None, "--redis-url", envvar="REDIS_URL",
                help="Redis 6.2+ URL. Without it an embedded Redis is started and its URL logged."),
    hand_option("backpressure", str, default(PipelineConfig, "backpressure").value, "--backpressure",
                envvar="VLMCAP_BACKPRESSURE", help=docstring_entries(PipelineConfig.__doc__)["backpressure"]),
    hand_option("annotate", str, default(PipelineConfig, "annotate").value, "--annotate", envvar="VLMCAP_ANNOTATE",
                help=docstring_entries(PipelineConfig.__doc__)["annotate"]),
    hand_option("caption_schema", Path | None, None, "--caption-schema", envvar="VLMCAP_CAPTION_SCHEMA",
                help="JSON Schema file sent with each job: the caption is decoded under it and stored parsed as the "
                     "result's `structured` (samples/caption.schema.json: people, actions, anyone on the ground)."),
]


def run_pipeline(**options: Any) -> None:
    """Run one camera: frames with people become caption jobs on the Redis queue."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    from jobqueue.connection import redis_url_or_embedded
    from jobqueue.producer import Backpressure
    from pipeline.detector import DetectorUnavailable
    from pipeline.runner import Annotate, CameraPipeline

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        path = options["caption_schema"]
        schema = read_caption_schema(path) if path is not None else None
        with redis_url_or_embedded(options["redis_url"]) as url:
            config = PipelineConfig(**values_for(PIPELINE, options), redis_url=url, caption_schema=schema,
                                    backpressure=Backpressure(options["backpressure"]),
                                    annotate=Annotate(options["annotate"]))
            stats = CameraPipeline(config).run(stop)
    except (ValueError, DetectorUnavailable) as err:
        raise fail(str(err)) from None
    typer.echo("pipeline finished: " + ", ".join(f"{name}={value}" for name, value in stats.items()))


pipeline = command(run_pipeline, HAND, DECLARED, RENAMES)
pipeline.__name__ = "pipeline"
