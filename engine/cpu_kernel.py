"""The CPU's decode attention over the paged cache, read in place (engine/paged_decode.c).

The reference path gathers every context's blocks into a new tensor in every layer before SDPA reads it; on
the CPU that copy costs as much as the attention itself, and grows with context. This small C library reads
each key and value where the cache holds it instead. It is compiled once per source and machine with the
system's C compiler (`CC`, else `cc`) into `<tmp>/vlmcap-kernels/` on first use, and shares torch's OpenMP
runtime; where no compiler is found, `available()` is False and the engine uses the reference path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_state: dict[str, object] = {}
_lock = threading.Lock()


def _build() -> ctypes.CDLL | None:
    """The compiled library, built at the first call (None, with the reason logged, where it cannot be)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (CC=%r): the CPU decode kernel is off", os.environ.get("CC", "cc"))
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "vlmcap-kernels"
    library = folder / f"paged_decode-{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{library.name}.{os.getpid()}"
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("the CPU decode kernel did not compile (%s): %s", compiler, done.stderr[-2000:])
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, library)  # atomic: a concurrent build of the same source leaves the same file
    lib = ctypes.CDLL(str(library))
    lib.paged_decode_attention.restype = ctypes.c_int
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_decode_attention.argtypes = [
        pointer, pointer, pointer, ctypes.c_int, pointer, pointer, i64, i64, i64, i64, i64, i64,
        ctypes.c_float, i64, pointer, ctypes.c_int,
    ]
    return lib


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _build()
        return _state["lib"]  # type: ignore[return-value]


def available(device: torch.device) -> bool:
    """Whether the kernel runs on `device` (the CPU, with a C compiler to build it)."""
    return device.type == "cpu" and _library() is not None


def paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, block_size: int, scale: float, window: int | None,
) -> torch.Tensor:
    """q [n, kv_heads, groups, d] (one query per head of each sequence) over the cache's [slots, kv_heads, d]
    keys and values -> [n, kv_heads, groups, d] in q's dtype. Sequence i attends to its first
    `context_lens[i]` positions (the last `window` of them in a sliding-window layer), which lie in the blocks
    `block_tables[i]`."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel is not available (no C compiler); use the reference path")
    if key_cache.dtype not in _DTYPES or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"the CPU decode kernel reads float32, bfloat16 or float16 caches, got {key_cache.dtype}")
    n, kv_heads, groups, d = q.shape
    if key_cache.shape[1:] != (kv_heads, d) or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"cache rows {tuple(key_cache.shape[1:])} must be contiguous [kv_heads={kv_heads}, d={d}]")
    query = q.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(query.shape, dtype=torch.float32)
    failed = lib.paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), _DTYPES[key_cache.dtype],
        tables.data_ptr(), lens.data_ptr(), n, kv_heads, groups, d, block_size, tables.shape[1],
        float(scale), int(window or 0), out.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"paged decode attention refused its inputs (code {failed}): context lengths "
                         f"{lens.tolist()} must lie in 1..{tables.shape[1] * block_size} (the block tables' reach)")
    return out.to(q.dtype)
