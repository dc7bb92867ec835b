"""The scheduler decides, each step, which tokens of which requests are computed.

The rule, under a token budget B (`max_num_batched_tokens`) and a sequence cap S (`max_num_seqs`):

1. Every running request that decodes gets exactly one token, in priority order.
2. Every running request whose prompt is partly prefilled gets the next chunk of it, as large as the
   budget left allows (its first chunk too, when it was admitted in an earlier step).
3. Waiting requests are admitted in priority order (lower value first, FIFO within a priority) while
   fewer than S run, the budget is not spent, and their whole prompt's blocks plus a watermark are free;
   each gets a first chunk from what is left of the budget.

A chunk may end anywhere, also inside an image's placeholder span. An encoder input (a tile or an image)
is run the step its first placeholder is reached, inputs of at most `max_encoder_tokens_per_step` output
tokens a step (but always one, however large); a chunk that would need more stops before the first
placeholder of the input that must wait. With `encoder_slices_per_step`, an input's vision tower runs that
many slices a step instead of whole, and the chunk stops before the first placeholder of an input whose
tower has not finished. What is left of a step's encoder budget goes to the next input that no chunk has
reached yet (one per request), so that its features are ready, or nearly, when the chunk gets there. With
chunked prefill off, a prompt is prefilled whole: admitted when it fits in what is left of the budget, or when
no other prefill runs this step (one oversized step).

Except where image tokens attend to each other both ways (`MultimodalPrompt.atomic_units`, Gemma 3): there
a chunk never ends inside an encoder input's span. A chunk that would stops before the span; a chunk that
starts at a span too large for what is left of the budget takes the whole span if no other prefill runs
this step (one oversized step, as with chunking off), and otherwise waits for a later step.

KV blocks are taken as the chunks need them. When a running request needs a block and none is free,
the lowest-priority, newest running request not yet scheduled this step is preempted (possibly the
one asking): its blocks are freed and it is recomputed later from its prompt plus the tokens it has
already generated. No request is admitted in a step that preempted.

Prefix caching (`enable_prefix_caching`): a request being admitted starts after the longest run of its full
blocks that the pool holds computed (engine/kv_cache.py, engine/block_hash.py), always leaving its last
token to compute, and counts only the blocks it does not find against the free ones. Blocks are registered
only once every token in them has been computed, in the step after that, so a request never reads a block
another one is still writing; a request never writes into a block it found (its computation starts at a block
boundary). An encoder input whose placeholders lie wholly in the found prefix is never encoded; one that the
boundary cuts is encoded whole as usual. Where image tokens attend both ways, the prefix never ends inside
an image's span: the span's cached keys were computed with its whole image, which the block's hash covers,
so they are the ones a recomputation would give, and the chunk that resumes starts at a span boundary as
every chunk there does. A preempted request finds its own blocks again when it is readmitted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_hash import full_block_hashes
from engine.config import EngineConfig
from engine.encoder_cache import EncoderOutputCache
from engine.kv_cache import BlockPool
from engine.request import MultimodalPrompt, Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so this step yields its next token."""
        return self.end == self.request.num_tokens


@dataclass
class EncoderWork:
    """Slices first..end-1 of the vision tower on encoder input `unit` of `request`."""

    request: Request
    unit: int
    first: int
    end: int
    from_cache: bool = False  # the features are taken from the shared encoder cache; no tower runs

    @property
    def finishes(self) -> bool:
        """After this step the input's features are ready for the chunks that reach its placeholders."""
        return self.end == self.request.mm.encoder_slices


