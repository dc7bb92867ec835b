"""The KV cache manager: which blocks each request holds, which computed prefix it can start from, and the
prefix cache's counters. The scheduler asks it and decides only what runs.

Block tables: a request's table is `request.block_ids` (the runner reads it to find its slots); only this
manager writes it. Blocks are taken as the chunks need them (`allocate`) and given back when the request
finishes, is aborted or is preempted (`free`), so no request reserves its maximum length up front.

Admission: a waiting request is admitted only when the blocks of its whole prompt that it does not find
cached, plus a watermark (`EngineConfig.watermark` of the pool), are free (`can_admit`), so that an admitted
prompt is not preempted by the next request's first chunk.

Prefix caching (`enable_prefix_caching`): a request being admitted starts after the longest run of its full
blocks that the pool holds computed (`computed_blocks`; hashes from engine/block_hash.py, the only place they
are made), always leaving its last token to compute, and counts only the blocks it does not find against the
free ones. Blocks are registered (`cache_full_blocks`) only once every token in them has been computed, in the
step after that, so a request never reads a block another one is still writing; a request never writes into a
block it found (its computation starts at a block boundary). Where image tokens attend both ways
(`MultimodalPrompt.atomic_inputs`), the prefix never ends inside an image's span: the span's cached keys were
computed with its whole image, which the block's hash covers, so they are the ones a recomputation would give,
and the chunk that resumes starts at a span boundary as every chunk there does. A preempted request finds its
own blocks again when it is readmitted. Reference counts and eviction live in the pool (engine/kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import full_block_hashes
from engine.config import EngineConfig
from engine.kv_cache import BlockPool
from engine.request import Request


@dataclass
class KVCacheStats:
    blocks_used: int
    blocks_total: int
    cached_blocks: int  # blocks findable by their hash
    queried_tokens: int  # prompt tokens looked up in the prefix cache at first admission
    hit_tokens: int  # of which found


class KVCacheManager:
    def __init__(self, pool: BlockPool, config: EngineConfig) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.watermark_blocks = int(config.watermark * pool.num_blocks)
        self.queried_tokens = 0
        self.hit_tokens = 0

    def max_prompt_blocks(self) -> int:
        """The most blocks a prompt may need and still be admitted into an otherwise empty cache."""
        return self.pool.num_blocks - self.watermark_blocks

    def computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks a waiting request can start from, and the tokens they hold: the longest run of its
        full blocks found in the pool, leaving at least its last token to compute (it must yield a token), and,
        where image tokens attend both ways, not ending inside an image's span. A request that asks for its
        prompt's log-probabilities starts only from blocks whose positions it has scored already (none at first):
        it computes the positions it scores, and registers their blocks for others as any request does."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        found = self.pool.find(full_block_hashes(request, bs, request.num_tokens - 1))
        if request.sampling.prompt_logprobs is not None:
            found = found[: request.prompt_positions_to_score // bs]
        mm = request.mm
        if mm is not None and mm.atomic_inputs:
            while found:
                boundary = len(found) * bs
                cut = [u for u in mm.inputs_in(boundary - 1, boundary + 1)
                       if mm.input_first_position(u) < boundary <= mm.input_last_position(u)]
                if not cut:
                    break
                found = found[: mm.input_first_position(cut[0]) // bs]
        return found, len(found) * bs

    def can_admit(self, request: Request, computed: list[int]) -> bool:
        """The blocks of the request's whole prompt that `computed` does not cover, plus the watermark, are free."""
        needed = self.pool.blocks_for(request.num_tokens) - len(computed) + self.pool.num_unheld(computed)
        return needed + self.watermark_blocks <= self.pool.num_free

    def num_fitting_tokens(self, request: Request) -> int:
        """How many more tokens the request could compute with the blocks it holds and every free one."""
        capacity = (len(request.block_ids) + self.pool.num_free) * self.block_size
        return capacity - request.num_computed_tokens

    def allocate(self, request: Request, num_tokens: int, computed: list[int] | None = None) -> bool:
        """Give the request the blocks for `num_tokens` more tokens after its computed ones; False, with nothing
        changed, when too few are free. `computed`: the request is being admitted and starts from these cached
        blocks (from `computed_blocks`), which it holds from now on; its prefix-cache hit is counted."""
        computed = computed or []
        needed = self.pool.blocks_for(request.num_computed_tokens + num_tokens) - len(request.block_ids)
        needed -= len(computed)
        if needed + self.pool.num_unheld(computed) > self.pool.num_free:
            return False
        if computed:
            self.pool.take(computed)
            request.block_ids = list(computed)
        if needed > 0:
            request.block_ids.extend(self.pool.allocate(needed, request.block_ids[-1] if request.block_ids else None))
        return True

    def record_admission(self, request: Request) -> None:
        """Count the prompt's tokens looked up and found, at its first admission only (not after preemption)."""
        if self.enable_prefix_caching and not request.output_token_ids:
            request.num_cached_tokens = request.num_computed_tokens
            self.queried_tokens += request.num_prompt_tokens
            self.hit_tokens += request.num_computed_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks; those registered stay findable until their space is needed."""
        self.pool.free(request.block_ids)
        request.block_ids = []

    def cache_full_blocks(self, request: Request, num_computed_before: int) -> None:
        """Blocks that the last step filled become findable by later requests."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, end = num_computed_before // bs, request.num_computed_tokens // bs
        if end <= first:
            return
        hashes = full_block_hashes(request, bs, request.num_computed_tokens)
        for index in range(first, end):
            self.pool.register(request.block_ids[index], hashes[index])

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.pool.num_used, self.pool.num_blocks, self.pool.num_cached,
                            self.queried_tokens, self.hit_tokens)
