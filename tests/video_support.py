"""Test videos made on the fly: a camera panning across a photo, written as MP4 with OpenCV's VideoWriter."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.report import mp4_bytes, panning_frames


def clip_frames(photo, count: int = 5, size: tuple[int, int] = (64, 48)) -> list[np.ndarray]:
    """RGB frames of a camera panning across `photo` (`bench.report.panning_frames`), small by default."""
    return panning_frames(photo, count, size)


def write_mp4(path: str | Path, frames: list[np.ndarray], fps: float) -> str:
    Path(path).write_bytes(mp4_bytes(frames, fps))
    return str(path)
