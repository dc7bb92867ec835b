"""The CPU kernels (engine/csrc/) called from Python: each wrapper checks its tensors, says what it refuses
(ValueError naming the value), and calls the build `engine.cpu.build` loaded.

- `paged_decode_attention` (paged_decode.c): decode attention over the paged cache, read in place. The
  reference path gathers every context's blocks into a new tensor in every layer before SDPA reads it; on the
  CPU that copy costs as much as the attention itself, and grows with context.
- `linear` (linear.c): a Linear layer reading its weight where transformers keeps it (row-major, its own dtype: no
  second copy), four weight rows against six rows of x at a time; or an `Int8Weight` (engine/quantization.py,
  linear_int8.c: x quantized per row at the call, int32 products). A decode step's matrix products are a few rows
  times every weight of the model: their cost is reading the weights. Its `glu` mode computes a gated MLP's
  act(gate) * up from one matrix of both, act SiLU (Llama) or GELU's tanh approximation (Gemma)
  (engine/lean_layers.py). Where the build has AVX-512's bfloat16 dot products, `tuning.bf16_products` measures once
  whether they or float32 FMAs on widened weights are faster on this CPU and `products_mode` uses those. Registered
  as the `vlmcap::linear` operator, so that a compiled model sees it as one opaque call.
- `rms_norm` / `add_rms_norm` (rms_norm.c): an RMSNorm (Llama's, or Gemma's `1 + weight`: `routing.Norm`) in one
  call instead of seven small operators, and the residual add before it (Gemma's sandwich norm of the added output
  too).
- `rope_store` (rope_store.c): a layer's rotary embedding and KV cache write in one call (Gemma's per-head q and k
  norms before it).
- `decode_layers` (decode_layers.c): every lean decoder layer of a decode step in one call.
- `full_attention` (full_attention.c) and `gelu_tanh` (gelu.c): a vision tower layer's attention and MLP
  activation (engine/lean_vision.py).
- `chunk_attention` (full_attention.c): a causal prefill chunk's attention over the paged cache, read in place, by
  the vision kernel's tiles (engine/attention.py).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from engine.cpu import build
from engine.cpu.abi import (
    DTYPE_CODES,
    GLU_ACTIVATIONS,
    I8,
    OUTPUT_ACTIVATIONS,
    PRODUCTS_TILES,
    PRODUCTS_WIDEN,
    DecodeStepArgs,
    ProjectionArgs,
)
from engine.quantization import Int8Weight

if TYPE_CHECKING:
    from engine.cpu.routing import Norm

LOGITS = (torch.float32, torch.bfloat16)  # the sampling kernels' logits (a bfloat16 model's head, read as it wrote)


def cache_code(key_cache: torch.Tensor, value_cache: torch.Tensor,
               scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int | None, int | None]:
    """The [slots, kv_heads, d] caches' dtype code and their scales' data pointers (None, None: a cache of a float
    dtype), checked: contiguous caches of one dtype, float32, bfloat16 or float16, or int8 with contiguous float32
    scales [slots, kv_heads] (engine/kv_cache.py)."""
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"the key and value caches must be contiguous and of one dtype, got {key_cache.dtype} and "
                         f"{value_cache.dtype}")
    if key_cache.dtype in DTYPE_CODES and scales is None:
        return DTYPE_CODES[key_cache.dtype], None, None
    if key_cache.dtype != torch.int8 or scales is None:
        raise ValueError(f"the CPU kernels read a float32, bfloat16 or float16 KV cache, or an int8 one with its "
                         f"scales, got {key_cache.dtype} with{'' if scales is not None else 'out'} scales")
    if not all(s.dtype == torch.float32 and s.is_contiguous() and s.shape == key_cache.shape[:2] for s in scales):
        raise ValueError(f"an int8 cache's scales are contiguous float32 {tuple(key_cache.shape[:2])}, got "
                         f"{[(s.dtype, tuple(s.shape)) for s in scales]}")
    return I8, scales[0].data_ptr(), scales[1].data_ptr()


def paged_decode_attention(
    q: torch.Tensor, query_index: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float, window: int | None,
    out: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None, products: str | None = None,
) -> None:
    """Sequence i's query is q[:, query_index[i]] ([heads, tokens, d], any strides); it attends to its first
    `context_lens[i]` positions (the last `window` of them in a sliding-window layer), which lie in the cache
    blocks `block_tables[i]` of the [slots, kv_heads, d] caches, and its output goes to out[query_index[i]]
    ([tokens, heads, d], contiguous, q's dtype). Integer tensors are int64 and contiguous. An int8 cache comes
    with its key and value `scales` and is read back in q's dtype (engine/kv_cache.py's `dequantize_kv`).
    bfloat16 queries over a bfloat16 or int8 cache are scored by the products `products` names (None:
    tuning.bf16_products, as the Linear kernel's)."""
    lib = build.lib()
    if q.dtype not in DTYPE_CODES:
        raise ValueError(f"the CPU decode kernel takes float32, bfloat16 or float16 queries, got {q.dtype}")
    code, key_scales, value_scales = cache_code(key_cache, value_cache, scales)
    heads, _, d = q.shape
    kv_heads = key_cache.shape[1]
    if key_cache.shape[2] != d or heads % kv_heads:
        raise ValueError(f"cache rows {tuple(key_cache.shape[1:])} must be [kv_heads, d={d}] with "
                         f"kv_heads dividing the {heads} query heads")
    if out.dtype != q.dtype or not out.is_contiguous() or q.stride(2) != 1:
        raise ValueError("the output must be contiguous in q's dtype, and q's rows contiguous")
    failed = lib.paged_decode_attention(
        q.data_ptr(), DTYPE_CODES[q.dtype], q.stride(0), q.stride(1), query_index.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), key_scales, value_scales, code, block_tables.data_ptr(), context_lens.data_ptr(),
        query_index.shape[0], kv_heads, heads // kv_heads, d, block_size, block_tables.shape[1], float(scale),
        int(window or 0), out.data_ptr(), products_mode(lib, products), torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"paged decode attention refused its inputs (code {failed}): context lengths "
                         f"{context_lens.tolist()} must lie in 1..{block_tables.shape[1] * block_size} "
                         "(the block tables' reach)")


