"""Properties of the schedule that do not depend on the machine's speed, counted in steps."""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.kv_cache import BlockPool
from engine.request import MultimodalPrompt, Request
from engine.scheduler import Scheduler
from tests.engine.conftest import PROMPTS, Job, run_jobs

CHAT = "User: Tell me a long story about buses.<end_of_utterance>\nAssistant:"


def start_chats(engine, n: int) -> list[str]:
    """n chats that decode for a long time, stepped until every one of them is decoding."""
    ids = [
        engine.add_request(prompt=CHAT, sampling=SamplingParams(max_tokens=500, ignore_eos=True)) for _ in range(n)
    ]
    while not all(engine.requests[rid].is_decoding for rid in ids):
        engine.step()
    return ids


def prefill_image_prompt(engine, chats: list[str], images) -> tuple[list[dict[str, int]], list[dict]]:
    """Add a two-image prompt while the chats decode; step until it yields its first token. Returns,
    per step, the tokens each chat gained, and the stats."""
    rid = engine.add_request(prompt=PROMPTS[2], images=images, sampling=SamplingParams(max_tokens=4))
    gained, stats = [], []
    counts = {c: len(engine.requests[c].output_token_ids) for c in chats}
    while not engine.requests[rid].output_token_ids:
        engine.step()
        now = {c: len(engine.requests[c].output_token_ids) for c in chats}
        gained.append({c: now[c] - counts[c] for c in chats})
        stats.append(engine.stats())
        counts = now
    return gained, stats


@pytest.mark.parametrize("slices_per_step", [None, 1])
def test_decodes_gain_one_token_every_step_while_a_long_image_prompt_prefills(make_engine, photos, slices_per_step):
    budget = 24
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=8, max_encoder_tokens_per_step=16,
                         encoder_slices_per_step=slices_per_step)
    chats = start_chats(engine, 4)
    gained, stats = prefill_image_prompt(engine, chats, photos)
    prompt_len = max(r.num_prompt_tokens for r in engine.requests.values())
    assert prompt_len > 5 * budget  # the prompt really is several times the budget
    assert len(gained) > 5
    for step in gained:
        assert set(step.values()) == {1}
    assert max(s.last_step_num_tokens for s in stats) <= budget
    slices = [b.encoder_slices_run - a.encoder_slices_run for a, b in zip(stats, stats[1:])]
    assert max(slices) <= (slices_per_step or engine.adapter.encoder_slices)  # one tile's share a step
    assert stats[-1].encoder_inputs_encoded == 10  # two images of five tiles, each tile once


def test_without_chunking_the_same_prompt_takes_one_oversized_step(make_engine, photos):
    budget = 24
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=8, enable_chunked_prefill=False)
    chats = start_chats(engine, 4)
    gained, stats = prefill_image_prompt(engine, chats, photos)
    assert len(gained) == 1
    assert stats[0].last_step_num_tokens > 5 * budget
    assert set(gained[0].values()) == {1}


# Encoder budgets in tokens: a tiny-model tile fills 16; 8 is under one tile, which still runs alone.
@pytest.mark.parametrize("budget,encoder_budget", [(8, 8), (8, 16), (13, 32), (64, None), (4096, None)])
def test_vision_encoder_runs_once_per_tile_whatever_the_chunking(make_engine, photos, budget, encoder_budget):
    # Without caching: the second request's photo is encoded for it too (test_prefix_cache.py covers reuse).
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=8, max_encoder_tokens_per_step=encoder_budget,
                         enable_prefix_caching=False)
    jobs = [Job(PROMPTS[2], photos, max_tokens=3), Job(PROMPTS[1], [photos[0]], max_tokens=3, arrive_at_step=2)]
    tiles = [engine.adapter.process(job.prompt, job.images)[1].num_inputs for job in jobs]
    _, trace = run_jobs(engine, jobs)
    assert engine.stats().encoder_inputs_encoded == sum(tiles) == 15  # 5 tiles an image for the tiny model
    encoded = [0] + [stats.encoder_inputs_encoded for _, stats in trace]
    per_step = [b - a for a, b in zip(encoded, encoded[1:])]
    if encoder_budget is not None:
        assert max(per_step) <= max(1, encoder_budget // 16)
    assert not engine.runner.encoder_features  # every output dropped once its span was prefilled


def test_one_token_per_decode_per_step_and_budget_never_exceeded_in_mixed_traffic(make_engine, photos):
    budget = 16
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=6)
    jobs = [
        Job(PROMPTS[i % 3], photos[: i % 3], max_tokens=6 + i, arrive_at_step=3 * i) for i in range(8)
    ]
    _, trace = run_jobs(engine, jobs)
    for outputs, stats in trace:
        assert stats.last_step_num_tokens <= budget
        assert len({o.request_id for o in outputs}) == len(outputs)  # at most one new token per request


