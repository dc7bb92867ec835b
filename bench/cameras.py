"""`vlmcap bench cameras`: the camera operator's figure. How many cameras can one box caption, with chats still
smooth? N synthetic cameras plus `chats` streaming chats load one backend for `duration` seconds, for N = 1, 2, 4,
... (`--cameras`), until a criterion fails; each step reports captions per minute, caption latency p50/p95 (from
the end of what a job shows, its last frame's time, to its result), fall-alert latency, and the chats' gap between
tokens (p50/p99, a gap still open when the step ends included). A step is sustained when every fall alert is
captioned within `alert_within_s`, captions' p95 is within `caption_p95_within_s` and the chats' p99 gap within
`chat_gap_p99_within_s`; the largest sustained N is each backend's figure.

Cameras send what the pipeline sends: the recorded people clip samples/people.mp4 is played through the camera
pipeline's own code (`pipeline.runner.CameraPipeline`: the clip's frames, the gate, the event recorder and the job
builder; the people-fall detector's tracked boxes of each frame replayed from samples/people.tracks.json instead
of running the detector), which gives the jobs of one pass and when in the clip each is sent: sightings, events of
several frames and a fall alert with its lead-up. Each camera sends that pass once every `clip_every` seconds (a
camera's people come and go), its copies stamped with the camera's id and the wall clock, the cameras' passes
spread evenly over the period. Jobs go onto the Redis stream through the producer (`jobqueue.producer`); results
are read back from the results hash (its `finished_at` is Redis's clock, the same machine's) and counted again
on the caption feed.

Backends, one at a time, each on a fresh queue:
- `vlmcap`: this project's server (`vlmcap serve`, started for the run), its own queue worker captioning;
- any OpenAI-compatible server (`--backend-url`, named by `--backend-name`: vLLM's or llama.cpp's): its captions
  through `vlmcap worker --vlm-url` (started for the run; what an operator would run in front of that server),
  its chats straight to it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from api.percentiles import percentile, percentiles_ms
from bench.configs import SAMPLE_VIDEO
from bench.report import listens, machine, pyplot, save_figure, stream_chat

log = logging.getLogger(__name__)

TRACKS = SAMPLE_VIDEO.with_suffix(".tracks.json")  # samples/people.tracks.json
RECORDING_CAMERA = "recorded-camera"  # the camera id of the recorded pass, replaced in each copy's prompt
CHAT_TEXT = "Tell me a long story about a bus driver in a rainy city."
VLMCAP = "vlmcap"


@dataclass
class CamerasConfig:
    """`vlmcap bench cameras`: N cameras and streaming chats against one backend, N ramped.

    model: the model vlmcap's server serves: tiny, dummy:<preset> or a checkpoint (other backends serve their own).
    dtype: the dtype of vlmcap's server: bfloat16, as vLLM and llama.cpp serve a bfloat16 checkpoint (the engine's
        own default, float32, would compare float32 against their bfloat16).
    threads: torch threads of vlmcap's server (default: torch's choice).
    quantization: the weights of vlmcap's server: int8 (`vlmcap serve --quantization int8`), or the checkpoint's (None).
    cameras: camera counts, in order (repeat); the ramp stops at the first that is not sustained.
    duration: seconds of load at each camera count.
    chats: chats streaming throughout.
    chat_max_tokens: tokens each chat streams (ignore_eos), then the next chat begins.
    caption_max_tokens: new tokens of a caption (default: the server's --caption-max-tokens, the worker's
        --max-tokens).
    clip_every: seconds between two passes of the recorded clip on one camera (at least the clip's length).
    alert_within_s: a step is sustained only if every fall alert is captioned within this many seconds.
    caption_p95_within_s: and the captions' p95 latency is within this.
    chat_gap_p99_within_s: and the chats' p99 gap between tokens is within this.
    backend: measure 'vlmcap', this project's server, started for the run; the default when no --backend-url
        is given.
    backend_url: an OpenAI-compatible server to measure (repeat): its captions through `vlmcap worker --vlm-url`,
        its chats straight to it.
    backend_name: the name of each --backend-url, in the same order (default: its host and port).
    api_key: bearer key of the --backend-url servers, if they need one.
    startup_timeout: seconds a backend (vlmcap's server, a worker) may take to start.
    in_process: start vlmcap's server on a thread of this process instead of its own process (quicker to start,
        for tests; it then shares this interpreter with the load).
    """

    model: str = "dummy:smolvlm-256m"
    dtype: str = "bfloat16"
    threads: int | None = None
    quantization: str | None = None
    cameras: tuple[str, ...] = ("1", "2", "4", "8", "16", "32", "64")
    duration: float = 120.0
    chats: int = 8
    chat_max_tokens: int = 128
    caption_max_tokens: int | None = None
    clip_every: float = 60.0
    alert_within_s: float = 5.0
    caption_p95_within_s: float = 60.0
    chat_gap_p99_within_s: float = 1.0
    backend: tuple[str, ...] = ()
    backend_url: tuple[str, ...] = ()
    backend_name: tuple[str, ...] = ()
    api_key: str | None = None
    startup_timeout: float = 600.0
    in_process: bool = False

    def __post_init__(self) -> None:
        counts = self.camera_counts
        if not counts or any(n < 1 for n in counts):
            raise ValueError(f"cameras must be positive counts, got {list(self.cameras)!r}")
        for name in ("duration", "clip_every", "alert_within_s", "caption_p95_within_s", "chat_gap_p99_within_s",
                     "startup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.chats < 0 or self.chat_max_tokens < 1:
            raise ValueError(f"chats must be >= 0 and chat_max_tokens >= 1, got {self.chats}, {self.chat_max_tokens}")
        if self.caption_max_tokens is not None and self.caption_max_tokens < 1:
            raise ValueError(f"caption_max_tokens must be positive, got {self.caption_max_tokens}")
        unknown = [b for b in self.backend if b != VLMCAP]
        if unknown:
            raise ValueError(f"backend is {VLMCAP!r} (others by --backend-url), got {unknown[0]!r}")
        if self.backend_name and len(self.backend_name) != len(self.backend_url):
            raise ValueError(f"give one backend_name per backend_url: {len(self.backend_name)} names for "
                             f"{len(self.backend_url)} URLs")
        for url in self.backend_url:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend_url must start with http:// or https://, got {url!r}")

    @property
    def camera_counts(self) -> list[int]:
        try:
            return [int(n) for n in self.cameras]
        except ValueError:
            raise ValueError(f"cameras must be whole numbers, got {list(self.cameras)!r}") from None

    @property
    def backends(self) -> list[tuple[str, str | None]]:
        """(name, URL) of each backend in the order they run; vlmcap's URL is its own server's (None here)."""
        from urllib.parse import urlsplit

        remote = [(name, url) for name, url in zip(self.backend_name or [urlsplit(u).netloc for u in self.backend_url],
                                                   self.backend_url, strict=True)]
        own = [(VLMCAP, None)] if VLMCAP in self.backend or not remote else []
        return own + remote


# -- the cameras' jobs -------------------------------------------------------------------------------

def recorded_tracks(path: Path = TRACKS) -> list[list]:
    """The tracked boxes of each frame of the clip, as recorded (`record_tracks`)."""
    return json.loads(path.read_text())["frames"]


def record_tracks(path: Path = TRACKS, detector: str = "people-fall") -> None:
    """Run `detector` with its tracker over samples/people.mp4 and write each frame's boxes to `path`."""
    import threading

    from pipeline.capture import open_source
    from pipeline.detector import load_detector
    from pipeline.tracker import tracking_function

    track = tracking_function(load_detector(detector))
    frames = [[[round(d.x1, 1), round(d.y1, 1), round(d.x2, 1), round(d.y2, 1), round(d.confidence, 3), d.track_id,
                d.label] for d in track(frame.image)]
              for frame in open_source(str(SAMPLE_VIDEO)).frames(threading.Event())]
    about = json.loads(path.read_text()) if path.exists() else {}
    head = {"source": SAMPLE_VIDEO.name, "detector": detector, "tracker": about.get("tracker", ""),
            "about": about.get("about", "")}
    body = ",\n".join(json.dumps(boxes, separators=(",", ":")) for boxes in frames)
    path.write_text(json.dumps(head, indent=1)[:-2] + ',\n "frames": [\n' + body + "\n]}\n")


def clip_pass(redis_url: str) -> tuple[list[tuple[float, Any]], float]:
    """The jobs of one pass of the clip through the camera pipeline, each with its time in the clip (when the
    pipeline sends it), and the clip's length in seconds. The pipeline's own code runs; only its detector's boxes
    are replayed (its producer and stats publisher are made, on `redis_url`, but nothing is sent)."""
    from jobqueue.contract import Detection
    from pipeline.runner import CameraPipeline, PipelineConfig

    tracks = recorded_tracks()

    class Replay(CameraPipeline):
        def __init__(self) -> None:
            # HOG is built (no weights, at once) but never run: each frame's boxes are the recorded ones.
            super().__init__(PipelineConfig(source=str(SAMPLE_VIDEO), camera_id=RECORDING_CAMERA,
                                            redis_url=redis_url, detector="hog"))
            self.fps = self.source.native_fps
            self.frame_index = -1
            self.sent: list[tuple[float, Any]] = []
            self._track = self.replayed

        def replayed(self, image: Any) -> list[Detection]:
            self.frame_index += 1
            boxes = tracks[self.frame_index] if self.frame_index < len(tracks) else []
            return [Detection(*box) for box in boxes]

        def _send(self, job: Any) -> None:  # the job kept with the time it is sent, instead of enqueued
            self.sent.append(((self.frame_index + 1) / self.fps, job))
            self.jobs += 1

    replay = Replay()
    replay.run()
    return replay.sent, len(tracks) / replay.fps


def camera_copy(job: Any, camera_id: str, shift: float) -> Any:
    """`job` as camera `camera_id` sends it: a new id, its frames' times moved by `shift` seconds (a pass's start
    on the wall clock), and each frame stamped with the camera and its time (`stamped`), so that no two copies'
    frames are the same image: a backend's caches keyed by an image's content (an encoder cache, a prefix cache)
    cannot serve a camera's frames from another camera's or an earlier pass's, as they could not in a real
    deployment."""
    frames = [dataclasses.replace(frame, ts=frame.ts + shift, image=stamped(frame.image, camera_id, frame.ts + shift))
              for frame in job.frames]
    image = frames[0].image if frames else stamped(job.image, camera_id, job.frame_ts + shift)
    return dataclasses.replace(job, camera_id=camera_id, job_id=uuid.uuid4().hex, created_at=time.time(),
                               frame_ts=job.frame_ts + shift, frames=frames, image=image,
                               prompt=job.prompt.replace(RECORDING_CAMERA, camera_id))


def stamped(jpeg: bytes, camera_id: str, ts: float) -> bytes:
    """The JPEG with the camera's id and the frame's time written in its top-left corner, as a camera's on-screen
    display stamps them, encoded again as the pipeline encodes a job's image (`pipeline.runner.job_image`)."""
    import cv2
    import numpy as np

    from pipeline.runner import Annotate, job_image

    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError(f"a recorded frame is not a JPEG ({len(jpeg)} bytes)")
    text = f"{camera_id} {time.strftime('%H:%M:%S', time.gmtime(ts))}.{int(ts * 1000) % 1000:03d}"
    cv2.putText(image, text, (4, 14), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1, cv2.LINE_AA)
    return job_image(image, [], Annotate.NONE)


# -- the backends ------------------------------------------------------------------------------------

def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from cli.main import app; app(prog_name='vlmcap')", *args]


def _wait_ready(process: subprocess.Popen, url: str | None, timeout: float, log_file: IO[str],
                ready: Any = None) -> None:
    """Until `url`'s /ready answers 200 from `process` itself (`listens`: the port picked for it may have gone to
    another process), or `ready()` holds; RuntimeError with the log's tail otherwise."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[3]} exited with {process.returncode}: {_tail(log_file)}")
        try:
            if ready() if ready else (httpx.get(f"{url}/ready", timeout=5).status_code == 200
                                      and listens(process.pid, int(url.rsplit(":", 1)[1]))):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{process.args[3]} was not ready within {timeout:.0f} s: {_tail(log_file)}")


def _tail(log_file: IO[str], chars: int = 3000) -> str:
    log_file.flush()
    log_file.seek(0)
    return log_file.read()[-chars:]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Backend:
    """One backend's processes, started for the run: vlmcap's server (its queue worker on `redis_url`), or a
    `vlmcap worker` in front of `url`. `url` is where chats go."""

    def __init__(self, cfg: CamerasConfig, name: str, url: str | None, redis_url: str, data_dir: str) -> None:
        self.cfg, self.name, self.url, self.redis_url, self.data_dir = cfg, name, url, redis_url, data_dir
        self.processes: list[subprocess.Popen] = []
        self.log = tempfile.TemporaryFile("w+")
        self.model: str | None = None
        self.in_process: Any = None  # a BackgroundServer, with `in_process`

    def __enter__(self) -> Backend:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        import httpx

        from jobqueue.connection import free_tcp_port

        cfg = self.cfg
        tokens = [] if cfg.caption_max_tokens is None else [str(cfg.caption_max_tokens)]
        if self.url is None and cfg.in_process:
            self._start_in_process()
        elif self.url is None:
            port = free_tcp_port()
            args = ["serve", "--model", cfg.model, "--port", str(port), "--redis-url", self.redis_url,
                    "--data-dir", self.data_dir, "--log-level", "warning"]
            args += ["--dtype", cfg.dtype] if cfg.dtype else []
            args += ["--num-threads", str(cfg.threads)] if cfg.threads else []
            args += ["--quantization", cfg.quantization] if cfg.quantization else []
            args += ["--caption-max-tokens", *tokens] if tokens else []
            self.url = f"http://127.0.0.1:{port}"
            self._spawn(args)
            _wait_ready(self.processes[-1], self.url, cfg.startup_timeout, self.log)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key and self.name != VLMCAP else {}
        models = httpx.get(f"{self.url.rstrip('/').removesuffix('/v1')}/v1/models", headers=headers, timeout=30)
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]
        if self.name == VLMCAP:
            return
        args = ["worker", "--vlm-url", self.url, "--model", self.model, "--redis-url", self.redis_url,
                "--data-dir", self.data_dir, "--consumer-name", f"bench-{self.name}"]
        args += ["--max-tokens", *tokens] if tokens else []
        args += ["--api-key", cfg.api_key] if cfg.api_key else []
        self._spawn(args)
        _wait_ready(self.processes[-1], None, cfg.startup_timeout, self.log, ready=self._worker_joined)

    def _start_in_process(self) -> None:
        """vlmcap's server on a thread of this process (`api.background.BackgroundServer`)."""
        from api.background import BackgroundServer
        from api.server import create_app
        from api.settings import ServerSettings
        from engine import EngineConfig

        cfg = self.cfg
        engine = EngineConfig(model=cfg.model, **({"dtype": cfg.dtype} if cfg.dtype else {}),
                              **({"num_threads": cfg.threads} if cfg.threads else {}),
                              **({"quantization": cfg.quantization} if cfg.quantization else {}))
        tokens = {} if cfg.caption_max_tokens is None else {"caption_max_tokens": cfg.caption_max_tokens}
        settings = ServerSettings(engine=engine, redis_url=self.redis_url, data_dir=self.data_dir, **tokens)
        self.in_process = BackgroundServer(create_app(settings), ready_timeout_s=cfg.startup_timeout)
        self.url = self.in_process.__enter__().url

    def _spawn(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("VLMCAP_API_KEY", "REDIS_URL")}
        self.processes.append(subprocess.Popen(_cli(*args), stdout=subprocess.DEVNULL, stderr=self.log, env=env,
                                               text=True))

    def _worker_joined(self) -> bool:
        """The worker has made the consumer group (on the queue flushed for this backend: no one else did), so
        every job put on the stream from now on is delivered to it."""
        import redis

        from jobqueue.contract import CONSUMER_GROUP, JOBS_STREAM

        client = redis.Redis.from_url(self.redis_url)
        try:
            return any(g["name"].decode() == CONSUMER_GROUP for g in client.xinfo_groups(JOBS_STREAM))
        except redis.ResponseError:  # no stream yet
            return False
        finally:
            client.close()

    @property
    def chat_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    def __exit__(self, *exc: Any) -> None:
        for process in reversed(self.processes):
            _stop(process)
        if self.in_process is not None:
            self.in_process.__exit__(None, None, None)
        self.log.close()


# -- one step: N cameras and the chats -----------------------------------------------------------------

@dataclass
class Sent:
    job: Any
    at: float  # wall clock when it was put on the queue


class _Arrivals(list):
    """A chat's text chunk times (`stream_chat` appends them), which set `streaming` at the first."""

    def __init__(self, streaming: asyncio.Event) -> None:
        super().__init__()
        self.streaming = streaming

    def append(self, at: float) -> None:
        super().append(at)
        self.streaming.set()


async def _chat_loop(http: Any, model: str, cfg: CamerasConfig, gaps: list[float], errors: list[str],
                     tokens: list[int], streaming: asyncio.Event) -> None:
    """Chats one after another until cancelled: the gaps between the text chunks of each, in seconds, and when
    cancelled (the load is over) the gap still open since the running chat's last chunk, so that a chat stalled at
    the end counts too. `streaming` is set at the first text chunk (or the first error)."""
    body = {"model": model, "messages": [{"role": "user", "content": CHAT_TEXT}], "stream": True,
            "max_tokens": cfg.chat_max_tokens, "ignore_eos": True}
    while True:
        times = _Arrivals(streaming)
        try:
            refused = await stream_chat(http, body, times)
            if refused is not None:
                errors.append(refused[:200])
                streaming.set()
                await asyncio.sleep(1.0)
                continue
        except asyncio.CancelledError:
            if times:
                gaps.append(time.perf_counter() - times[-1])
            raise
        except Exception as exc:  # a chat that breaks is counted, the others go on
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            streaming.set()
            await asyncio.sleep(1.0)
        finally:
            gaps.extend(later - earlier for earlier, later in zip(times, times[1:]))
            tokens[0] += len(times)


async def _camera(index: int, count: int, schedule: list[tuple[float, Any]], cycle: float, began: float,
                  until: float, producer: Any, sent: list[Sent]) -> None:
    """Camera `index` of `count`: a pass of the clip every `cycle` seconds, the cameras' passes spread evenly over
    the period (at `began` camera i is (i + 1/2) / count of a period into its pass, so none starts empty)."""
    camera_id = f"cam-{index + 1:02d}"
    start = began - (index + 0.5) * cycle / count
    while start < until:
        for offset, job in schedule:
            at = start + offset
            if at < began:
                continue
            if at >= until:
                return
            await asyncio.sleep(max(0.0, at - time.time()))
            copy = camera_copy(job, camera_id, start)
            producer.submit(copy)
            sent.append(Sent(copy, time.time()))
        start += cycle


async def _load(cfg: CamerasConfig, backend: Backend, count: int, schedule: list[tuple[float, Any]],
                cycle: float) -> dict[str, Any]:
    import httpx

    from jobqueue.producer import JobProducer

    producer = JobProducer(backend.redis_url, stream_maxlen=1_000_000)
    gaps: list[float] = []
    errors: list[str] = []
    sent: list[Sent] = []
    limits = httpx.Limits(max_connections=cfg.chats + 4)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key and backend.name != VLMCAP else {}
    async with httpx.AsyncClient(base_url=backend.chat_url, timeout=httpx.Timeout(600, connect=30), limits=limits,
                                 headers=headers) as http:
        tokens = [0]
        streaming = [asyncio.Event() for _ in range(cfg.chats)]
        chats = [asyncio.create_task(_chat_loop(http, backend.model, cfg, gaps, errors, tokens, started))
                 for started in streaming]
        # The step begins once every chat streams: a chat's wait for its first token (a fresh server's first
        # requests, a loaded machine) is no gap between tokens, and a step whose chats had not streamed yet when it
        # ended would have no gap to judge them by.
        try:
            await asyncio.wait_for(asyncio.gather(*(started.wait() for started in streaming)), cfg.startup_timeout)
        except TimeoutError:
            errors.append(f"a chat streamed nothing within {cfg.startup_timeout:.0f} s")
        began = time.time()
        until = began + cfg.duration
        await asyncio.gather(*(_camera(i, count, schedule, cycle, began, until, producer, sent)
                               for i in range(count)))
        await asyncio.sleep(max(0.0, until - time.time()))
        for chat in chats:
            chat.cancel()
        await asyncio.gather(*chats, return_exceptions=True)
    await asyncio.to_thread(producer.close)
    outcome = await _read_back(cfg, backend.redis_url, sent, until)
    return {**outcome, "began": began, "until": until, "chat_gaps_s": gaps, "chat_tokens": tokens[0],
            "chat_errors": errors, "producer": asdict(producer.stats)}


async def _read_back(cfg: CamerasConfig, redis_url: str, sent: list[Sent], until: float) -> dict[str, Any]:
    """Wait (at most `caption_p95_within_s` after the load: a job unfinished by then is late whatever its
    latency) for every sent job's result, then read each back, and count the step's captions on the feed."""
    import redis.asyncio as aioredis

    from jobqueue.contract import CAPTIONS_STREAM, FINAL_STATUSES
    from jobqueue.results import get_result

    client = aioredis.Redis.from_url(redis_url)
    ids = [s.job.job_id for s in sent]
    deadline = until + cfg.caption_p95_within_s
    results: dict[str, Any] = {}
    try:
        while True:
            for job_id in ids:
                if job_id not in results or results[job_id].status not in FINAL_STATUSES:
                    results[job_id] = await get_result(client, job_id)
            if all(r is not None and r.status in FINAL_STATUSES for r in results.values()) \
                    or time.time() > deadline:
                break
            await asyncio.sleep(0.2)
        own = set(ids)
        on_feed = sum(1 for _, fields in await client.xrange(CAPTIONS_STREAM)
                      if fields.get(b"id", b"").decode() in own and fields.get(b"status") == b"done")
    finally:
        await client.aclose()
    return {"sent": sent, "results": results, "feed_captions": on_feed}


def late_percentile(latencies: list[float], q: float) -> float:
    """`api.percentiles.percentile`, where a late job (an infinite latency) is the slowest: infinite when the q-th
    rank falls on one (interpolating towards infinity with a weight of 0 gives NaN)."""
    value = percentile(latencies, q)
    if math.isnan(value) and latencies:
        ordered = sorted(latencies)
        rank = (len(ordered) - 1) * q / 100
        return ordered[int(rank)] if rank == int(rank) else math.inf
    return value


def step_figures(cfg: CamerasConfig, count: int, load: dict[str, Any]) -> dict[str, Any]:
    """One step's figures from what was sent and read back: latencies from each job's last frame to its result
    (a job failed or unfinished counts as late: infinite)."""
    inf = float("inf")
    latencies, alerts, kinds = [], [], {}
    done = failed = unfinished = in_window = 0
    for entry in load["sent"]:
        job, result = entry.job, load["results"].get(entry.job.job_id)
        kinds[job.job_kind] = kinds.get(job.job_kind, 0) + 1
        if result is None or result.status not in ("done", "failed"):
            unfinished += 1
            latency = inf
        elif result.status == "failed":
            failed += 1
            latency = inf
        else:
            done += 1
            latency = result.finished_at - job.end_ts
            in_window += result.finished_at <= load["until"]
        latencies.append(latency)
        if job.fall:
            alerts.append(latency)
    caption = {"p50": late_percentile(latencies, 50), "p95": late_percentile(latencies, 95),
               "max": max(latencies, default=inf)}
    alert = {"p50": late_percentile(alerts, 50), "max": max(alerts, default=math.nan), "count": len(alerts)}
    gap = percentiles_ms(load["chat_gaps_s"])
    meets = {
        "alerts": not alerts or alert["max"] <= cfg.alert_within_s,
        "captions": bool(latencies) and caption["p95"] <= cfg.caption_p95_within_s,
        "chats": cfg.chats == 0 or (bool(load["chat_gaps_s"]) and gap["p99"] <= cfg.chat_gap_p99_within_s * 1000),
    }
    return {
        "cameras": count,
        "duration_s": load["until"] - load["began"],
        "jobs": len(load["sent"]),
        "jobs_by_kind": kinds,
        "captions": done,
        "feed_captions": load["feed_captions"],
        "failed": failed,
        "unfinished": unfinished,
        "captions_per_min": in_window * 60.0 / (load["until"] - load["began"]),
        "caption_latency_s": caption,
        "alert_latency_s": alert,
        "chat_gap_ms": gap,
        "chat_tokens": load["chat_tokens"],
        "chat_errors": load["chat_errors"][:10],
        "producer": load["producer"],
        "meets": meets,
        "sustained": all(meets.values()),
    }


def _flush(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()


def run_backend(cfg: CamerasConfig, name: str, url: str | None, redis_url: str, schedule: list[tuple[float, Any]],
                cycle: float) -> dict[str, Any]:
    """The ramp on one backend: steps until one is not sustained."""
    steps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vlmcap-bench-cameras-") as data_dir:
        _flush(redis_url)
        with Backend(cfg, name, url, redis_url, data_dir) as backend:
            for count in cfg.camera_counts:
                load = asyncio.run(_load(cfg, backend, count, schedule, cycle))
                steps.append(step_figures(cfg, count, load))
                log.info("bench cameras: %s, %d camera(s): %s", name, count, steps[-1]["meets"])
                if not steps[-1]["sustained"]:
                    break
            model = backend.model
            server_log = _tail(backend.log, 2000)
    sustained = [s["cameras"] for s in steps if s["sustained"]]
    # The largest N sustained with every smaller one sustained too (the ramp stops at the first failure).
    return {"name": name, "url": url, "model": model, "steps": steps,
            "largest_sustained": max(sustained, default=0), "log_tail": server_log}


def run_cameras(cfg: CamerasConfig) -> dict[str, Any]:
    from jobqueue.connection import EmbeddedRedis

    redis_server = EmbeddedRedis()
    try:
        schedule, clip_s = clip_pass(redis_server.url)
        cycle = max(cfg.clip_every, clip_s)
        backends = [run_backend(cfg, name, url, redis_server.url, schedule, cycle) for name, url in cfg.backends]
    finally:
        redis_server.close()
    kinds: dict[str, int] = {}
    for _, job in schedule:
        kinds[job.job_kind] = kinds.get(job.job_kind, 0) + 1
    return {
        "benchmark": "cameras",
        "config": asdict(cfg),
        "machine": machine(with_torch=False),
        "clip": {"source": SAMPLE_VIDEO.name, "seconds": clip_s, "pass_every_s": cycle, "jobs_per_pass": kinds,
                 "frames_per_job": [job.frame_count for _, job in schedule],
                 "sent_at_s": [round(offset, 2) for offset, _ in schedule]},
        "criteria": {"alert_within_s": cfg.alert_within_s, "caption_p95_within_s": cfg.caption_p95_within_s,
                     "chat_gap_p99_within_s": cfg.chat_gap_p99_within_s},
        "backends": backends,
    }


# -- output ------------------------------------------------------------------------------------------

def summary(result: dict[str, Any]) -> str:
    clip = result["clip"]
    crit = result["criteria"]
    lines = [f"bench cameras: {clip['source']} ({clip['seconds']:.0f} s) once every {clip['pass_every_s']:.0f} s a "
             f"camera: {clip['jobs_per_pass']} a pass; {result['config']['chats']} chats streaming; sustained = "
             f"alerts <= {crit['alert_within_s']:g} s, captions p95 <= {crit['caption_p95_within_s']:g} s, chat gap "
             f"p99 <= {crit['chat_gap_p99_within_s'] * 1000:g} ms",
             f"{'backend':12s} {'cams':>4s} {'jobs':>5s} {'capt/min':>8s} {'cap p50 s':>9s} {'cap p95 s':>9s} "
             f"{'alert max s':>11s} {'gap p50 ms':>10s} {'gap p99 ms':>10s} {'fail':>4s} {'late':>4s}  ok"]
    for backend in result["backends"]:
        for step in backend["steps"]:
            cap, alert, gap = step["caption_latency_s"], step["alert_latency_s"], step["chat_gap_ms"]
            missed = ", ".join(name for name, met in step["meets"].items() if not met)
            lines.append(f"{backend['name'][:12]:12s} {step['cameras']:4d} {step['jobs']:5d} "
                         f"{step['captions_per_min']:8.1f} {cap['p50']:9.2f} {cap['p95']:9.2f} {alert['max']:11.2f} "
                         f"{gap['p50']:10.1f} {gap['p99']:10.1f} {step['failed']:4d} {step['unfinished']:4d}  "
                         f"{'yes' if step['sustained'] else 'no: ' + missed}")
    lines += [f"{b['name']}: largest camera count sustained {b['largest_sustained']}" for b in result["backends"]]
    return "\n".join(lines)


def plot(result: dict[str, Any], png_path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in result["backends"]:
        counts = [s["cameras"] for s in backend["steps"]]
        left.plot(counts, [s["caption_latency_s"]["p95"] for s in backend["steps"]], marker="o",
                  label=f"{backend['name']} captions p95")
        left.plot(counts, [s["alert_latency_s"]["max"] for s in backend["steps"]], marker="x", linestyle="--",
                  label=f"{backend['name']} alerts max")
        right.plot(counts, [s["chat_gap_ms"]["p99"] for s in backend["steps"]], marker="o", label=backend["name"])
    for axis, title, ylabel in ((left, "caption latency", "seconds"), (right, "chats' gap between tokens, p99", "ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("cameras")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.legend()
    save_figure(fig, png_path)


if __name__ == "__main__":  # `python -m bench.cameras`: record the detector's boxes of the clip anew
    record_tracks()
