"""The CPU's C kernels (engine/csrc/), built for the instruction set of the CPU they run on.

- `paged_decode_attention` (paged_decode.c): decode attention over the paged cache, read in place. The
  reference path gathers every context's blocks into a new tensor in every layer before SDPA reads it; on the
  CPU that copy costs as much as the attention itself, and grows with context.
- `linear` (linear.c): a Linear layer reading its weight where transformers keeps it (row-major, its own
  dtype: no second copy), four weight rows against six rows of x at a time. A decode step's matrix products
  are a few rows times every weight of the model: their cost is reading the weights. `route_linears` sends a
  model's Linear layers and patch embeddings (a Conv2d whose stride is its kernel: a Linear over the image's
  patches) through it for the row counts where it beats torch's own GEMM on this machine (`measure_row_ranges`).
  Its `glu` mode computes a gated MLP's act(gate) * up from one matrix of both, act SiLU (Llama) or GELU's tanh
  approximation (Gemma) (engine/lean_layers.py). Where
  the build has AVX-512's bfloat16 dot products, `bf16_products` measures once whether they or float32 FMAs on
  widened weights are faster on this CPU (some run the dot products at half their FMAs' rate) and uses those.
- `rms_norm` / `add_rms_norm` (rms_norm.c): an RMSNorm (Llama's, or Gemma's `1 + weight`: `Norm`) in one call
  instead of seven small operators, and the residual add before it (Gemma's sandwich norm of the added output
  too); `route_norms` swaps it in for every norm whose forward is LlamaRMSNorm's code.
- `rope_store` (rope_store.c): a layer's rotary embedding and KV cache write in one call (Gemma's per-head q and k
  norms before it).
- `gelu_tanh` (gelu.c): GELU's tanh approximation in place, vectorized (a vision tower's MLP activation:
  torch's own costs as much as the matrix product before it; engine/lean_vision.py).

Each source is compiled once per machine and instruction set with the system's C compiler (`CC`, else `cc`)
into `<tmp>/vlmcap-kernels/`, one library per entry of `VARIANTS` (AMX tiles, AVX-512 with BF16 dot products,
AVX-512F, AVX2, plain C); the best one the CPU's flags allow is loaded (`variant()`), and shares torch's OpenMP runtime.
Where no compiler is found, `available()` is False and the engine keeps torch's own operations.
"""

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FOLDER = Path(__file__).with_name("csrc")
SOURCES = [FOLDER / "paged_decode.c", FOLDER / "linear.c", FOLDER / "rms_norm.c", FOLDER / "rope_store.c",
           FOLDER / "gelu.c", FOLDER / "decode_layers.c", FOLDER / "full_attention.c"]
HEADERS = [FOLDER / "dtypes.h", FOLDER / "kernels.h"]
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# name -> (compiler flags, the CPU flags of /proc/cpuinfo it needs), best first.
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "amx_bf16": ((*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
                 frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                            "amx_tile", "amx_bf16"})),
    "avx512_bf16": ((*_AVX512, "-mavx512bf16"),
                    frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})),
    "avx512": (_AVX512, frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    "avx2": (_AVX2, frozenset({"avx2", "fma", "f16c"})),
    "generic": ((), frozenset()),
}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' dtype codes (dtypes.h)
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
class NormArgs(ctypes.Structure):
    """kernels.h's `norm_weights`: one RMSNorm's weight, its dtype, flavor and epsilon (a NULL weight: none)."""

    _fields_ = [("weight", _P), ("dtype", _INT), ("flavor", _INT), ("eps", _F)]


class ProjectionArgs(ctypes.Structure):
    """decode_layers.c's `projection`: one weight as `linear` reads it."""

    _fields_ = [("weight", _P), ("n", _I64), ("k", _I64), ("stride", _I64), ("bias", _P), ("dtype", _INT)]


class LeanLayerArgs(ctypes.Structure):
    """decode_layers.c's `lean_layer`: one layer's weights and KV cache."""

    _fields_ = [*((name, NormArgs) for name in ("input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm",
                                                "k_norm")),
                *((name, ProjectionArgs) for name in ("qkv", "o", "gate_up", "down")),
                ("key_cache", _P), ("value_cache", _P), ("scaling", _F), ("window", _I64), ("act", _INT),
                ("local_rope", _INT)]