def check_weight(weight: torch.Tensor | Int8Weight) -> None:
    if isinstance(weight, Int8Weight):  # its own checks ran when it was made
        if weight.qweight.device.type != "cpu":
            raise ValueError(f"the Linear kernel reads CPU weights, got an int8 weight on {weight.qweight.device}")
        return
    if weight.dtype not in DTYPE_CODES or weight.dim() != 2 or weight.stride(1) != 1 or weight.device.type != "cpu":
        raise ValueError(f"the Linear kernel reads a 2-d CPU float32, bfloat16 or float16 weight with contiguous "
                         f"rows, got {weight.dtype} {tuple(weight.shape)} strides {weight.stride()} on "
                         f"{weight.device}")


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None,
           glu: str | None = None, out: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """x [..., k] @ weight [n, k]^T (+ bias, float32), summed in float32 and returned in x's dtype
    (engine/csrc/linear.c). With `glu` (an activation of `GLU_ACTIVATIONS`), weight is [gate; up] and the result
    act(x gate^T) * (x up^T), [..., n/2]. `out`, when given, receives the result (contiguous, x's dtype). An
    `Int8Weight`: x quantized per row at the call and the products summed in int32 (engine/csrc/linear_int8.c,
    engine/quantization.py's rule). `act` (one of `OUTPUT_ACTIVATIONS`, no glu): the result's activation, the
    same bits as `gelu_tanh(linear(x))`, in the int8 kernel's epilogue, after the float kernels' products.
    `residual` (the result's shape and dtype, contiguous) is added as torch's `residual + linear(x)` adds it (after
    `act`): in the int8 kernel's epilogue, after the float kernels' products."""
    check_weight(weight)
    if x.dtype not in DTYPE_CODES or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input {x.dtype} {tuple(x.shape)} does not fit a [{weight.shape[0]}, {weight.shape[1]}] "
                         "weight")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"the Linear kernel takes a contiguous float32 bias, got {bias.dtype}")
    if glu is not None and glu not in GLU_ACTIVATIONS:
        raise ValueError(f"glu is one of {list(GLU_ACTIVATIONS)} (the gate's activation), got {glu!r}")
    if glu and weight.shape[0] % 2:
        raise ValueError(f"a glu weight stacks gate and up rows: an even count, got {weight.shape[0]}")
    if act is not None and (act not in OUTPUT_ACTIVATIONS or glu is not None):
        raise ValueError(f"act is one of {list(OUTPUT_ACTIVATIONS)}, without glu, got {act!r} (glu {glu!r})")
    width = weight.shape[0] // 2 if glu else weight.shape[0]
    if residual is not None and (residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], width)
                                 or not residual.is_contiguous()):
        raise ValueError(f"a residual is the result's shape {(*x.shape[:-1], width)} and dtype {x.dtype}, "
                         f"contiguous, got {residual.dtype} {tuple(residual.shape)} "
                         f"(contiguous: {residual.is_contiguous()})")
    return run_linear(build.lib(), x, weight, bias, glu, out, residual=residual, act=act)


