"""The paged KV cache: fixed-size blocks, a pool that hands them out, and one key and one value tensor per layer.

A token at position p of a request lives in slot `block_ids[p // block_size] * block_size + p % block_size`.
Which request holds which blocks is the KV cache manager's (engine/kv_cache_manager.py); the pool counts them
and chooses where they lie (runs, below).

Prefix caching: a computed block can be registered under its hash (engine/block_hash.py), so a later request
whose prompt starts with the same blocks takes them instead of computing them. Blocks are reference-counted:
several requests may read one; a block nobody holds keeps its content and stays findable until a new block is
needed, when the least recently released such block is taken (its hash forgotten). Blocks without content are
handed out before cached ones, except where a run goes on (below).

Runs: the CPU's decode attention reads a sequence's blocks in turn, and blocks that follow each other in the cache
read faster than scattered ones (8 sequences at 3,000 positions, SmolVLM-256M's cache, AMX machine: 0.83x the time
of blocks at random, 0.90x of blocks interleaved as decodes in lockstep take them one at a time). So a request's
next block is the one after its last where that one has no content, or holds content nobody holds that was
released longer ago than half of such blocks (taken before its turn, its hash forgotten: a recent one, a chat's
last turn, say, stays findable); otherwise a run starts in the middle of the widest stretch of blocks without
content (at its start where it begins the cache), so that the runs on either side have room to grow; otherwise
the least recently released blocks, in the cache's order.

An int8 cache (`EngineConfig.kv_cache_dtype="int8"`) holds each key and value row quantized, with one float32
scale per token and KV head beside it (`quantize_kv` states the rule); every attention path reads the rows back as
`dequantize_kv` gives them, the model dtype's values, so it computes exactly what it computes on a cache of the
model's dtype that holds those values.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

import torch

from engine.config import KV_CACHE_DTYPES

INT8_LIMIT = 127  # an int8 cache's values lie in [-127, 127] (symmetric)
# An int8 cache's scales are powers of two, 2^SCALE_EXPONENTS[0] to 2^SCALE_EXPONENTS[1] (float16 models: up to
# 2^FLOAT16_TOP_EXPONENT): within them q * s is exact in float32 and in the model's dtype (7 significant bits; at
# least 2^-24, a float16 subnormal's step; at most 127 * 2^120 < float32's and bfloat16's largest, 127 * 2^9 = 65,024
# under float16's 65,504).
SCALE_EXPONENTS = (-24, 120)
FLOAT16_TOP_EXPONENT = 9


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values [..., kv_heads, head_dim] in the model's dtype (normed and rotated, as the model gives them)
    -> (int8 [..., kv_heads, head_dim], float32 scales [..., kv_heads]). Per token and KV head, symmetric, the scale
    a power of two (a shared exponent, as OCP's MXINT8): in float32, t = max|x| / 127 over the head's head_dim
    values (an IEEE division), s = the least power of two >= t, kept within 2^-24..2^120 (2^9 for a float16
    model), s = 1 where that max is 0; q = x / s (exact) rounded half to even and clamped to [-127, 127], as
    engine/csrc/dtypes.h's `quantize_row` does it. So q * s is exact in float32 and in the model's dtype: a reader
    may multiply by s wherever it likes (scores by the keys' s after the dot product, the values' s into the
    softmax weights) and get the same bits as over the dequantized values. Against s = t, the step is up to 2x
    coarser (about half a bit)."""
    x32 = x.float()
    top = x32.abs().amax(-1)
    mantissa, exponent = torch.frexp(top / INT8_LIMIT)  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).int()  # t a power of two already: s = t
    highest = FLOAT16_TOP_EXPONENT if x.dtype == torch.float16 else SCALE_EXPONENTS[1]
    exponent = exponent.clamp(SCALE_EXPONENTS[0], highest)
    scales = torch.where(top == 0, 1.0, ((exponent + 127) << 23).view(torch.float32))
    q = (x32 / scales[..., None]).round_().clamp_(-INT8_LIMIT, INT8_LIMIT).to(torch.int8)
    return q, scales


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., kv_heads, d] and their scales [..., kv_heads] -> the values they stand for, (float)q * s in
    float32 rounded to the model's `dtype` (exact under `quantize_kv`'s scales): what every attention path reads."""
    return (q.float() * scales[..., None]).to(dtype)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._empty = bytearray(b"\x01") * num_blocks  # 1 where a block has no content worth keeping
        self._num_empty = num_blocks
        # the stretches of empty blocks, start -> end (exclusive), and a heap of (-length, start, end) over them
        # whose entries for stretches that have changed since are skipped when met (`_run_start`)
        self._stretches: dict[int, int] = {0: num_blocks} if num_blocks else {}
        self._heap: list[tuple[int, int, int]] = [(-num_blocks, 0, num_blocks)] if num_blocks else []
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # nobody holds them; least recently released first
        self._released = [0] * num_blocks  # when each block of `_cached_free` went there (`_clock`'s count)
        self._clock = 0
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> the hash it is registered under
        self._block_of: dict[bytes, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: empty ones and cached ones that no request holds."""
        return self._num_empty + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks, held once each, in runs as the module's docstring says; `after`: the last block the request
        holds already (its next one continues that run where it can)."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free")
        blocks: list[int] = []
        last = after
        for left in range(n, 0, -1):
            block = None if last is None else self._next_of(last)
            if block is None and not self._num_empty:
                # the `left` least recently released blocks, in the cache's order: a request releases its blocks
                # last first, so that they come in reverse
                rest = sorted(itertools.islice(self._cached_free, left))
                for block in rest:
                    self._take(block)
                return blocks + rest
            if block is None:
                block = self._run_start(left)
            self._take(block)
            blocks.append(block)
            last = block
        return blocks

    def _take(self, block: int) -> None:
        """`block`, which nobody holds, held once: an empty one's stretch split around it, a cached one's hash
        forgotten."""
        if self._empty[block]:
            begin, end = self._stretch_around(block)
            del self._stretches[begin]
            self._empty[block] = 0
            self._num_empty -= 1
            self._add_stretch(begin, block)
            self._add_stretch(block + 1, end)
        else:
            del self._cached_free[block]
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1

    def _next_of(self, block: int) -> int | None:
        """The block after `block` where a run may take it (the module's docstring), else None."""
        following = block + 1
        if following >= self.num_blocks:
            return None
        if self._empty[following]:
            return following
        if following in self._cached_free:
            oldest = self._released[next(iter(self._cached_free))]
            if 2 * self._released[following] <= oldest + self._clock:
                return following
        return None

    def _run_start(self, n: int) -> int:
        """Where a run of `n` new blocks starts: in the widest stretch of empty blocks (the first such), its middle
        less half the run, or its start where it begins the cache."""
        while True:  # the heap's top, once a stale entry is dropped
            _, begin, end = self._heap[0]
            if self._stretches.get(begin) == end:
                break
            heapq.heappop(self._heap)
        return begin if begin == 0 else begin + max(0, (end - begin - n) // 2)

    def _stretch_around(self, block: int) -> tuple[int, int]:
        """The first and past-the-last block of the empty ones on either side of `block`, `block` counted in."""
        end = self._empty.find(0, block + 1)
        return self._empty.rfind(0, 0, block) + 1, self.num_blocks if end < 0 else end

    def _give_empty(self, block: int) -> None:
        """`block` empty again: joined with the stretches on either side."""
        begin, end = self._stretch_around(block)
        self._stretches.pop(begin, None)  # the stretch that ended at `block`, if any
        self._stretches.pop(block + 1, None)  # the one that began after it
        self._empty[block] = 1
        self._num_empty += 1
        self._add_stretch(begin, end)

    def _add_stretch(self, begin: int, end: int) -> None:
        if begin < end:
            self._stretches[begin] = end
            heapq.heappush(self._heap, (begin - end, begin, end))
            if len(self._heap) > 2 * len(self._stretches) + 64:  # mostly stale: made again from the stretches
                self._heap = [(b - e, b, e) for b, e in self._stretches.items()]
                heapq.heapify(self._heap)

    def free(self, block_ids: list[int]) -> None:
        """Release one reference to each block; a cached block nobody holds stays findable. A request's last
        blocks are released first, so its prefix outlives its tail."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._clock += 1
                    self._released[block] = self._clock
                    self._cached_free[block] = None
                else:
                    self._give_empty(block)

    # -- prefix caching -------------------------------------------------------------------------
    def find(self, hashes: list[bytes]) -> list[int]:
        """The blocks registered under the longest prefix of `hashes`."""
        found = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of these blocks no request holds (taking them leaves fewer free blocks)."""
        return sum(self._refs[b] == 0 for b in block_ids)

    def take(self, block_ids: list[int]) -> None:
        """Hold cached blocks found by `find`."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._cached_free[block]
            self._refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` is full and computed: later requests may find it under `block_hash` (unless another block
        holding the same content already is)."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash


def storage_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """What the cache stores for a model of `dtype` (`kv_cache_dtype` one of `KV_CACHE_DTYPES`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return torch.int8 if kv_cache_dtype == "int8" else dtype


class KVCache:
    """Key and value storage of every layer, laid out as [slots, kv_heads, head_dim], slots being
    (num_blocks + 1) * block_size: one block more than the pool hands out, `scratch_block`, where the padding
    rows of a captured CUDA graph write and read. `dtype` is the model's; an int8 cache (`kv_cache_dtype`) stores
    int8 rows and, per layer, float32 scales [slots, kv_heads] for keys and values (`key_scales`,
    `value_scales`; None otherwise)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.model_dtype = dtype
        self.dtype = storage_dtype(dtype, kv_cache_dtype)
        slots = (num_blocks + 1) * block_size
        shape = (slots, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.key_scales: list[torch.Tensor] | None = None
        self.value_scales: list[torch.Tensor] | None = None
        if self.quantized:
            self.key_scales = [torch.ones(slots, num_kv_heads, device=device) for _ in range(num_layers)]
            self.value_scales = [torch.ones(slots, num_kv_heads, device=device) for _ in range(num_layers)]

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s key and value scales (None: the cache holds the model's dtype)."""
        if self.key_scales is None or self.value_scales is None:
            return None
        return self.key_scales[layer], self.value_scales[layer]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New keys and values [T, kv_heads, d] (the model's dtype) into the cache rows `slots` of `layer`,
        quantized where the cache is int8."""
        key_cache, value_cache = self.keys[layer], self.values[layer]
        if not self.quantized:
            key_cache.index_copy_(0, slots, keys.to(self.dtype))
            value_cache.index_copy_(0, slots, values.to(self.dtype))
            return
        for cache, scales, x in zip((key_cache, value_cache), self.scales(layer), (keys, values)):
            q, s = quantize_kv(x.to(self.model_dtype))
            cache.index_copy_(0, slots, q)
            scales.index_copy_(0, slots, s)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        kv_cache_dtype: str = "auto") -> int:
        """A block's bytes over every layer, keys and values (an int8 cache's scales included)."""
        stored = storage_dtype(dtype, kv_cache_dtype)
        per_head = head_dim * torch.empty((), dtype=stored).element_size()
        if stored == torch.int8:
            per_head += torch.empty((), dtype=torch.float32).element_size()  # the head's scale
        return 2 * num_layers * block_size * num_kv_heads * per_head