class DecodeStepArgs(ctypes.Structure):
    """decode_layers.c's `decode_step`: a step's buffers, rotary tables, attention metadata and sizes."""

    _fields_ = [*((name, _P) for name in ("h", "normed", "qkv", "attended", "o", "gate_up", "down", "cos", "sin",
                                          "local_cos", "local_sin", "slots", "query_index", "block_tables",
                                          "context_lens")),
                ("final_norm", NormArgs),
                *((name, _I64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "num_seqs",
                                            "block_size", "table_width")),
                *((name, _INT) for name in ("io_dtype", "cache_dtype", "mode", "num_threads"))]


_SIGNATURES = {  # function -> argument types (every one returns an int: 0, or why it refused)
    "paged_decode_attention": [_P, _INT, _I64, _I64, _P, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                               _F, _I64, _P, _INT],
    "linear": [_P, _INT, _I64, _I64, _P, _INT, _I64, _I64, _P, _INT, _P, _INT],
    "rms_norm": [_P, _INT, _I64, _I64, _P, _INT, _F, _P, _INT],
    "add_rms_norm": [_P, _P, ctypes.POINTER(NormArgs), _INT, _I64, _I64, ctypes.POINTER(NormArgs), _P, _INT],
    "rope_store": [_P, _INT, _I64, _I64, _I64, _I64, _I64, ctypes.POINTER(NormArgs), ctypes.POINTER(NormArgs), _P,
                   _P, _P, _P, _P, _INT, _INT],
    "gelu_tanh": [_P, _INT, _I64, _INT],
    "full_attention": [_P, _P, _P, _INT, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _INT],
    "decode_layers": [ctypes.POINTER(DecodeStepArgs), ctypes.POINTER(LeanLayerArgs), _I64],
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
    key = hashlib.sha256(source + " ".join(flags).encode() + platform.machine().encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "vlmcap-kernels"
    library = folder / f"vlmcap-cpu-{name}-{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{library.name}.{os.getpid()}"
        done = subprocess.run([compiler, *flags, f"-I{FOLDER}", *map(str, SOURCES), "-o", str(partial), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("the CPU kernels (%s) did not compile (%s): %s", name, compiler, done.stderr[-2000:])
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, library)  # atomic: a concurrent build of the same source leaves the same file
    return library


@functools.cache
def load_variant(name: str) -> ctypes.CDLL | None:
    """Build `name` loaded, its functions typed (None where it does not compile)."""
    path = compile_variant(name)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for function, argtypes in _SIGNATURES.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = ctypes.c_int
    lib.linear_isa.restype = ctypes.c_char_p
    lib.linear_isa.argtypes = []
    return lib


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


def _library() -> ctypes.CDLL | None:
    name = variant()
    return None if name is None else load_variant(name)


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (no C compiler); use torch's operations")
    return lib


def available(device: torch.device) -> bool:
    """Whether the kernels run on `device` (the CPU, with a C compiler to build them)."""
    return device.type == "cpu" and _library() is not None


def paged_decode_attention(
    q: torch.Tensor, query_index: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float, window: int | None,
    out: torch.Tensor,
) -> None:
    """Sequence i's query is q[:, query_index[i]] ([heads, tokens, d], any strides); it attends to its first
    `context_lens[i]` positions (the last `window` of them in a sliding-window layer), which lie in the cache
    blocks `block_tables[i]` of the [slots, kv_heads, d] caches, and its output goes to out[query_index[i]]
    ([tokens, heads, d], contiguous, q's dtype). Integer tensors are int64 and contiguous."""
    lib = _lib()
    if key_cache.dtype not in DTYPE_CODES or key_cache.dtype != value_cache.dtype or q.dtype not in DTYPE_CODES:
        raise ValueError(f"the CPU decode kernel reads float32, bfloat16 or float16 tensors, got cache "
                         f"{key_cache.dtype} and queries {q.dtype}")
    heads, _, d = q.shape
    kv_heads = key_cache.shape[1]
    if key_cache.shape[2] != d or heads % kv_heads or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"cache rows {tuple(key_cache.shape[1:])} must be contiguous [kv_heads, d={d}] with "
                         f"kv_heads dividing the {heads} query heads")
    if out.dtype != q.dtype or not out.is_contiguous() or q.stride(2) != 1:
        raise ValueError("the output must be contiguous in q's dtype, and q's rows contiguous")
    failed = lib.paged_decode_attention(
        q.data_ptr(), DTYPE_CODES[q.dtype], q.stride(0), q.stride(1), query_index.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), DTYPE_CODES[key_cache.dtype], block_tables.data_ptr(), context_lens.data_ptr(),
        query_index.shape[0], kv_heads, heads // kv_heads, d, block_size, block_tables.shape[1], float(scale),
        int(window or 0), out.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"paged decode attention refused its inputs (code {failed}): context lengths "
                         f"{context_lens.tolist()} must lie in 1..{block_tables.shape[1] * block_size} "
                         "(the block tables' reach)")


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dtype not in DTYPE_CODES or weight.dim() != 2 or weight.stride(1) != 1 or weight.device.type != "cpu":
        raise ValueError(f"the Linear kernel reads a 2-d CPU float32, bfloat16 or float16 weight with contiguous "
                         f"rows, got {weight.dtype} {tuple(weight.shape)} strides {weight.stride()} on "
                         f"{weight.device}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, glu: str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ weight [n, k]^T (+ bias, float32), summed in float32 and returned in x's dtype
    (engine/csrc/linear.c). With `glu` (an activation of `GLU_ACTIVATIONS`), weight is [gate; up] and the result
    act(x gate^T) * (x up^T), [..., n/2]. `out`, when given, receives the result (contiguous, x's dtype)."""
    _check_weight(weight)
    if x.dtype not in DTYPE_CODES or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input {x.dtype} {tuple(x.shape)} does not fit a [{weight.shape[0]}, {weight.shape[1]}] "
                         "weight")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"the Linear kernel takes a contiguous float32 bias, got {bias.dtype}")
    if glu is not None and glu not in GLU_ACTIVATIONS:
        raise ValueError(f"glu is one of {list(GLU_ACTIVATIONS)} (the gate's activation), got {glu!r}")
    if glu and weight.shape[0] % 2:
        raise ValueError(f"a glu weight stacks gate and up rows: an even count, got {weight.shape[0]}")
    return _run_linear(_lib(), x, weight, bias, glu, out)


_PRODUCTS_WIDEN = 2  # kernels.h's `mode` bits of linear()
# A gated MLP's activations (linear()'s `glu`) -> kernels.h's `mode` bits for it.
GLU_ACTIVATIONS = {"silu": 1, "gelu_tanh": 1 | 4}
PRODUCTS = ("dot", "widen")  # bfloat16 products: vdpbf16ps, or float32 FMAs on widened weights
# transformers' activation modules by what they compute (a class of either kind computes exactly that function).
ACTIVATION_CLASSES = {"silu": frozenset({"SiLU", "SiLUActivation"}),
                      "gelu_tanh": frozenset({"GELUTanh", "PytorchGELUTanh", "NewGELUActivation"})}


def activation_of(module: torch.nn.Module | None) -> str | None:
    """What activation `module` computes ("silu", "gelu_tanh"), None where it is neither."""
    name = type(module).__name__
    return next((act for act, classes in ACTIVATION_CLASSES.items() if name in classes), None)


def _run_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                glu: str | None, out: torch.Tensor | None = None, products: str | None = None) -> torch.Tensor:
    """`linear` on inputs already checked (a layer's own weight: checked once, at routing); bfloat16 products
    as `products` says (None: `bf16_products(lib)`)."""
    n, k = weight.shape
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    width = n // 2 if glu else n
    if out is None:
        out = torch.empty(*x.shape[:-1], width, dtype=x.dtype)
    if lib.linear(rows.data_ptr(), DTYPE_CODES[x.dtype], rows.shape[0], k, weight.data_ptr(), DTYPE_CODES[weight.dtype],
                  weight.stride(0), n, None if bias is None else bias.data_ptr(),
                  (GLU_ACTIVATIONS[glu] if glu else 0) | products_mode(lib, products), out.data_ptr(),
                  torch.get_num_threads()):
        raise MemoryError(f"the Linear kernel could not allocate its buffer ({rows.shape[0]} x {k} floats)")
    return out