PRODUCTS = ("dot", "widen")  # bfloat16 products: vdpbf16ps, or float32 FMAs on widened weights


def run_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None,
               glu: str | None, out: torch.Tensor | None = None, products: str | None = None,
               residual: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """`linear` on inputs already checked (a layer's own weight: checked once, at routing); bfloat16 products
    as `products` says (None: tuning.bf16_products(lib))."""
    n, k = weight.shape
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    width = n // 2 if glu else n
    if out is None:
        out = torch.empty(*x.shape[:-1], width, dtype=x.dtype)
    mode = GLU_ACTIVATIONS[glu] if glu else OUTPUT_ACTIVATIONS[act] if act else 0
    if isinstance(weight, Int8Weight):  # no bfloat16 products to choose
        q = weight.qweight
        w, code, stride = q.data_ptr(), I8, q.stride(0)
        scale, sums = weight.scale.data_ptr(), weight.row_sums.data_ptr()
    else:
        w, code, stride, scale, sums = weight.data_ptr(), DTYPE_CODES[weight.dtype], weight.stride(0), None, None
        mode |= products_mode(lib, products)
    if lib.linear(rows.data_ptr(), DTYPE_CODES[x.dtype], rows.shape[0], k, w, code, stride, n,
                  None if bias is None else bias.data_ptr(), scale, sums, mode, out.data_ptr(),
                  None if residual is None else residual.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"the Linear kernel could not allocate its buffer ({rows.shape[0]} x {k} floats)")
    return out


_products: dict[int, str] = {}  # a loaded build's id -> its bfloat16 products (tuning.bf16_products)


def products_mode(lib: ctypes.CDLL, products: str | None = None) -> int:
    """linear()'s `mode` bit for bfloat16 products as `products` says (None: tuning.bf16_products(lib))."""
    if products is None:
        products = _products.get(id(lib))
        if products is None:
            from engine.cpu import tuning  # measures with run_linear, so imported when first needed

            products = _products[id(lib)] = tuning.bf16_products(lib)
    return PRODUCTS_WIDEN if products == "widen" else 0


ATTENTION_PRODUCTS = (*PRODUCTS, "tiles")  # attention's bfloat16 products: also AMX tiles (the AMX build's)


def attention_mode(lib: ctypes.CDLL, products: str | None = None) -> int:
    """full_attention's and chunk_attention's `mode` bits for bfloat16 products as `products` says: "tiles" (the
    default, None) takes the AMX tiles where the build has them (full_attention.c), else, as for a head size they
    do not take, the products tuning.bf16_products chose; "dot" and "widen" those products only."""
    tiles = products in (None, "tiles")
    return products_mode(lib, None if tiles else products) | (PRODUCTS_TILES if tiles else 0)


def projection_args(weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None) -> ProjectionArgs:
    """A layer's own weight (checked) and float32 bias as decode_layers.c reads them; an `Int8Weight` with its
    scales and row sums."""
    check_weight(weight)
    bias_at = None if bias is None else bias.data_ptr()
    if isinstance(weight, Int8Weight):
        q = weight.qweight
        return ProjectionArgs(q.data_ptr(), q.shape[0], q.shape[1], q.stride(0), bias_at, I8, weight.scale.data_ptr(),
                              weight.row_sums.data_ptr())
    return ProjectionArgs(weight.data_ptr(), weight.shape[0], weight.shape[1], weight.stride(0), bias_at,
                          DTYPE_CODES[weight.dtype], None, None)


