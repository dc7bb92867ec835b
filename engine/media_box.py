"""Client media decoded in a box: supervised child processes with a deadline, an address-space limit and a check of
every frame's size, fed bytes of an allow-listed container only.

Why a box: FFmpeg's demuxers do what a file says (an ffconcat script opens other files, an SDP description binds
UDP ports, an HLS playlist fetches its segments), a decoder's cost follows the frames rather than the header (a clip
whose header says 64x64 can carry 3840x2160 frames, which OpenCV silently crops to the header's size), and an image
decoder's cost follows the file's structure (a progressive JPEG with hundreds of scans takes seconds). So:

- A video's container is sniffed from its first bytes (`engine.video.sniff_container`: mp4/mov, webm/mkv, avi) and
  FFmpeg is given that demuxer alone (`input_format`) and the file protocol alone: nothing is probed, so a forged
  header over a concat script, an SDP description or a playlist is read as the claimed container, and fails.
  Its codec must be one of `CODECS`.
- The child writes the bytes to a private temporary file (mkstemp, 0600, in a 0700 directory that is also its
  working directory) and removes it as soon as FFmpeg has opened it; the parent removes the directory with the child.
- The child (`python -m engine.media_box`, started with none of the server's descriptors) limits its own address
  space (RLIMIT_AS, `BoxLimits.memory_bytes` over what it holds once started), its open files and core dumps, and
  runs at a lower CPU priority than the engine. The parent kills it past `BoxLimits.timeout_s` and starts another for
  the next decode.
- Every frame is sized before it is decoded: the packets are read once without decoding and each one's frame size
  is read from its bitstream (`packet_size`: JPEG, VP8, VP9, MPEG-4 part 2, H.264); a frame over the pixel limit
  refuses the clip. Kept frames are checked again after decoding.
- The child sends back a JSON header and raw pixels (never pickle: a child that FFmpeg's bugs took over could
  otherwise run code in the server); the parent checks the header against the request's own bounds before it reads
  the pixels.

`default_box()` is the process's box, started at first use; `MediaBox.decode_video` and `MediaBox.decode_image` block
the calling thread (call them from a worker thread, never the event loop).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.child_slots import kill_idle

if TYPE_CHECKING:
    from PIL import Image

    from engine.video import Video, VideoSampling

log = logging.getLogger(__name__)

# FFmpeg's demuxer for each container `sniff_container` names.
DEMUXERS = {"mov": "mov", "matroska": "matroska", "avi": "avi"}
# Video codecs decoded, by the FOURCC OpenCV reports (the container's tag, else the codec's name), case-insensitive.
CODECS = frozenset({
    "avc1", "avc3", "h264", "x264", "davc",  # H.264
    "hvc1", "hev1", "hevc", "h265", "x265",  # H.265
    "fmp4", "mp4v", "xvid", "divx", "dx50", "mp4s", "m4s2",  # MPEG-4 part 2
    "vp80", "vp90", "vp09", "av01", "mjpg",  # VP8, VP9, AV1, Motion JPEG
})
NICE = 5  # the children's CPU priority below the engine's: heavy media slows its own request first
MAX_OPEN_FILES = 32  # descriptors a child may hold: its pipes, the temporary file, FFmpeg's own
POLL_S = 0.05
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's fcntl to size a pipe
PIPE_BYTES = 1 << 20


class MediaLimitError(ValueError):
    """Media over one of the limits it was decoded under; `limit` names the limit."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class MediaTimeout(MediaLimitError):
    """A decode ran past `BoxLimits.timeout_s`; its child was killed."""

    def __init__(self, message: str) -> None:
        super().__init__("decode_timeout_s", message)


