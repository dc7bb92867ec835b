"""How the engine's process keeps freed host memory, on the CPU.

torch's CPU tensors come from the C library's malloc and go back to it when freed. glibc serves a large
allocation (past a threshold that starts at 128 kB) with a fresh `mmap` and unmaps it on free, and returns the
heap's free top to the system past another; every large tensor then costs the kernel a page fault per 4 kB
page, zeroed, on first touch. A SigLIP layer's activations for four 512 px tiles are 25 MB: on a 2-core CPU,
faulting them in doubled a vision-tower slice's time. The rule: on the CPU the engine asks glibc to serve
allocations up to `MMAP_THRESHOLD` (the most it allows) from its heaps and to keep up to `TRIM_THRESHOLD` of
freed memory for reuse (`keep_freed_memory`); the process's resident memory then stays near its peak instead of
following each step. Adapters keep a call's largest tensor under `MMAP_THRESHOLD` where they can
(engine/models/smolvlm.py groups tiles). Elsewhere than glibc this does nothing.

Start-up is the exception: loading copies every weight once (the lean layers' fused matrices, the vision
tower's) and calibration runs the largest steps, and the heaps would keep all of that garbage for good (the
originals' freed chunks lie between live weights, where the trim threshold never reaches). So once the engine has
started, `release_freed_memory` hands every free page of the heaps back (glibc's `malloc_trim(0)`): the loaded
engine holds its weights and what the steps keep, not the copies it made on the way. Threads that first allocate
after `keep_freed_memory` share the main heap (`ARENA_MAX`): with arenas of their own, the 256M model's int8 engine
held 364-392 MB besides its KV cache from one start to another (1.26-1.36x its weights), 6-26 MB of it resident in
another thread's arena after the trim; sharing, 364-365 MB in five starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (half its heap size); larger allocations are always mapped
TRIM_THRESHOLD = 256 << 20
ARENA_MAX = 1  # the heaps threads may use: the main one alone (the kernels' threads allocate once, at growth)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds (see the module's docstring) once for the process; whether they took effect."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version  # glibc's own, absent elsewhere
    except (OSError, AttributeError, TypeError):
        return False
    version.restype = ctypes.c_char_p
    if not version():
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            and mallopt(_M_ARENA_MAX, ARENA_MAX) == 1)
    log.info("host memory: glibc serves allocations up to %d MB from its heaps, keeps %d MB of freed memory and gives "
             "threads that start allocating now %d heap: %s", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, ARENA_MAX,
             done)
    return done


def release_freed_memory() -> int:
    """Every wholly free page of glibc's heaps given back to the system (`malloc_trim(0)`, every arena); the bytes
    the process's resident memory went down by (0 elsewhere than glibc)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return 0
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    before = resident_bytes()
    trim(0)
    released = max(0, before - resident_bytes())
    log.info("host memory: %d MB of start-up garbage given back", released >> 20)
    return released


def resident_bytes() -> int:
    """The process's resident memory (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
