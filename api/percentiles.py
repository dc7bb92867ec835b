"""Percentiles, the project's one helper: for the dashboard's live numbers and the benchmarks' reports. Plain
Python (no numpy, torch, FastAPI or Prometheus), so the benchmarks import it on a machine that has none of the
server's packages."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0 to 100) of `values`, interpolated between the nearest ranks as numpy's default
    does; NaN without values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of durations given in seconds, in milliseconds (NaN when there are none)."""
    ms = [value * 1000.0 for value in seconds]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms, default=math.nan)}