def products_mode(lib: ctypes.CDLL, products: str | None = None) -> int:
    """linear()'s `mode` bit for bfloat16 products as `products` says (None: `bf16_products(lib)`)."""
    return _PRODUCTS_WIDEN if (products or bf16_products(lib)) == "widen" else 0


def projection_args(weight: torch.Tensor, bias: torch.Tensor | None) -> ProjectionArgs:
    """A layer's own weight (checked) and float32 bias as decode_layers.c reads them."""
    _check_weight(weight)
    return ProjectionArgs(weight.data_ptr(), weight.shape[0], weight.shape[1], weight.stride(0),
                          None if bias is None else bias.data_ptr(), DTYPE_CODES[weight.dtype])


def decode_layers(step: DecodeStepArgs, layers: ctypes.Array) -> None:
    """Every lean decoder layer of a decode step, then the final norm, in one call (engine/csrc/decode_layers.c;
    engine/lean_layers.py fills `step` and `layers`, whose tensors it checked): the layer-by-layer kernels'
    results, bit for bit."""
    lib = _lib()
    step.mode = products_mode(lib)
    step.num_threads = torch.get_num_threads()
    failed = lib.decode_layers(ctypes.byref(step), layers, len(layers))
    if failed:
        layer, code = divmod(failed, 10)
        what = f"layer {layer - 1} of {len(layers)}" if layer <= len(layers) else "the final norm"
        lens = ctypes.cast(step.context_lens, ctypes.POINTER(ctypes.c_int64))[:step.num_seqs]
        why = (f"context lengths {lens} past the block tables' {step.table_width} x {step.block_size} positions"
               if code == 1 else "out of memory")
        raise ValueError(f"decode_layers: a kernel of {what} refused its inputs: {why}")


