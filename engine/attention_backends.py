"""The attention backends: one class per attention path (engine/attention.py has the paths themselves), each
its step's metadata builder, chosen once at start-up (`choose_backend`, from `EngineConfig.attention_backend`,
the device and the dtype; the engine logs the choice and `stats()` reports it).

The runner lays out the step's chunks once (where each chunk's queries start in the packed batch, which cache
blocks hold its context) and puts every integer of the step into one packer; the backend asks the packer for
the integers its path needs (`reserve`) and, after the step's one upload, makes its `AttentionBatch` from views
of them (`build`), whose `attend` is the backend's path:

- **triton** (`TritonBackend`, the config's `"kernel"`): the Triton kernel's query starts, sequence lengths and
  padded block table for the whole mixed batch;
- **reference** (`ReferenceBackend`): decodes in padded batches of similar context length with their masks,
  prefill chunks one by one with theirs;
- **cpu** (`CpuBackend`): every decode in one batch the CPU's kernel reads in place (context lengths, no masks),
  and with them each query of a short causal chunk (`DECODE_ROWS_CHUNK`, or a longer one ending within
  `rows_context`) as a decode at its own position, so a step of decodes and a few prompt tokens runs as a step of
  decodes (and the lean layers' one call); longer prefill chunks as the reference plus what reading the cache in
  place needs (the chunk kernel's block table; the torch path's runs of consecutive prefix slots, the chunk's own
  slots and mask).

A step whose prefill chunk needs explicit masks (image tokens that attend both ways) goes to the reference
backend whatever the backend (`accepts`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.attention import (
    MAX_PREFIX_RUNS,
    AttentionBatch,
    DecodeGroup,
    PagedKernelMetadata,
    PrefillSpan,
    cpu_attention,
    reference_attention,
    triton_attention,
)
from engine.kv_cache import KVCache
from engine.scheduler_output import ScheduledChunk

log = logging.getLogger(__name__)

# A chunk of at most this many tokens the CPU backend attends as decodes wherever it ends (`CpuBackend.as_decodes`:
# 2 Zen 4 cores, 9 decodes and a chunk of 2 to 32 tokens took 15-35% less as decodes, at any context).
DECODE_ROWS_CHUNK = 32
# A longer chunk is attended as decodes while it ends within the context measured at its first use (`rows_context`):
# each query reading its whole context costs queries x context, the prefill path (the chunk kernel, which reads each
# key once for a tile of queries; else torch's flash kernel by pieces) less per key but more per call, so the
# decodes can win up to some context and lose past it (2 Zen 4 cores: against the chunk kernel at no context of
# these; against torch's flash kernel up to 512-1,536). The contexts measured, and the chunk.
ROWS_CONTEXTS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
ROWS_CHUNK = 128
# A decode batch's padded keys may be at most this many times its real ones (see `decode_batches`).
PADDED_KEYS_LIMIT = 1.5


class IntPacker:
    """Integers of one step gathered into one list; `take` returns where a run of them lies."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def take(self, values: Iterable[int]) -> slice:
        start = len(self.values)
        self.values.extend(values)
        return slice(start, len(self.values))


@dataclass
class QueryRow:
    """One query attended as a decode: its index in the packed batch, how many keys it sees (its position + 1,
    the keys of its own chunk written before it included) and the cache blocks that hold them."""

    index: int
    context_len: int
    blocks: list[int]


@dataclass
class ChunkLayout:
    """Where one chunk's queries start in the packed batch, and the cache blocks that hold its context."""

    query_start: int
    chunk: ScheduledChunk
    blocks: list[int]

    def rows(self) -> list[QueryRow]:
        """Each of the chunk's queries as a decode's: query i sees the keys up to its own position."""
        start = self.chunk.start
        return [QueryRow(self.query_start + i, start + i + 1, self.blocks) for i in range(self.chunk.num_tokens)]


def needs_masks(chunk: ScheduledChunk) -> bool:
    """A prefill chunk whose image tokens attend both ways needs the reference path's explicit masks."""
    mm = chunk.mm
    return chunk.num_tokens > 1 and mm is not None and mm.atomic_inputs and bool(mm.inputs_in(chunk.start, chunk.end))


def padded(blocks: list[int], width: int) -> list[int]:
    return blocks + [0] * (width - len(blocks))


