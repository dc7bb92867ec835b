"""The media box (engine/media_box.py) against hostile videos: an ffconcat script naming a real file, an SDP
description, an HLS playlist and a forged-magic concat script are refused before FFmpeg reads anything else; a clip
whose header says 64x64 but carries 3840x2160 frames fails the pixel limit; a decode past the deadline is killed and
the box decodes the next clip; mp4, mov, webm, mkv and avi still give their frames."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from engine.media_box import BoxLimits, MediaBox, MediaTimeout, packet_size
from engine.video import VideoLimitError, VideoSampling, sniff_container
from tests.video_support import clip_frames, mp4_bytes


def chunk(fourcc: bytes, data: bytes) -> bytes:
    return fourcc + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")


def mjpeg_avi(jpegs: list[bytes], width: int, height: int, fps: int = 4) -> bytes:
    """An AVI of Motion JPEG frames whose headers say `width` x `height`, whatever size each JPEG is."""
    n = len(jpegs)
    avih = struct.pack("<10I4I", 1_000_000 // fps, 0, 0, 0x10, n, 0, 1, 0, width, height, 0, 0, 0, 0)
    strh = b"vidsMJPG" + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 1, fps, 0, n, 0, -1, 0, 0, 0, width, height)
    strf = struct.pack("<IiiHH4sIiiII", 40, width, height, 1, 24, b"MJPG", width * height * 3, 0, 0, 0, 0)
    strl = chunk(b"LIST", b"strl" + chunk(b"strh", strh) + chunk(b"strf", strf))
    hdrl = chunk(b"LIST", b"hdrl" + chunk(b"avih", avih) + strl)
    movi, index, offset = b"", b"", 4
    for data in jpegs:
        index += b"00dc" + struct.pack("<III", 0x10, offset, len(data))
        movi += chunk(b"00dc", data)
        offset += len(chunk(b"00dc", data))
    body = b"AVI " + hdrl + chunk(b"LIST", b"movi" + movi) + chunk(b"idx1", index)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def jpeg(width: int, height: int, value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), value, np.uint8)).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture(scope="module")
def box():
    made = MediaBox(BoxLimits(timeout_s=20.0, workers=1))
    yield made
    made.close()


def writer_clip(suffix: str, fourcc: str, frames: list[np.ndarray]) -> bytes:
    import tempfile
    from pathlib import Path

    import cv2

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / f"clip{suffix}")
        height, width = frames[0].shape[:2]
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), 4.0, (width, height))
        for frame in frames:
            writer.write(frame)
        writer.release()
        return Path(path).read_bytes()


@pytest.mark.parametrize(("suffix", "fourcc", "container"), [
    (".mp4", "mp4v", "mov"), (".mov", "mp4v", "mov"), (".webm", "VP80", "matroska"), (".mkv", "XVID", "matroska"),
    (".avi", "MJPG", "avi"), (".webm", "VP90", "matroska")])
def test_accepted_containers_give_their_frames(box, photos, suffix, fourcc, container):
    frames = clip_frames(photos[0], count=6)
    data = writer_clip(suffix, fourcc, frames)
    assert sniff_container(data) == container
    video = box.decode_video(data, VideoSampling(num_frames=3))
    assert video.frames.shape == (3, 48, 64, 3) and video.frames_indices == [0, 2, 5] and video.fps == 4.0


def test_an_ffconcat_script_naming_a_real_file_is_refused(box, photos, tmp_path, monkeypatch):
    secret = mp4_bytes(clip_frames(photos[0], count=4), fps=2.0)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "cam7.mp4").write_bytes(secret)
    monkeypatch.chdir(tmp_path)
    script = b"ffconcat version 1.0\nfile private/cam7.mp4\n"
    forged = b"\x00\x00\x00\x14ftypisom\x00\x00\x00\x00isom" + script  # the magic of an mp4 over the script
    for data in (script, forged):
        with pytest.raises(ValueError, match="not a readable video") as refused:
            box.decode_video(data, VideoSampling())
        assert not isinstance(refused.value, VideoLimitError)


@pytest.mark.parametrize("data", [
    b"v=0\r\no=- 0 0 IN IP4 0.0.0.0\r\ns=x\r\nc=IN IP4 0.0.0.0\r\nt=0 0\r\nm=video 5004 RTP/AVP 96\r\n",
    b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nprivate/cam7.mp4\n#EXT-X-ENDLIST\n",
    b"\x00\x00\x01\xb3" + b"\x00" * 64])
def test_sdp_playlists_and_raw_streams_are_refused_before_ffmpeg(box, data):
    started = box.started
    with pytest.raises(ValueError, match="not one of the accepted containers"):
        box.decode_video(data, VideoSampling())
    assert box.started == started  # refused in the caller: no child was even asked


def test_a_header_of_64x64_over_4k_frames_fails_the_pixel_limit(box):
    small, big = jpeg(64, 64, 50), jpeg(3840, 2160, 200)
    assert packet_size("MJPG", big) == (3840, 2160)
    forged = mjpeg_avi([small, small, big, small], 64, 64)
    with pytest.raises(VideoLimitError, match="3840x2160 = 8294400 pixels, over the limit of 2073600") as refused:
        box.decode_video(forged, VideoSampling(num_frames=2, max_frame_pixels=1920 * 1080))
    assert refused.value.limit == "max_video_frame_pixels"
    honest = box.decode_video(mjpeg_avi([small] * 4, 64, 64), VideoSampling(num_frames=2, max_frame_pixels=4096))
    assert honest.frames.shape == (2, 64, 64, 3)


def test_a_decode_past_the_deadline_is_killed_and_the_next_one_decodes(photos):
    slow = MediaBox(BoxLimits(timeout_s=0.05, workers=1))
    try:
        # 60 4K Motion JPEG frames, all sized and grabbed (decoded) to reach the last: far more than 50 ms.
        big = jpeg(3840, 2160, 90)
        clip = mjpeg_avi([big] * 60, 3840, 2160)
        with pytest.raises(MediaTimeout, match="took longer than 0.05 s to decode") as refused:
            slow.decode_video(clip, VideoSampling(num_frames=2))
        assert refused.value.limit == "decode_timeout_s" and slow.killed == 1
        small = writer_clip(".avi", "MJPG", clip_frames(photos[0], count=2))
        assert slow.decode_video(small, VideoSampling(num_frames=2)).num_frames == 2
        assert slow.started == 2
    finally:
        slow.close()
