"""The CPU kernels' libraries: each source of engine/csrc/ compiled once per machine and instruction set with the
system's C compiler (`CC`, else `cc`) into `<tmp>/vlmcap-kernels/`, one library per entry of `VARIANTS` (AMX tiles,
AVX-512 with BF16 dot products, AVX-512F, AVX2, plain C); the best one the CPU's flags allow is loaded (`variant()`,
or the one `choose_variant` set for the process), and shares torch's OpenMP runtime. Where no compiler is found,
`available()` is False and the engine keeps torch's own operations."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.cpu import abi

log = logging.getLogger(__name__)

FOLDER = Path(__file__).parent.parent / "csrc"
SOURCES = [FOLDER / "paged_decode.c", FOLDER / "linear.c", FOLDER / "linear_int8.c", FOLDER / "rms_norm.c",
           FOLDER / "rope_store.c", FOLDER / "gelu.c", FOLDER / "decode_layers.c", FOLDER / "full_attention.c",
           FOLDER / "sampling.c", FOLDER / "scratch.c"]
HEADERS = [FOLDER / "dtypes.h", FOLDER / "kernels.h", FOLDER / "linear.h"]
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")  # compiling; linking is LINK_FLAGS, without -ffast-math:
# GCC links crtfastmath.o into what it links with -ffast-math (shared libraries too, before GCC 13), whose constructor
# turns on flush-to-zero and denormals-are-zero for the thread that loads the library and the threads it starts, so
# the whole server's floats changed (Python parsed 1e-320 as 0.0: a top_k of 1e-320 passed as an integer).
LINK_FLAGS = ("-shared", "-fopenmp")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# name -> (compiler flags, the CPU flags of /proc/cpuinfo it needs), best first.
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "amx_bf16": ((*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
                 frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                            "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"})),
    "avx512_bf16": ((*_AVX512, "-mavx512bf16", "-mavx512vnni"),
                    frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                               "avx512_vnni"})),
    "avx512": (_AVX512, frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    "avx2": (_AVX2, frozenset({"avx2", "fma", "f16c"})),
    "generic": ((), frozenset()),
}


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports (/proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def runnable_variants() -> list[str]:
    """The builds this CPU can run, best first (on other architectures than x86-64, plain C only)."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    flags = cpu_flags()
    return [name for name, (_, needs) in VARIANTS.items() if (x86 or not needs) and needs <= flags]


def compile_variant(name: str) -> Path | None:
    """The shared library of build `name`, compiled at the first call (None, with the reason logged, where it
    cannot be)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (CC=%r): the CPU kernels are off", os.environ.get("CC", "cc"))
        return None
    flags = (*FLAGS, *VARIANTS[name][0])
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    recipe = " ".join((*flags, *LINK_FLAGS)).encode() + platform.machine().encode()
    key = hashlib.sha256(source + recipe).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "vlmcap-kernels"
    library = folder / f"vlmcap-cpu-{name}-{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{library.name}.{os.getpid()}"
        with tempfile.TemporaryDirectory(dir=folder) as work:  # objects first, then linked without -ffast-math
            done = _compile_objects(compiler, flags, work)
            if done.returncode == 0:
                objects = [str(Path(work) / f"{path.stem}.o") for path in SOURCES]
                done = subprocess.run([compiler, *LINK_FLAGS, *objects, "-o", str(partial), "-lm"],
                                      capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("the CPU kernels (%s) did not compile (%s): %s", name, compiler, done.stderr[-2000:])
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, library)  # atomic: a concurrent build of the same source leaves the same file
    return library


def _compile_objects(compiler: str, flags: tuple[str, ...], work: str) -> subprocess.CompletedProcess:
    """Each source's object in `work`, a compiler process a source, as many at once as this process has cores: a
    build then takes about its slowest file's time (paged_decode.c, SOURCES' first), not the sum of all of them. The
    first failed compilation's result, else the last's."""
    def one(source: Path) -> subprocess.CompletedProcess:
        return subprocess.run([compiler, *flags, "-c", f"-I{FOLDER}", str(source)], cwd=work, capture_output=True,
                              text=True)

    with ThreadPoolExecutor(max_workers=min(usable_cores(), len(SOURCES))) as pool:
        results = list(pool.map(one, SOURCES))
    return next((result for result in results if result.returncode != 0), results[-1])


@functools.cache
def load_variant(name: str) -> ctypes.CDLL | None:
    """Build `name` loaded, its functions typed (None where it does not compile)."""
    path = compile_variant(name)
    return None if path is None else abi.declare(ctypes.CDLL(str(path)))


_chosen: str | None = None  # the build `choose_variant` set (None: the best)


def choose_variant(name: str | None) -> None:
    """Make build `name` the one every kernel call of this process uses (None: the best this CPU runs, as at
    import). ValueError where this CPU's flags lack what it needs or it does not compile."""
    global _chosen
    if name is not None:
        if name not in VARIANTS:
            raise ValueError(f"no CPU kernel build {name!r}: the builds are {list(VARIANTS)}")
        if name not in runnable_variants():
            missing = sorted(VARIANTS[name][1] - cpu_flags())
            raise ValueError(f"this CPU cannot run the {name} build of the CPU kernels (its flags lack {missing}); "
                             f"it runs {runnable_variants()}")
        if load_variant(name) is None:
            raise ValueError(f"the {name} build of the CPU kernels did not compile (CC={os.environ.get('CC', 'cc')!r})")
    _chosen = name
    variant.cache_clear()


@functools.cache
def variant() -> str | None:
    """The build the engine uses: the one chosen (`choose_variant`), else the best this CPU runs that compiles
    (None: no compiler)."""
    if _chosen is not None:
        return _chosen
    for name in runnable_variants():
        if load_variant(name) is not None:
            log.info("CPU kernels: the %s build", name)
            return name
    return None


def library() -> ctypes.CDLL | None:
    """The build `variant()` names, loaded (None: no compiler)."""
    name = variant()
    return None if name is None else load_variant(name)


def lib() -> ctypes.CDLL:
    """`library()`, or RuntimeError where there is none."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (no C compiler); use torch's operations")
    return lib


def available(device: torch.device) -> bool:
    """Whether the kernels run on `device` (the CPU, with a C compiler to build them)."""
    return device.type == "cpu" and library() is not None


# The builds with AVX-512's bfloat16 dot products: those compiled for them.
DOT_BUILDS = frozenset(name for name, (flags, _) in VARIANTS.items() if "-mavx512bf16" in flags)


def has_dot_products(lib: ctypes.CDLL) -> bool:
    """Whether build `lib` can multiply bfloat16 by the dot products (where the tiles do not)."""
    return lib.linear_isa().decode() in DOT_BUILDS
