"""The engine's attention, registered with transformers' `AttentionInterface`.

Stock transformers decoder layers compute queries, keys and values (with their rotary embedding) for the
packed batch of one step and hand them to this function. It writes the new keys and values into the paged
cache, then lets each sequence's queries attend over that sequence's cached keys with a causal mask in
absolute positions: a query at position p sees keys 0..p (and, in a sliding-window layer, only keys more
than `window` behind it are hidden).

Three paths compute the same function; the step's `AttentionBatch.attend` is the one that runs (set by the
backend that built the batch, engine/attention_backends.py, where the choice is made once):
- **triton** (`triton_attention`, `PagedKernelMetadata`; `attention_backend="kernel"`): one call per layer for
  the whole mixed batch of decodes and prefill chunks, reading keys and values from the cache blocks in place
  (engine/paged_kernel.py, a Triton kernel: CUDA in bfloat16/float16). Every step of a decode-only batch has the
  same shapes, so it can be captured in a CUDA graph.
- **reference** (`reference_attention`, `DecodeGroup`, `PrefillSpan`): keys and values gathered a whole block at
  a time, then SDPA; decodes in padded batches of similar context length, prefill chunks one by one, with
  explicit masks where a chunk is not plain causal (a chunk after the first, image tokens that attend both ways,
  sliding windows). float32 anywhere, and everything on the CPU; the exactness reference.
- **cpu** (`cpu_attention`): every decode of the step in one call of a small C kernel that reads the cache
  blocks in place (engine/cpu/ops.py): on the CPU the gather's copy costs as much as the attention, and grows
  with context. A short chunk's queries go with them, each a decode whose context ends at its own position
  (its chunk's keys are in the cache before attention runs): what a causal mask computes, without the
  prefill path's pieces a layer. Longer prefill chunks go to the CPU's chunk kernel (engine/csrc/full_attention.c:
  the vision tower's tiles, the keys a task's queries see packed once from their cache blocks, each query's
  unseen keys hidden), sliding windows and int8 caches included. Where it does not take a chunk (a head size of
  no vector width) the chunk reads the cache in place by torch's flash kernel (`PrefillSpan.prefix_runs`): the
  keys before the chunk, which every query of the chunk sees, as views of runs of consecutive cache blocks, no
  mask; the chunk's own keys (copied: as many as the chunk's tokens) with the chunk's causal mask; the pieces'
  results merged by their log-sum-exp, as flash attention merges blocks. Sliding-window layers, and a prefix in
  more than `MAX_PREFIX_RUNS` runs, then take the reference's gather.

An int8 cache (engine/kv_cache.py) passes each path its layer's scales (`scales`: the key and value scales,
[slots, kv_heads] float32): the CPU's decode kernel and the Triton kernel read the int8 rows in place, the torch
paths dequantize what they gather (a chunk's own keys, its prefix's runs), the model dtype's values either way, so
each path computes what it computes on a cache of the model's dtype holding them.

Every tensor here was built once per step by the model runner and shared by all layers; nothing here reads a
device value back to the host.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.cpu import build
from engine.cpu.ops import chunk_attention, paged_decode_attention
from engine.kv_cache import KVCache, dequantize_kv

log = logging.getLogger(__name__)

# An int8 cache's key and value scales of one layer ([slots, kv_heads] float32 each); None: a cache of the model's
# dtype.
Scales = tuple[torch.Tensor, torch.Tensor] | None

ATTN_IMPLEMENTATION = "vlmcap_paged"
# A prefix cached in more runs of consecutive blocks than this is gathered instead (one attention call a run).
MAX_PREFIX_RUNS = 8
# The chunk `chunk_kernel_wins` times: its queries and the position it ends at.
CHECK_CHUNK, CHECK_END = 128, 1024
# Bytes written before each call `cold_seconds` times (more than the CPU's caches hold).
COLD_BYTES = 64 << 20


@dataclass
class PrefillSpan:
    """One prefill chunk in the packed batch: queries [query_start, query_end) over the sequence's first
    `context_len` cached positions, which lie in the cache blocks `block_table`."""

    query_start: int
    query_end: int
    block_table: torch.Tensor  # [blocks]
    context_len: int
    mask: torch.Tensor | None  # [q, context_len] bool; None for plain causal attention over the chunk alone
    sliding_mask: torch.Tensor | None = None  # `mask` within the sliding window, for models that have one
    # The CPU path's in-place reading: the positions before the chunk as runs (first cache slot, count) of
    # consecutive slots; the chunk's own slots [q] and what its queries see of its own keys ([1, 1, q, q], 0 or
    # -inf in the model's dtype, built once a step; None: causal). None: keys and values gathered (the reference).
    prefix_runs: list[tuple[int, int]] | None = None
    own_slots: torch.Tensor | None = None
    own_mask: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Sequences with one query each, attended in one batch: padded to its longest context and masked (the
    reference path), or, with `context_lens` set, read in place by the CPU's decode kernel (no masks)."""

    query_index: torch.Tensor  # [B] packed index of each sequence's query
    block_tables: torch.Tensor  # [B, max_blocks] padded with block 0
    mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True where a key is real
    sliding_mask: torch.Tensor | None = None  # `mask` within the sliding window, for models that have one
    context_lens: torch.Tensor | None = None  # [B] keys of each sequence, for engine/cpu/ops.py