# The builds with AVX-512's bfloat16 dot products: those compiled for them.
DOT_BUILDS = frozenset(name for name, (flags, _) in VARIANTS.items() if "-mavx512bf16" in flags)


def has_dot_products(lib: ctypes.CDLL) -> bool:
    """Whether build `lib` can multiply bfloat16 by the dot products (where the tiles do not)."""
    return lib.linear_isa().decode() in DOT_BUILDS


@functools.cache
@torch.inference_mode()
def bf16_products(lib: ctypes.CDLL) -> str:
    """How build `lib` multiplies bfloat16 weights: "dot" where it has the dot products and they were the faster
    of the two loops in a short measurement here (8 rows of x, a decode batch; with tiles, the 3 rows below
    them; against a weight that stays in the cache, so that the arithmetic is timed, not the memory), else
    "widen"."""
    if not has_dot_products(lib):
        return "widen"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 576, generator=generator).bfloat16()
    rows = 3 if lib.linear_isa().decode() == "amx_bf16" else 8
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    seconds = {products: median_seconds(lambda p=products: [_run_linear(lib, x, weight, None, None, products=p)
                                                           for _ in range(20)], repeats=5)
               for products in PRODUCTS}
    chosen = min(PRODUCTS, key=seconds.__getitem__)
    log.info("CPU kernels (%s): bfloat16 products by %s (dot %.0f us, widen %.0f us a call)",
             lib.linear_isa().decode(), chosen, seconds["dot"] * 5e4, seconds["widen"] * 5e4)
    return chosen



