"""Helpers of the queue tests: a captioner that really decodes the JPEG, a minimal OpenAI-compatible
chat-completions server that does the same over HTTP (and can hold requests, to kill a worker mid-job), jobs
enqueued through the real producer, a worker run until the stream is empty, and a bounded wait."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np
import redis

from jobqueue.consumer import QueueWorker
from jobqueue.contract import JOBS_STREAM, Detection, Job
from jobqueue.producer import JobProducer
from jobqueue.results import queue_stats


class UndecodableImage(ValueError):
    pass


def describe(image_jpeg: bytes, prompt: str) -> str:
    """The image's size and the prompt; raises UndecodableImage for bytes that are not an image. (OpenCV
    decodes here: once ultralytics is imported, its patch of PIL.Image.open tries to install a HEIF
    plugin on unidentified bytes.)"""
    image = cv2.imdecode(np.frombuffer(image_jpeg, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise UndecodableImage(f"{len(image_jpeg)} bytes that are not a decodable image")
    return f"{image.shape[1]}x{image.shape[0]}: {prompt}"


class DecodingCaptioner:
    """A real implementation of the Captioner protocol, without a model: the caption states the image's
    size, so it proves the bytes arrived intact. It takes no clips."""

    def __init__(self) -> None:
        self.calls = 0

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        self.calls += 1
        return describe(image_jpeg, prompt)

    async def caption_frames(self, images: list[bytes], notes: list[str], prompt: str, priority: int,
                             schema: dict | None = None, cache_salt: str | None = None) -> str:
        """A job of several frames: each frame described after its note, then the prompt."""
        self.calls += 1
        return " | ".join(describe(image, note) for image, note in zip(images, notes, strict=True)) + f" | {prompt}"

    async def caption_video(self, video: bytes, prompt: str, priority: int, schema: dict | None = None,
                            cache_salt: str | None = None) -> str:
        raise ValueError(f"{type(self).__name__} takes no clips; got one of {len(video)} bytes")


def make_job(camera_id: str = "cam", width: int = 64, height: int = 48, image: bytes | None = None,
             frame_ts: float = 1.5) -> Job:
    if image is None:
        image = cv2.imencode(".jpg", np.full((height, width, 3), 120, np.uint8))[1].tobytes()
    return Job(camera_id=camera_id, frame_ts=frame_ts, prompt=f"who is at {camera_id}?", image=image,
               detections=[Detection(1, 2, 30, 40, 0.9, 1)])


class ChatServer:
    """POST /v1/chat/completions: decodes the data-URL image and answers with `describe()`. While
    `hold` is set, requests wait (the client sees a request in flight); `received` counts them."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.received = 0
        self.priorities: list[int | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.received += 1
                server.priorities.append(body.get("priority"))
                while server.hold.is_set():
                    time.sleep(0.05)
                content = body["messages"][0]["content"]
                url = next(p["image_url"]["url"] for p in content if p["type"] == "image_url")
                prompt = next(p["text"] for p in content if p["type"] == "text")
                try:
                    text = describe(base64.b64decode(url.split(",", 1)[1]), prompt)
                    status, payload = 200, {
                        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": text}}],
                    }
                except Exception as err:  # the server's answer to an unreadable image
                    status, payload = 400, {"error": {"message": f"invalid image: {err}", "type": "invalid"}}
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client was killed
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.hold.clear()
        self.httpd.shutdown()
        self.httpd.server_close()


class WebhookReceiver:
    """A real HTTP server on loopback standing in for an alert webhook. It answers the first `fail_first`
    requests 503 and the others `status` (with `headers`), holding requests while `hold` is set; it records
    every answer's status (`statuses`, a GET's too: a followed redirect arrives as one) and the JSON of each
    POST answered 200 (`bodies`)."""

    def __init__(self, fail_first: int = 0, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.bodies: list[dict] = []
        self.statuses: list[int] = []
        self.hold = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def do_GET(self) -> None:
                self.answer(None)

            def answer(self, body: dict | None) -> None:
                while receiver.hold.is_set():
                    time.sleep(0.02)
                code = 503 if len(receiver.statuses) < fail_first else status
                receiver.statuses.append(code)
                if body is not None and code == 200:
                    receiver.bodies.append(body)
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.hold.clear()
        self.server.shutdown()
        self.server.server_close()


def stream_jobs(redis_url: str) -> list[Job]:
    """The jobs on the job stream, oldest first, each decoded through the contract."""
    client = redis.Redis.from_url(redis_url)
    try:
        return [Job.from_fields(fields) for _, fields in client.xrange(JOBS_STREAM)]
    finally:
        client.close()


def enqueue(redis_url: str, jobs: list[Job], **producer_options) -> JobProducer:
    producer = JobProducer(redis_url, **producer_options)
    for job in jobs:
        producer.submit(job)
    producer.close()
    return producer


async def work_until_idle(worker: QueueWorker, max_rounds: int = 50) -> None:
    """Run rounds until the stream holds no job (waiting or pending)."""
    for _ in range(max_rounds):
        await worker.run_once()
        if await worker.redis.xlen(JOBS_STREAM) == 0:
            return
    raise AssertionError(f"jobs left after {max_rounds} rounds: {await queue_stats(worker.redis)}")


def wait_for(condition, what: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Poll until `condition()` holds; the deadline only turns a hang into a clear failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(interval)


def caption_remotely(redis_url: str, server_url: str, model: str, job: Job, max_tokens: int = 512,
                     max_deliveries: int = 3):
    """`vlmcap worker`'s path: submit `job`, caption the queue through a QueueWorker with an OpenAICaptioner against
    `server_url` until no job is left, and return the job's result."""
    import asyncio

    from jobqueue.openai_captioner import OpenAICaptioner
    from jobqueue.results import get_result

    producer = JobProducer(redis_url)
    producer.submit(job)
    producer.close()

    async def work():
        captioner = OpenAICaptioner(server_url, model=model, max_tokens=max_tokens)
        worker = QueueWorker(redis_url, captioner, block_seconds=0.1, max_deliveries=max_deliveries)
        try:
            await work_until_idle(worker)
            return await get_result(worker.redis, job.job_id)
        finally:
            await captioner.aclose()
            await worker.redis.aclose()

    return asyncio.run(work())