@dataclass
class PagedKernelMetadata:
    """The whole batch as the paged kernel reads it: sequence i's queries are packed rows
    query_start_loc[i]..query_start_loc[i+1]-1, the last of its seq_lens[i] positions; its keys lie in the
    cache blocks block_table[i, :]."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    num_seqs: int


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[slots, kv_heads, d] cache, [..., blocks] tables -> [..., kv_heads, blocks * block_size, d]. Whole
    blocks are copied, not one position at a time."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])[block_tables]  # [..., blocks, block_size, kv, d]
    return blocks.flatten(-4, -3).transpose(-3, -2)


def _read(cache: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
          rows: torch.Tensor | slice | None = None, block_tables: torch.Tensor | None = None,
          block_size: int = 0) -> torch.Tensor:
    """The cache's values in `dtype`: its rows `rows` ([n, kv_heads, d]) or the blocks `block_tables` gathered
    (`gather_blocks`' layout), an int8 cache's dequantized with `scales`."""
    if block_tables is not None:
        values = gather_blocks(cache, block_tables, block_size)
        if scales is None:
            return values.to(dtype)
        return dequantize_kv(values, gather_blocks(scales[..., None], block_tables, block_size)[..., 0], dtype)
    if scales is None:
        return cache[rows]
    return dequantize_kv(cache[rows], scales[rows], dtype)


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[kv_heads, n, d] -> [heads, n, d] for grouped-query attention."""
    groups = num_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[heads, n, d] -> [kv_heads, groups * n, d]: the query heads that share a KV head become its rows,
    so keys and values are read once per KV head instead of being repeated for every query head."""
    heads, n, d = q.shape
    return q.reshape(kv_heads, heads // kv_heads * n, d)


def _pick(item: PrefillSpan | DecodeGroup, sliding: bool) -> torch.Tensor | None:
    if not sliding:
        return item.mask
    if item.sliding_mask is None:
        raise RuntimeError("a sliding-window layer got no sliding-window mask (the adapter's sliding_window)")
    return item.sliding_mask


def reference_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch, window: int | None,
    scaling: float | None, out: torch.Tensor | None = None, scales: Scales = None,
) -> torch.Tensor:
    """[heads, T, d] queries -> [T, heads, d] (into `out` when given: contiguous, q's dtype): gathered keys and
    values, SDPA per decode group and per chunk."""
    out = _output(q, out)
    for group in batch.decodes:
        _gathered_decodes(q, key_cache, value_cache, batch, group, window, scaling, out, scales)
    for span in batch.prefills:
        out[span.query_start : span.query_end] = _gathered_prefill(q, key_cache, value_cache, batch, span, window,
                                                                   scaling, scales)
    return out


def cpu_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch, window: int | None,
    scaling: float | None, out: torch.Tensor | None = None, scales: Scales = None,
) -> torch.Tensor:
    """As `reference_attention`, reading the cache in place: each decode group (its `context_lens`) through the
    CPU's decode kernel, straight from q into out; each prefill chunk by `cpu_prefill`."""
    out = _output(q, out)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    for group in batch.decodes:
        paged_decode_attention(q, group.query_index, key_cache, value_cache, group.block_tables, group.context_lens,
                               batch.kv_cache.block_size, scale, window, out, scales)
    for span in batch.prefills:
        cpu_prefill(q, key_cache, value_cache, span, batch.kv_cache.block_size, window, scaling, out, scales, batch)
    return out


def cpu_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, span: PrefillSpan,
                block_size: int, window: int | None, scaling: float | None, out: torch.Tensor, scales: Scales = None,
                batch: AttentionBatch | None = None) -> None:
    """One causal chunk of the CPU path into its rows of out: by the chunk kernel where it takes the chunk (a cache of
    q's dtype or int8, a head size of its vectors) and was the faster here (`chunk_kernel_wins`), else, with
    `prefix_runs` (and a cache of the model's dtype, or int8: `batch` says), by `_prefill_in_place`, else gathered
    (which needs `batch`)."""
    n = span.query_end - span.query_start
    heads, _, d = q.shape
    scale = scaling if scaling is not None else d ** -0.5
    if (span.own_mask is None and chunk_kernel_wins(build.variant(), q.dtype, heads, key_cache.shape[1], d, block_size)
            and chunk_attention(q, span.query_start, n, span.context_len - n, key_cache, value_cache,
                                span.block_table, block_size, scale, window, out, scales)):
        return
    rows = slice(span.query_start, span.query_end)
    if span.prefix_runs is not None and window is None and (batch is None or batch.kv_cache.model_dtype == q.dtype):
        out[rows] = _prefill_in_place(q, key_cache, value_cache, span, scaling, scales)
    else:
        assert batch is not None, "a gathered chunk needs its batch"
        out[rows] = _gathered_prefill(q, key_cache, value_cache, batch, span, window, scaling, scales)


def cold_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """The median of `repeats` timed calls of `fn` (after one untimed), each after `COLD_BYTES` are written, so
    that it reads its inputs from memory as a step's layer does (the other layers' weights and keys in between),
    not from the CPU's caches."""
    flush = torch.zeros(COLD_BYTES // 4)
    fn()
    times = []
    for _ in range(repeats):
        flush.add_(1.0)
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def timing_chunk(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, queries: int,
                 end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PrefillSpan]:
    """What the start-up timings of the CPU path run (`chunk_kernel_wins`, engine/attention_backends.py's
    `rows_context`): random queries [heads, queries, d] of a chunk ending at position `end`, a cache of `end`
    positions in consecutive blocks (keys, values [slots, kv_heads, d]), an output [queries, heads, d], and the
    chunk's span (its block table; its prefix as one run)."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(end + block_size, kv_heads, head_dim, generator=generator).to(dtype)
                    for _ in range(2))
    q = torch.randn(heads, queries, head_dim, generator=generator).to(dtype)
    out = torch.empty(queries, heads, head_dim, dtype=dtype)
    start = end - queries
    span = PrefillSpan(0, queries, torch.arange(-(-end // block_size)), end, None, prefix_runs=[(0, start)],
                       own_slots=torch.arange(start, end))
    return q, keys, values, out, span


@functools.cache
@torch.inference_mode()
def chunk_kernel_wins(variant: str | None, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                      block_size: int) -> bool:
    """Whether the chunk kernel of CPU kernel build `variant` (engine/cpu/build.py) takes a chunk of these shapes
    and attended `CHECK_CHUNK` queries ending at `CHECK_END` positions faster than torch's flash kernel by pieces
    (`_prefill_in_place`, one run of prefix), here, on a cache read from memory (`cold_seconds`). Timed once per
    build and shape, with the caller's threads (the step thread's, at the first chunk), and logged: where the build's
    vectors are narrow, torch's own kernels can be the faster."""
    q, keys, values, out, span = timing_chunk(dtype, heads, kv_heads, head_dim, block_size, CHECK_CHUNK, CHECK_END)
    start, scale, table = CHECK_END - CHECK_CHUNK, head_dim ** -0.5, span.block_table
    if not chunk_attention(q, 0, CHECK_CHUNK, start, keys, values, table, block_size, scale, None, out):
        return False
    kernel = cold_seconds(lambda: chunk_attention(q, 0, CHECK_CHUNK, start, keys, values, table, block_size, scale,
                                                  None, out))
    pieces = cold_seconds(lambda: _prefill_in_place(q, keys, values, span, scale))
    log.info("prefill attention (%d queries at %d positions, %d heads over %d KV heads of %d, %s, %s build): the CPU "
             "kernel %.2f ms, torch's flash kernel by pieces %.2f ms: %s", CHECK_CHUNK, CHECK_END, heads, kv_heads,
             head_dim, dtype, variant, kernel * 1e3, pieces * 1e3, "the kernel" if kernel < pieces else "torch's")
    return kernel < pieces


def triton_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch, window: int | None,
    scaling: float | None, out: torch.Tensor | None = None, scales: Scales = None,
) -> torch.Tensor:
    """The whole batch in one launch of the paged Triton kernel (`batch.kernel`) -> [T, heads, d]."""
    from engine.paged_kernel import paged_attention

    if batch.kernel is None:
        raise RuntimeError("the Triton attention path got no paged-kernel metadata (AttentionBatch.kernel)")
    attended = paged_attention(q.transpose(0, 1), key_cache, value_cache, batch.kernel, batch.kv_cache.block_size,
                               scaling, window, scales=scales)
    if out is None:
        return attended
    out.copy_(attended)
    return out


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device) if out is None else out


