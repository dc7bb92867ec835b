"""`vlmcap demo`: the whole product on one machine. An embedded Redis, the server with its in-process
queue worker and its dashboard, and a camera pipeline playing the bundled sample video in real time, looping,
with the trained people-fall detector (HOG when it cannot be fetched); one line per caption as it arrives,
a line per event (a tracked person's frames captioned as one prompt, also on the dashboard as a strip of
frames) and a line per fall alert, until Ctrl-C. With `once`, one pass, not paced: it ends when the video has ended
and every job it queued has its caption."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import typer

from bench.configs import SAMPLE_VIDEO
from cli.options import PORT, STARTUP_FAILURE, run_until_signalled, stop_on_sigterm

HUB_MODEL = "HuggingFaceTB/SmolVLM-256M-Instruct"
CAMERA = "sample-cam"

log = logging.getLogger(__name__)


def hub_reachable(host: str = "huggingface.co", timeout_s: float = 3.0) -> bool:
    """A quick look before asking the hub: offline, transformers would retry for half a minute."""
    try:
        with socket.create_connection((host, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def choose_model(model: str | None) -> tuple[str, str | None]:
    """The model to serve and, when the demo had to fall back to random weights, the banner to show."""
    if model is not None:
        return model, None
    if hub_reachable():
        return HUB_MODEL, None
    return "tiny", (
        f"demo: {HUB_MODEL} cannot be downloaded here, so the demo runs 'tiny', a small model with random "
        "weights: its captions are meaningless text. Give --model a local checkpoint for real captions."
    )


def choose_detector(detector: str | None) -> str:
    """The detector to run: the one asked for, else people-fall when its checkpoint can be had, else HOG
    (saying why)."""
    if detector is not None:
        return detector
    from pipeline.detector import PEOPLE_FALL, DetectorUnavailable, fetch_checkpoint

    try:
        fetch_checkpoint(PEOPLE_FALL)
        return PEOPLE_FALL
    except DetectorUnavailable as err:
        print(f"demo: the {PEOPLE_FALL} detector is unavailable ({err}); falling back to HOG, which finds "
              "standing people only, so the demo shows no fall alert", flush=True)
        return "hog"


async def _print_captions(redis_url: str, pipeline_done: threading.Event, timeout_s: float | None,
                          printed: list[int], stop: asyncio.Event) -> None:
    """Print each finished caption of the demo camera as it arrives, counting them in `printed[0]`; return
    when `stop` is set (Ctrl-C, SIGTERM), or when the camera is done and every job has its caption (never,
    while the camera loops)."""
    from jobqueue.connection import connect
    from jobqueue.contract import camera_captions_stream
    from jobqueue.results import queue_stats, tail_captions

    redis = connect(redis_url)
    arrived: asyncio.Queue = asyncio.Queue()
    ended = asyncio.Event()  # the follower's own stop: it ends within a second, nothing is cancelled

    async def follow() -> None:
        async for _, result in tail_captions(redis, camera=CAMERA, after="0-0", block_seconds=1.0, stop=ended):
            await arrived.put(result)

    follower = asyncio.create_task(follow())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else float("inf")
        while not stop.is_set():
            if loop.time() >= deadline:
                raise TimeoutError(f"captions were still arriving after {timeout_s:.0f} s")
            try:
                result = await asyncio.wait_for(arrived.get(), timeout=1.0)
            except asyncio.TimeoutError:
                # Done when the video has ended, no job is left, and every finished job was printed.
                if pipeline_done.is_set() and (await queue_stats(redis))["backlog"] == 0:
                    if printed[0] == await redis.xlen(camera_captions_stream(CAMERA)):
                        return
                continue
            text = result.caption if result.status == "done" else f"[failed: {result.error}]"
            if result.fall:
                print(f"ALERT fall camera={result.camera_id} t={result.frame_ts:.1f}s: a person on the ground "
                      f"(on the dashboard, /v1/alerts and /v1/alerts/stream)", flush=True)
            if result.kind == "event":
                print(f"event camera={result.camera_id} person={result.track_id} t={result.start_ts:.1f}-"
                      f"{result.end_ts:.1f}s frames={result.frame_count}: {(text or '').strip()!r}", flush=True)
            else:
                print(f"caption camera={result.camera_id} t={result.frame_ts:.1f}s persons={result.person_count}"
                      f"{' fall' if result.fall else ''}: {(text or '').strip()!r}", flush=True)
            printed[0] += 1
    finally:
        ended.set()
        await asyncio.gather(follower, return_exceptions=True)
        await redis.aclose()


def run_demo(model: str | None, detector: str | None, source: str | None, timeout_s: float = 900.0,
             once: bool = False, port: int = PORT, sockets: list[socket.socket] | None = None) -> int:
    """Run the demo; return the number of captions printed. Without `once` it runs until Ctrl-C (the
    video in real time, looping); with it, one pass as fast as the detector goes, within `timeout_s`. The server
    listens on `sockets` (bound beforehand: `bind_listeners`), else on 127.0.0.1 at `port`."""
    from api.background import BackgroundServer
    from api.server import create_app
    from api.settings import ServerSettings
    from engine import EngineConfig
    from jobqueue.connection import EmbeddedRedis
    from pipeline.runner import CameraPipeline, PipelineConfig

    served, banner = choose_model(model)
    if banner:
        print(banner, flush=True)
    detector = choose_detector(detector)
    redis = EmbeddedRedis()
    print(f"demo: embedded Redis at {redis.url}", flush=True)
    try:
        settings = ServerSettings(engine=EngineConfig(model=served), redis_url=redis.url, run_queue_worker=True)
        with BackgroundServer(create_app(settings), port=port, sockets=sockets) as server:
            print(f"demo: server on {served} at {server.url}", flush=True)
            camera = CameraPipeline(PipelineConfig(
                source=source or str(SAMPLE_VIDEO), camera_id=CAMERA, redis_url=redis.url, detector=detector,
                track_cooldown_seconds=3.0, stats_interval_seconds=3600.0, realtime=not once, loop=not once,
            ))
            print(f"demo: camera {CAMERA} reads {source or SAMPLE_VIDEO.name} with the "
                  f"{camera.detector.name} detector" + ("" if once else ", in real time, looping"), flush=True)
            print(f"demo: dashboard at {server.url}/ (open it in a browser)"
                  + ("" if once else "; Ctrl-C stops the demo"), flush=True)
            done, stop = threading.Event(), threading.Event()

            def run_camera() -> None:
                try:
                    stats = camera.run(stop)
                    print(f"demo: video ended: {stats['captured']} frames, {stats['detected']} with people, "
                          f"{stats['jobs']} jobs, {stats['falls']} falls, {stats['events']} events", flush=True)
                finally:
                    done.set()

            thread = threading.Thread(target=run_camera, name="demo-camera", daemon=True)
            thread.start()
            printed = [0]
            try:
                _, signalled = run_until_signalled(
                    lambda stop: _print_captions(redis.url, done, timeout_s if once else None, printed, stop))
                if signalled:
                    raise KeyboardInterrupt  # as an interrupt that comes before or after the loop
            except KeyboardInterrupt:
                print("demo: stopping (Ctrl-C)", flush=True)
            finally:
                stop.set()
                thread.join(30)
            print(f"demo: {printed[0]} captions", flush=True)
            return printed[0]
    finally:
        redis.close()


def demo(
    model: str = typer.Option(None, help="Model to serve (default: HuggingFaceTB/SmolVLM-256M-Instruct when it "
                                         "can be downloaded, else the random-weight 'tiny')."),
    detector: str = typer.Option(None, help="'people-fall', 'hog' or YOLO weights (default: people-fall, which "
                                            "tells falls, else HOG)."),
    source: str = typer.Option(None, help="Camera source instead of the bundled samples/people.mp4."),
    once: bool = typer.Option(False, "--once", help="One pass over the video as fast as the detector goes, then "
                                                    "exit when every job has its caption (default: real time, "
                                                    "looping, until Ctrl-C)."),
    port: int = typer.Option(PORT, help="Port of the server and its dashboard on 127.0.0.1 (0: any free one)."),
    timeout: float = typer.Option(900.0, help="With --once: give up when captions are still arriving after this "
                                              "many seconds."),
) -> None:
    """Play the sample video through the whole product: print each caption and fall alert as it arrives."""
    from api.connections import bind_listeners

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stop_on_sigterm()
    try:  # the port before the server's imports (seconds): one in use ends the demo at once, saying so
        sockets = bind_listeners("127.0.0.1", port)
    except OSError as exc:
        typer.echo(f"demo: {exc.strerror or exc} (--port 0 takes any free port)", err=True)
        raise typer.Exit(STARTUP_FAILURE) from None
    if run_demo(model, detector, source, timeout, once=once, sockets=sockets) == 0 and once:
        raise typer.Exit(1)