def decode_batches(decodes: list[QueryRow]) -> list[list[QueryRow]]:
    """Decodes in padded batches, longest contexts first; a sequence starts a new batch when joining would make
    the batch's padded keys more than `PADDED_KEYS_LIMIT` times its real ones (one long context among short
    ones would otherwise have every short one read as many keys as it)."""
    groups: list[list[QueryRow]] = []
    total = 0
    for decode in sorted(decodes, key=lambda d: d.context_len, reverse=True):
        group = groups[-1] if groups else []
        longest = group[0].context_len if group else 0
        if group and (len(group) + 1) * longest <= PADDED_KEYS_LIMIT * (total + decode.context_len):
            group.append(decode)
            total += decode.context_len
        else:
            groups.append([decode])
            total = decode.context_len
    return groups


class AttentionBackend:
    """One attention path: its name (`EngineConfig.attention_backend`'s word), the function its layers call
    (`attend`), and its step's metadata builder (`reserve`, `build`) over what every backend shares: the cache,
    its block size, the model's sliding window."""

    name: ClassVar[str]
    attend: ClassVar[Callable[..., torch.Tensor]]

    def __init__(self, kv_cache: KVCache, block_size: int, device: torch.device, sliding_window: int | None,
                 num_heads: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sliding_window = sliding_window
        self.num_heads = num_heads or kv_cache.keys[0].shape[1]  # the model's query heads (default: one a KV head)

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> list[str]:
        """Why this path cannot run with this device, dtype and block size (empty: it can)."""
        return []

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this path can run the step."""
        return True

    def reserve(self, layouts: list[ChunkLayout], num_tokens: int, packer: IntPacker) -> Any:
        raise NotImplementedError

    def build(self, reserved: Any, values: torch.Tensor, slot_mapping: torch.Tensor) -> AttentionBatch:
        raise NotImplementedError


class TritonBackend(AttentionBackend):
    """The paged Triton kernel reads the whole mixed batch in one launch per layer (`PagedKernelMetadata`)."""

    name = "kernel"
    attend = staticmethod(triton_attention)

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> list[str]:
        from engine import paged_kernel

        reasons = []
        if not paged_kernel.available(device):
            reasons.append(f"it needs Triton on CUDA (device {str(device)!r})")
        if dtype not in (torch.bfloat16, torch.float16) and device.type == "cuda":
            reasons.append(f"it runs in bfloat16 or float16 (dtype {str(dtype).removeprefix('torch.')!r})")
        if block_size < 16 or block_size & (block_size - 1):
            reasons.append(f"it needs a block size that is a power of two of at least 16 (block_size {block_size})")
        return reasons

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return not any(needs_masks(chunk) for chunk in chunks)

    def reserve(self, layouts: list[ChunkLayout], num_tokens: int, packer: IntPacker) -> Any:
        width = max(len(layout.blocks) for layout in layouts)
        starts = packer.take([layout.query_start for layout in layouts] + [num_tokens])
        lengths = packer.take(layout.chunk.end for layout in layouts)
        table = packer.take(b for layout in layouts for b in padded(layout.blocks, width))
        return starts, lengths, table, len(layouts), max(layout.chunk.num_tokens for layout in layouts)

    def build(self, reserved: Any, values: torch.Tensor, slot_mapping: torch.Tensor) -> AttentionBatch:
        starts, lengths, table, num_seqs, max_query_len = reserved
        meta = PagedKernelMetadata(
            query_start_loc=values[starts].to(torch.int32), seq_lens=values[lengths].to(torch.int32),
            block_table=values[table].view(num_seqs, -1).to(torch.int32), max_query_len=max_query_len,
            num_seqs=num_seqs,
        )
        return AttentionBatch(self.kv_cache, slot_mapping, [], [], kernel=meta, attend=self.attend)


class ReferenceBackend(AttentionBackend):
    """Decodes (chunks of one query, which see every cached key) in padded batches with masks; each prefill
    chunk alone, with masks where it is not plain causal."""

    name = "reference"
    attend = staticmethod(reference_attention)

    def decode_groups(self, decodes: list[QueryRow]) -> list[list[QueryRow]]:
        return decode_batches(decodes)

    def as_decodes(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk's queries are attended as decodes (`ChunkLayout.rows`): a decode's one query."""
        return chunk.num_tokens == 1

    def reserve(self, layouts: list[ChunkLayout], num_tokens: int, packer: IntPacker) -> Any:
        decodes = [row for layout in layouts if self.as_decodes(layout.chunk) for row in layout.rows()]
        prefills = [layout for layout in layouts if not self.as_decodes(layout.chunk)]
        groups = []
        for group in self.decode_groups(decodes):
            width = max(len(row.blocks) for row in group)
            groups.append((packer.take(row.index for row in group),
                           packer.take(row.context_len for row in group),
                           packer.take(b for row in group for b in padded(row.blocks, width))))
        tables = [packer.take(layout.blocks) for layout in prefills]
        return groups, prefills, tables

    def build(self, reserved: Any, values: torch.Tensor, slot_mapping: torch.Tensor) -> AttentionBatch:
        groups, prefills, tables = reserved
        decode_groups = [self.decode_group(values[i], values[c], values[t].view(len(values[i]), -1))
                         for i, c, t in groups]
        spans = [self.prefill_span(layout, values[table], slot_mapping) for layout, table in zip(prefills, tables)]
        return AttentionBatch(self.kv_cache, slot_mapping, decode_groups, spans, attend=self.attend)

    def prefill_span(self, layout: ChunkLayout, table: torch.Tensor, slot_mapping: torch.Tensor) -> PrefillSpan:
        return PrefillSpan(layout.query_start, layout.query_start + layout.chunk.num_tokens, table, layout.chunk.end,
                           *self.prefill_masks(layout.chunk))

    def decode_group(self, query_index: torch.Tensor, context_lens: torch.Tensor, tables: torch.Tensor) -> DecodeGroup:
        """A decode batch's masks from its context lengths: key k is real for a sequence of context n when k < n,
        and in a sliding-window layer when also k > n - 1 - window."""
        keys = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
        mask = keys < context_lens[:, None]
        sliding_mask = None
        if self.sliding_window is not None:
            sliding_mask = (mask & (keys > context_lens[:, None] - 1 - self.sliding_window))[:, None, None]
        return DecodeGroup(query_index, tables, mask[:, None, None], sliding_mask)

    def prefill_masks(self, chunk: ScheduledChunk) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Which keys each query of a prefill chunk sees: causally the positions up to its own, and where image
        tokens attend both ways (`atomic_inputs`, whose spans a chunk holds whole) every token of its own
        image too. None for plain causal attention over a chunk that starts the sequence. Then the same
        within the sliding window, for models with sliding-window layers (None otherwise)."""
        start, end, mm = chunk.start, chunk.end, chunk.mm
        images = mm.inputs_in(start, end) if mm is not None and mm.atomic_inputs else []
        window = self.sliding_window
        plain_causal = start == 0 and not images
        if plain_causal and window is None:
            return None, None
        mask = torch.ones(chunk.num_tokens, end, dtype=torch.bool, device=self.device).tril(start)
        for index in images:
            first, last = mm.input_first_position(index), mm.input_last_position(index) + 1
            mask[max(first, start) - start : last - start, first:last] = True
        sliding_mask = None
        if window is not None:
            queries = torch.arange(start, end, device=self.device)[:, None]
            sliding_mask = mask & (torch.arange(end, device=self.device)[None, :] > queries - window)
        return (None if plain_causal else mask), sliding_mask


class CpuBackend(ReferenceBackend):
    """Every decode in one batch that the CPU's kernel reads in place: each context's own blocks, unsorted,
    unpadded in keys, its length instead of a mask; each prefill chunk's prefix as runs of cache slots."""

    name = "cpu"
    attend = staticmethod(cpu_attention)

    def __init__(self, kv_cache: KVCache, block_size: int, device: torch.device, sliding_window: int | None,
                 num_heads: int | None = None) -> None:
        super().__init__(kv_cache, block_size, device, sliding_window, num_heads)
        self.rows_context: int | None = None  # `rows_context` here, measured at the first chunk that asks

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> list[str]:
        from engine.cpu import build

        if device.type == "cpu" and build.available(device):
            return []
        return [f"it needs the CPU and a C compiler to build its kernel (device {str(device)!r}, "
                f"CC={os.environ.get('CC', 'cc')!r})"]

    def decode_groups(self, decodes: list[QueryRow]) -> list[list[QueryRow]]:
        return [decodes] if decodes else []

    def as_decodes(self, chunk: ScheduledChunk) -> bool:
        """A decode, and a causal chunk that is short (`DECODE_ROWS_CHUNK`) or ends within `rows_context`: its
        queries read the cache in place beside the decodes (its keys are written before attention), instead of the
        prefill path's pieces merged by log-sum-exp."""
        if needs_masks(chunk):
            return False
        if chunk.num_tokens <= DECODE_ROWS_CHUNK:
            return True
        if self.rows_context is None:
            cache = self.kv_cache
            self.rows_context = rows_context(cache.model_dtype, self.num_heads, cache.keys[0].shape[1],
                                             cache.keys[0].shape[2], self.block_size)
        return chunk.end <= self.rows_context

    def decode_group(self, query_index: torch.Tensor, context_lens: torch.Tensor, tables: torch.Tensor) -> DecodeGroup:
        return DecodeGroup(query_index, tables, None, context_lens=context_lens)

    def prefill_span(self, layout: ChunkLayout, table: torch.Tensor, slot_mapping: torch.Tensor) -> PrefillSpan:
        """The reference's span, and what reading the cache in place needs (engine/attention.py)."""
        span = super().prefill_span(layout, table, slot_mapping)
        runs = slot_runs(layout.blocks, layout.chunk.start, self.block_size)
        if len(runs) <= MAX_PREFIX_RUNS:
            span.prefix_runs = runs
            span.own_slots = slot_mapping[span.query_start : span.query_end]
            span.own_mask = self.own_mask(layout.chunk)
        return span

    def own_mask(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        """What each query of a prefill chunk sees of the chunk's own keys, as SDPA adds it to the scores
        ([1, 1, q, q]: 0 or -inf, the model's dtype): causally, and where image tokens attend both ways every
        token of its own image (None: causal alone)."""
        start, end, mm = chunk.start, chunk.end, chunk.mm
        images = mm.inputs_in(start, end) if mm is not None and mm.atomic_inputs else []
        if not images:
            return None
        mask = torch.ones(chunk.num_tokens, chunk.num_tokens, dtype=torch.bool, device=self.device).tril()
        for index in images:
            first = max(mm.input_first_position(index), start) - start
            last = mm.input_last_position(index) + 1 - start
            mask[first:last, first:last] = True
        hidden = torch.zeros(mask.shape, dtype=self.kv_cache.model_dtype, device=self.device)
        return hidden.masked_fill_(~mask, float("-inf"))[None, None]


@functools.cache
@torch.inference_mode()
def rows_context(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> int:
    """The longest of `ROWS_CONTEXTS` at whose end a chunk of `ROWS_CHUNK` queries took no longer attended as decodes
    (the CPU's decode kernel, each query over its context) than by the prefill path (`cpu_prefill`: the chunk kernel
    where it takes the chunk and wins here, else the pieces of its own keys and one run of prefix), here, on a cache
    of these shapes read from memory (`cold_seconds`), and at each shorter one too; 0 where the decodes lost at the
    first. Measured once per shape (under a second), with the threads of the caller (the step thread's, at the
    first long chunk)."""
    from engine.attention import cold_seconds, cpu_prefill, timing_chunk
    from engine.cpu.ops import paged_decode_attention

    query_index = torch.arange(ROWS_CHUNK)
    scale = head_dim ** -0.5

    def decodes_win(end: int) -> bool:
        q, keys, values, out, span = timing_chunk(dtype, heads, kv_heads, head_dim, block_size, ROWS_CHUNK, end)
        tables = span.block_table.expand(ROWS_CHUNK, -1).contiguous()
        lengths = torch.arange(end - ROWS_CHUNK + 1, end + 1)
        as_rows = cold_seconds(lambda: paged_decode_attention(q, query_index, keys, values, tables, lengths,
                                                              block_size, scale, None, out))
        return as_rows <= cold_seconds(lambda: cpu_prefill(q, keys, values, span, block_size, None, scale, out))

    won = 0
    for end in ROWS_CONTEXTS:
        if not decodes_win(end):
            break
        won = end
    log.info("CPU attention: chunks of over %d tokens are attended as decodes while they end within %d positions "
             "(%s, %d heads over %d KV heads of %d)", DECODE_ROWS_CHUNK, won, dtype, heads, kv_heads, head_dim)
    return won


def slot_runs(blocks: list[int], positions: int, block_size: int) -> list[tuple[int, int]]:
    """The cache slots of a sequence's first `positions` positions as runs (first slot, count) of consecutive
    slots, its blocks `blocks` in order."""
    runs: list[tuple[int, int]] = []
    for index in range((positions + block_size - 1) // block_size):
        count = min(block_size, positions - index * block_size)
        slot = blocks[index] * block_size
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            runs.append((slot, count))
    return runs


BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (TritonBackend, CpuBackend, ReferenceBackend)
}  # best first: what "auto" takes


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> type[AttentionBackend]:
    """The backend `requested` ("auto": the first of `BACKENDS` that can run here); ValueError saying why where the
    one requested cannot."""
    if requested == "auto":
        return next(backend for backend in BACKENDS.values() if not backend.unavailable(device, dtype, block_size))
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {['auto', *BACKENDS]}, got {requested!r}")
    backend = BACKENDS[requested]
    reasons = backend.unavailable(device, dtype, block_size)
    if reasons:
        raise ValueError(f"attention_backend {requested!r} cannot run here: " + "; ".join(reasons))
    return backend