def test_lower_priority_value_is_admitted_first(make_engine):
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=1)
    low = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=2), priority=5)
    high = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=2), priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [high, low]


def test_preemption_takes_the_lowest_priority_newest_request(make_engine, photos):
    engine = make_engine(max_num_batched_tokens=256, max_num_seqs=4, num_kv_blocks=16)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    first = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=params, priority=0)
    second = engine.add_request(prompt=PROMPTS[1], images=[photos[1]], sampling=params, priority=0)
    victims = []
    while engine.has_unfinished_requests() and not victims:
        before = engine.stats().num_preemptions
        engine.step()
        if engine.stats().num_preemptions > before:
            victims = [r for r in (first, second) if engine.requests[r].num_computed_tokens == 0]
    assert victims == [second]


def test_abort_frees_blocks_at_once_and_others_continue(make_engine, oracle, photos):
    engine = make_engine(max_num_batched_tokens=32, max_num_seqs=4)
    keep = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=10))
    drop = engine.add_request(prompt=PROMPTS[2], images=photos, sampling=SamplingParams(max_tokens=50))
    for _ in range(6):
        engine.step()
    used = engine.stats().kv_blocks_used
    # Both prompts start with the same image: with prefix caching the first blocks are shared and stay held.
    held = len(set(engine.requests[drop].block_ids) - set(engine.requests[keep].block_ids))
    assert held > 0
    assert engine.abort(drop)
    assert engine.stats().kv_blocks_used == used - held
    assert not engine.abort(drop)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[keep].token_ids == oracle(PROMPTS[1], [photos[0]], 10)
    assert engine.stats().kv_blocks_used == 0


def test_encoder_budget_counts_tokens_and_always_runs_one_input():
    """Inputs of different sizes (as Qwen2-VL images are): small ones share a step's encoder budget, one
    larger than the whole budget runs alone rather than never."""
    rows = [40, 10, 10, 50, 5]
    starts = [sum(rows[:u]) for u in range(len(rows))]
    mm = MultimodalPrompt(
        placeholder_positions=list(range(2, 2 + sum(rows))), input_row_starts=starts, input_rows=rows,
        encoder_inputs=[{} for _ in rows],
    )
    request = Request(request_id="r", prompt_token_ids=list(range(sum(rows) + 4)), sampling=SamplingParams(),
                      priority=0, arrival=0, max_total_tokens=1000, mm=mm)
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=200, max_encoder_tokens_per_step=25), BlockPool(64, 16))
    scheduler.add(request)
    encoded = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        out = scheduler.schedule()
        encoded.append([work.index for work in out.encoder_work])
        scheduler.update(out, {})
    assert encoded == [[0], [1, 2], [3], [4]]


