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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (half its heap size); larger allocations are always mapped
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


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
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.info("host memory: glibc serves allocations up to %d MB from its heaps and keeps %d MB of freed memory: %s",
             MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, done)
    return done
