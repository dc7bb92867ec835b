"""Frame sources: the fps cap and looping on the real sample video, folders of images, clear errors for
bad sources, and a live MJPEG-over-HTTP camera that goes dark and comes back through the watchdog."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np
import pytest

from pipeline.capture import ImageFolderSource, LiveSource, VideoFileSource, open_source


def test_video_file_read_whole_then_capped_then_looped(sample_video):
    full = list(VideoFileSource(sample_video).frames(threading.Event()))
    assert len(full) == 60
    assert [f.ts for f in full[:3]] == [0.0, 0.2, 0.4]

    capped = VideoFileSource(sample_video, fps=1.0)
    frames = list(capped.frames(threading.Event()))
    assert [f.ts for f in frames] == pytest.approx([float(s) for s in range(12)])
    assert capped.stats.captured == 60 and capped.stats.skipped == 48

    looped = VideoFileSource(sample_video, fps=1.0, loop=True)
    stop = threading.Event()
    taken = []
    for frame in looped.frames(stop):
        taken.append(frame.ts)
        if len(taken) == 25:
            stop.set()
    # Frame times keep increasing across passes (12 s per pass).
    assert taken == pytest.approx([float(s) for s in range(25)])


def test_image_folder_is_one_frame_per_second(tmp_path, sample_maker):
    scenes = sample_maker.scenes()
    for name in ("b-bus", "a-empty", "c-zidane"):
        cv2.imwrite(str(tmp_path / f"{name}.jpg"), scenes[name.split("-", 1)[1] if "empty" not in name
                                                          else "empty-dark"])
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "d-broken.png").write_bytes(b"not a png")
    source = open_source(str(tmp_path))
    assert isinstance(source, ImageFolderSource)
    frames = list(source.frames(threading.Event()))
    assert [f.ts for f in frames] == [0.0, 1.0, 2.0]
    assert frames[1].image.shape == scenes["bus"].shape
    assert source.stats.skipped == 1  # the unreadable png


@pytest.mark.parametrize(("spec", "message"), [
    ("/nonexistent/cam.mp4", "not a video file, a folder"),
    ("ftp://camera/stream", "unsupported scheme 'ftp'"),
])
def test_bad_source_is_named(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        open_source(spec)
    assert spec in str(err.value)


def test_unreadable_video_file_is_named(tmp_path):
    path = tmp_path / "garbage.mp4"
    path.write_bytes(b"\x00" * 1000)
    with pytest.raises(ValueError, match="cannot open video file"):
        open_source(str(path))


class _MjpegCamera:
    """An MJPEG-over-HTTP camera. The first connection sends `frames_before_dark` frames and then goes
    dark: it keeps the connection open and sends nothing, like a stalled network camera. Every later
    connection streams until the test ends."""

    def __init__(self, frames_before_dark: int) -> None:
        self.connections = 0
        self.done = threading.Event()
        camera = self
        jpeg = cv2.imencode(".jpg", np.full((120, 160, 3), 90, np.uint8))[1].tobytes()
        part = b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n%s\r\n" % (len(jpeg), jpeg)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                camera.connections += 1
                first = camera.connections == 1
                self.send_response(200)
                self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
                self.end_headers()
                sent = 0
                try:
                    while not camera.done.is_set():
                        if first and sent >= frames_before_dark:
                            camera.done.wait()  # dark, connection held open
                            return
                        self.wfile.write(part)
                        self.wfile.flush()
                        sent += 1
                        camera.done.wait(0.05)
                except (BrokenPipeError, ConnectionResetError):
                    return

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/stream.mjpg"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.done.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.timeout(60)
def test_camera_that_goes_dark_comes_back_through_the_watchdog():
    camera = _MjpegCamera(frames_before_dark=5)
    source = open_source(camera.url, watchdog_seconds=1.0, max_frame_age_seconds=10.0)
    assert isinstance(source, LiveSource)
    stop = threading.Event()
    frames = []
    try:
        for frame in source.frames(stop):
            frames.append(frame)
            if len(frames) >= 15:
                stop.set()
    finally:
        source.close()
        camera.close()
    # The first connection gave only 5 frames; the rest came after the watchdog reopened the stream.
    assert source.stats.watchdog_restarts >= 1
    assert camera.connections >= 2
    assert len(frames) == 15
    assert [f.index for f in frames] == list(range(15))
    assert all(f.image.shape == (120, 160, 3) for f in frames)
