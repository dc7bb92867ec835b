"""The engine's process keeps large freed tensors for reuse on glibc (engine/host_memory.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest
import torch

from engine.host_memory import MMAP_THRESHOLD, keep_freed_memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    """glibc's bytes in allocations served by their own mmap (`mallinfo2().hblkhd`)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblkhd


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the rule is glibc's malloc; elsewhere it does nothing")
def test_a_vision_layer_s_activations_come_from_the_heap(make_engine):
    """After an engine starts on the CPU, a 24 MB tensor is not mapped on its own (it would cost a page fault a
    4 kB page each time it is made)."""
    make_engine()
    assert keep_freed_memory()
    before = _mapped_bytes()
    held = torch.empty(MMAP_THRESHOLD - (8 << 20), dtype=torch.uint8)
    assert _mapped_bytes() - before < 1 << 20
    del held
