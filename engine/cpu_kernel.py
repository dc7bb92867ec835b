"""The CPU's C kernels, for the steps a server spends most of its time in: decodes.

- `paged_decode_attention` (engine/paged_decode.c): decode attention over the paged cache, read in place.
  The reference path gathers every context's blocks into a new tensor in every layer before SDPA reads it;
  on the CPU that copy costs as much as the attention itself, and grows with context.
- `small_linear` (engine/small_linear.c): a Linear layer reading its weights in their own dtype from panels
  packed once (`pack_weight`), six rows of x against sixteen weight rows at a time. A decode step's matrix
  products are a few rows times every weight of the model: their cost is reading the weights, which the
  general GEMMs torch calls do at a fraction of the memory's bandwidth here; bfloat16 ones also run several
  times slower on CPUs without bfloat16 instructions, at any row count. `route_linears` sends a model's Linear
  layers through it where it is faster (`KERNEL_ROWS`); each keeps its packed copy beside its weight.
- Patch embeddings (a Conv2d whose stride is its kernel, as vision towers cut images into patches) are a Linear
  over the image's patches: `route_linears` sends them through `small_linear` too (torch's bfloat16 conv2d
  takes over a second for one 512 px tile on a 2-core AVX2 CPU; float32, 22 ms).
- `rms_norm` (engine/rms_norm.c): Llama's RMSNorm in one call instead of seven small operators, each of which
  costs more to dispatch than to run on a decode step's few rows; `route_norms` swaps it in for every norm
  whose forward is LlamaRMSNorm's own code.

They are compiled once per source and machine with the system's C compiler (`CC`, else `cc`) into
`<tmp>/vlmcap-kernels/` on first use, and share torch's OpenMP runtime; where no compiler is found,
`available()` is False and the engine keeps torch's own operations.
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
import torch.nn.functional as F

log = logging.getLogger(__name__)

FOLDER = Path(__file__).with_name("csrc")
SOURCES = [FOLDER / "paged_decode.c", FOLDER / "small_linear.c", FOLDER / "rms_norm.c"]
HEADERS = [FOLDER / "dtypes.h"]
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
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "vlmcap-kernels"
    library = folder / f"vlmcap-cpu-{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{library.name}.{os.getpid()}"
        done = subprocess.run([compiler, *FLAGS, f"-I{FOLDER}", *map(str, SOURCES), "-o", str(partial), "-lm"],
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
        pointer, ctypes.c_int, i64, i64, pointer, pointer, pointer, ctypes.c_int, pointer, pointer, i64, i64, i64,
        i64, i64, i64, ctypes.c_float, i64, pointer, ctypes.c_int,
    ]
    lib.small_linear.restype = ctypes.c_int
    lib.small_linear.argtypes = [pointer, ctypes.c_int, i64, i64, pointer, ctypes.c_int, i64, pointer, pointer,
                                 ctypes.c_int]
    lib.pack_panels.restype = None
    lib.pack_panels.argtypes = [pointer, ctypes.c_int, i64, i64, pointer]
    lib.rms_norm.restype = ctypes.c_int
    lib.rms_norm.argtypes = [pointer, ctypes.c_int, i64, i64, pointer, ctypes.c_int, ctypes.c_float, pointer,
                             ctypes.c_int]
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
    q: torch.Tensor, query_index: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float, window: int | None,
    out: torch.Tensor,
) -> None:
    """Sequence i's query is q[:, query_index[i]] ([heads, tokens, d], any strides); it attends to its first
    `context_lens[i]` positions (the last `window` of them in a sliding-window layer), which lie in the cache
    blocks `block_tables[i]` of the [slots, kv_heads, d] caches, and its output goes to out[query_index[i]]
    ([tokens, heads, d], contiguous, q's dtype). Integer tensors are int64 and contiguous."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (no C compiler); use the reference path")
    if key_cache.dtype not in _DTYPES or key_cache.dtype != value_cache.dtype or q.dtype not in _DTYPES:
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
        q.data_ptr(), _DTYPES[q.dtype], q.stride(0), q.stride(1), query_index.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), _DTYPES[key_cache.dtype], block_tables.data_ptr(), context_lens.data_ptr(),
        query_index.shape[0], kv_heads, heads // kv_heads, d, block_size, block_tables.shape[1], float(scale),
        int(window or 0), out.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"paged decode attention refused its inputs (code {failed}): context lengths "
                         f"{context_lens.tolist()} must lie in 1..{block_tables.shape[1] * block_size} "
                         "(the block tables' reach)")