def decode_layers(step: DecodeStepArgs, layers: ctypes.Array) -> None:
    """Every lean decoder layer of a decode step, then the final norm, in one call (engine/csrc/decode_layers.c;
    engine/lean_layers.py fills `step` and `layers`, whose tensors it checked): the layer-by-layer kernels'
    results, bit for bit."""
    lib = build.lib()
    step.mode = products_mode(lib)
    step.num_threads = torch.get_num_threads()
    failed = lib.decode_layers(ctypes.byref(step), layers, len(layers))
    if failed:
        layer, code = divmod(failed, 10)
        what = f"layer {layer - 1} of {len(layers)}" if layer <= len(layers) else "the final norm"
        lens = ctypes.cast(step.context_lens, ctypes.POINTER(ctypes.c_int64))[:step.num_seqs]
        if failed == 5:
            ids = ctypes.cast(step.ids, ctypes.POINTER(ctypes.c_int64))[:step.tokens]
            raise ValueError(f"decode_layers: token ids {ids} outside the embedding's {step.embedding_rows} rows")
        if code == 1:
            why = f"context lengths {lens} past the block tables' {step.table_width} x {step.block_size} positions"
        elif code == 4:
            positions = ctypes.cast(step.positions, ctypes.POINTER(ctypes.c_int64))[:step.tokens]
            why = f"rotary positions {positions} outside the tables' {step.rope_rows} rows"
        else:
            why = "out of memory"
        raise ValueError(f"decode_layers: a kernel of {what} refused its inputs: {why}")


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, products: str | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every position's attention to every position of its input, no mask (a vision tower's layer): q, k, v [batch,
    heads, n, d] views of one packed projection (the same strides, each row contiguous) -> [batch, n, heads, d],
    q's dtype (engine/csrc/full_attention.c), bfloat16 scores by the products `products` names (`attention_mode`;
    None: the AMX tiles where the build has them, else the Linear kernel's). Into `out` where given (that shape and
    dtype, its heads' rows contiguous and one after another: some heads of a wider tensor), else a new contiguous
    tensor. None where the kernel does not take these inputs (a head size it has no loop for, other strides), so
    that the caller runs SDPA."""
    batch, heads, n, d = q.shape
    if (q.dtype not in DTYPE_CODES or not q.dtype == k.dtype == v.dtype or not q.stride() == k.stride() == v.stride()
            or q.stride(3) != 1 or q.device.type != "cpu"):
        return None
    if out is None:
        out = torch.empty(batch, n, heads, d, dtype=q.dtype)
    elif tuple(out.shape) != (batch, n, heads, d) or out.dtype != q.dtype or out.stride()[2:] != (d, 1):
        raise ValueError(f"full attention's out is [{batch}, {n}, {heads}, {d}] {q.dtype} with contiguous heads, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    lib = build.lib()
    failed = lib.full_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), DTYPE_CODES[q.dtype], batch, heads, n, d,
                                q.stride(0), q.stride(1), q.stride(2), float(scale), out.data_ptr(), out.stride(0),
                                out.stride(1), attention_mode(lib, products), torch.get_num_threads())
    if failed == 2:
        raise MemoryError(f"full attention could not allocate its buffers ({n} positions of {d})")
    return None if failed else out


def chunk_attention(q: torch.Tensor, query_start: int, n: int, start: int, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_table: torch.Tensor, block_size: int, scale: float,
                    window: int | None, out: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    products: str | None = None) -> bool:
    """A causal prefill chunk's attention over the paged cache read in place (engine/csrc/full_attention.c): its n
    queries q[:, query_start : query_start + n] ([heads, tokens, d], rows contiguous), at positions start.., over the
    [slots, kv_heads, d] caches' blocks `block_table` (int64, contiguous), into out[query_start : query_start + n]
    ([tokens, heads, d], contiguous, q's dtype). An int8 cache comes with its key and value `scales` and is read
    back in q's dtype (as `paged_decode_attention` reads it). False, with nothing written, where the kernel does not
    take these inputs (a float cache of another dtype than q's, a head size it has no loop for), so that the caller
    runs its torch path. bfloat16 products as `full_attention`'s."""
    heads, _, d = q.shape
    kv_heads = key_cache.shape[1]
    if (q.dtype not in DTYPE_CODES or q.stride(2) != 1 or q.device.type != "cpu" or heads % kv_heads
            or key_cache.shape[2] != d or not out.is_contiguous() or out.dtype != q.dtype
            or block_table.dtype != torch.int64 or not block_table.is_contiguous()):
        return False
    code, key_scales, value_scales = cache_code(key_cache, value_cache, scales)
    lib = build.lib()
    failed = lib.chunk_attention(q.data_ptr(), DTYPE_CODES[q.dtype], q.stride(0), q.stride(1), query_start, n, start,
                                 key_cache.data_ptr(), value_cache.data_ptr(), key_scales, value_scales, code,
                                 block_table.data_ptr(), block_size, kv_heads, heads // kv_heads, d, float(scale),
                                 int(window or 0), out.data_ptr(), attention_mode(lib, products),
                                 torch.get_num_threads())
    if failed == 2:
        raise MemoryError(f"chunk attention could not allocate its buffers ({start + n} positions of {d})")
    return not failed


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """x (contiguous, float32, bfloat16 or float16, on the CPU) replaced in place by GELU's tanh approximation
    (transformers' "gelu_pytorch_tanh"), computed in float32; returns x."""
    if x.dtype not in DTYPE_CODES or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"gelu_tanh takes a contiguous CPU float32, bfloat16 or float16 tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device} (contiguous: {x.is_contiguous()})")
    if build.lib().gelu_tanh(x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), torch.get_num_threads()):
        raise MemoryError("gelu_tanh could not allocate its buffer")
    return x


