"""The paged KV cache: fixed-size blocks, a pool that hands them out, and one key and one value tensor per layer.

A token at position p of a request lives in slot `block_ids[p // block_size] * block_size + p % block_size`.
Which request holds which blocks is the KV cache manager's (engine/kv_cache_manager.py); the pool only counts.

Prefix caching: a computed block can be registered under its hash (engine/block_hash.py), so a later request
whose prompt starts with the same blocks takes them instead of computing them. Blocks are reference-counted:
several requests may read one; a block nobody holds keeps its content and stays findable until a new block is
needed, when the least recently released such block is taken (its hash forgotten). Blocks without content are
handed out first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # no content worth keeping
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # nobody holds them; least recently released first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> the hash it is registered under
        self._block_of: dict[bytes, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: empty ones and cached ones that no request holds."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently released cached block
                block, _ = self._cached_free.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Release one reference to each block; a cached block nobody holds stays findable. A request's last
        blocks are released first, so its prefix outlives its tail."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)

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


class KVCache:
    """Key and value storage of every layer, laid out as [slots, kv_heads, head_dim], slots being
    (num_blocks + 1) * block_size: one block more than the pool hands out, `scratch_block`, where the padding
    rows of a captured CUDA graph write and read."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element
