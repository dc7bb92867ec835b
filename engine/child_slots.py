"""Pools of supervised child processes (engine/media_box.py's decoders, engine/grammar_pool.py's compilers) keep
their idle children in a queue of slots, None marking a free slot whose child starts at first use. This module
holds what they share and imports the standard library only (the command line loads it without torch)."""

from __future__ import annotations

import queue
from typing import Protocol, TypeVar


class Killable(Protocol):
    def kill(self) -> None: ...


ChildT = TypeVar("ChildT", bound=Killable)


def kill_idle(slots: queue.Queue[ChildT | None]) -> None:
    """Kill the child in each slot, emptying the queue: the idle children, as a busy one is not in it."""
    while True:
        try:
            child = slots.get_nowait()
        except queue.Empty:
            return
        if child is not None:
            child.kill()
