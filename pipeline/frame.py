"""One captured frame, as sources yield it and the gate takes it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Frame:
    """One captured frame: BGR pixels, seconds (position for files, Unix time for live sources) and
    its running number from the source."""

    image: np.ndarray
    ts: float
    index: int