class MediaBusy(MediaTimeout):
    """Every decoding child stayed busy for `BoxLimits.timeout_s`: the media was not looked at (the server's fault
    of capacity, not the media's). `retry_after_s`: within it a child is free again (each decode is killed then)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ImageTooLarge(MediaLimitError):
    """An image whose header gives more pixels than allowed (`size` is its width and height), or one Pillow calls a
    decompression bomb (`size` None)."""

    def __init__(self, message: str, size: tuple[int, int] | None) -> None:
        super().__init__("max_image_pixels", message)
        self.size = size


class UnreadableImage(ValueError):
    """Bytes that are not an image of the allowed formats (`stage` "open") or that fail to decode (`stage` "load")."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass(frozen=True)
class BoxLimits:
    """The child processes that decode client media.

    timeout_s: seconds one decode may take in its child; past them the child is killed and the decode refused.
    memory_bytes: address space a decoding child may take beyond what it holds once started (RLIMIT_AS).
    workers: children decoding at once; more decodes wait for one, at most timeout_s.
    """

    timeout_s: float = 30.0
    memory_bytes: int = 2 * 1024**3
    workers: int = 3

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, int | float) and 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in ("memory_bytes", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


# --- the wire: a 4-byte length, a JSON header, then header["bytes"] bytes of payload ------------------------------

def _header_bytes(header: dict[str, Any], payload_size: int) -> bytes:
    head = json.dumps({**header, "bytes": payload_size}).encode()
    return struct.pack(">I", len(head)) + head


class _Child:
    """One decoding child: its process, its private directory, non-blocking pipe ends read and written under a
    deadline."""

    START_TIMEOUT_S = 60.0
    MAX_HEADER = 1 << 20

    def __init__(self, limits: BoxLimits) -> None:
        self.folder = tempfile.mkdtemp(prefix="vlmcap-media-")  # 0700
        root = str(Path(__file__).resolve().parent.parent)
        env = {key: value for key, value in os.environ.items() if key in ("PATH", "LANG", "LC_ALL", "HOME")}
        env["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.media_box", self.folder, str(limits.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self.folder, env=env,
            close_fds=True, start_new_session=True)
        self.out = self.process.stdin.fileno()
        self.inp = self.process.stdout.fileno()
        os.set_blocking(self.out, False)
        os.set_blocking(self.inp, False)
        for fd in (self.out, self.inp):  # 1 MiB pipes: a decoded frame comes back in few reads, not 64 KiB ones
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # over /proc/sys/fs/pipe-max-size: the default size works, only slower
                pass
        header, _ = self.receive(time.monotonic() + self.START_TIMEOUT_S, 0)
        if header.get("ready") is not True:
            self.kill()
            raise RuntimeError("a media decoding process did not start")

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, header: dict[str, Any], payload: bytes, deadline: float) -> None:
        for data in (_header_bytes(header, len(payload)), payload):
            view = memoryview(data)
            while view:
                self._wait(self.out, "w", deadline)
                try:
                    written = os.write(self.out, view[: 1 << 20])
                except BlockingIOError:
                    continue
                view = view[written:]

    def receive(self, deadline: float, max_payload: int) -> tuple[dict[str, Any], bytearray]:
        (length,) = struct.unpack(">I", self._read(4, deadline))
        if length > self.MAX_HEADER:
            raise ConnectionError(f"a media decoding process sent a header of {length} bytes")
        header = json.loads(bytes(self._read(length, deadline)))
        size = header.get("bytes", 0)
        if not isinstance(header, dict) or not isinstance(size, int) or not 0 <= size <= max_payload:
            raise ConnectionError(f"a media decoding process announced {size!r} bytes, over the {max_payload} expected")
        return header, self._read(size, deadline)

    def _read(self, size: int, deadline: float) -> bytearray:
        data = bytearray()
        while len(data) < size:
            self._wait(self.inp, "r", deadline)
            try:
                chunk = os.read(self.inp, min(size - len(data), 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise ConnectionError(f"a media decoding process ended ({self._why()})")
            data += chunk
        return data

    def _wait(self, fd: int, mode: str, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready = select.select([fd], [], [], left) if mode == "r" else select.select([], [fd], [], left)
        if not any(ready):
            raise TimeoutError

    def _why(self) -> str:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.error("a media decoding process (pid %d) did not end after SIGKILL", self.process.pid)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


class MediaBox:
    """Up to `limits.workers` decoding children, started at first use and replaced when one is killed or dies."""

    def __init__(self, limits: BoxLimits | None = None) -> None:
        self.limits = limits or BoxLimits()
        self._slots: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(self.limits.workers):
            self._slots.put(None)
        self.started = 0  # children started
        self.killed = 0  # children killed past a deadline or found dead
        self._closed = False

    def decode_video(self, data: bytes, sampling: VideoSampling, where: str = "video") -> Video:
        """The frames `sampling` picks from an encoded video: ValueError for bytes that are not a readable video of
        an accepted container and codec, `VideoLimitError` (a `MediaLimitError`) over one of `sampling`'s limits,
        `MediaTimeout` past the deadline, `MediaLimitError` past the memory limit."""
        import numpy as np

        from engine.video import Video, VideoLimitError, sniff_container

        container = sniff_container(data, where)
        pixels = sampling.max_frame_pixels
        # What an answer may carry: max_frames frames of at most the pixel limit (without one, of 8K).
        bound = sampling.max_frames * (pixels or 7680 * 4320) * 3
        request = {"kind": "video", "container": container, "sampling": asdict(sampling), "where": where}
        header, payload = self._run(request, data, bound, where)
        if not header.get("ok"):
            if header.get("error") == "limit" and header.get("limit", "").startswith("max_video"):
                raise VideoLimitError(header["limit"], header["message"])
            raise self._error(header)
        shape = header.get("shape")
        if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(n, int) and n > 0 for n in shape)
                and shape[0] <= sampling.max_frames and shape[3] == 3 and math.prod(shape) == len(payload)
                and (pixels is None or shape[1] * shape[2] <= pixels)):
            raise ValueError(f"{where} could not be decoded: the decoder answered frames of shape {shape}")
        frames = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
        return Video(frames, float(header["fps"]), list(header["indices"]), int(header["total"]))

    def decode_image(self, data: bytes, formats: tuple[str, ...] | None = None, max_pixels: int | None = None,
                     where: str = "image") -> Image.Image:
        """An RGB image from encoded bytes of one of `formats` (Pillow's names; None: any Pillow reads):
        `ImageTooLarge` over `max_pixels` (from the header, before any pixel is decoded) or Pillow's own
        decompression-bomb limit, `UnreadableImage` for bytes that are not such an image or fail to decode,
        `MediaTimeout` past the deadline, `MediaLimitError` past the memory limit."""
        from PIL import Image

        request = {"kind": "image", "formats": list(formats) if formats else None, "max_pixels": max_pixels,
                   "where": where}
        bound = (max_pixels or Image.MAX_IMAGE_PIXELS or 1 << 31) * 2 * 3
        header, payload = self._run(request, data, bound, where)
        if not header.get("ok"):
            raise self._error(header)
        size = header.get("size")
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)
                and size[0] * size[1] * 3 == len(payload)):
            raise UnreadableImage("load", f"{where} could not be decoded: the decoder answered a size of {size}")
        return Image.frombuffer("RGB", tuple(size), bytes(payload), "raw", "RGB", 0, 1)

    @staticmethod
    def _error(header: dict[str, Any]) -> ValueError:
        message = str(header.get("message", "the media could not be decoded"))
        kind = header.get("error")
        if kind == "limit":
            return MediaLimitError(str(header.get("limit")), message)
        if kind == "image_too_large":
            size = header.get("size")
            return ImageTooLarge(message, tuple(size) if isinstance(size, list) else None)
        if kind == "unreadable_image":
            return UnreadableImage(str(header.get("stage", "load")), message)
        return ValueError(message)

    def _run(self, request: dict[str, Any], data: bytes, bound: int, where: str) -> tuple[dict[str, Any], bytearray]:
        if self._closed:
            raise RuntimeError("the media box is closed")
        try:  # a free child within the deadline too: a decode waits at most timeout_s, then runs at most as long
            child = self._slots.get(timeout=self.limits.timeout_s)
        except queue.Empty:
            raise MediaBusy(f"{where} waited longer than {self.limits.timeout_s:g} s for a decoding process (all "
                               f"{self.limits.workers} busy; decode_timeout_s)", self.limits.timeout_s) from None
        try:
            if child is None or not child.alive():
                if child is not None:
                    child.kill()
                child = _Child(self.limits)
                self.started += 1
            deadline = time.monotonic() + self.limits.timeout_s
            child.send(request, data, deadline)
            header, payload = child.receive(deadline, bound)
        except TimeoutError:
            self._lost(child)
            raise MediaTimeout(f"{where} took longer than {self.limits.timeout_s:g} s to decode "
                               "(decode_timeout_s)") from None
        except (ConnectionError, OSError, ValueError) as exc:
            why = child._why() if child is not None else "not started"
            self._lost(child)
            if "SIGKILL" in why or "SIGSEGV" in why or "SIGABRT" in why or "SIGBUS" in why:
                log.warning("a media decoding process died (%s) on %s", why, where)
            raise ValueError(f"{where} could not be decoded: the decoder failed ({why}: {exc})") from None
        except BaseException:
            self._lost(child)
            raise
        self._slots.put(child)
        return header, payload

    def _lost(self, child: _Child | None) -> None:
        if child is not None:
            child.kill()
            self.killed += 1
        self._slots.put(None)

    def close(self) -> None:
        self._closed = True
        kill_idle(self._slots)


