"""The media box's H.264 frame-size reader (engine/media_box.py `packet_size`) on real H.264 clips, encoded by x264
(imageio-ffmpeg's FFmpeg build carries it; OpenCV's wheel has no H.264 encoder): every chroma format and
interlacing gives the size the decoder gives, and a clip whose stream switches to 4K frames behind a 64x64 header
fails the pixel limit at that packet."""

from __future__ import annotations

import subprocess
from pathlib import Path

import imageio_ffmpeg
import pytest

from engine.media_box import BoxLimits, MediaBox, packet_size
from engine.video import VideoLimitError, VideoSampling


def ffmpeg(*args: str) -> None:
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-y", *args], check=True, timeout=120)


def x264(path: Path, size: str, pix_fmt: str = "yuv420p", profile: str = "high", options: str = "",
         seconds: float = 1.0, annex_b: bool = False) -> Path:
    """A clip of FFmpeg's test pattern, 2 frames a second, encoded by x264."""
    extra = ["-x264opts", options] if options else []
    out = ["-bsf:v", "h264_mp4toannexb", "-f", "h264"] if annex_b else []
    ffmpeg("-f", "lavfi", "-i", f"testsrc=size={size}:rate=2", "-t", str(seconds), "-c:v", "libx264",
           "-profile:v", profile, "-preset", "veryfast", *extra, "-pix_fmt", pix_fmt, *out, str(path))
    return path


def stream_sizes(path: Path) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The decoder's frame size, and the sizes `packet_size` reads from the clip's packets as the box sees them."""
    import cv2

    capture = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    header = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    ok, frame = capture.read()
    assert ok and (frame.shape[1], frame.shape[0]) == header
    capture.release()
    packets = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    packets.set(cv2.CAP_PROP_FORMAT, -1)
    read = []
    while packets.grab():
        size = packet_size("avc1", packets.retrieve()[1].tobytes())
        if size is not None:
            read.append(size)
    packets.release()
    return header, read


@pytest.mark.parametrize(("size", "pix_fmt", "profile", "options"), [
    ("1920x1080", "yuv420p", "baseline", ""),  # 1080 coded as 1088 and cropped
    ("1920x1080", "yuv420p", "high", ""),
    ("1920x1080", "yuv420p", "high", "interlaced=1"),  # field macroblocks: crop rows count twice
    ("1920x1080", "yuv422p", "high422", ""),  # 4:2:2 crops rows one by one
    ("1920x1080", "yuv444p", "high444", ""),  # 4:4:4 crops luma samples
    ("250x142", "gray", "high", ""),  # monochrome, odd sizes
])
def test_the_reader_gives_the_decoder_s_size_for_every_chroma_format(tmp_path, size, pix_fmt, profile, options):
    header, read = stream_sizes(x264(tmp_path / "clip.mp4", size, pix_fmt, profile, options))
    assert header == tuple(map(int, size.split("x")))
    assert read and set(read) == {header}


def test_an_h264_stream_switching_to_4k_behind_a_64x64_header_fails_the_pixel_limit(tmp_path):
    small = x264(tmp_path / "small.h264", "64x64", seconds=2.0, annex_b=True).read_bytes()
    big = x264(tmp_path / "big.h264", "3840x2160", seconds=0.5, annex_b=True).read_bytes()
    (tmp_path / "joined.h264").write_bytes(small + big + small)
    forged = tmp_path / "forged.mp4"
    ffmpeg("-r", "2", "-i", str(tmp_path / "joined.h264"), "-c", "copy", str(forged))
    header, read = stream_sizes(forged)
    assert header == (64, 64) and (3840, 2160) in read
    box = MediaBox(BoxLimits(timeout_s=60.0, workers=1))
    try:
        with pytest.raises(VideoLimitError, match="3840x2160 = 8294400 pixels, over the limit of 2073600"):
            box.decode_video(forged.read_bytes(), VideoSampling(num_frames=4, max_frame_pixels=1920 * 1080))
        honest = box.decode_video(x264(tmp_path / "honest.mp4", "64x64").read_bytes(),
                                  VideoSampling(num_frames=2, max_frame_pixels=4096))
        assert honest.frames.shape == (2, 64, 64, 3)
    finally:
        box.close()