def _gathered_decodes(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch,
                      group: DecodeGroup, window: int | None, scaling: float | None, out: torch.Tensor,
                      scales: Scales = None) -> None:
    """One padded decode group: its contexts' blocks gathered, SDPA with its mask, into out's rows."""
    num_heads, kv_heads = q.shape[0], key_cache.shape[1]
    block_size = batch.kv_cache.block_size
    rows = group.query_index.shape[0]
    dq = q[:, group.query_index].transpose(0, 1).reshape(rows, kv_heads, num_heads // kv_heads, -1)
    key_scales, value_scales = scales or (None, None)
    dk = _read(key_cache, key_scales, q.dtype, block_tables=group.block_tables, block_size=block_size)
    dv = _read(value_cache, value_scales, q.dtype, block_tables=group.block_tables, block_size=block_size)
    o = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=_pick(group, window is not None), scale=scaling)
    out[group.query_index] = o.reshape(rows, num_heads, -1)


def _gathered_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch,
                      span: PrefillSpan, window: int | None, scaling: float | None,
                      scales: Scales = None) -> torch.Tensor:
    """One prefill chunk over its gathered context -> [n, heads, d]."""
    num_heads, kv_heads = q.shape[0], key_cache.shape[1]
    block_size = batch.kv_cache.block_size
    pq = q[:, span.query_start : span.query_end]  # [heads, n, d]
    n = pq.shape[1]
    key_scales, value_scales = scales or (None, None)
    pk = _read(key_cache, key_scales, q.dtype, block_tables=span.block_table, block_size=block_size)
    pv = _read(value_cache, value_scales, q.dtype, block_tables=span.block_table, block_size=block_size)
    pk, pv = pk[:, : span.context_len], pv[:, : span.context_len]
    mask = _pick(span, window is not None)
    if mask is None:  # the chunk is the whole context so far: plain causal attention
        o = F.scaled_dot_product_attention(pq, _expand_kv(pk, num_heads), _expand_kv(pv, num_heads),
                                           is_causal=True, scale=scaling)
    else:
        mask = mask.repeat(num_heads // kv_heads, 1)
        o = F.scaled_dot_product_attention(_by_kv_head(pq, kv_heads), pk, pv, attn_mask=mask, scale=scaling)
        o = o.reshape(num_heads, n, -1)
    return o.transpose(0, 1)


def _prefill_in_place(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, span: PrefillSpan,
                      scaling: float | None, scales: Scales = None) -> torch.Tensor:
    """A prefill chunk's attention reading the cache in place (see the module's docstring; an int8 cache's runs
    dequantized, one run at a time) -> [n, heads, d]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    pq = q[:, span.query_start : span.query_end]  # [heads, n, d]
    heads, n, d = pq.shape
    kv_heads = key_cache.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    key_scales, value_scales = scales or (None, None)
    own_k = _read(key_cache, key_scales, q.dtype, span.own_slots)  # [n, kv_heads, d]: the chunk's own keys
    own_v = _read(value_cache, value_scales, q.dtype, span.own_slots)
    own_k, own_v = _expand_kv(own_k.transpose(0, 1), heads), _expand_kv(own_v.transpose(0, 1), heads)
    if span.own_mask is None:
        o, lse = flash(pq[None], own_k[None], own_v[None], 0.0, True, scale=scale)
    else:
        o, lse = flash(pq[None], own_k[None], own_v[None], 0.0, False, attn_mask=span.own_mask, scale=scale)
    if not span.prefix_runs:
        return o[0].transpose(0, 1)
    outputs, lses = [o[0].float()], [lse[0]]
    grouped = _by_kv_head(pq, kv_heads)[None]  # [1, kv_heads, groups * n, d]: keys read once per KV head
    for slot, count in span.prefix_runs:
        run = slice(slot, slot + count)  # [1, kv_heads, count, d]: a view (an int8 cache's: dequantized)
        keys = _read(key_cache, key_scales, q.dtype, run).transpose(0, 1)[None]
        values = _read(value_cache, value_scales, q.dtype, run).transpose(0, 1)[None]
        o, lse = flash(grouped, keys, values, 0.0, False, scale=scale)
        outputs.append(o.reshape(heads, n, d).float())
        lses.append(lse.reshape(heads, n))
    stacked = torch.stack(lses)  # [pieces, heads, n]
    weights = (stacked - stacked.amax(0)).exp_()
    merged = (torch.stack(outputs) * weights[..., None]).sum(0) / weights.sum(0)[..., None]
    return merged.to(q.dtype).transpose(0, 1)


@dataclass
class AttentionBatch:
    """Per-step metadata, built once by the model runner and shared by every layer."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key and value go
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    kernel: PagedKernelMetadata | None = None  # the Triton path's metadata
    # The path every layer of the step runs (set by the backend that built the batch).
    attend: Callable[..., torch.Tensor] = reference_attention


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vlmcap_batch: AttentionBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if vlmcap_batch is None:
        raise RuntimeError("vlmcap_paged attention called without the engine's batch metadata")
    batch = vlmcap_batch
    layer = module.layer_idx
    cache = batch.kv_cache
    # [1, kv_heads, T, d] -> [T, kv_heads, d], the cache's layout.
    cache.write(layer, batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    # Layers with a sliding window (Gemma 3's local layers) see only keys less than the window behind.
    window = getattr(module, "sliding_window", None)
    out = batch.attend(query[0], cache.keys[layer], cache.values[layer], batch, window, scaling,
                       scales=cache.scales(layer))
    return out.unsqueeze(0), None


# A compiled decoder layer (engine/compiled.py) runs this function eagerly between its compiled halves: the
# per-step metadata's Python structure (how many decode groups and chunks) must not become graph guards.
AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(paged_attention_forward))