# Images decoded in the calling process rather than the box: the box costs a child's round trip and a copy of the
# pixels back (measured on 2 cores: 640x480 JPEG 1-2 ms here, 5 ms boxed; 1920x1080 JPEG 6 ms here, 29 ms boxed; PNG
# 26 ms here, 47 ms boxed), while a PNG's or a sequential JPEG's decode costs milliseconds a megapixel whatever its
# bytes. What the box is for is a decode whose cost follows the file's structure (a progressive JPEG takes a pass
# over every block for each of its scans: 6300x6300 with 3,000 scans in 416 KB decoded 7.4 s here), or formats and
# sizes kept off the server's own process.
INLINE_FORMATS = frozenset({"JPEG", "PNG"})
INLINE_MAX_PIXELS = 4_000_000
# Start-of-scan markers a sequential JPEG may hold and still decode here: up to three components scanned one by
# one, and a thumbnail's scan. Entropy-coded data stuffs every 0xFF byte, so counting the marker's bytes over-counts
# only through metadata, which at worst sends an image to the box.
INLINE_MAX_JPEG_SCANS = 4


def decodes_inline(image: Image.Image, data: bytes) -> bool:
    """Whether an image opened from `data` (its header read, no pixel decoded) is cheap enough to decode in this
    process: a PNG, or a JPEG neither progressive nor of more than `INLINE_MAX_JPEG_SCANS` scans, of at most
    `INLINE_MAX_PIXELS` pixels. Anything else goes to `MediaBox.decode_image`."""
    if image.format not in INLINE_FORMATS or image.width * image.height > INLINE_MAX_PIXELS:
        return False
    if image.format == "JPEG":
        return not image.info.get("progressive") and data.count(b"\xff\xda") <= INLINE_MAX_JPEG_SCANS
    return True