def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Every position's attention to every position of its input, no mask (a vision tower's layer): q, k, v
    [batch, heads, n, d] views of one packed projection (the same strides, each row contiguous) ->
    [batch, n, heads, d], contiguous, q's dtype (engine/csrc/full_attention.c). None where the kernel does not
    take these inputs (a head size it has no loop for, other strides), so that the caller runs SDPA."""
    batch, heads, n, d = q.shape
    if (q.dtype not in DTYPE_CODES or not q.dtype == k.dtype == v.dtype or not q.stride() == k.stride() == v.stride()
            or q.stride(3) != 1 or q.device.type != "cpu"):
        return None
    out = torch.empty(batch, n, heads, d, dtype=q.dtype)
    lib = _lib()
    failed = lib.full_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), DTYPE_CODES[q.dtype], batch, heads, n, d,
                                q.stride(0), q.stride(1), q.stride(2), float(scale), out.data_ptr(),
                                torch.get_num_threads())
    if failed == 2:
        raise MemoryError(f"full attention could not allocate its buffers ({n} positions of {d})")
    return None if failed else out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """x (contiguous, float32, bfloat16 or float16, on the CPU) replaced in place by GELU's tanh approximation
    (transformers' "gelu_pytorch_tanh"), computed in float32; returns x."""
    if x.dtype not in DTYPE_CODES or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"gelu_tanh takes a contiguous CPU float32, bfloat16 or float16 tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device} (contiguous: {x.is_contiguous()})")
    if _lib().gelu_tanh(x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), torch.get_num_threads()):
        raise MemoryError("gelu_tanh could not allocate its buffer")
    return x


# Row buckets `measure_row_range` times each Linear shape at, and the work past which a bucket is not timed
# (multiply-adds: a 256M model's lm head at 512 rows takes some 10 ms a call; vision towers run 1,024 rows).
ROW_BUCKETS = (1, 8, 16, 32, 128, 512)
MEASURE_MACS = 1.6e10


def median_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """The median of `repeats` timed calls of `fn`, after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def measure_row_range(weight: torch.Tensor) -> tuple[int, int]:
    """The rows of x [first, last] for which the kernel was faster than torch's F.linear with this weight here:
    the first run of buckets in which it won, from the row after the bucket before it (beyond the last bucket
    timed, the kernel keeps what it won there). (0, 0): torch at every row count."""
    lib = _lib()
    n, k = weight.shape
    won: list[bool] = []
    for rows in ROW_BUCKETS:
        if rows * n * k > MEASURE_MACS and won:
            break
        x = torch.randn(rows, k).to(weight.dtype)
        own = median_seconds(lambda x=x: _run_linear(lib, x, weight, None, None))
        theirs = median_seconds(lambda x=x: F.linear(x, weight))
        won.append(own <= theirs)
    if True not in won:
        return (0, 0)
    first = won.index(True)
    last = won.index(False, first) - 1 if False in won[first:] else None
    low = ROW_BUCKETS[first - 1] + 1 if first else 1
    return (low, ALL_ROWS if last is None else ROW_BUCKETS[last])


def measure_row_ranges(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Sets each routed layer's `rows` from `measure_row_range`, one measurement per weight shape and dtype;
    returns them by shape ("n x k dtype")."""
    ranges: dict[str, tuple[int, int]] = {}
    for module in model.modules():
        if isinstance(module, (KernelLinear, KernelPatchConv)):
            weight = module.weight.reshape(module.weight.shape[0], -1)
            key = shape_key(weight)
            if key not in ranges:
                ranges[key] = measure_row_range(weight)
            module.rows = ranges[key]
    return ranges


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}"


def set_row_ranges(model: torch.nn.Module, rows: int) -> None:
    """Every routed layer of `model` takes the kernel up to `rows` rows (instead of `measure_row_ranges`)."""
    for module in model.modules():
        if isinstance(module, (KernelLinear, KernelPatchConv)):
            module.rows = (1, rows) if rows else (0, 0)


ALL_ROWS = 1 << 30
# Rows for which `linear` is used before any measurement: every row count (bfloat16 and float16 GEMMs lack fast
# kernels on CPUs without their instructions), float32 up to 16 rows, beyond which MKL's blocking wins.
KERNEL_ROWS: dict[torch.dtype, tuple[int, int]] = {torch.float32: (1, 16), torch.bfloat16: (1, ALL_ROWS),
                                                   torch.float16: (1, ALL_ROWS)}


