"""Where image tokens attend to each other both ways (Gemma 3), the scheduler never splits an
image's span across chunks: a chunk stops before a span it cannot finish, and a span larger than what is left
of the budget runs whole in a step with no other prefill. Checked on the scheduler alone."""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.kv_cache import BlockPool
from engine.request import MultimodalPrompt, Request
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

# (prompt length, image spans as [start, end) positions, arrival step)
PROMPTS = [
    (40, [(5, 25), (28, 34)], 0),  # a span larger than every budget below, then a small one
    (30, [], 0),  # text only
    (24, [(2, 14)], 2),
    (50, [(0, 9), (9, 18), (30, 47)], 3),  # adjacent spans, and a span at the very start
]


def make_request(index: int, atomic: bool) -> Request:
    length, spans, _ = PROMPTS[index]
    mm = None
    if spans:
        mm = MultimodalPrompt(
            placeholder_positions=[p for start, end in spans for p in range(start, end)],
            input_row_starts=[sum(e - s for s, e in spans[:u]) for u in range(len(spans))],
            input_rows=[end - start for start, end in spans],
            encoder_inputs=[{} for _ in spans],
            atomic_inputs=atomic,
        )
    return Request(
        request_id=f"r{index}", prompt_token_ids=list(range(length)), sampling=SamplingParams(max_tokens=100),
        priority=0, arrival=index, max_total_tokens=1000, mm=mm,
    )


def schedule_all_prompts(budget: int, atomic: bool) -> list[SchedulerOutput]:
    """Step the scheduler (sampling token 0 whenever a chunk reaches a request's end) until every prompt is
    prefilled; the requests then keep decoding alongside the later prefills."""
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=budget, max_num_seqs=4), BlockPool(64, 16))
    requests = [make_request(i, atomic) for i in range(len(PROMPTS))]
    steps = []
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        for request, (_, _, arrival) in zip(requests, PROMPTS):
            if arrival == len(steps):
                scheduler.add(request)
        out = scheduler.schedule()
        scheduler.update(out, {c.request_id: 0 for c in out.chunks if c.samples})
        steps.append(out)
        assert len(steps) < 200, "no progress"
    return steps


def ends_inside_a_span(request_id: str, end: int) -> bool:
    spans = PROMPTS[int(request_id[1:])][1]
    return any(start < end < stop for start, stop in spans)


@pytest.mark.parametrize("budget", [7, 8, 13])
def test_atomic_spans_are_never_split_and_oversized_spans_run_without_other_prefills(budget):
    steps = schedule_all_prompts(budget, atomic=True)
    for out in steps:
        prefills = [c for c in out.chunks if c.start < c.num_prompt_tokens]
        for chunk in prefills:
            assert chunk.num_tokens > 0
            assert not ends_inside_a_span(chunk.request_id, chunk.end)
        if out.num_tokens > budget:  # the one allowed excess: a span alone, larger than what decodes left
            assert len(prefills) == 1
            chunk = prefills[0]
            assert (chunk.start, chunk.end) in PROMPTS[int(chunk.request_id[1:])][1]
            assert chunk.num_tokens > budget - (len(out.chunks) - 1)
    assert any(out.num_tokens > budget for out in steps)  # the 20-token span could not fit any budget here


@pytest.mark.parametrize("budget", [7, 8, 13])
def test_without_the_flag_the_same_spans_are_split_and_the_budget_holds(budget):
    steps = schedule_all_prompts(budget, atomic=False)
    assert any(ends_inside_a_span(c.request_id, c.end) for out in steps for c in out.chunks)
    assert max(out.num_tokens for out in steps) <= budget