_default: MediaBox | None = None
_default_lock = threading.Lock()


def default_box() -> MediaBox:
    """The process's media box (default `BoxLimits`), made at first use; `configure_default_box` replaces it."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MediaBox()
        return _default


def configure_default_box(limits: BoxLimits) -> MediaBox:
    """Make the process's box one of `limits` (the server does at start-up), closing the one before."""
    global _default
    with _default_lock:
        old, _default = _default, MediaBox(limits)
    if old is not None:
        old.close()
    return _default


# --- frame sizes read from bitstreams, without decoding -------------------------------------------------------------

class _Bits:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def u(self, n: int) -> int:
        value = 0
        for _ in range(n):
            byte = self.pos >> 3
            if byte >= len(self.data):
                raise EOFError
            value = (value << 1) | ((self.data[byte] >> (7 - (self.pos & 7))) & 1)
            self.pos += 1
        return value

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise EOFError
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        value = self.ue()
        return (value + 1) // 2 if value & 1 else -(value // 2)


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The largest frame size of the JPEG start-of-frame markers in `data` (an MJPEG packet)."""
    found = None
    pos = 2 if data[:2] == b"\xff\xd8" else 0
    while pos + 9 <= len(data):
        if data[pos] != 0xFF:
            pos += 1
            continue
        marker = data[pos + 1]
        if marker in (0xD8, 0x01, 0xFF) or 0xD0 <= marker <= 0xD7:
            pos += 1 if marker == 0xFF else 2
            continue
        if marker == 0xD9:
            break
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            if found is None or width * height > found[0] * found[1]:
                found = (width, height)
        if marker == 0xDA:  # entropy-coded data follows: skip to the next marker that is not a stuffed byte
            pos += 2 + length
            while pos + 1 < len(data) and not (data[pos] == 0xFF and data[pos + 1] not in (0x00,) and
                                               not 0xD0 <= data[pos + 1] <= 0xD7):
                pos += 1
            continue
        pos += 2 + length
    return found


def _vp8_size(data: bytes) -> tuple[int, int] | None:
    if len(data) >= 10 and not data[0] & 1 and data[3:6] == b"\x9d\x01\x2a":  # a key frame
        return int.from_bytes(data[6:8], "little") & 0x3FFF, int.from_bytes(data[8:10], "little") & 0x3FFF
    return None


def _vp9_size(data: bytes) -> tuple[int, int] | None:
    bits = _Bits(data)
    if bits.u(2) != 2:
        return None
    profile = bits.u(1) | (bits.u(1) << 1)
    if profile == 3:
        bits.u(1)
    if bits.u(1):  # show_existing_frame
        return None
    key = bits.u(1) == 0
    bits.u(2)  # show_frame, error_resilient_mode
    if not key:
        return None  # inter frames take their size from a reference, or (intra-only) are rare: sized at decode
    if bits.u(24) != 0x498342:
        return None
    if profile >= 2:
        bits.u(1)
    if bits.u(3) != 7:  # colour space not sRGB
        bits.u(1)
        if profile in (1, 3):
            bits.u(3)
    elif profile in (1, 3):
        bits.u(1)
    return bits.u(16) + 1, bits.u(16) + 1


def _unescape(nal: bytes) -> bytes:
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


def _nal_units(data: bytes) -> list[bytes]:
    """The NAL units of Annex B data (start codes 00 00 01)."""
    units = []
    start = data.find(b"\x00\x00\x01")
    while start >= 0:
        end = data.find(b"\x00\x00\x01", start + 3)
        units.append(data[start + 3 : end if end >= 0 else len(data)])
        start = end
    return units


def _h264_sps_size(sps: bytes) -> tuple[int, int] | None:
    bits = _Bits(_unescape(sps[1:]))
    profile = bits.u(8)
    bits.u(16)
    bits.ue()
    chroma, separate_planes = 1, 0  # 4:2:0 unless a high profile says otherwise
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        chroma = bits.ue()
        if chroma == 3:
            separate_planes = bits.u(1)
        bits.ue()
        bits.ue()
        bits.u(1)
        if bits.u(1):  # scaling matrices
            for i in range(8 if chroma != 3 else 12):
                if bits.u(1):
                    last, scale = 8, 8
                    for _ in range(16 if i < 6 else 64):
                        if scale:
                            scale = (last + bits.se()) % 256
                        last = scale or last
    bits.ue()
    poc = bits.ue()
    if poc == 0:
        bits.ue()
    elif poc == 1:
        bits.u(1)
        bits.se()
        bits.se()
        for _ in range(min(bits.ue(), 255)):
            bits.se()
    bits.ue()
    bits.u(1)
    width, units = (bits.ue() + 1) * 16, bits.ue() + 1
    frames_only = bits.u(1)
    height = units * (2 - frames_only) * 16
    if not frames_only:
        bits.u(1)
    bits.u(1)
    if bits.u(1):  # cropping, in units of the chroma sampling (H.264 7.4.2.1.1: CropUnitX, CropUnitY)
        left, right, top, bottom = bits.ue(), bits.ue(), bits.ue(), bits.ue()
        if separate_planes or chroma == 0:  # monochrome, or 4:4:4 coded as three planes: luma samples
            unit_x, unit_y = 1, 2 - frames_only
        else:  # 4:2:0 halves both ways, 4:2:2 the width only, 4:4:4 neither
            unit_x, unit_y = (1 if chroma == 3 else 2), (2 if chroma == 1 else 1) * (2 - frames_only)
        width -= unit_x * (left + right)
        height -= unit_y * (top + bottom)
    return width, height


def _h264_size(data: bytes) -> tuple[int, int] | None:
    sizes = [_h264_sps_size(nal) for nal in _nal_units(data) if nal and nal[0] & 0x1F == 7]
    sizes = [s for s in sizes if s]
    return max(sizes, key=lambda s: s[0] * s[1]) if sizes else None


def _mpeg4_size(data: bytes) -> tuple[int, int] | None:
    """The size in an MPEG-4 part 2 video object layer header (start code 00 00 01 2x), if `data` has one."""
    for unit in _nal_units(data):
        if not unit or not 0x20 <= unit[0] <= 0x2F:
            continue
        bits = _Bits(unit[1:])
        bits.u(9)  # random_accessible_vol, video_object_type_indication
        verid = 1
        if bits.u(1):
            verid = bits.u(4)
            bits.u(3)
        if bits.u(4) == 15:
            bits.u(16)
        if bits.u(1):  # vol_control_parameters
            bits.u(3)
            if bits.u(1):
                bits.u(79)
        shape = bits.u(2)
        if shape == 3 and verid != 1:
            bits.u(4)
        bits.u(1)
        resolution = bits.u(16)
        bits.u(1)
        if bits.u(1):
            bits.u(max(1, (resolution - 1).bit_length()))
        if shape != 0:
            return None
        bits.u(1)
        width = bits.u(13)
        bits.u(1)
        return width, bits.u(13)
    return None


SIZERS = {"mjpg": _jpeg_size, "vp80": _vp8_size, "vp90": _vp9_size, "vp09": _vp9_size,
          **dict.fromkeys(("avc1", "avc3", "h264", "x264", "davc"), _h264_size),
          **dict.fromkeys(("fmp4", "mp4v", "xvid", "divx", "dx50", "mp4s", "m4s2"), _mpeg4_size)}


def packet_size(codec: str, packet: bytes) -> tuple[int, int] | None:
    """The frame size a packet of `codec` (a FOURCC of `CODECS`) sets, read from its bitstream; None when it sets
    none (an inter frame) or the codec has no reader here (H.265, AV1: sized from their headers)."""
    sizer = SIZERS.get(codec.lower())
    if sizer is None:
        return None
    try:
        return sizer(packet)
    except (EOFError, IndexError):
        return None


# --- the child ------------------------------------------------------------------------------------------------------

def _fourcc(value: float) -> str:
    code = int(value)
    return "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4))


def _check_pixels(sampling: VideoSampling, width: int, height: int, where: str, what: str) -> None:
    from engine.video import VideoLimitError

    if sampling.max_frame_pixels is not None and width * height > sampling.max_frame_pixels:
        raise VideoLimitError("max_video_frame_pixels", f"{where} has {what} of {width}x{height} = {width * height} "
                                                        f"pixels, over the limit of {sampling.max_frame_pixels}")


def _open(path: str, container: str, raw: bool) -> Any:
    import cv2

    # FFmpeg takes the claimed container's demuxer and the file protocol, nothing else (no probing).
    os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = f"input_format;{DEMUXERS[container]}|protocol_whitelist;file"
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    if raw and capture.isOpened():
        capture.set(cv2.CAP_PROP_FORMAT, -1)
    return capture


def _decode_video_file(path: str, container: str, sampling: VideoSampling, where: str) -> Video:
    """The sampled frames of the file at `path` (run in the child): the header's limits, the codec, every packet's
    frame size, then the sampled frames' own sizes."""
    import cv2
    import numpy as np

    from engine.video import Video, check_duration, sampled_frames

    capture = _open(path, container, raw=False)
    packets = _open(path, container, raw=True)
    os.unlink(path)  # FFmpeg holds it open: nothing of the client's bytes stays on disk
    try:
        if not capture.isOpened():
            raise ValueError(f"{where} is not a readable video (corrupt, truncated, or not the {container} it "
                             "claims to be)")
        codec = _fourcc(capture.get(cv2.CAP_PROP_FOURCC))
        if codec.lower() not in CODECS:
            raise ValueError(f"{where} is not a readable video: its codec {codec!r} is not one of the accepted "
                             "(H.264, H.265, MPEG-4, VP8, VP9, AV1, MJPEG)")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = float(capture.get(cv2.CAP_PROP_FPS))
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if total < 1 or not np.isfinite(fps) or fps <= 0 or width < 1 or height < 1:
            raise ValueError(f"{where} is not a readable video: {total} frames at {fps} fps, {width}x{height}")
        check_duration(sampling, total / fps, where)
        _check_pixels(sampling, width, height, where, "frames")
        if packets.isOpened():
            _check_packets(packets, codec, sampling, (width, height), where)
        packets.release()
        wanted = sampling.indices(total, fps)
        frames, kept = sampled_frames(capture, wanted)
        for frame in frames:
            _check_pixels(sampling, frame.shape[1], frame.shape[0], where, "a decoded frame")
        if any(frame.shape[:2] != (height, width) for frame in frames):
            raise ValueError(f"{where} is not a readable video: its frames change size")
    finally:
        capture.release()
        packets.release()
    if not frames:
        raise ValueError(f"{where} is not a readable video: no frame could be decoded")
    return Video(np.stack(frames), fps, kept, total)


