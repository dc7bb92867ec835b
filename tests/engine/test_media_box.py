"""The media box (engine/media_box.py) against hostile videos: an ffconcat script naming a real file, an SDP
description, an HLS playlist and a forged-magic concat script are refused before FFmpeg reads anything else; a clip
whose header says 64x64 but carries 3840x2160 frames fails the pixel limit; a decode past the deadline is killed and
the box decodes the next clip; mp4, mov, webm, mkv and avi still give their frames."""

from __future__ import annotations

import dataclasses
import io
import struct

import numpy as np
import pytest
from PIL import Image

from bench.soak import many_scans_jpeg
from engine.media_box import BoxLimits, MediaBox, MediaBusy, MediaTimeout, packet_size
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


# --- images: which decode here, which in the box --------------------------------------------------------------------

def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def test_small_pngs_and_sequential_jpegs_decode_here_the_rest_in_the_box(photos):
    from engine.media_box import INLINE_MAX_PIXELS, decodes_inline

    photo = photos[0].convert("RGB")
    big = photo.resize((2500, 2000))
    assert 2500 * 2000 > INLINE_MAX_PIXELS
    cases = {"baseline": (encoded(photo, "JPEG"), True), "png": (encoded(photo, "PNG"), True),
             "progressive": (encoded(photo, "JPEG", progressive=True), False),
             "many scans": (many_scans_jpeg(256, 50), False), "webp": (encoded(photo, "WEBP"), False),
             "large": (encoded(big, "JPEG"), False)}
    for name, (data, inline) in cases.items():
        with Image.open(io.BytesIO(data)) as opened:
            assert decodes_inline(opened, data) is inline, name


def test_the_box_decodes_an_image_to_the_pixels_pillow_gives(box, photos):
    for data in (encoded(photos[0].convert("RGBA"), "PNG"), encoded(photos[1], "JPEG", progressive=True),
                 many_scans_jpeg(128, 20)):
        expected = Image.open(io.BytesIO(data)).convert("RGB")
        decoded = box.decode_image(data, ("JPEG", "PNG"), 10**6)
        assert decoded.size == expected.size and decoded.tobytes() == expected.tobytes()


def test_images_refused_in_the_box_name_why(box):
    from engine.media_box import ImageTooLarge, UnreadableImage

    with pytest.raises(ImageTooLarge, match="over the limit of 1000") as refused:
        box.decode_image(jpeg(64, 64, 10), ("JPEG",), 1000)
    assert refused.value.size == (64, 64)
    with pytest.raises(UnreadableImage) as unreadable:
        box.decode_image(b"GIF89a" + b"\0" * 40, ("JPEG",), 1000)
    assert unreadable.value.stage == "open"
    truncated = encoded(Image.new("RGB", (300, 300), (9, 9, 9)), "JPEG", progressive=True)
    with pytest.raises(UnreadableImage):
        box.decode_image(truncated[: len(truncated) // 3], ("JPEG",), 10**6)


def test_a_jpeg_of_many_scans_past_the_deadline_is_killed_and_the_engine_names_the_image(photos):
    from engine.engine import _load_image
    from engine.media_box import configure_default_box, default_box

    slow = many_scans_jpeg(3000, 1000)  # in the byte and pixel limits; seconds of decoding
    configure_default_box(BoxLimits(timeout_s=0.2, workers=1))
    try:
        with pytest.raises(MediaTimeout, match="image 0 took longer than 0.2 s to decode") as refused:
            _load_image(slow, 0)
        assert refused.value.limit == "decode_timeout_s" and default_box().killed == 1
        # The deadline lifted for the rest: the replacement child's start and a progressive decode may take more
        # than 0.2 s on a loaded machine.
        default_box().limits = dataclasses.replace(default_box().limits, timeout_s=30.0)
        progressive = encoded(photos[0].convert("RGB"), "JPEG", progressive=True)
        assert _load_image(progressive, 1).tobytes() == Image.open(io.BytesIO(progressive)).convert("RGB").tobytes()
        assert default_box().started == 2  # the killed child replaced
        before = default_box().started
        assert _load_image(encoded(photos[0].convert("RGB"), "JPEG"), 2).size == photos[0].size  # decoded here
        assert default_box().started == before
        with pytest.raises(ValueError, match="image 3 could not be read"):
            _load_image(b"\xff\xd8 not a jpeg", 3)
    finally:
        configure_default_box(BoxLimits())


def test_a_decode_waits_for_a_busy_box_at_most_its_deadline(photos):
    busy = MediaBox(BoxLimits(timeout_s=1.0, workers=1))
    try:
        held = busy._slots.get()  # the one child's place, taken as a long decode would
        with pytest.raises(MediaBusy, match=r"waited longer than 1 s for a decoding process \(all 1 busy") as late:
            busy.decode_image(encoded(photos[0], "JPEG", progressive=True))
        assert late.value.limit == "decode_timeout_s" and busy.started == 0
        busy._slots.put(held)
        assert busy.decode_image(encoded(photos[0], "JPEG", progressive=True)).size == photos[0].size
    finally:
        busy.close()
