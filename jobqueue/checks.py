"""Range checks of arguments and settings: each raises ValueError naming the value, what it must be and what it
was (`max_pending must be at least 1, got 0`). The queue, the camera side and the event memory use them; this
module imports nothing."""

from __future__ import annotations


def at_least(name: str, value: float, low: float, unit: str = "") -> None:
    """`{name} must be at least {low}{unit}, got {value}` when `value` < `low`."""
    if value < low:
        raise ValueError(f"{name} must be at least {low}{unit}, got {value}")


def not_negative(name: str, value: float) -> None:
    """`{name} must not be negative, got {value}` when `value` < 0."""
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")


def positive(name: str, value: float) -> None:
    """`{name} must be positive, got {value}` when `value` <= 0 (a number of seconds, a rate)."""
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def positive_count(name: str, value: int) -> None:
    """`{name} must be positive, got {value}` when the count `value` < 1."""
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