def _check_packets(packets: Any, codec: str, sampling: VideoSampling, header: tuple[int, int], where: str) -> None:
    """Every packet's frame size against the pixel limit. The first size read must be the header's (to a
    macroblock): a stream whose bitstream this reader misreads is sized by its header and decode alone."""
    import cv2

    extradata = packets.retrieve(flag=int(packets.get(cv2.CAP_PROP_CODEC_EXTRADATA_INDEX)))[1]
    first = True
    for index, packet in enumerate(_packets(packets, extradata)):
        size = packet_size(codec, packet)
        if size is None:
            continue
        if first and not (0 <= size[0] - header[0] < 16 and 0 <= size[1] - header[1] < 16):
            log.warning("%s: the %s bitstream gives %s, the header %s: sized by its header", where, codec, size, header)
            return
        first = False
        _check_pixels(sampling, *size, where, f"a frame (packet {index})")


def _packets(capture: Any, extradata: Any) -> Iterator[bytes]:
    """The codec's extradata (its sequence headers), then every packet of a capture in raw mode."""
    if extradata is not None and len(extradata):
        yield extradata.tobytes()
    while capture.grab():
        ok, packet = capture.retrieve()
        if ok and packet is not None:
            yield packet.tobytes()


def _decode_image_bytes(data: bytes, formats: list[str] | None, max_pixels: int | None, where: str) -> Any:
    import io

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=formats)  # reads the header only
    except Image.DecompressionBombError as exc:
        return {"ok": False, "error": "image_too_large", "message": str(exc)}, b""
    except UnidentifiedImageError as exc:
        return {"ok": False, "error": "unreadable_image", "stage": "open", "message": str(exc)}, b""
    except Exception as exc:  # Pillow's plugins raise many kinds (OSError, SyntaxError, struct.error, ...)
        return {"ok": False, "error": "unreadable_image", "stage": "open",
                "message": f"{type(exc).__name__}: {exc}"}, b""
    with image:
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            return {"ok": False, "error": "image_too_large", "size": [width, height],
                    "message": f"{width}x{height} = {width * height} pixels, over the limit of {max_pixels}"}, b""
        if width < 1 or height < 1:
            return {"ok": False, "error": "unreadable_image", "stage": "load",
                    "message": f"the image has no pixels ({width}x{height})"}, b""
        try:
            image.load()
            rgb = image.convert("RGB")
        except Image.DecompressionBombError as exc:
            return {"ok": False, "error": "image_too_large", "message": str(exc)}, b""
        except MemoryError:
            raise
        except Exception as exc:
            return {"ok": False, "error": "unreadable_image", "stage": "load",
                    "message": f"{type(exc).__name__}: {exc}"}, b""
    pixels = np.asarray(rgb)
    return {"ok": True, "size": [rgb.width, rgb.height]}, pixels.tobytes()


