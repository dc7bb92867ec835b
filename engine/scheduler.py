"""The scheduler decides, each step, which tokens of which requests are computed.

The rule, under a step budget of B tokens (`max_num_batched_tokens`) and a cap of S running requests
(`max_num_seqs`):

1. Every running request that decodes gets exactly one token, in priority order (with the tokens its grammar
   forced after it, if any: engine/engine.py's jump-forward).
2. Then the prompts, running ones partly prefilled and waiting ones alike, in priority order (lower value
   first, first come first served within a priority: `Request.sort_key`), each in turn getting all it can use
   of what the earlier ones left of the step's budgets (tokens, encoder output tokens and, under a target,
   time); the next one gets only what the earlier ones cannot use this step (a prompt whose next placeholders
   wait for their tower leaves the tokens past them to the next prompt's text or tiles). So photo prompts
   finish one after another instead of all late together, and camera captions (a higher priority value) come
   after chats. A running prompt gets the next chunk of itself; a waiting one is admitted with its first chunk
   while fewer than S run and the KV cache manager can admit it (once one cannot be admitted, no later one is,
   so that a long prompt is not starved); one that could take nothing this step waits. No request is admitted
   after one was preempted in the step.

A chunk may end anywhere, also inside an image's placeholder span. An encoder input (a tile or an image)
runs in the step its first placeholder is reached, inputs of at most `max_encoder_tokens_per_step` output
tokens a step (always at least one); a chunk stops before the first placeholder of an input that must wait,
or (with `encoder_slices_per_step`, a tower run a few slices a step) whose tower has not finished. What a step
leaves of the encoder budget starts the next input no chunk has reached yet (one per request). With chunked
prefill off, a prompt is prefilled whole: when it fits what is left of the budget, or when no other prefill
runs this step (one oversized step). Where image tokens attend to each other both ways (`atomic_inputs`,
Gemma 3) a chunk never ends inside an input's span: it stops before the span, or takes a span too large for
the budget whole when no other prefill runs this step.

With an inter-token-latency target (`itl_target_ms`, engine/step_costs.py), each step is also budgeted by time:
decodes first, whatever they cost; then chunks and encoder slices only as far as the step's predicted time
stays within the target; the first prefill chunk of a step still gets `block_size` tokens, and the first
encoder work one slice (or one whole input, for towers that run whole), so that prompts always progress. A
prompt's inputs then run in lockstep: the next ones in order that stand at the same slice (up to
`ENCODER_GROUP`) run as many slices together as fit (at most `encoder_slices_per_step`, when set); where a
group finishes with time and encoder budget left, the prompt's next group starts in the same step. Under the
default target (`itl_target_ms` not set), where the decodes leave the rest of the step less time than they take
themselves (a large model on a small machine, whose decodes alone reach the target), chunks and encoder work
still get as much time as the decodes (at most the planned share of the target): a chat's gap at most doubles
while a prompt is prefilled, and the prompt keeps a share of the machine whatever the model's size; a target
that is set is kept to. The token and encoder budgets stay upper bounds.

When a running request needs a block and none is free, the lowest-priority, newest running request not yet
scheduled this step is preempted (possibly the one asking): its blocks are freed and it is recomputed later
from its prompt plus the tokens it has generated. Blocks and the prefix cache: engine/kv_cache_manager.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.encoder_cache import EncoderOutputCache
from engine.encoder_inputs import EncoderInputs
from engine.kv_cache import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import MultimodalPrompt, Request, RequestStatus
from engine.scheduler_output import EncoderWork, ScheduledChunk, SchedulerOutput
from engine.step_costs import ENCODER_GROUP, StepCosts, chunk_keys


@dataclass
class StepBudget:
    """What is left of one step: tokens (`max_num_batched_tokens`), encoder output tokens
    (`max_encoder_tokens_per_step`; None: no encoder budget), seconds (the inter-token-latency target less what
    is scheduled, by the cost model; None: no time budget), and whether a prefill chunk and encoder work already
    run in it. Every budget of a step is read and spent here."""

    tokens: int
    encoder_tokens: int | None
    encoder_tokens_per_step: int | None
    seconds: float | None = None
    costs: StepCosts | None = None
    prefill_scheduled: bool = False
    encoder_scheduled: bool = False
    decode_seconds: float = 0.0  # the predicted time of the step's decodes (the step's fixed cost included)
    balanced: bool = False  # the default target: see `balance`

    @classmethod
    def for_step(cls, config: EngineConfig, costs: StepCosts | None = None) -> StepBudget:
        encoder = config.max_encoder_tokens_per_step
        timed = costs is not None and costs.ready and config.enable_chunked_prefill
        if not timed:
            return cls(config.max_num_batched_tokens, encoder, encoder)
        fixed = costs.forward_seconds(0, 0)
        return cls(config.max_num_batched_tokens, encoder, encoder, costs.planned - fixed, costs,
                   decode_seconds=fixed, balanced=config.itl_target_ms is None)

    @property
    def spent(self) -> bool:
        return self.tokens == 0

    @property
    def encoder_untouched(self) -> bool:
        """No input has been encoded this step yet: the first one runs whatever its size."""
        return self.encoder_tokens == self.encoder_tokens_per_step and not self.encoder_scheduled

    def spend_decode(self, context: int, num_tokens: int = 1) -> None:
        self.tokens -= num_tokens
        if self.seconds is not None:
            seconds = self._token_seconds(context, num_tokens)
            self.seconds -= seconds
            self.decode_seconds += seconds

    def balance(self) -> None:
        """After the decodes, under the default target: the rest of the step gets at least as much time as the
        decodes took, at most the planned share of the target (see the module's docstring)."""
        if self.balanced and self.seconds is not None:
            self.seconds = max(self.seconds, min(self.decode_seconds, self.costs.planned))

    def spend_prefill(self, start: int, num_tokens: int, work: list[EncoderWork]) -> None:
        self.tokens = max(self.tokens - num_tokens, 0)  # a whole atomic span may take more than was left
        self.encoder_tokens = encoder_tokens_after(self.encoder_tokens, work)
        if self.seconds is not None:
            self.seconds -= self._token_seconds(start, num_tokens) + sum(self.work_seconds(w) for w in work)
        self.prefill_scheduled = self.prefill_scheduled or num_tokens > 0
        self.encoder_scheduled = self.encoder_scheduled or any(not w.from_cache for w in work)

    def _token_seconds(self, start: int, num_tokens: int) -> float:
        costs = self.costs
        return costs.scale * (costs.per_token * num_tokens + costs.per_key * chunk_keys(start, num_tokens))

    def affordable_tokens(self, start: int, reserved: float, floor: int) -> int:
        """The most tokens of a chunk from `start` whose predicted time fits what is left (less `reserved`
        seconds of encoder work); at least `floor`."""
        if self.seconds is None:
            return self.tokens
        left, low, high = self.seconds - reserved, 0, self.tokens
        while low < high:  # the cost grows with n (quadratically, through the keys)
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self._token_seconds(start, mid) <= left else (low, mid - 1)
        return max(low, min(floor, self.tokens))

    def work_seconds(self, work: EncoderWork) -> float:
        """Predicted seconds of `work` (slices first..end-1 of an input's tower; 0 from the shared cache)."""
        per_row = self.costs.per_encoder_row if self.costs is not None else None
        if work.from_cache or per_row is None:
            return 0.0
        mm = work.mm
        return per_row * mm.input_rows[work.index] * (work.end - work.first) / mm.encoder_slices

    def affordable_slices(self, rows: int, slices: int, reserved: float = 0.0, first: bool = True) -> int:
        """How many slices of inputs of `rows` output rows in all fit in what is left of the step's time (which
        is set), less `reserved` seconds of encoder work already chosen. The step's `first` encoder work gets one
        slice whatever it costs (a whole tower, where it runs whole), and so does an input before the encoder's
        cost is known."""
        least = 1 if first and self.encoder_untouched else 0
        per_row = self.costs.per_encoder_row
        if per_row is None:
            return least
        per_slice = per_row * rows / slices
        left = self.seconds - reserved
        return max(int(left // per_slice) if per_slice > 0 else slices, least)


def encoder_tokens_after(left: int | None, work: list[EncoderWork]) -> int | None:
    """The encoder budget left after `work` (inputs taken from the encoder output cache cost nothing)."""
    if left is None:
        return None
    spent = sum(item.mm.input_rows[item.index] for item in work if not item.from_cache)
    return max(left - spent, 0)


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: BlockPool, encoder_outputs: EncoderOutputCache | None = None,
        costs: StepCosts | None = None,
    ) -> None:
        self.config = config
        self.costs = costs  # the step cost model (engine/step_costs.py); None or not ready: no time budget
        self.kv_cache_manager = KVCacheManager(pool, config)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # waiting or running, by id
        self.encoder_inputs = EncoderInputs(encoder_outputs)  # every encoder input's progress, held and freed
        self.num_preemptions = 0

    # -- queue changes --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self.requests.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_inputs.release(request.request_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_forced = 0  # recomputed from its prompt and outputs like any others
        self.add(request)
        self.num_preemptions += 1
        out.preempted.append(request.request_id)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(freed_encoder_inputs=self.encoder_inputs.take_freed())
        budget = StepBudget.for_step(self.config, self.costs)
        scheduled: set[str] = set()
        by_priority = sorted(self.running, key=Request.sort_key)
        self._schedule_decodes([r for r in by_priority if r.is_decoding], budget, scheduled, out)
        budget.balance()
        prompts = sorted([r for r in by_priority if not r.is_decoding] + self.waiting, key=Request.sort_key)
        self._schedule_prompts(prompts, budget, scheduled, out)
        return out

    def _schedule_decodes(
        self, decodes: list[Request], budget: StepBudget, scheduled: set[str], out: SchedulerOutput
    ) -> None:
        for position, request in enumerate(decodes):
            if budget.spent:
                return
            # 1, or the last token and the forced ones after it, as far as leaves a token for each decode after it
            n = max(min(request.num_uncomputed_tokens, budget.tokens - (len(decodes) - position - 1)), 1)
            if request.status is RequestStatus.RUNNING and self._allocate(request, n, scheduled, out):
                out.chunks.append(ScheduledChunk.of(request, request.num_computed_tokens, n, self.config.block_size))
                scheduled.add(request.request_id)
                budget.spend_decode(request.num_computed_tokens, n)

    def _schedule_prompts(
        self, prompts: list[Request], budget: StepBudget, scheduled: set[str], out: SchedulerOutput
    ) -> None:
        """Running prompts' next chunks and waiting prompts' admissions, in `prompts`' order (the rule's item 2)."""
        admitting = True
        for request in prompts:
            if budget.spent:
                return
            if request.status is RequestStatus.RUNNING and request.request_id not in scheduled:
                self._schedule_prefill(request, budget, scheduled, out)
            elif request.status is RequestStatus.WAITING and admitting:
                admitting = self._admit(request, budget, scheduled, out)

    def _schedule_prefill(
        self, request: Request, budget: StepBudget, scheduled: set[str], out: SchedulerOutput
    ) -> None:
        fitting = max(self.kv_cache_manager.num_fitting_tokens(request), 1)
        n, work = self._chunk(request, min(budget.tokens, fitting), budget)
        if (n == 0 and not work) or not self._allocate(request, n, scheduled, out):
            return
        start = request.num_computed_tokens
        self._take(request, n, work, out, scheduled)
        budget.spend_prefill(start, n, work)

    def _admit(self, request: Request, budget: StepBudget, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Admit waiting `request` with its first chunk if it can run and take something this step. False when
        no later request may be admitted this step (one was preempted, S run, or the cache cannot admit it)."""
        manager = self.kv_cache_manager
        if out.preempted or len(self.running) >= self.config.max_num_seqs:
            return False
        computed, num_computed = manager.computed_blocks(request)
        if not manager.can_admit(request, computed):
            return False
        request.num_computed_tokens = num_computed
        n, work = self._chunk(request, budget.tokens, budget)
        if n == 0 and not work:
            request.num_computed_tokens = 0
            return True
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        manager.allocate(request, n, computed)  # cannot fail: `can_admit` counted the whole prompt
        manager.record_admission(request)
        start = request.num_computed_tokens
        self._take(request, n, work, out, scheduled)
        budget.spend_prefill(start, n, work)
        return True

    def _allocate(self, request: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Give `request` the blocks for `n` more tokens, preempting others if needed. False if the
        request itself was preempted."""
        while not self.kv_cache_manager.allocate(request, n):
            candidates = [r for r in self.running if r.request_id not in scheduled or r is request]
            victim = max(candidates, key=Request.sort_key)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    # -- chunks and encoder work ----------------------------------------------------------------
    def _chunk(self, request: Request, max_tokens: int, budget: StepBudget) -> tuple[int, list[EncoderWork]]:
        """How many prompt tokens (at most `max_tokens`) `request` computes this step, and the encoder work
        that needs."""
        start = request.num_computed_tokens
        remaining = request.num_tokens - start
        if not self.config.enable_chunked_prefill:
            n = remaining if remaining <= max_tokens or not budget.prefill_scheduled else 0
            indices = self.encoder_inputs.unfinished(request, start, start + n)
            return n, [self._work(request, u, whole=True) for u in indices]
        n = min(remaining, max_tokens)
        if request.mm is not None and request.mm.atomic_inputs:
            n = self._keep_span_whole(request.mm, start, n, alone=not budget.prefill_scheduled)
        indices = self.encoder_inputs.unfinished(request, start, start + n)
        if budget.seconds is not None:
            return self._timed_chunk(request, start, n, indices, budget)
        if budget.encoder_tokens is not None:
            fitting = self._inputs_within(request, indices, budget)
            if fitting < len(indices):
                n = request.mm.input_first_position(indices[fitting]) - start
                indices = indices[:fitting]
        work = [self._work(request, index, whole=False) for index in indices]
        unready = next((w.index for w in work if not w.finishes), None)
        if unready is not None:  # the chunk stops where it would need features still being computed
            n = min(n, request.mm.input_first_position(unready) - start)
        if budget.encoder_tokens is not None:
            work += self._work_ahead(request, start + n, work, budget)
        return n, work

    def _timed_chunk(self, request: Request, start: int, n: int, indices: list[int], budget: StepBudget
                     ) -> tuple[int, list[EncoderWork]]:
        """`_chunk` under a time budget: a prompt's encoder inputs run in lockstep (`_lockstep`), then the chunk
        stops before the first input it reaches whose features are not ready after this step, and takes as many
        tokens as the time left allows."""
        if request.mm is None:
            work: list[EncoderWork] = []
        else:
            work = self._lockstep(request, start, budget)
            after = dict(self.encoder_inputs.progress.get(request.request_id, {}))
            after.update({item.index: item.end for item in work})
            unready = next((u for u in indices if after.get(u, 0) < request.mm.encoder_slices), None)
            if unready is not None:
                n = min(n, request.mm.input_first_position(unready) - start)
        if n > 0:
            floor = 0 if budget.prefill_scheduled else self.config.block_size
            n = min(n, budget.affordable_tokens(start, self._seconds(budget, work), floor))
            if request.mm is not None and request.mm.atomic_inputs:
                n = self._keep_span_whole(request.mm, start, n, alone=not budget.prefill_scheduled)
        return n, work

    def _lockstep(self, request: Request, start: int, budget: StepBudget) -> list[EncoderWork]:
        """The encoder work of a prompt under a time budget. Inputs whose features are in the encoder output
        cache are taken from it; of the others, the next ones in order (reached by the chunk or not) that stand
        at the same slice of their towers, up to `ENCODER_GROUP` and what the encoder budget leaves, run the
        same slices together, as many as fit the step's time (one input alone multiplies a third slower per
        row than two together); where that finishes their towers, the next group follows in the same step, as
        far as the step's time and encoder budget go."""
        mm = request.mm
        pending = self.encoder_inputs.unfinished(request, start, request.num_tokens)
        held = [u for u in pending if self.encoder_inputs.held(request, u)]
        work = [EncoderWork(request.request_id, mm, u, mm.encoder_slices, mm.encoder_slices, from_cache=True)
                for u in held]
        todo = [u for u in pending if u not in held]
        progress = self.encoder_inputs.progress.get(request.request_id, {})
        cap = self.config.encoder_slices_per_step
        left, reserved, first = budget.encoder_tokens, 0.0, True
        while todo:
            done = progress.get(todo[0], 0)
            group = [todo[0]]
            for index in todo[1:]:
                if len(group) == ENCODER_GROUP or progress.get(index, 0) != done:
                    break
                group.append(index)
            while len(group) > 1 and left is not None and sum(mm.input_rows[u] for u in group) > left:
                group.pop()
            if left is not None and mm.input_rows[group[0]] > left and not (first and budget.encoder_untouched):
                break
            affordable = 0
            while group:
                rows = sum(mm.input_rows[u] for u in group)
                affordable = budget.affordable_slices(rows, mm.encoder_slices, reserved, first)
                if affordable or len(group) == 1:
                    break
                group.pop()
            end = min(mm.encoder_slices, done + affordable, done + cap if cap else mm.encoder_slices)
            if end == done:
                break
            chosen = [EncoderWork(request.request_id, mm, index, done, end) for index in group]
            work += chosen
            if end < mm.encoder_slices:  # the step's time or the slice cap is reached
                break
            left = encoder_tokens_after(left, chosen)
            reserved += self._seconds(budget, chosen)
            todo, first = todo[len(group):], False
        return work

    @staticmethod
    def _seconds(budget: StepBudget, work: list[EncoderWork]) -> float:
        return sum(budget.work_seconds(item) for item in work)

    def _work_ahead(self, request: Request, end: int, work: list[EncoderWork], budget: StepBudget) -> list[EncoderWork]:
        """The next slices of the first unfinished input past `end` that this step's work does not touch,
        if it fits in what is left of the encoder budget (token budgets; under a time budget `_lockstep`
        decides)."""
        busy = {item.index for item in work}
        pending = self.encoder_inputs.unfinished(request, end, request.num_tokens)
        ahead = next((u for u in pending if u not in busy), None)
        if ahead is None:
            return []
        encoder_left = encoder_tokens_after(budget.encoder_tokens, work)
        if (encoder_left is not None and request.mm.input_rows[ahead] > encoder_left
                and not self.encoder_inputs.held(request, ahead)):
            return []
        return [self._work(request, ahead, whole=False)]

    def _inputs_within(self, request: Request, indices: list[int], budget: StepBudget) -> int:
        """How many of `indices`, in order, fit in what is left of the step's encoder budget; the first of the
        step runs whatever its size, so that an input larger than the budget still gets encoded."""
        mm = request.mm
        used = 0
        for count, index in enumerate(indices):
            if self.encoder_inputs.held(request, index):
                continue
            used += mm.input_rows[index]
            if used > budget.encoder_tokens and not (budget.encoder_untouched and count == 0):
                return count
        return len(indices)

    def _work(self, request: Request, index: int, whole: bool) -> EncoderWork:
        """The next slices of an input's vision tower: all that are left, or `encoder_slices_per_step` (token
        budgets; under a time budget `_lockstep` decides)."""
        slices = request.mm.encoder_slices
        if self.encoder_inputs.held(request, index):
            return EncoderWork(request.request_id, request.mm, index, slices, slices, from_cache=True)
        done = self.encoder_inputs.slices_done(request.request_id, index)
        step = self.config.encoder_slices_per_step
        end = slices if whole or step is None else min(done + step, slices)
        return EncoderWork(request.request_id, request.mm, index, done, end)

    @staticmethod
    def _keep_span_whole(mm: MultimodalPrompt, start: int, n: int, alone: bool) -> int:
        """Shorten chunk [start, start + n) so that it does not end inside an encoder input's span; a span at
        the chunk's start that does not fit is taken whole when the chunk runs `alone`, else the chunk is
        empty. Chunks start at span boundaries, so only the chunk's last span can be cut."""
        indices = mm.inputs_in(start, start + n)
        if not indices:
            return n
        span_start, span_end = mm.input_first_position(indices[-1]), mm.input_last_position(indices[-1]) + 1
        if span_end <= start + n:
            return n
        if span_start > start:
            return span_start - start
        return span_end - start if alone else 0

    def _take(
        self, request: Request, n: int, work: list[EncoderWork], out: SchedulerOutput, scheduled: set[str]
    ) -> None:
        if n > 0:
            out.chunks.append(ScheduledChunk.of(request, request.num_computed_tokens, n, self.config.block_size))
        out.encoder_work.extend(work)
        scheduled.add(request.request_id)

    # -- after the forward ----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """After the runner ran `out`: commit the encoder work's progress, advance each scheduled request
        past its chunk, append sampled tokens, and free the encoder inputs that every later chunk has passed."""
        self.encoder_inputs.commit(out.encoder_work, self.requests)
        for chunk in out.chunks:
            request = self.requests[chunk.request_id]
            request.num_computed_tokens = chunk.end
            self.kv_cache_manager.cache_full_blocks(request, chunk.start)
            token = sampled.get(request.request_id)
            if token is not None:
                request.output_token_ids.append(token)
            if request.num_forced:  # those the chunk did not reach stay forced (and the step sampled none)
                request.num_forced = max(request.num_uncomputed_tokens - 1, 0)
            if request.mm is not None:
                self.encoder_inputs.passed(request.request_id, request.mm, request.num_computed_tokens)

