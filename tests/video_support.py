"""Test videos made on the fly: a camera panning across a photo, written as MP4 with OpenCV's VideoWriter."""

from __future__ import annotations

import tempfile
from pathlib import Path

import cv2
import numpy as np

from bench.report import panning_frames


def clip_frames(photo, count: int = 5, size: tuple[int, int] = (64, 48)) -> list[np.ndarray]:
    """RGB frames of a camera panning across `photo` (`bench.report.panning_frames`), small by default."""
    return panning_frames(photo, count, size)


def write_mp4(path: str | Path, frames: list[np.ndarray], fps: float) -> str:
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return str(path)


def mp4_bytes(frames: list[np.ndarray], fps: float) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        return Path(write_mp4(Path(folder) / "clip.mp4", frames, fps)).read_bytes()
