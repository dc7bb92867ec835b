"""Videos as the engine takes them: sampled frames with where they lie in the clip.

A `Video` is a few frames (RGB, one size) and the source's frame rate, so that each frame's time is known:
SmolVLM writes it into the prompt, Qwen2.5-VL spaces its temporal rotary positions by it. Encoded bytes are decoded
in the media box (engine/media_box.py): only an accepted container (`sniff_container`: mp4/mov, webm/mkv, avi, by
its first bytes) reaches FFmpeg, forced to that demuxer, in a supervised child process with a deadline and a memory
limit. Frames are read one by one: frames between the sampled ones are grabbed (demuxed and decoded, never
converted or kept), so a clip's decoded frames in memory are at most `max_frames` frames of at most
`max_frame_pixels` pixels whatever its length. Limits a file passes raise `VideoLimitError` naming the limit; a
file that cannot be read, ValueError.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from PIL import Image

from engine.media_box import MediaLimitError

if TYPE_CHECKING:
    from engine.media_box import MediaBox

# The frame rate given to frames that come without one (a list of frames): one a second.
UNTIMED_FPS = 1.0


class VideoLimitError(MediaLimitError):
    """A video over one of the limits it was read under; `limit` names the limit."""


@dataclass(frozen=True)
class VideoSampling:
    """Which frames of a video file are kept: `num_frames` spread evenly from the first to the last, or, when
    `fps` is set, one every 1/`fps` seconds; never more than `max_frames`. Limits on the file: its duration
    (`max_seconds`) and each frame's pixels (`max_frame_pixels`); None for none."""

    num_frames: int = 8
    fps: float | None = None
    max_frames: int = 32
    max_seconds: float | None = None
    max_frame_pixels: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_frames, bool) or not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"max_frames must be a positive integer, got {self.max_frames!r}")
        if isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int) or self.num_frames < 1:
            raise ValueError(f"num_frames must be a positive integer, got {self.num_frames!r}")
        if self.num_frames > self.max_frames:
            raise VideoLimitError("max_frames", f"num_frames {self.num_frames} is over the limit of "
                                                f"{self.max_frames} frames a video")
        if self.fps is not None and not (isinstance(self.fps, int | float) and 0 < self.fps <= 1000):
            raise ValueError(f"fps must be a number in (0, 1000], got {self.fps!r}")

    def indices(self, total_frames: int, source_fps: float) -> list[int]:
        """The frame indices to keep of a clip of `total_frames` frames at `source_fps`."""
        count = min(self.num_frames, total_frames)
        if self.fps is not None:
            step = max(source_fps / self.fps, 1.0)
            count = math.ceil(total_frames / step)
            if count <= self.max_frames:
                return sorted({min(round(i * step), total_frames - 1) for i in range(count)})
            count = self.max_frames  # more than max_frames at that rate: max_frames spread over the clip
        return sorted({int(round(i)) for i in np.linspace(0, total_frames - 1, count)})


@dataclass
class Video:
    """Frames [T, H, W, 3] (uint8 RGB) taken at `frames_indices` of a source of `total_num_frames` frames at
    `fps` frames a second."""

    frames: np.ndarray
    fps: float
    frames_indices: list[int] = field(default_factory=list)
    total_num_frames: int = 0

    def __post_init__(self) -> None:
        frames = self.frames
        if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[0] < 1 or frames.shape[3] != 3 \
                or frames.dtype != np.uint8:
            shape = getattr(frames, "shape", None)
            raise ValueError(f"a Video's frames must be a uint8 array [frames, height, width, 3], got {shape}")
        if isinstance(self.fps, bool) or not isinstance(self.fps, int | float) or not 0 < self.fps < math.inf:
            raise ValueError(f"a Video's fps must be a positive number, got {self.fps!r}")
        if not self.frames_indices:
            self.frames_indices = list(range(len(frames)))
        if len(self.frames_indices) != len(frames) or self.frames_indices != sorted(set(self.frames_indices)):
            raise ValueError(f"a Video's frames_indices must be {len(frames)} ascending indices, got "
                             f"{self.frames_indices[:8]}")
        self.total_num_frames = max(self.total_num_frames, self.frames_indices[-1] + 1)

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def duration(self) -> float:
        return self.total_num_frames / self.fps

    @property
    def timestamps(self) -> list[float]:
        return [index / self.fps for index in self.frames_indices]

    def metadata(self) -> Any:
        """transformers' `VideoMetadata` of the frames, as its video processors read it."""
        from transformers.video_utils import VideoMetadata

        height, width = self.frames.shape[1:3]
        return VideoMetadata(total_num_frames=self.total_num_frames, fps=self.fps, width=width, height=height,
                             duration=self.duration, video_backend="opencv", frames_indices=list(self.frames_indices))