def route_linears(model: torch.nn.Module) -> int:
    """Make every `nn.Linear` of `model` a `KernelLinear` (its weights untouched): inputs whose row count lies in
    its `rows` range go through `linear`, the rest through F.linear as before; likewise every patch embedding
    (`nn.Conv2d` whose stride is its kernel, no padding) a `KernelPatchConv`, one row a patch. Returns how
    many."""
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in KERNEL_ROWS:
            module.__class__ = KernelLinear
        elif _is_patch_conv(module):
            module.__class__ = KernelPatchConv
        else:
            continue
        _check_weight(module.weight.reshape(module.weight.shape[0], -1))
        bias32 = None if module.bias is None else module.bias.detach().to(torch.float32).contiguous()
        module.register_buffer("bias32", bias32, persistent=False)  # the kernel sums in float32
        module.rows = KERNEL_ROWS[module.weight.dtype]
        routed += 1
    return routed


def _is_patch_conv(module: torch.nn.Module) -> bool:
    return (type(module) is torch.nn.Conv2d and module.weight.dtype in KERNEL_ROWS and module.groups == 1
            and tuple(module.stride) == tuple(module.kernel_size) and tuple(module.dilation) == (1, 1)
            and module.padding in ((0, 0), "valid") and module.padding_mode == "zeros"
            and module.weight.is_contiguous())


class KernelLinear(torch.nn.Linear):
    """A Linear layer whose inputs of `rows[0]` to `rows[1]` rows go through `linear`, reading the layer's own
    weight (one class for all, so that a compiled model sees the same code in every layer)."""

    bias32: torch.Tensor | None
    rows: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this some 200 times: only what the call needs (the weight was checked once).
        width = x.shape[-1]  # a wrong width goes to F.linear, which says so
        low, high = self.rows
        if (width == self.in_features and low * width <= x.numel() <= high * width and x.dtype in DTYPE_CODES
                and x.device.type == "cpu" and self.weight.dtype in DTYPE_CODES):
            if torch.compiler.is_compiling():  # an opaque operator in the graph (engine/compiled.py)
                return torch.ops.vlmcap.linear(x, self.weight, self.bias32)
            return _run_linear(load_variant(variant()), x, self.weight, self.bias32, None)
        return F.linear(x, self.weight, self.bias)


class KernelPatchConv(torch.nn.Conv2d):
    """A patch embedding (stride = kernel, no padding) as `linear` over the image's patches: each patch,
    flattened as the weight is ([channels, kh, kw]), is a row. The same sums as the convolution, in float32."""

    bias32: torch.Tensor | None
    rows: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kh, kw = self.kernel_size
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.dtype not in DTYPE_CODES or x.device.type != "cpu":
            return super().forward(x)
        batch, channels, height, width = x.shape
        rows_h, rows_w = (height - kh) // kh + 1, (width - kw) // kw + 1
        if not self.rows[0] <= batch * rows_h * rows_w <= self.rows[1] or torch.compiler.is_compiling():
            return super().forward(x)
        patches = (x[:, :, : rows_h * kh, : rows_w * kw].reshape(batch, channels, rows_h, kh, rows_w, kw)
                   .permute(0, 2, 4, 1, 3, 5).reshape(batch, rows_h * rows_w, channels * kh * kw))
        weight = self.weight.view(self.out_channels, -1)
        out = _run_linear(load_variant(variant()), patches, weight, self.bias32, None)
        return out.transpose(1, 2).reshape(batch, self.out_channels, rows_h, rows_w).contiguous()