def test_the_next_inputs_tower_starts_while_the_chunk_prefills_the_input_before():
    """Tiles of 16 tokens, a tower of two slices run one a step, 8 prompt tokens a step: what a step leaves of
    the encoder budget starts the next tile's tower before the chunk reaches it, so the chunk never waits
    after the first tile."""
    rows = [16, 16, 16]
    mm = MultimodalPrompt(
        placeholder_positions=list(range(2, 2 + sum(rows))), input_row_starts=[0, 16, 32], input_rows=rows,
        encoder_inputs=[{} for _ in rows], encoder_slices=2,
    )
    request = Request(request_id="r", prompt_token_ids=list(range(sum(rows) + 4)), sampling=SamplingParams(),
                      priority=0, arrival=0, max_total_tokens=1000, mm=mm)
    config = EngineConfig(max_num_batched_tokens=8, max_num_seqs=8, max_encoder_tokens_per_step=16,
                          encoder_slices_per_step=1)
    scheduler = Scheduler(config, BlockPool(64, 16))
    scheduler.add(request)
    steps = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        out = scheduler.schedule()
        steps.append(([(c.start, c.end) for c in out.chunks], [(w.index, w.first) for w in out.encoder_work]))
        scheduler.update(out, {})
    # (chunks, [(tile, slice)]): tile 0's first slice holds the chunk before its span; tiles 1 and 2 start
    # in the steps that prefill the tokens before them.
    assert steps == [
        ([(0, 2)], [(0, 0)]), ([(2, 10)], [(0, 1)]), ([(10, 18)], [(1, 0)]), ([(18, 26)], [(1, 1)]),
        ([(26, 34)], [(2, 0)]), ([(34, 42)], [(2, 1)]), ([(42, 50)], []), ([(50, 52)], []),
    ]


def test_photo_prompts_arriving_together_are_prefilled_one_after_the_other(make_engine, oracle, photos):
    """Two photo prompts arrive while chats decode: the first gets the step's prefill and encoder budgets, the
    second only what the first cannot use, so the first's first token comes steps before the second's; every
    chat gains one token a step meanwhile, and both prompts' tokens are transformers' greedy ones."""
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=8, max_encoder_tokens_per_step=16, itl_target_ms=0)
    chats = start_chats(engine, 2)
    jobs = [(PROMPTS[1], [photos[0]]), (PROMPTS[1], [photos[1]])]
    ids = [engine.add_request(prompt=p, images=i, sampling=SamplingParams(max_tokens=4)) for p, i in jobs]
    first_token: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    step = 0
    while any(rid in engine.requests for rid in ids):
        before = {c: len(engine.requests[c].output_token_ids) for c in chats}
        for output in engine.step():
            if output.request_id in ids:
                first_token.setdefault(output.request_id, step)
                tokens[output.request_id] = output.token_ids
        assert all(len(engine.requests[c].output_token_ids) == before[c] + 1 for c in chats)
        step += 1
    assert first_token[ids[0]] + 3 < first_token[ids[1]]
    for rid, (prompt, images) in zip(ids, jobs):
        assert tokens[rid] == oracle(prompt, images, 4)


def test_a_fall_alerts_own_target_holds_a_camera_prompt_back_until_its_last_token(make_engine, oracle, photos):
    """An alert decodes under a target its decodes alone are over: a camera's photo prompt (less urgent) computes
    nothing, no token and no tower slice, until the alert's last token, while a chat's prompt (more urgent) is
    prefilled and decodes; then the camera prompt runs. Every request's tokens are transformers' greedy ones."""
    engine = make_engine(max_num_seqs=8)
    assert engine.step_costs is not None and engine.step_costs.ready  # steps budgeted by time (the CPU's target)
    alert = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=8),
                               priority=5, itl_target_ms=1e-3)
    while not engine.requests[alert].is_decoding:
        engine.step()
    camera = engine.add_request(prompt=PROMPTS[1], images=[photos[1]], sampling=SamplingParams(max_tokens=4),
                                priority=10)
    chat = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=4))
    tokens: dict[str, list[int]] = {}
    while alert in engine.requests:
        for output in engine.step():
            tokens[output.request_id] = output.token_ids
        assert engine.requests[camera].num_computed_tokens == 0
        assert not engine.scheduler.encoder_inputs.progress.get(camera)
    assert tokens[chat]  # prefilled and decoding beside the alert
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = output.token_ids
    assert tokens[alert] == oracle(PROMPTS[1], [photos[0]], 8)
    assert tokens[camera] == oracle(PROMPTS[1], [photos[1]], 4)
    assert tokens[chat] == oracle(PROMPTS[0], [], 4)


@pytest.mark.parametrize("target", [0, -5, float("nan"), float("inf"), True, "50"])
def test_a_request_target_that_is_not_a_positive_number_is_refused(make_engine, target):
    engine = make_engine()
    with pytest.raises(ValueError, match="itl_target_ms must be a positive number"):
        engine.add_request(prompt=PROMPTS[0], itl_target_ms=target)
    assert not engine.has_unfinished_requests()