VideoInput = Video | list | tuple | np.ndarray | bytes | bytearray | str | os.PathLike


def _frame_array(frame: Any, where: str) -> np.ndarray:
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    array = np.asarray(frame)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (3, 4) or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"{where} must be an RGB image (H x W x 3), got an array of shape {array.shape}")
    if array.dtype != np.uint8:
        raise ValueError(f"{where} must hold uint8 pixels, got {array.dtype}")
    return array[:, :, :3]


def frames_video(frames: Any, where: str, fps: float = UNTIMED_FPS) -> Video:
    """A video of frames given as PIL images or arrays (a list, or one [T, H, W, 3] array), all one size."""
    items = list(frames)
    if not items:
        raise ValueError(f"{where} has no frames")
    arrays = [_frame_array(frame, f"{where} frame {i}") for i, frame in enumerate(items)]
    sizes = {a.shape for a in arrays}
    if len(sizes) > 1:
        raise ValueError(f"{where} has frames of different sizes: {sorted(sizes)}")
    return Video(np.stack(arrays), fps)


def as_video(value: VideoInput, where: str, sampling: VideoSampling) -> Video:
    """A request's video: a `Video`, frames, encoded bytes or a file path (read under `sampling`)."""
    if isinstance(value, Video):
        return value
    if isinstance(value, (bytes, bytearray)):
        return read_video(io.BytesIO(bytes(value)), sampling, where)
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(Path(value), "rb") as file:
                return read_video(file, sampling, where)
        except OSError as exc:
            raise ValueError(f"{where} could not be opened: {exc}") from exc
    if isinstance(value, (list, tuple, np.ndarray)):
        return frames_video(value, where)
    raise ValueError(f"{where} has unsupported type {type(value).__name__}")


def sniff_container(data: bytes, where: str = "video") -> str:
    """The container of an encoded video by its first bytes (`engine.media_box.DEMUXERS` names each one's demuxer):
    "mov" (an ISO/QuickTime 'ftyp' box), "matroska" (EBML, also WebM) or "avi" (RIFF AVI); ValueError for anything
    else (concat scripts, SDP descriptions, playlists, raw streams, images) before any decoder sees it."""
    head = bytes(data[:12])
    if len(head) == 12 and head[4:8] == b"ftyp":
        return "mov"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    raise ValueError(f"{where} is not a readable video: not one of the accepted containers (mp4/mov, webm/mkv, avi)")


def read_video(file: BinaryIO, sampling: VideoSampling, where: str = "video", box: MediaBox | None = None) -> Video:
    """The frames `sampling` picks from an encoded video read from `file`, decoded in `box` (the process's media
    box by default) and checked against `sampling`'s limits before any frame is decoded."""
    from engine.media_box import default_box

    return (box or default_box()).decode_video(file.read(), sampling, where)


def check_duration(sampling: VideoSampling, seconds: float, where: str) -> None:
    if sampling.max_seconds is not None and seconds > sampling.max_seconds:
        raise VideoLimitError("max_video_seconds", f"{where} lasts {seconds:.1f} s, over the limit of "
                                                   f"{sampling.max_seconds:g} s")


def sampled_frames(capture: Any, wanted: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """Frames at the `wanted` indices (ascending) of an open OpenCV capture: each frame up to the last is grabbed,
    only the wanted ones converted (to RGB) and kept. A stream that ends early gives the frames read until then."""
    import cv2

    frames: list[np.ndarray] = []
    kept: list[int] = []
    targets = iter(wanted)
    target = next(targets, None)
    index = 0
    while target is not None and capture.grab():
        if index == target:
            ok, frame = capture.retrieve()
            if ok and frame is not None:
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
                kept.append(index)
            target = next(targets, None)
        index += 1
    return frames, kept