PANEL = 16  # weight rows per packed panel (NR in engine/csrc/small_linear.c)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] as the kernel's panels, [ceil(n / 16), k, 16] in its dtype: panel p, step t holds
    weight[16 p : 16 p + 16, t] (zeros past n). Made once per layer; `small_linear` reads only these."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (no C compiler)")
    if weight.dtype not in _DTYPES or weight.dim() != 2:
        raise ValueError(f"pack_weight takes a 2-d float32, bfloat16 or float16 weight, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    panels = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=weight.dtype)
    lib.pack_panels(weight.data_ptr(), _DTYPES[weight.dtype], n, k, panels.data_ptr())
    return panels


def packed_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ weight [n, k]^T (+ bias) from `pack_weight(weight)`, summed in float32 and returned in x's
    dtype (engine/small_linear.c). `bias` is float32."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (no C compiler)")
    count, k, width = panels.shape
    if panels.dtype not in _DTYPES or x.dtype not in _DTYPES or width != PANEL or not panels.is_contiguous():
        raise ValueError(f"packed_linear reads contiguous float32, bfloat16 or float16 panels [*, k, {PANEL}] "
                         f"and input, got panels {panels.dtype} {tuple(panels.shape)} and input {x.dtype}")
    if not (count - 1) * PANEL < n <= count * PANEL or x.shape[-1] != k:
        raise ValueError(f"{count} panels of {k} cannot hold a [{n}, {k}] weight for input {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"small_linear takes a contiguous float32 bias, got {bias.dtype}")
    return _run_packed(lib, x, panels, n, bias)


def _run_packed(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`packed_linear` on inputs already checked (a layer's own panels: checked once, at routing)."""
    k = panels.shape[1]
    rows = x.reshape(-1, k).contiguous()  # no copy when it already is
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    if lib.small_linear(rows.data_ptr(), _DTYPES[x.dtype], rows.shape[0], k, panels.data_ptr(),
                        _DTYPES[panels.dtype], n, None if bias is None else bias.data_ptr(), out.data_ptr(),
                        torch.get_num_threads()):
        raise MemoryError(f"small_linear could not allocate its buffer ({rows.shape[0]} x {k} floats)")
    return out


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`packed_linear` with the weight packed for this call alone (a layer packs once: `route_linears`)."""
    return packed_linear(x, pack_weight(weight), weight.shape[0], bias)


# Most rows of x for which `small_linear` beats torch's GEMM, by weight dtype (measured on a 2-core AVX2 CPU
# with the first, unpacked kernel: float32 weights to 16 rows, beyond which MKL's blocking won; bfloat16 and
# float16 at any count, their general GEMM lacking fast kernels there; not remeasured for float32 panels).
KERNEL_ROWS: dict[torch.dtype, int] = {torch.float32: 16, torch.bfloat16: 1 << 30, torch.float16: 1 << 30}


def route_linears(model: torch.nn.Module) -> int:
    """Make every `nn.Linear` of `model` a `KernelLinear` (its weights untouched): inputs of at most
    `KERNEL_ROWS` rows go through `small_linear`, the rest through F.linear as before; likewise every patch
    embedding (`nn.Conv2d` whose stride is its kernel, no padding) a `KernelPatchConv`, one row a patch.
    Returns how many."""
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in KERNEL_ROWS:
            module.__class__ = KernelLinear
        elif _is_patch_conv(module):
            module.__class__ = KernelPatchConv
        else:
            continue
        bias32 = None if module.bias is None else module.bias.detach().to(torch.float32).contiguous()
        module.register_buffer("bias32", bias32, persistent=False)  # the kernel sums in float32
        module.register_buffer("panels", None, persistent=False)
        _pack(module)
        module.max_rows = KERNEL_ROWS[module.weight.dtype]
        routed += 1
    return routed


def _is_patch_conv(module: torch.nn.Module) -> bool:
    return (type(module) is torch.nn.Conv2d and module.weight.dtype in KERNEL_ROWS and module.groups == 1
            and tuple(module.stride) == tuple(module.kernel_size) and tuple(module.dilation) == (1, 1)
            and module.padding in ((0, 0), "valid") and module.padding_mode == "zeros")


class KernelLinear(torch.nn.Linear):
    """A Linear layer whose few-row inputs go through `small_linear` (one class for all, so that a compiled
    model sees the same code in every layer). Its panels are a copy of its weight: an in-place change of the
    weight (one that bumps its version, as `weight[i] = ...` or `weight.copy_(...)` under `torch.no_grad()` do;
    writes through `weight.data` bypass versions, by torch's design) repacks them at the next eager call."""

    bias32: torch.Tensor | None
    panels: torch.Tensor
    packed_version: int  # the weight's version when the panels were packed
    max_rows: int  # KERNEL_ROWS for its weights' dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this some 200 times: only what the call needs (the panels were checked once).
        width = x.shape[-1]  # a wrong width goes to F.linear, which says so
        if (width == self.in_features and x.numel() <= self.max_rows * width and x.dtype in _DTYPES
                and x.device.type == "cpu"):
            if torch.compiler.is_compiling():  # an opaque operator in the graph (engine/compiled.py)
                return torch.ops.vlmcap.packed_linear(x, self.panels, self.out_features, self.bias32)
            _repack_if_changed(self)
            return _run_packed(_state["lib"], x, self.panels, self.out_features, self.bias32)
        return F.linear(x, self.weight, self.bias)


def _pack(module: torch.nn.Module) -> None:
    """`module.panels` from its weight (one row per output: a convolution's filters flattened) and the weight's
    version they were packed at."""
    weight = module.weight
    module.panels = pack_weight(weight.reshape(weight.shape[0], -1))
    module.packed_version = weight._version


def _repack_if_changed(module: torch.nn.Module) -> None:
    """Pack `module`'s weight again if it changed in place since it was packed."""
    if module.weight._version != module.packed_version:
        _pack(module)


class KernelPatchConv(torch.nn.Conv2d):
    """A patch embedding (stride = kernel, no padding) as `small_linear` over the image's patches: each patch,
    flattened as the weight is ([channels, kh, kw]), is a row. The same sums as the convolution, in float32."""

    bias32: torch.Tensor | None
    panels: torch.Tensor
    packed_version: int
    max_rows: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kh, kw = self.kernel_size
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.dtype not in _DTYPES or x.device.type != "cpu":
            return super().forward(x)
        batch, channels, height, width = x.shape
        rows_h, rows_w = (height - kh) // kh + 1, (width - kw) // kw + 1
        if batch * rows_h * rows_w > self.max_rows or torch.compiler.is_compiling():
            return super().forward(x)
        _repack_if_changed(self)
        patches = (x[:, :, : rows_h * kh, : rows_w * kw].reshape(batch, channels, rows_h, kh, rows_w, kw)
                   .permute(0, 2, 4, 1, 3, 5).reshape(batch, rows_h * rows_w, channels * kh * kw))
        out = _run_packed(_state["lib"], patches, self.panels, self.out_channels, self.bias32)
        return out.transpose(1, 2).reshape(batch, self.out_channels, rows_h, rows_w).contiguous()


@torch.library.custom_op("vlmcap::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, panels, n, bias)


@_packed_linear_op.register_fake
def _(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward (engine/rms_norm.c): x / sqrt(mean(x^2) + eps) in float32, rounded to x's dtype,
    times `weight` (of x's dtype) and rounded again."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (no C compiler)")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or x.device.type != "cpu":
        raise ValueError(f"rms_norm takes a CPU float32, bfloat16 or float16 input and a weight of its last "
                         f"dimension and dtype, got {x.dtype} {tuple(x.shape)} and {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return _run_norm(lib, x, weight, eps)


def _run_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    code = _DTYPES[x.dtype]
    if lib.rms_norm(rows.data_ptr(), code, rows.shape[0], dim, weight.data_ptr(), code, eps, out.data_ptr(),
                    torch.get_num_threads()):
        raise MemoryError(f"rms_norm could not allocate its buffer ({dim} floats a thread)")
    return out


def _llama_norm_code() -> str | None:
    """The source of LlamaRMSNorm's forward, which `KernelRMSNorm` computes (None where it cannot be read)."""
    import inspect

    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return inspect.getsource(LlamaRMSNorm.forward)
    except (ImportError, OSError, TypeError):
        return None


def route_norms(model: torch.nn.Module) -> int:
    """Make every norm of `model` whose forward is LlamaRMSNorm's own code (its copies in other models, such as
    Qwen2's and Mistral's, included; anything else, such as Gemma's 1 + weight, is left alone) a
    `KernelRMSNorm`. Returns how many."""
    import inspect

    reference = _llama_norm_code()
    if reference is None or _library() is None:
        return 0
    routed = 0
    same: dict[type, bool] = {}
    for module in model.modules():
        kind = type(module)
        if kind not in same:
            try:
                same[kind] = (kind.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
                              and inspect.getsource(kind.forward) == reference)
            except (OSError, TypeError):
                same[kind] = False
        if same[kind]:
            module.__class__ = KernelRMSNorm
            routed += 1
    return routed


class KernelRMSNorm(torch.nn.Module):
    """A LlamaRMSNorm (same parameters, same arithmetic) whose CPU forward is one C call."""

    weight: torch.nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight, dtype = self.weight, hidden_states.dtype
        if (hidden_states.device.type == "cpu" and dtype is weight.dtype and dtype in _DTYPES
                and not torch.compiler.is_compiling()):
            return _run_norm(_state["lib"], hidden_states, weight, self.variance_epsilon)
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = hidden_states.to(torch.float32) * torch.rsqrt(variance + self.variance_epsilon)
        return weight * normed.to(hidden_states.dtype)
