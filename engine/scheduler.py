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

Each step has a cost budget besides: its predicted time under an inter-token-latency target (`itl_target_ms`,
engine/step_costs.py: decodes first, whatever they cost, then chunks and encoder slices only as far as the step's
predicted time stays within the target), or, without one, its tokens again (a token costs one, encoder work
nothing). One planner decides each prompt's part of a step against it (`_chunk`):

3. Encoder work first. Inputs (tiles or images) whose features are in the encoder output cache are taken from
   it. Of the others, the next ones in order that stand at the same slice of their towers (up to
   `ENCODER_GROUP`, and inputs of at most `max_encoder_tokens_per_step` output tokens a step) run as many
   slices together as the cost allows, at most `encoder_slices_per_step` when set; where a group finishes, the
   next one follows in the same step. The step's first encoder work runs one slice (or one whole input, for
   towers that run whole) whatever its size and cost, so that prompts always progress. Inputs past the chunk's
   reach start only where a budget bounds the encoder's work (the encoder budget, or time): so a tower starts
   while the chunks still prefill the tokens before it.
4. Then the chunk: it may end anywhere, also inside an image's placeholder span, but stops before the first
   placeholder of an input whose features are not ready after this step, and takes as many tokens as the cost
   left allows; the step's first chunk still gets `block_size` tokens. Where image tokens attend to each other
   both ways (`atomic_inputs`, Gemma 3) a chunk never ends inside an input's span: it stops before the span, or
   takes a span too large for the budget whole when no other prefill runs this step. With chunked prefill off,
   a prompt is prefilled whole with its inputs' whole towers: when it fits what is left of the token budget, or
   when no other prefill runs this step (one oversized step).

Under the default target (`itl_target_ms` not set), where the decodes leave the rest of the step less time than
they take themselves (a large model on a small machine, whose decodes alone reach the target), chunks and encoder
work still get as much time as the decodes (at most the planned share of the target): a chat's gap at most
doubles while a prompt is prefilled, and the prompt keeps a share of the machine whatever the model's size; a
target that is set is kept to. The token and encoder budgets stay upper bounds.

A request may ask for a tighter target of its own (`Request.itl_target_ms`: a fall alert's caption, which a person
waits for to its end). It holds against the prompts after it in the rule's order (a higher priority value, or the
same and later): while it decodes in a step, they get only what a step planned to its target leaves after the
work before them, without the least progress above (a decode's tokens are bounded, so they wait at most that
long); the prompts before it are planned against the step's target as before. Under a token budget (no target)
it bounds nothing.

