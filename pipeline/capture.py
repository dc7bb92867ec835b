"""Frame sources through OpenCV: video files, folders of images, RTSP/HTTP streams and webcams.

File and folder sources are read as fast as the consumer takes frames (or paced with `realtime`), and
end at their end unless `loop`. Live sources (streams, webcams) are read by a thread into a small
buffer that drops the oldest frame, so the consumer always gets recent frames; frames older than
`max_frame_age_seconds` when taken are skipped. A live source reconnects with capped exponential
backoff when it fails, and a watchdog restarts it when it is connected but delivers no frame for
`watchdog_seconds` (a stalled stream that never reports an error)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from jobqueue.checks import at_least, positive
from pipeline.frame import Frame

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "udp", "tcp", "srt")
FOLDER_FRAME_SECONDS = 1.0  # a folder of images has no frame rate: its images are one second apart


@dataclass
class CaptureStats:
    captured: int = 0  # frames read from the source
    skipped: int = 0  # frames left out by the fps cap, stale frames and unreadable images
    dropped: int = 0  # frames pushed out of a live source's buffer before the consumer took them
    reconnects: int = 0
    watchdog_restarts: int = 0


class FpsLimiter:
    """Lets through at most `fps` frames per second of frame time (no cap when fps is None)."""

    def __init__(self, fps: float | None) -> None:
        if fps is not None:
            positive("fps", fps)
        self.interval = 1.0 / fps if fps else 0.0
        self._next_ts = float("-inf")

    def allow(self, ts: float) -> bool:
        # A small tolerance, so that float rounding of frame times does not skip a frame on the grid.
        if ts < self._next_ts - self.interval * 1e-3:
            return False
        # Advance on a fixed grid (30 fps capped to 10 keeps every third frame), restarting it after a gap.
        self._next_ts += self.interval
        if self._next_ts <= ts:
            self._next_ts = ts + self.interval
        return True


class _PacedSource:
    """Shared by file and folder sources: fps cap on frame time, optional real-time pacing, looping
    with frame times that keep increasing across loops."""

    def __init__(self, fps: float | None, realtime: bool, loop: bool) -> None:
        self.stats = CaptureStats()
        self._limiter = FpsLimiter(fps)
        self.realtime = realtime
        self.loop = loop

    def _raw_frames(self) -> Iterator[tuple[float, Callable[[], np.ndarray | None]]]:
        """One pass: (seconds from the start, a function that decodes the image, None if unreadable).
        The image is decoded only for frames the fps cap lets through, and before the next item."""
        raise NotImplementedError

    def _pass_duration(self, last_ts: float) -> float:
        raise NotImplementedError

    def frames(self, stop: threading.Event) -> Iterator[Frame]:
        offset, index = 0.0, 0
        started = time.monotonic()
        while not stop.is_set():
            last_ts = None
            for ts, load_image in self._raw_frames():
                if stop.is_set():
                    return
                last_ts = ts
                self.stats.captured += 1
                image = load_image() if self._limiter.allow(offset + ts) else None
                if image is None:
                    self.stats.skipped += 1
                    continue
                if self.realtime:
                    stop.wait(max(0.0, started + offset + ts - time.monotonic()))
                yield Frame(image, offset + ts, index)
                index += 1
            if not self.loop or last_ts is None:
                return
            offset += self._pass_duration(last_ts)

    def close(self) -> None:
        """Nothing stays open between passes."""


class VideoFileSource(_PacedSource):
    def __init__(self, path: Path, fps: float | None = None, realtime: bool = False,
                 loop: bool = False) -> None:
        super().__init__(fps, realtime, loop)
        self.path = path
        probe = cv2.VideoCapture(str(path))
        if not probe.isOpened():
            raise ValueError(f"cannot open video file {str(path)!r}")
        native_fps = probe.get(cv2.CAP_PROP_FPS)
        probe.release()
        self.native_fps = native_fps if native_fps and native_fps > 0 else 25.0

    def _raw_frames(self) -> Iterator[tuple[float, Callable[[], np.ndarray | None]]]:
        cap = cv2.VideoCapture(str(self.path))

        def retrieve() -> np.ndarray | None:
            ok, image = cap.retrieve()
            return image if ok else None

        try:
            index = 0
            while cap.grab():  # grab() alone does not convert frames that the fps cap leaves out
                yield index / self.native_fps, retrieve
                index += 1
        finally:
            cap.release()

    def _pass_duration(self, last_ts: float) -> float:
        return last_ts + 1.0 / self.native_fps


class ImageFolderSource(_PacedSource):
    def __init__(self, folder: Path, fps: float | None = None, realtime: bool = False,
                 loop: bool = False) -> None:
        super().__init__(fps, realtime, loop)
        self.paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.paths:
            raise ValueError(f"folder {str(folder)!r} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")

    def _raw_frames(self) -> Iterator[tuple[float, Callable[[], np.ndarray | None]]]:
        for index, path in enumerate(self.paths):
            yield index * FOLDER_FRAME_SECONDS, lambda path=path: self._read(path)

    @staticmethod
    def _read(path: Path) -> np.ndarray | None:
        image = cv2.imread(str(path))
        if image is None:
            log.warning("skipping unreadable image %s", path)
        return image

    def _pass_duration(self, last_ts: float) -> float:
        return last_ts + FOLDER_FRAME_SECONDS


class LiveSource:
    """A stream URL or webcam index read by a background thread."""

    def __init__(
        self,
        target: str | int,
        fps: float | None = None,
        buffer_size: int = 2,
        max_frame_age_seconds: float = 2.0,
        watchdog_seconds: float = 10.0,
        max_backoff_seconds: float = 30.0,
    ) -> None:
        at_least("buffer_size", buffer_size, 1)
        positive("watchdog_seconds", watchdog_seconds)
        self.target = target
        self.stats = CaptureStats()
        self.max_frame_age_seconds = max_frame_age_seconds
        self.watchdog_seconds = watchdog_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self._limiter = FpsLimiter(fps)
        self._buffer: deque[tuple[float, float, np.ndarray]] = deque(maxlen=buffer_size)
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._generation = 0
        self._connected_generation = -1

    def _open(self) -> cv2.VideoCapture:
        if isinstance(self.target, int):
            return cv2.VideoCapture(self.target)
        # Bounded waits inside FFmpeg, so a reader thread abandoned by the watchdog ends eventually.
        timeout_ms = int(self.watchdog_seconds * 2000)
        return cv2.VideoCapture(self.target, cv2.CAP_FFMPEG, [
            cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, timeout_ms, cv2.CAP_PROP_READ_TIMEOUT_MSEC, timeout_ms,
        ])

    def _current(self, generation: int) -> bool:
        return generation == self._generation and not self._closed.is_set()

    def _read_loop(self, generation: int) -> None:
        backoff = 0.0
        while self._current(generation):
            cap = self._open()
            if not cap.isOpened():
                cap.release()
                backoff = min(self.max_backoff_seconds, backoff * 2 or 0.5)
                log.warning("cannot open source %s; retrying in %.1f s", self.target, backoff)
                self._closed.wait(backoff)
                continue
            self._connected_generation = generation
            while self._current(generation):
                ok, image = cap.read()
                if not ok:
                    break
                backoff = 0.0
                with self._cond:
                    self.stats.captured += 1
                    if len(self._buffer) == self._buffer.maxlen:
                        self.stats.dropped += 1
                    self._buffer.append((time.monotonic(), time.time(), image))
                    self._cond.notify()
            cap.release()
            if self._current(generation):
                self.stats.reconnects += 1
                backoff = min(self.max_backoff_seconds, backoff * 2 or 0.5)
                log.warning("source %s stopped delivering; reconnecting in %.1f s", self.target, backoff)
                self._closed.wait(backoff)

    def _start_reader(self) -> None:
        self._generation += 1
        threading.Thread(target=self._read_loop, args=(self._generation,), daemon=True,
                         name=f"vlmcap-capture-{self._generation}").start()

    def frames(self, stop: threading.Event) -> Iterator[Frame]:
        self._start_reader()
        index = 0
        last_frame_at = time.monotonic()
        while not stop.is_set() and not self._closed.is_set():
            with self._cond:
                if not self._buffer:
                    self._cond.wait(0.2)
                item = self._buffer.popleft() if self._buffer else None
            now = time.monotonic()
            if item is None:
                connected = self._connected_generation == self._generation
                if connected and now - last_frame_at > self.watchdog_seconds:
                    log.warning("watchdog: no frame from %s for %.1f s; restarting it",
                                self.target, now - last_frame_at)
                    self.stats.watchdog_restarts += 1
                    self._start_reader()
                    last_frame_at = now
                continue
            last_frame_at = now
            captured_at, ts, image = item
            if now - captured_at > self.max_frame_age_seconds or not self._limiter.allow(ts):
                self.stats.skipped += 1
                continue
            yield Frame(image, ts, index)
            index += 1

    def close(self) -> None:
        self._closed.set()


def open_source(
    spec: str,
    fps: float | None = None,
    realtime: bool = False,
    loop: bool = False,
    buffer_size: int = 2,
    max_frame_age_seconds: float = 2.0,
    watchdog_seconds: float = 10.0,
    max_backoff_seconds: float = 30.0,
) -> VideoFileSource | ImageFolderSource | LiveSource:
    """A webcam index ("0"), a stream URL (rtsp://, http://, ...), a folder of images or a video file."""
    if spec.isdigit() or "://" in spec:
        scheme = spec.split("://", 1)[0].lower()
        if not spec.isdigit() and scheme not in STREAM_SCHEMES:
            raise ValueError(f"source {spec!r} has an unsupported scheme {scheme!r} "
                             f"(supported: {', '.join(STREAM_SCHEMES)})")
        target = int(spec) if spec.isdigit() else spec
        return LiveSource(target, fps, buffer_size, max_frame_age_seconds, watchdog_seconds,
                          max_backoff_seconds)
    path = Path(spec)
    if path.is_dir():
        return ImageFolderSource(path, fps, realtime, loop)
    if path.is_file():
        return VideoFileSource(path, fps, realtime, loop)
    raise ValueError(f"source {spec!r} is not a video file, a folder, a stream URL or a webcam index")
