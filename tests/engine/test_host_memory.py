"""The engine's process keeps large freed tensors for reuse on glibc (engine/host_memory.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

import pytest
import torch

from engine.host_memory import MMAP_THRESHOLD, keep_freed_memory, release_freed_memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> _MallInfo2:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2()


def _in_use_bytes() -> int:
    """glibc's bytes handed out and not yet freed, heap and mapped (`uordblks + hblkhd`)."""
    info = _mallinfo()
    return info.uordblks + info.hblkhd


def _mapped_bytes() -> int:
    """glibc's bytes in allocations served by their own mmap (`mallinfo2().hblkhd`)."""
    return _mallinfo().hblkhd


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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the rule is glibc's malloc; elsewhere it does nothing")
def test_garbage_between_live_tensors_goes_back_to_the_system():
    """Freed heap chunks lying between live tensors (what loading leaves: the originals of the fused weights) are
    beyond the trim threshold's reach; `release_freed_memory` hands their pages back."""
    keep_freed_memory()
    chunks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(96)]  # 1 MB each: served by the heap
    kept = chunks[1::2]
    del chunks
    assert release_freed_memory() > 32 << 20
    assert all(int(chunk[0]) == 1 for chunk in kept)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the rule is glibc's malloc; elsewhere it does nothing")
def test_an_engine_gives_back_its_start_up_copies(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="engine.host_memory"):
        make_engine()
    assert any("start-up garbage given back" in record.getMessage() for record in caplog.records)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
def test_the_kernels_scratch_is_given_back_and_grows_again():
    """A Linear of 512 rows x 12,288 (SmolVLM's connector at the row count start-up times it) packs x into a
    scratch buffer the kernels keep (25 MB of float32 panels in the vector builds, 12.6 MB of bfloat16 pairs for
    AMX tiles); `release_scratch` frees it, and the next call, given a fresh buffer, computes the same."""
    from engine.cpu import ops

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 12288, generator=generator).bfloat16()
    weight = torch.randn(64, 12288, generator=generator).bfloat16()
    first = ops.linear(x, weight)
    before = _in_use_bytes()
    ops.release_scratch()
    assert before - _in_use_bytes() >= 512 * 12288 * 2  # at least x in bfloat16
    assert torch.equal(ops.linear(x, weight), first)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
def test_release_scratch_frees_the_buffers_of_every_thread_of_the_team():
    """A tower attention over 4,096 patches grows each thread's scratch (its keys, values and scores: about 2.4 MB a
    thread, the worker's as well as the calling thread's); `release_scratch` frees them on every thread of the
    team, not only on the calling one, and the next call computes the same."""
    from engine.cpu import ops

    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two, whatever an earlier test in this process left
    try:
        generator = torch.Generator().manual_seed(0)
        both = torch.randn(1, 4096, 3, 2, 64, generator=generator).bfloat16()
        queries, keys, values = both.permute(2, 0, 3, 1, 4)
        first = ops.full_attention(queries, keys, values, 0.125)
        assert first is not None
        before = _in_use_bytes()
        ops.release_scratch()
        per_thread = (2 * 64 * 4096 + 16 * 4096) * 4
        assert before - _in_use_bytes() >= 1.9 * per_thread
        assert torch.equal(ops.full_attention(queries, keys, values, 0.125), first)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the rule is glibc's malloc; elsewhere it does nothing")
def test_threads_that_start_allocating_after_the_rule_share_the_main_heap():
    """`malloc_trim` does not give back all that a thread's own arena keeps (an int8 engine held 2-26 MB more from
    one start to another in them): once the rule is set, threads allocating for the first time use the main heap,
    which glibc's `malloc_info` shows as the only one (a fresh process, so that no arena from before exists)."""
    import subprocess
    import sys

    script = (
        "import ctypes, ctypes.util, os, tempfile, threading, torch\n"
        "from engine.host_memory import keep_freed_memory\n"
        "assert keep_freed_memory()\n"
        "kept = []\n"
        "def work():\n"
        "    kept.append(torch.ones(1 << 20, dtype=torch.uint8))\n"
        "threads = [threading.Thread(target=work) for _ in range(4)]\n"
        "for thread in threads: thread.start()\n"
        "for thread in threads: thread.join()\n"
        "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
        "libc.fopen.restype = ctypes.c_void_p\n"
        "path = os.path.join(tempfile.mkdtemp(), 'info.xml')\n"
        "stream = libc.fopen(path.encode(), b'w')\n"
        "libc.malloc_info(0, ctypes.c_void_p(stream))\n"
        "libc.fclose(ctypes.c_void_p(stream))\n"
        "print(open(path).read().count('<heap nr='))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == 1