def _handle(request: dict[str, Any], payload: bytes, folder: str) -> tuple[dict[str, Any], bytes]:
    from engine.video import VideoLimitError, VideoSampling

    if request.get("kind") == "image":
        return _decode_image_bytes(payload, request.get("formats"), request.get("max_pixels"),
                                   str(request.get("where")))
    where = str(request.get("where"))
    sampling = VideoSampling(**request["sampling"])
    descriptor, path = tempfile.mkstemp(dir=folder, suffix=".media")  # 0600
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(payload)
        video = _decode_video_file(path, request["container"], sampling, where)
    except VideoLimitError as exc:
        return {"ok": False, "error": "limit", "limit": exc.limit, "message": str(exc)}, b""
    except ValueError as exc:
        return {"ok": False, "error": "invalid", "message": str(exc)}, b""
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return ({"ok": True, "shape": list(video.frames.shape), "fps": video.fps, "indices": video.frames_indices,
             "total": video.total_num_frames}, video.frames.tobytes())


def _read_exact(fd: int, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _limit_self(memory_bytes: int) -> None:
    import resource

    with open("/proc/self/status") as status:
        held = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:")), 0)
    resource.setrlimit(resource.RLIMIT_AS, (held + memory_bytes, held + memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    os.nice(NICE)


def child_main(folder: str, memory_bytes: int) -> None:
    """A child's loop: a request in, an answer out, until its pipe closes; a decode that runs out of memory ends
    with a limit answer (or kills the child, which the parent replaces)."""
    wire_in, wire_out = 0, os.dup(1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the answers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's; the child ends when its pipe does
    os.chdir(folder)
    import cv2  # noqa: F401 - loaded before the address space is measured and limited
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401

    import engine.video  # noqa: F401

    cv2.setNumThreads(1)
    _limit_self(memory_bytes)
    _write_all(wire_out, _header_bytes({"ready": True}, 0))
    while True:
        try:
            (length,) = struct.unpack(">I", _read_exact(wire_in, 4))
            request = json.loads(_read_exact(wire_in, length))
            payload = _read_exact(wire_in, request["bytes"])
        except EOFError:
            return
        try:
            header, answer = _handle(request, payload, folder)
        except MemoryError:
            header, answer = {"ok": False, "error": "limit", "limit": "decode_memory_bytes",
                              "message": f"{request.get('where')} needs more memory to decode than the limit "
                                         f"(decode_memory_bytes)"}, b""
        except Exception as exc:  # cv2.error and others: the bytes are not readable media
            header, answer = {"ok": False, "error": "invalid",
                              "message": f"{request.get('where')} could not be decoded ({type(exc).__name__})"}, b""
        _write_all(wire_out, _header_bytes(header, len(answer)))
        _write_all(wire_out, answer)
        del answer, payload


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]))