def sample_rows(logits: torch.Tensor, index: torch.Tensor, top: torch.Tensor, inv_temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token for each row `index[r]` of float32 or bfloat16 logits [rows, vocab] (sampling.c: weights by the row's
    maximum `top[r]` and `inv_temperature[r]`, cut by `top_k[r]` (0: none) and `top_p[r]` (1: none), drawn at `u[r]`
    in [0, 1)); -1 for a row whose maximum is not finite. Per-row tensors: contiguous, on the CPU, index / top_k
    int64, top / inv_temperature / top_p float32, u float64; an index outside the logits is refused (by the kernel,
    before it draws)."""
    n = index.shape[0]
    wanted = ((index, torch.int64), (top, torch.float32), (inv_temperature, torch.float32), (top_k, torch.int64),
              (top_p, torch.float32), (u, torch.float64))
    if logits.dtype not in LOGITS or logits.dim() != 2 or not logits.is_contiguous() or logits.device.type != "cpu":
        raise ValueError(f"sample_rows takes contiguous CPU float32 or bfloat16 logits [rows, vocab], got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    for tensor, dtype in wanted:
        fits = tensor.dtype == dtype and tuple(tensor.shape) == (n,) and tensor.is_contiguous()
        if not fits or tensor.device.type != "cpu":
            raise ValueError(f"sample_rows' per-row arguments are contiguous CPU [{n}] tensors, one of {dtype} got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
    tokens = torch.empty(n, dtype=torch.int64)
    failed = build.lib().sample_rows(logits.data_ptr(), DTYPE_CODES[logits.dtype], logits.shape[1], logits.shape[0],
                                     index.data_ptr(), n, top.data_ptr(), inv_temperature.data_ptr(), top_k.data_ptr(),
                                     top_p.data_ptr(), u.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
    if failed == 3:
        raise ValueError(f"sample_rows' rows {index.tolist()} are not all within the logits' {logits.shape[0]}")
    if failed:
        raise MemoryError(f"sample_rows could not allocate its buffers for a vocabulary of {logits.shape[1]}")
    return tokens


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum of float32 or bfloat16 x [rows, vocab] (contiguous, CPU), as float32, and the index of its
    first occurrence (sampling.c: torch's max(dim=-1) rule, a NaN the largest)."""
    if x.dtype not in LOGITS or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"row_max takes contiguous CPU float32 or bfloat16 rows [rows, vocab], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    top, at = torch.empty(x.shape[0]), torch.empty(x.shape[0], dtype=torch.int64)
    if build.lib().row_max(x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], top.data_ptr(),
                           at.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"row_max could not allocate its threads' maxima for {x.shape[0]} rows")
    return top, at


def release_scratch() -> None:
    """The kernels' scratch buffers freed, the calling thread's and its team's (torch's thread count; the kernels'
    parallel regions run on the same pooled threads) (engine/csrc/scratch.c): start-up's timings grew them to
    shapes that steps may never run; steps grow them again to what they need. Not while a kernel runs."""
    build.lib().release_scratch(torch.get_num_threads())