@dataclass
class SchedulerOutput:
    """What the runner runs this step, and what it frees first: the encoder inputs (request id, input) whose
    features or tower state no chunk will read again, freed since the last step (a request finished,
    aborted or preempted, or its chunks went past the input's placeholders)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    freed_encoder_inputs: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: BlockPool, encoder_outputs: EncoderOutputCache | None = None
    ) -> None:
        self.config = config
        self.pool = pool
        self.encoder_outputs = encoder_outputs  # features shared across requests by content (engine/encoder_cache.py)
        self.watermark_blocks = int(config.watermark * pool.num_blocks)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Per request, the encoder inputs whose state or features the runner holds, and the slices run.
        self.encoder_progress: dict[str, dict[int, int]] = {}
        self.freed_encoder_inputs: list[tuple[str, int]] = []  # for the runner, in the next SchedulerOutput
        self.num_preemptions = 0

    # -- queue changes --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def max_prompt_blocks(self) -> int:
        """The most blocks a prompt may need and still be admitted into an otherwise empty cache."""
        return self.pool.num_blocks - self.watermark_blocks

    def _release(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        for unit in sorted(self.encoder_progress.pop(request.request_id, ())):
            self.freed_encoder_inputs.append((request.request_id, unit))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        self.add(request)
        self.num_preemptions += 1
        out.preempted.append(request)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(freed_encoder_inputs=self.freed_encoder_inputs)
        self.freed_encoder_inputs = []
        budget = self.config.max_num_batched_tokens
        encoder_left = self.config.max_encoder_tokens_per_step
        scheduled: set[str] = set()
        prefill_scheduled = False

        by_priority = sorted(self.running, key=Request.sort_key)
        decodes = [r for r in by_priority if r.is_decoding]
        prefills = [r for r in by_priority if not r.is_decoding]

        for request in decodes:
            if budget == 0:
                break
            if request.status is RequestStatus.RUNNING and self._reserve(request, 1, scheduled, out):
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, 1))
                scheduled.add(request.request_id)
                budget -= 1

        for request in prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted above
            capacity = (len(request.block_ids) + self.pool.num_free) * self.pool.block_size
            cap = max(capacity - request.num_computed_tokens, 1)
            n, work = self._chunk(request, min(budget, cap), encoder_left, prefill_scheduled)
            if (n == 0 and not work) or not self._reserve(request, n, scheduled, out):
                continue
            self._take(request, n, work, out, scheduled)
            budget = max(budget - n, 0)  # a whole atomic span may take more than was left
            encoder_left = self._encoder_left(encoder_left, work)
            prefill_scheduled = prefill_scheduled or n > 0

        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self._cached_prefix(request)
            needed = self.pool.blocks_for(request.num_tokens) - len(cached) + self.pool.num_unheld(cached)
            if needed + self.watermark_blocks > self.pool.num_free:
                break
            self._resume_after(request, cached)
            n, work = self._chunk(request, budget, encoder_left, prefill_scheduled)
            if n == 0 and not work:
                self._release(request)
                request.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            self._count_cached(request)
            self._reserve(request, n, scheduled, out)  # cannot fail: the whole prompt's blocks are free
            self._take(request, n, work, out, scheduled)
            budget = max(budget - n, 0)
            encoder_left = self._encoder_left(encoder_left, work)
            prefill_scheduled = prefill_scheduled or n > 0
        return out

    # -- prefix caching -------------------------------------------------------------------------
    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks a waiting request can start from: the longest run of its full blocks found in the
        pool, leaving at least its last token to compute (it must yield a token), and, where image tokens
        attend both ways, not ending inside an image's span (the chunk that resumes must hold the span whole)."""
        if not self.config.enable_prefix_caching:
            return []
        bs = self.pool.block_size
        hashes = full_block_hashes(request, bs, request.num_tokens - 1)
        found = self.pool.find(hashes)
        mm = request.mm
        if mm is not None and mm.atomic_units:
            while found:
                boundary = len(found) * bs
                cut = [u for u in mm.units_in(boundary - 1, boundary + 1)
                       if mm.unit_first_position(u) < boundary <= mm.unit_last_position(u)]
                if not cut:
                    break
                found = found[: mm.unit_first_position(cut[0]) // bs]
        return found

    def _resume_after(self, request: Request, cached: list[int]) -> None:
        """Hold the cached blocks and start the request's computation after them."""
        self.pool.take(cached)
        request.block_ids = list(cached)
        request.num_computed_tokens = len(cached) * self.pool.block_size

    def _count_cached(self, request: Request) -> None:
        if self.config.enable_prefix_caching and not request.output_token_ids:  # first admission: reported
            request.num_cached_tokens = request.num_computed_tokens
            self.pool.queried_tokens += request.num_prompt_tokens
            self.pool.hit_tokens += request.num_computed_tokens

    def _register_full_blocks(self, request: Request, computed_before: int) -> None:
        """Blocks that this step filled become findable by later requests."""
        bs = self.pool.block_size
        first, end = computed_before // bs, request.num_computed_tokens // bs
        if end <= first:
            return
        hashes = full_block_hashes(request, bs, request.num_computed_tokens)
        for index in range(first, end):
            self.pool.register(request.block_ids[index], hashes[index])

    @staticmethod
    def _encoder_left(encoder_left: int | None, work: list[EncoderWork]) -> int | None:
        if encoder_left is None:
            return None
        spent = sum(item.request.mm.unit_rows[item.unit] for item in work if not item.from_cache)
        return max(encoder_left - spent, 0)

    def _held(self, request: Request, unit: int) -> bool:
        """The input's features are in the shared encoder cache and its tower has not started."""
        cache = self.encoder_outputs
        return (cache is not None and bool(request.mm.unit_hashes) and request.mm.unit_hashes[unit] in cache
                and self.encoder_progress.get(request.request_id, {}).get(unit, 0) == 0)

    def _chunk(
        self, request: Request, budget: int, encoder_left: int | None, prefill_scheduled: bool
    ) -> tuple[int, list[EncoderWork]]:
        """How many prompt tokens `request` computes this step, and the encoder work that needs."""
        start = request.num_computed_tokens
        remaining = request.num_tokens - start
        if not self.config.enable_chunked_prefill:
            n = remaining if remaining <= budget or not prefill_scheduled else 0
            return n, [self._work(request, u, whole=True) for u in self._unfinished_units(request, start, start + n)]
        n = min(remaining, budget)
        if request.mm is not None and request.mm.atomic_units:
            n = self._keep_span_whole(request.mm, start, n, alone=not prefill_scheduled)
        units = self._unfinished_units(request, start, start + n)
        if encoder_left is not None:
            fitting = self._units_within(request, units, encoder_left)
            if fitting < len(units):
                n = request.mm.unit_first_position(units[fitting]) - start
                units = units[:fitting]
        work = [self._work(request, u, whole=False) for u in units]
        unready = next((w.unit for w in work if not w.finishes), None)
        if unready is not None:  # the chunk stops where it would need features still being computed
            n = min(n, request.mm.unit_first_position(unready) - start)
        if encoder_left is not None:
            work += self._work_ahead(request, start + n, work, self._encoder_left(encoder_left, work))
        return n, work

    def _work_ahead(self, request: Request, end: int, work: list[EncoderWork], encoder_left: int) -> list[EncoderWork]:
        """The next slices of the first unfinished input past `end` that this step's work does not touch,
        if it fits in what is left of the encoder budget."""
        busy = {item.unit for item in work}
        ahead = next((u for u in self._unfinished_units(request, end, request.num_tokens) if u not in busy), None)
        if ahead is None or (request.mm.unit_rows[ahead] > encoder_left and not self._held(request, ahead)):
            return []
        return [self._work(request, ahead, whole=False)]

    def _units_within(self, request: Request, units: list[int], encoder_left: int) -> int:
        """How many of `units`, in order, fit in what is left of the step's encoder budget; the first of the
        step runs whatever its size, so that an input larger than the budget still gets encoded."""
        first_of_step = encoder_left == self.config.max_encoder_tokens_per_step
        mm = request.mm
        used = 0
        for count, unit in enumerate(units):
            if self._held(request, unit):
                continue
            used += mm.unit_rows[unit]
            if used > encoder_left and not (first_of_step and count == 0):
                return count
        return len(units)

    def _work(self, request: Request, unit: int, whole: bool) -> EncoderWork:
        """The next slices of an input's vision tower: all that are left, or `encoder_slices_per_step`."""
        slices = request.mm.encoder_slices
        if self._held(request, unit):
            return EncoderWork(request, unit, slices, slices, from_cache=True)
        done = self.encoder_progress.get(request.request_id, {}).get(unit, 0)
        step = self.config.encoder_slices_per_step
        end = slices if whole or step is None else min(done + step, slices)
        return EncoderWork(request, unit, done, end)

    @staticmethod
    def _keep_span_whole(mm: MultimodalPrompt, start: int, n: int, alone: bool) -> int:
        """Shorten chunk [start, start + n) so that it does not end inside an encoder input's span; a span at
        the chunk's start that does not fit is taken whole when the chunk runs `alone`, else the chunk is
        empty. Chunks start at span boundaries, so only the chunk's last span can be cut."""
        units = mm.units_in(start, start + n)
        if not units:
            return n
        span_start, span_end = mm.unit_first_position(units[-1]), mm.unit_last_position(units[-1]) + 1
        if span_end <= start + n:
            return n
        if span_start > start:
            return span_start - start
        return span_end - start if alone else 0

    def _unfinished_units(self, request: Request, start: int, end: int) -> list[int]:
        """Encoder inputs with placeholders in [start, end) whose features are not ready yet."""
        if request.mm is None or end <= start:
            return []
        progress = self.encoder_progress.get(request.request_id, {})
        slices = request.mm.encoder_slices
        return [u for u in request.mm.units_in(start, end) if progress.get(u, 0) < slices]

    def _take(
        self, request: Request, n: int, work: list[EncoderWork], out: SchedulerOutput, scheduled: set[str]
    ) -> None:
        if n > 0:
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
        out.encoder_work.extend(work)
        progress = self.encoder_progress.setdefault(request.request_id, {})
        for item in work:
            progress[item.unit] = item.end
        scheduled.add(request.request_id)

    def _reserve(self, request: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Give `request` the blocks for `n` more tokens, preempting others if needed. False if the
        request itself was preempted."""
        needed = self.pool.blocks_for(request.num_computed_tokens + n) - len(request.block_ids)
        while needed > self.pool.num_free:
            candidates = [r for r in self.running if r.request_id not in scheduled or r is request]
            victim = max(candidates, key=Request.sort_key)
            self._preempt(victim, out)
            if victim is request:
                return False
        if needed > 0:
            request.block_ids.extend(self.pool.allocate(needed))
        return True

    # -- after the forward ----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance each scheduled request past its chunk, append sampled tokens, and release the
        encoder outputs that every later chunk has passed."""
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            if self.config.enable_prefix_caching:
                self._register_full_blocks(request, chunk.start)
            token = sampled.get(request.request_id)
            if token is not None:
                request.output_token_ids.append(token)
            progress = self.encoder_progress.get(request.request_id)
            if progress:
                passed = [u for u in progress if request.mm.unit_last_position(u) < request.num_computed_tokens]
                for unit in sorted(passed):
                    del progress[unit]
                    self.freed_encoder_inputs.append((request.request_id, unit))