When a running request needs a block and none is free, the lowest-priority, newest running request not yet
scheduled this step is preempted (possibly the one asking): its blocks are freed and it is recomputed later
from its prompt plus the tokens it has generated. Blocks and the prefix cache: engine/kv_cache_manager.py.
"""

from __future__ import annotations

import bisect

from engine.config import EngineConfig
from engine.encoder_cache import EncoderOutputCache
from engine.encoder_inputs import EncoderInputs
from engine.kv_cache import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import MultimodalPrompt, Request, RequestStatus
from engine.scheduler_output import EncoderWork, ScheduledChunk, SchedulerOutput
from engine.step_budget import StepBudget, encoder_tokens_after
from engine.step_costs import ENCODER_GROUP, StepCosts


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
        decodes = [r for r in by_priority if r.is_decoding]
        self._schedule_decodes(decodes, budget, scheduled, out)
        if self.config.itl_target_ms is None:
            budget.balance()
        # The own targets of the requests decoding in this step, most urgent first (the rule's own targets).
        targets = [(r.sort_key(), r.itl_target_ms) for r in decodes
                   if r.itl_target_ms is not None and r.request_id in scheduled]
        prompts = sorted([r for r in by_priority if not r.is_decoding] + self.waiting, key=Request.sort_key)
        self._schedule_prompts(prompts, budget, scheduled, out, targets)
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
        self, prompts: list[Request], budget: StepBudget, scheduled: set[str], out: SchedulerOutput,
        targets: list[tuple[tuple[int, int], float]],
    ) -> None:
        """Running prompts' next chunks and waiting prompts' admissions, in `prompts`' order (the rule's item 2),
        each planned under the own `targets` (sort key, ms) of the decodes before it in that order."""
        admitting, urgent, tightened = True, sorted(targets), 0
        for request in prompts:
            if budget.spent:
                return
            while tightened < len(urgent) and urgent[tightened][0] < request.sort_key():
                budget.tighten(urgent[tightened][1])
                tightened += 1
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
        """How many prompt tokens (at most `max_tokens`) `request` computes this step, and the encoder work that
        needs: the encoder work first (`_encoder_work`), then the chunk stops before the first input it reaches
        whose features are not ready after this step, and takes as many tokens as the step's cost leaves."""
        start = request.num_computed_tokens
        remaining = request.num_tokens - start
        chunked = self.config.enable_chunked_prefill
        if chunked:
            n = self._keep_spans_whole(request, start, min(remaining, max_tokens), budget)
        else:
            n = remaining if remaining <= max_tokens or not budget.prefill_scheduled else 0
        work = [] if request.mm is None else self._encoder_work(request, start, n, budget, whole=not chunked)
        done = dict(self.encoder_inputs.progress.get(request.request_id, {}))
        done.update({item.index: item.end for item in work})
        unready = next((u for u in self.encoder_inputs.unfinished(request, start, start + n)
                        if done.get(u, 0) < request.mm.encoder_slices), None)
        if unready is not None:
            n = min(n, request.mm.input_first_position(unready) - start)
        if chunked and n > 0:
            floor = 0 if budget.prefill_scheduled or budget.tightened else self.config.block_size
            n = self._keep_spans_whole(request, start, min(n, budget.affordable_tokens(start, budget.work_cost(work),
                                                                                       floor)), budget)
        return n, work

    def _encoder_work(self, request: Request, start: int, n: int, budget: StepBudget, whole: bool
                      ) -> list[EncoderWork]:
        """The encoder work of a prompt whose chunk is [start, start + n) before the cuts (the rule's lockstep).
        Inputs whose features are in the encoder output cache are taken from it; of the others, the next ones in
        order that stand at the same slice of their towers, up to `ENCODER_GROUP` and what the encoder budget
        leaves, run the same slices together, as many as the step's cost allows and `encoder_slices_per_step`
        (one input alone multiplies a third slower per row than two together); where that finishes their towers,
        the next group follows in the same step. Inputs past the chunk are candidates only where a budget bounds
        the encoder's work (the encoder budget, or its cost under a time budget); `whole` (chunked prefill off):
        the chunk's inputs run their whole towers, unbounded."""
        mm = request.mm
        bounded = not whole and (budget.encoder_tokens is not None or budget.costs.bounds_encoder)
        pending = self.encoder_inputs.unfinished(request, start, request.num_tokens if bounded else start + n)
        held = [u for u in pending if self.encoder_inputs.held(request, u)]
        work = [EncoderWork(request.request_id, mm, u, mm.encoder_slices, mm.encoder_slices, from_cache=True)
                for u in held]
        todo = [u for u in pending if u not in held]
        progress = self.encoder_inputs.progress.get(request.request_id, {})
        cap = None if whole else self.config.encoder_slices_per_step
        left, reserved, first = (None if whole else budget.encoder_tokens), 0.0, True
        while todo:
            done = progress.get(todo[0], 0)
            group = [todo[0]]
            for index in todo[1:]:
                if len(group) == ENCODER_GROUP or progress.get(index, 0) != done:
                    break
                group.append(index)
            while len(group) > 1 and left is not None and sum(mm.input_rows[u] for u in group) > left:
                group.pop()
            if left is not None and mm.input_rows[group[0]] > left and not (first and not budget.encoder_scheduled):
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
            if end < mm.encoder_slices:  # the step's cost or the slice cap is reached
                break
            left = encoder_tokens_after(left, chosen)
            reserved += budget.work_cost(chosen)
            todo, first = todo[len(group):], False
        return work

    def _keep_spans_whole(self, request: Request, start: int, n: int, budget: StepBudget) -> int:
        """`_keep_span_whole` where the prompt's image spans are atomic (`atomic_inputs`), else `n`."""
        if request.mm is None or not request.mm.atomic_inputs:
            return n
        return self._keep_span_whole(request.mm, start, n, alone=not (budget.prefill_scheduled or budget.tightened))

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