@torch.library.custom_op("vlmcap::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("vlmcap::linear_int8", mutates_args=())
def _linear_int8_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` of an `Int8Weight` given as its three tensors (what a compiled model can pass to an operator)."""
    return linear(x, Int8Weight(qweight, scale, row_sums), bias)


@_linear_int8_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
      bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward (engine/csrc/rms_norm.c): x / sqrt(mean(x^2) + eps) in float32, rounded to x's
    dtype, times `weight` (of x's dtype) and rounded again."""
    lib = build.lib()
    if x.dtype not in DTYPE_CODES or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or x.device.type != "cpu":
        raise ValueError(f"rms_norm takes a CPU float32, bfloat16 or float16 input and a weight of its last "
                         f"dimension and dtype, got {x.dtype} {tuple(x.shape)} and {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return run_norm(lib, x, weight, eps)


def run_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    code = DTYPE_CODES[x.dtype]
    if lib.rms_norm(rows.data_ptr(), code, rows.shape[0], dim, weight.data_ptr(), code, eps, out.data_ptr(),
                    torch.get_num_threads()):
        raise MemoryError(f"rms_norm could not allocate its buffer ({dim} floats a thread)")
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: Norm, out: torch.Tensor,
                 delta_norm: Norm | None = None) -> None:
    """h += delta (normalised by `delta_norm` first where given, rounded to h's dtype, as torch's add), then
    out = norm(h) (engine/csrc/rms_norm.c); all [rows, dim], contiguous, one dtype."""
    lib = build.lib()
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
               q_norm: Norm | None = None, k_norm: Norm | None = None,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None,
               positions: torch.Tensor | None = None) -> None:
    """Rotary embedding of the queries (in place) and keys of qkv [T, (q_heads + 2 kv_heads) head_dim], keys and
    values written to the cache rows `slots` (int64 [T]) of [slots, kv_heads, head_dim] caches
    (engine/csrc/rope_store.c); cos and sin [T, head_dim] in qkv's dtype, or with `positions` (int64 [T]) tables
    [rows, head_dim] whose row positions[t] token t takes (engine/rotary_tables.py); each query and key head
    normalised by `q_norm` / `k_norm` before its rotation where given (Gemma 3). An int8 cache is written
    quantized, each row's scale into its `scales` (engine/kv_cache.py's `quantize_kv`)."""
    lib = build.lib()
    code, key_scales, value_scales = cache_code(key_cache, value_cache, scales)
    tokens, width = qkv.shape
    table_rows = tokens if positions is None else cos.shape[0]
    if not (width == (q_heads + 2 * kv_heads) * head_dim and qkv.is_contiguous()
            and cos.shape == (table_rows, head_dim) and sin.shape == cos.shape and cos.is_contiguous()
            and sin.is_contiguous() and cos.dtype == qkv.dtype and sin.dtype == qkv.dtype
            and all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (tokens,)
                    for t in (slots, positions) if t is not None)
            and key_cache.shape[1:] == (kv_heads, head_dim)
            and all(norm is None or norm.weight.shape == (head_dim,) for norm in (q_norm, k_norm))):
        raise ValueError(f"rope_store got qkv {tuple(qkv.shape)} {qkv.dtype}, cos {tuple(cos.shape)} {cos.dtype}, "
                         f"slots {tuple(slots.shape)} {slots.dtype}, positions "
                         f"{None if positions is None else (tuple(positions.shape), positions.dtype)}, cache "
                         f"{tuple(key_cache.shape)} {key_cache.dtype} for {q_heads}/{kv_heads} heads of {head_dim}")
    norms = [None if norm is None else ctypes.byref(norm.args) for norm in (q_norm, k_norm)]
    failed = lib.rope_store(qkv.data_ptr(), DTYPE_CODES[qkv.dtype], tokens, width, q_heads, kv_heads, head_dim,
                            *norms, cos.data_ptr(), sin.data_ptr(), None if positions is None else positions.data_ptr(),
                            table_rows, slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_scales,
                            value_scales, code, torch.get_num_threads())
    if failed == 4:
        raise ValueError(f"rope_store got positions {positions.tolist()} outside its tables' {table_rows} rows")
    if failed:
        raise MemoryError(f"rope_store could not allocate its buffer ({6 * head_dim} floats a thread)")