@torch.library.custom_op("vlmcap::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward (engine/csrc/rms_norm.c): x / sqrt(mean(x^2) + eps) in float32, rounded to x's
    dtype, times `weight` (of x's dtype) and rounded again."""
    lib = _lib()
    if x.dtype not in DTYPE_CODES or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or x.device.type != "cpu":
        raise ValueError(f"rms_norm takes a CPU float32, bfloat16 or float16 input and a weight of its last "
                         f"dimension and dtype, got {x.dtype} {tuple(x.shape)} and {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return _run_norm(lib, x, weight, eps)


def _run_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    code = DTYPE_CODES[x.dtype]
    if lib.rms_norm(rows.data_ptr(), code, rows.shape[0], dim, weight.data_ptr(), code, eps, out.data_ptr(),
                    torch.get_num_threads()):
        raise MemoryError(f"rms_norm could not allocate its buffer ({dim} floats a thread)")
    return out


NORM_LLAMA, NORM_GEMMA = 0, 1  # kernels.h's norm flavors


@dataclass
class Norm:
    """One RMSNorm as rms_norm.c applies it: `weight` [dim] as the kernel reads it (Llama's own weight; Gemma's
    `1 + weight` in float32, made once), its epsilon and flavor (NORM_LLAMA: x * scale rounded to the input's dtype,
    times the weight, rounded again; NORM_GEMMA: x * scale * weight rounded once)."""

    weight: torch.Tensor
    eps: float
    flavor: int

    def __post_init__(self) -> None:
        if self.weight.dtype not in DTYPE_CODES or self.weight.dim() != 1 or not self.weight.is_contiguous():
            raise ValueError(f"a norm's weight is a contiguous 1-d float32, bfloat16 or float16 tensor, got "
                             f"{self.weight.dtype} {tuple(self.weight.shape)}")

    @property
    def args(self) -> NormArgs:
        """As the kernels read it (made on each use: a copy of the norm points at its own weight)."""
        return NormArgs(self.weight.data_ptr(), DTYPE_CODES[self.weight.dtype], self.flavor, self.eps)

    @staticmethod
    def of(module: torch.nn.Module | None) -> Norm | None:
        """`module`'s norm where its forward is LlamaRMSNorm's or Gemma's RMSNorm's code (None elsewhere)."""
        kind = type(module)
        if is_llama_norm(kind):
            return Norm(module.weight.detach(), float(module.variance_epsilon), NORM_LLAMA)
        if is_gemma_norm(kind):
            return Norm((1.0 + module.weight.detach().float()).contiguous(), float(module.eps), NORM_GEMMA)
        return None


def norm_args(norm: Norm | None) -> NormArgs:
    """`norm` as the kernels read it; None: a NULL weight, no norm."""
    return NormArgs() if norm is None else norm.args


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: Norm, out: torch.Tensor,
                 delta_norm: Norm | None = None) -> None:
    """h += delta (normalised by `delta_norm` first where given, rounded to h's dtype, as torch's add), then
    out = norm(h) (engine/csrc/rms_norm.c); all [rows, dim], contiguous, one dtype."""
    lib = _lib()
    rows, dim = h.shape
    if not (h.is_contiguous() and out.is_contiguous() and norm.weight.shape == (dim,) and out.shape == h.shape
            and out.dtype == h.dtype
            and h.dtype in DTYPE_CODES and (delta_norm is None or delta_norm.weight.shape == (dim,))
            and (delta is None or (delta.is_contiguous() and delta.shape == h.shape and delta.dtype == h.dtype))):
        raise ValueError(f"add_rms_norm takes contiguous [rows, {dim}] tensors of one dtype and weights of {dim}, "
                         f"got {h.dtype} {tuple(h.shape)}, out {out.dtype} {tuple(out.shape)}, weight "
                         f"{tuple(norm.weight.shape)}")
    if lib.add_rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(),
                        None if delta_norm is None else ctypes.byref(delta_norm.args), DTYPE_CODES[h.dtype], rows,
                        dim, ctypes.byref(norm.args), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"add_rms_norm could not allocate its buffer ({dim} floats a thread)")


def rope_store(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               q_norm: Norm | None = None, k_norm: Norm | None = None) -> None:
    """Rotary embedding of the queries (in place) and keys of qkv [T, (q_heads + 2 kv_heads) head_dim], keys and
    values written to the cache rows `slots` (int64 [T]) of [slots, kv_heads, head_dim] caches
    (engine/csrc/rope_store.c); cos and sin [T, head_dim] in qkv's dtype; each query and key head normalised by
    `q_norm` / `k_norm` before its rotation where given (Gemma 3)."""
    lib = _lib()
    tokens, width = qkv.shape
    if not (width == (q_heads + 2 * kv_heads) * head_dim and qkv.is_contiguous() and cos.shape == (tokens, head_dim)
            and sin.shape == cos.shape and cos.is_contiguous() and sin.is_contiguous() and cos.dtype == qkv.dtype
            and sin.dtype == qkv.dtype and slots.dtype == torch.int64 and slots.is_contiguous()
            and slots.shape == (tokens,) and key_cache.is_contiguous() and value_cache.is_contiguous()
            and key_cache.dtype == value_cache.dtype and key_cache.dtype in DTYPE_CODES
            and key_cache.shape[1:] == (kv_heads, head_dim)
            and all(norm is None or norm.weight.shape == (head_dim,) for norm in (q_norm, k_norm))):
        raise ValueError(f"rope_store got qkv {tuple(qkv.shape)} {qkv.dtype}, cos {tuple(cos.shape)} {cos.dtype}, "
                         f"slots {tuple(slots.shape)} {slots.dtype}, cache {tuple(key_cache.shape)} "
                         f"{key_cache.dtype} for {q_heads}/{kv_heads} heads of {head_dim}")
    norms = [None if norm is None else ctypes.byref(norm.args) for norm in (q_norm, k_norm)]
    if lib.rope_store(qkv.data_ptr(), DTYPE_CODES[qkv.dtype], tokens, width, q_heads, kv_heads, head_dim, *norms,
                      cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                      DTYPE_CODES[key_cache.dtype], torch.get_num_threads()):
        raise MemoryError(f"rope_store could not allocate its buffer ({6 * head_dim} floats a thread)")


def _norm_code(module_path: str, class_name: str) -> str | None:
    """The source of transformers' `class_name`.forward in `module_path` (None where it cannot be read)."""
    import importlib
    import inspect

    try:
        return inspect.getsource(getattr(importlib.import_module(module_path), class_name).forward)
    except (ImportError, AttributeError, OSError, TypeError):
        return None


def _computes(kind: type, module_path: str, class_name: str) -> bool:
    """Whether class `kind` is an RMSNorm whose forward is the code of transformers' `class_name` (a copy of it in
    another model counts)."""
    import inspect

    reference = _norm_code(module_path, class_name)
    try:
        return (reference is not None and kind.__name__.endswith("RMSNorm")
                and inspect.getsource(kind.forward) == reference)
    except (OSError, TypeError):
        return False


@functools.cache
def is_llama_norm(kind: type) -> bool:
    """Whether modules of class `kind` compute LlamaRMSNorm's forward (its copies in Qwen2, Mistral, ...)."""
    return kind is KernelRMSNorm or _computes(kind, "transformers.models.llama.modeling_llama", "LlamaRMSNorm")


@functools.cache
def is_gemma_norm(kind: type) -> bool:
    """Whether modules of class `kind` compute Gemma 3's RMSNorm's forward (x * (1 + weight) in float32)."""
    return _computes(kind, "transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm")


def route_norms(model: torch.nn.Module) -> int:
    """Make every norm of `model` whose forward is LlamaRMSNorm's own code (its copies in other models, such as
    Qwen2's and Mistral's, included; anything else, such as Gemma's 1 + weight, is left alone) a
    `KernelRMSNorm`. Returns how many."""
    if _library() is None:
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is not KernelRMSNorm and hasattr(module, "variance_epsilon") and is_llama_norm(type(module)):
            module.__class__ = KernelRMSNorm
            routed += 1
    return routed


class KernelRMSNorm(torch.nn.Module):
    """A LlamaRMSNorm (same parameters, same arithmetic) whose CPU forward is one C call."""

    weight: torch.nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight, dtype = self.weight, hidden_states.dtype
        if (hidden_states.device.type == "cpu" and dtype is weight.dtype and dtype in DTYPE_CODES
                and not torch.compiler.is_compiling()):
            return _run_norm(load_variant(variant()), hidden_states, weight, self.variance_epsilon)
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = hidden_states.to(torch.float32) * torch.rsqrt(variance + self.variance_epsilon)
        return weight * normed.to(hidden_states.dtype)
