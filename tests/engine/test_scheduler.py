"""The scheduler and the KV cache manager without a model: requests as token lists, a config, and the
SchedulerOutput of each step (the runner's part played by `update`, sampling token 7 at each chunk's end)."""

from __future__ import annotations

from engine import EngineConfig, SamplingParams
from engine.kv_cache import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import MultimodalPrompt, Request
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

BS = 4  # tokens a block


def request(rid: str, num_tokens: int, priority: int = 0, arrival: int = 0, first_token: int = 100) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(first_token, first_token + num_tokens)),
                   sampling=SamplingParams(), priority=priority, arrival=arrival, max_total_tokens=1000)


def scheduler(num_blocks: int = 64, **config) -> Scheduler:
    config = {"max_num_batched_tokens": 16, "max_num_seqs": 8, "block_size": BS, "watermark": 0.0} | config
    return Scheduler(EngineConfig(**config), BlockPool(num_blocks, BS))


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {c.request_id: 7 for c in out.chunks if c.samples})
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start, c.end) for c in out.chunks]


def test_decodes_first_then_prefill_chunks_then_admissions_in_priority_order_under_the_budget():
    s = scheduler()
    s.add(request("a", 10, arrival=0, first_token=500))
    s.add(request("urgent", 30, priority=-1, arrival=1))
    assert chunks(step(s)) == [("urgent", 0, 16)]
    assert chunks(step(s)) == [("urgent", 16, 30), ("a", 0, 2)]
    assert chunks(step(s)) == [("urgent", 30, 31), ("a", 2, 10)]  # urgent decodes: one token, before any chunk
    assert chunks(step(s)) == [("urgent", 31, 32), ("a", 10, 11)]


def test_max_num_seqs_caps_the_running_requests():
    s = scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(request(f"r{i}", 3, arrival=i, first_token=100 * i))
    assert [rid for rid, _, _ in chunks(step(s))] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_a_request_that_needs_a_block_preempts_the_lowest_priority_newest_one():
    s = scheduler(num_blocks=4)  # 16 tokens in all
    s.add(request("old", 8, arrival=0))
    s.add(request("new", 7, arrival=1, first_token=500))
    step(s)
    assert s.kv_cache_manager.pool.num_free == 0
    out = step(s)  # both decode; "old" needs its third block and none is free
    assert out.preempted == ["new"]
    assert chunks(out) == [("old", 8, 9)]
    new = next(r for r in s.waiting if r.request_id == "new")
    assert new.block_ids == [] and new.num_computed_tokens == 0 and new in s.waiting
    assert s.num_preemptions == 1


def test_a_second_request_with_the_same_prompt_starts_after_the_cached_blocks_leaving_its_last_token():
    s = scheduler()
    s.add(request("first", 12))
    step(s)
    s.add(request("second", 12, arrival=1))
    out = step(s)
    assert ("second", 8, 12) in chunks(out)  # blocks 0 and 1 found; block 2 holds the last token, recomputed
    second = s.requests[out.chunks[-1].request_id]
    assert second.block_ids[:2] == s.running[0].block_ids[:2]
    assert second.num_cached_tokens == 8
    stats = s.kv_cache_manager.stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (24, 8)


def test_blocks_are_found_only_after_the_step_that_computed_them():
    s = scheduler()
    s.add(request("a", 12))
    s.add(request("b", 12, arrival=1))
    assert chunks(step(s)) == [("a", 0, 12), ("b", 0, 4)]  # admitted together: b cannot read what a writes
    assert s.kv_cache_manager.stats().hit_tokens == 0


def test_a_preempted_request_finds_its_own_blocks_when_readmitted():
    s = scheduler(num_blocks=5)
    old, new = request("old", 8, arrival=0), request("new", 11, arrival=1, first_token=500)
    s.add(old)
    s.add(new)
    assert chunks(step(s)) == [("old", 0, 8), ("new", 0, 8)]
    assert step(s).preempted == ["new"]  # "old" needs a third block: the last empty one goes to it
    assert new.block_ids == []
    s.finish(old, "stop")
    assert chunks(step(s)) == [("new", 8, 11)]  # its two full blocks were still findable


def test_without_prefix_caching_nothing_is_found():
    s = scheduler(enable_prefix_caching=False)
    s.add(request("first", 12))
    step(s)
    s.add(request("second", 12, arrival=1))
    assert ("second", 0, 12) in chunks(step(s))
    assert s.kv_cache_manager.stats().cached_blocks == 0


# -- the manager alone ---------------------------------------------------------------------------------
def manager(num_blocks: int = 4, watermark: float = 0.0) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BS), EngineConfig(block_size=BS, watermark=watermark))


def test_allocate_refuses_with_nothing_changed_when_too_few_blocks_are_free():
    m = manager()
    a, b = request("a", 12), request("b", 8)
    assert m.allocate(a, 12)
    assert not m.allocate(b, 8)
    assert b.block_ids == [] and m.pool.num_free == 1
    m.free(a)
    assert a.block_ids == [] and m.pool.num_free == 4
    assert m.allocate(b, 8)


def test_admission_counts_the_whole_prompt_and_the_watermark():
    m = manager(num_blocks=10, watermark=0.2)  # 2 blocks kept back
    assert m.max_prompt_blocks() == 8
    assert m.can_admit(request("fits", 32), [])
    assert not m.can_admit(request("too long", 33), [])


def test_allocate_grows_a_table_block_by_block():
    m = manager(num_blocks=8)
    r = request("r", 20)
    for computed, added in [(0, 1), (1, 3), (4, 1), (5, 6)]:
        r.num_computed_tokens = computed
        assert m.allocate(r, added)
        assert len(r.block_ids) == m.pool.blocks_for(computed + added)
    assert len(set(r.block_ids)) == len(r.block_ids)


def test_a_shared_block_stays_held_until_its_last_reader_frees_it_and_a_cached_prefix_outlives_its_tail():
    s = scheduler(num_blocks=6)
    first = request("first", 9)
    s.add(first)
    step(s)  # blocks 0 and 1 full and registered; block 2 holds the last prompt token
    second = request("second", 9, arrival=1)
    s.add(second)
    step(s)
    manager = s.kv_cache_manager
    shared = first.block_ids[:2]
    assert second.block_ids[:2] == shared
    s.finish(first, "stop")
    assert manager.pool.num_unheld(shared) == 0  # "second" still reads them
    s.finish(second, "stop")
    assert manager.pool.num_unheld(shared) == 2 and manager.stats().cached_blocks == 2
    # Empty blocks go first; then the cached ones, a request's tail before its prefix.
    other = request("other", 4 * 5, first_token=900)
    assert manager.allocate(other, 4 * 5)
    assert manager.stats().cached_blocks == 1
    assert manager.computed_blocks(request("again", 9, arrival=2)) == (shared[:1], 4)


def runs(blocks: list[int]) -> int:
    """How many stretches of consecutive block ids `blocks` is made of."""
    return 1 + sum(b != a + 1 for a, b in zip(blocks, blocks[1:]))


def test_requests_decoding_in_lockstep_keep_their_blocks_in_runs():
    """Four prompts admitted together, prefilled a chunk at a time, then decoding a token a step each (a block
    every fourth step): each request's table stays one run of consecutive blocks, though their blocks are taken
    turn by turn; a request that starts once they are done takes a run of its own in the space between."""
    s = scheduler(num_blocks=128, max_num_batched_tokens=12)
    requests = [request(f"r{i}", 10, arrival=i, first_token=100 * i) for i in range(4)]
    for r in requests:
        s.add(r)
    for _ in range(60):
        step(s)
    assert all(len(r.block_ids) >= 15 for r in requests)
    assert [runs(r.block_ids) for r in requests] == [1, 1, 1, 1]
    late = request("late", 30, arrival=9, first_token=900)
    s.add(late)
    for _ in range(6):
        step(s)
    assert runs(late.block_ids) == 1 and not set(late.block_ids) & {b for r in requests for b in r.block_ids}


def test_a_new_run_starts_in_the_middle_of_the_widest_stretch_of_empty_blocks():
    """Room on both sides: the run before the stretch and the new one can grow; at the cache's start the run takes
    the stretch's start; where no two empty blocks are adjacent, the first empty block."""
    for empty, n, expected in ((list(range(5, 10)) + list(range(20, 36)) + [38], 4, [26, 27, 28, 29]),
                               (list(range(0, 10)) + list(range(12, 40)), 2, [25, 26]),
                               (list(range(0, 30)), 2, [0, 1]),
                               ([3, 7, 11], 2, [3, 7])):
        pool = BlockPool(40, BS)
        pool.free([b for b in pool.allocate(40) if b in empty])
        assert pool.allocate(n) == expected, empty


def test_the_widest_stretch_is_kept_track_of_through_any_allocations_and_releases():
    """Random requests taking, continuing and releasing runs, some blocks registered: the stretches the pool keeps
    as blocks are taken and released are those a scan of its empty blocks finds, and each new run starts where that
    scan says the widest one is."""
    import random
    import re

    rng = random.Random(1)
    for _ in range(40):
        pool = BlockPool(rng.randint(1, 200), BS)
        held: list[list[int]] = []
        for step_index in range(150):
            assert pool._stretches == {m.start(): m.end() for m in re.finditer(b"\x01+", pool._empty)}
            if rng.random() < 0.5 and pool.num_free:
                n = rng.randint(1, min(5, pool.num_free))
                after = rng.choice(held)[-1] if held and rng.random() < 0.5 else None
                expected = None
                if after is None and pool._num_empty:  # a new run, in the widest stretch
                    widest = max(re.finditer(b"\x01+", pool._empty), key=lambda m: (len(m.group()), -m.start()))
                    begin, end = widest.span()
                    expected = begin if begin == 0 else begin + max(0, (end - begin - n) // 2)
                blocks = pool.allocate(n, after)
                assert expected is None or blocks[0] == expected
                for block in blocks:
                    if rng.random() < 0.5:
                        pool.register(block, f"{block} {step_index}".encode())
                held.append(blocks)
            elif held:
                pool.free(held.pop(rng.randrange(len(held))))


def test_with_no_empty_block_the_least_recently_released_blocks_come_in_the_cache_s_order():
    """A request releases its blocks last first; a later chunk that evicts them takes them as one run, in order, and
    a prefix released after them stays findable."""
    pool = BlockPool(10, BS)
    old, recent = pool.allocate(6), pool.allocate(4)
    assert (old, recent) == ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9])
    for block in old + recent:
        pool.register(block, bytes([block]))
    pool.free(old)
    pool.free(recent)
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert pool.find([bytes([0]), bytes([1]), bytes([2])]) == [0, 1]
    assert pool.find([bytes([6]), bytes([7]), bytes([8]), bytes([9])]) == [6, 7, 8, 9]


def test_a_run_takes_the_next_cached_block_only_if_it_was_released_long_ago():
    """The block after a run's last one is cached and nobody holds it: the run takes it (its hash forgotten) where
    it was released before half of such blocks, and goes on elsewhere where it was released recently, so that the
    prefix a chat's next turn asks for stays findable."""
    for recent in (False, True):
        pool = BlockPool(12, BS)
        blocks = pool.allocate(7)
        assert blocks == list(range(7))  # one run, from the cache's start
        for block in blocks[1:]:
            pool.register(block, bytes([block]))
        for block in (2, 3, 4, 5, 6, 1) if recent else (1, 2, 3, 4, 5, 6):
            pool.free([block])
        (taken,) = pool.allocate(1, after=0)
        assert (taken == 1) is not recent
        assert pool.find([bytes([1])]) == ([1] if recent else [])
        assert pool.num_cached == (6 if recent else 5) and pool.num_free == 10


# -- prompts in order ----------------------------------------------------------------------------------
def photo_request(rid: str, first: int, tiles: int, arrival: int, rows: int = 4, slices: int = 1) -> Request:
    """A prompt with `tiles` encoder inputs of `rows` placeholders from position `first`, then 3 text tokens."""
    mm = MultimodalPrompt(placeholder_positions=list(range(first, first + tiles * rows)),
                          input_row_starts=[u * rows for u in range(tiles)], input_rows=[rows] * tiles,
                          encoder_inputs=[{} for _ in range(tiles)], encoder_slices=slices)
    tokens = list(range(100 * arrival, 100 * arrival + first + tiles * rows + 3))
    return Request(request_id=rid, prompt_token_ids=tokens, sampling=SamplingParams(), priority=0, arrival=arrival,
                   max_total_tokens=1000, mm=mm)


def test_a_waiting_chat_goes_before_a_running_camera_prompts_next_chunk():
    s = scheduler()
    s.add(request("camera", 40, priority=5))
    assert chunks(step(s)) == [("camera", 0, 16)]
    s.add(request("chat", 10, arrival=1, first_token=500))
    assert chunks(step(s)) == [("chat", 0, 10), ("camera", 16, 22)]  # the camera prompt gets what is left


def test_prompts_behind_one_that_can_take_nothing_get_what_it_leaves():
    """One tile a step: "a" encodes its first tile; "b" starts with a tile of its own, which must wait, so it is
    not admitted; the text prompt behind both takes the tokens they leave."""
    s = scheduler(max_encoder_tokens_per_step=4)
    s.add(photo_request("a", first=2, tiles=3, arrival=0))
    s.add(photo_request("b", first=0, tiles=3, arrival=1))
    s.add(request("text", 6, arrival=2, first_token=900))
    out = step(s)
    assert chunks(out) == [("a", 0, 6), ("text", 0, 6)]
    assert [(w.request_id, w.index) for w in out.encoder_work] == [("a", 0)]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_two_photo_prompts_arriving_together_finish_one_after_the_other():
    """Under a time budget that fits eight and a half towers a step: the first prompt's six run in the step they
    arrive (two groups) and only the time left goes to the second's, so the first yields its first token steps
    before the second."""
    from engine.step_costs import PLANNED_SHARE, StepCosts

    costs = StepCosts(0.0185 / PLANNED_SHARE, fixed=0.010, per_token=1e-6, ready=True)
    costs.per_encoder_row = 1e-4  # a tower of 10 rows: 1 ms
    config = EngineConfig(max_num_batched_tokens=512, max_num_seqs=8, block_size=BS, watermark=0.0,
                          max_encoder_tokens_per_step=None, itl_target_ms=costs.target * 1e3)
    s = Scheduler(config, BlockPool(256, BS), costs=costs)
    first, second = (photo_request(rid, first=2, tiles=6, arrival=i, rows=10, slices=5)
                     for i, rid in enumerate(("first", "second")))
    s.add(first)
    s.add(second)
    out = step(s)
    assert [(w.index, w.first, w.end) for w in out.encoder_work if w.request_id == "first"] == [
        (u, 0, 5) for u in range(6)]
    towers = sum((w.end - w.first) / 5 for w in out.encoder_work if w.request_id == "second")
    assert 0 < towers <= 2.5  # the time the first leaves
    sampled_at = {}
    for number in range(1, 20):
        for c in out.chunks:
            if c.samples:
                sampled_at.setdefault(c.request_id, number)
        if len(sampled_at) == 2:
            break
        out = step(s)
    assert sampled_at["first"] < sampled_at["second"]


def test_a_decode_with_forced_tokens_computes_them_in_one_chunk_leaving_a_token_for_each_other_decode():
    s = scheduler(max_num_batched_tokens=12)
    a, b, c = (request(rid, 3, arrival=i, first_token=100 * (i + 1)) for i, rid in enumerate("abc"))
    for r in (a, b, c):
        s.add(r)
    step(s)
    a.output_token_ids += [8] * 10  # ten tokens its grammar forced after its sampled one (engine/engine.py)
    a.num_forced = 10
    assert a.is_decoding
    out = step(s)
    assert chunks(out) == [("a", 3, 13), ("b", 3, 4), ("c", 3, 4)]
    assert [c.samples for c in out.chunks] == [False, True, True]
    assert a.is_decoding and a.num_forced == 0  # the last forced token is its next decode
    out = step(s)
    assert chunks(out) == [("a", 13, 14), ("b", 4, 5), ("c", 4, 5)] and all(c.samples for c in out.chunks)


# -- a request's own target ----------------------------------------------------------------------------
def timed_scheduler(target_ms: float = 100.0) -> Scheduler:
    """Steps budgeted by time: 10 ms fixed, 1 ms a token (no key or encoder cost), planned to 85 ms of 100."""
    from engine.step_costs import StepCosts

    costs = StepCosts(target_ms * 1e-3, fixed=0.010, per_token=0.001, ready=True)
    config = EngineConfig(max_num_batched_tokens=512, max_num_seqs=8, block_size=BS, watermark=0.0,
                          itl_target_ms=target_ms)
    return Scheduler(config, BlockPool(256, BS), costs=costs)


def decoding(s: Scheduler, rid: str, priority: int, target_ms: float | None, arrival: int = 0) -> Request:
    """A request of `priority` with its own target, stepped until it decodes."""
    r = request(rid, 3, priority=priority, arrival=arrival, first_token=700)
    r.itl_target_ms = target_ms
    s.add(r)
    step(s)
    assert r.is_decoding
    return r


def test_a_decoding_request_with_its_own_target_bounds_the_less_urgent_prompts_after_it():
    """The alert decodes (1 ms) under its own target, planned to 17.5 ms: a camera prompt behind it gets what that
    leaves after the fixed 10 ms and the decode (6 tokens, instead of the step target's 74)."""
    from engine.step_costs import PLANNED_SHARE

    own = 17.5 / PLANNED_SHARE
    for target, expected in ((own, 6), (None, 74)):
        s = timed_scheduler()
        decoding(s, "alert", 5, target)
        s.add(request("camera", 200, priority=10, arrival=1))
        assert chunks(step(s)) == [("alert", 3, 4), ("camera", 0, expected)]


def test_prompts_before_it_keep_the_step_target_and_those_after_it_get_no_least_progress():
    """A chat's prompt (more urgent) is prefilled whole although the alert's target is spent by it; the camera
    prompt and a second alert (same priority, later) then get nothing, not even the step's first block."""
    from engine.step_costs import PLANNED_SHARE

    s = timed_scheduler()
    decoding(s, "alert", 5, 17.5 / PLANNED_SHARE)
    s.add(request("camera", 200, priority=10, arrival=1))
    s.add(request("later-alert", 30, priority=5, arrival=2, first_token=300))
    out = step(s)
    assert chunks(out) == [("alert", 3, 4), ("later-alert", 0, 6)]
    s.add(request("chat", 40, priority=0, arrival=3, first_token=500))
    assert chunks(step(s)) == [("alert", 4, 5), ("chat", 0, 40)]  # the chat's 40 ms leave nothing under 17.5
    s = timed_scheduler()
    decoding(s, "alert", 5, 1e-3)  # a target its decode alone is over
    s.add(request("camera", 200, priority=10, arrival=1))
    assert chunks(step(s)) == [("alert", 3, 4)]  # no least progress: the camera waits for the alert's last token


def test_a_request_target_bounds_nothing_under_a_token_budget():
    s = scheduler()  # no cost model: tokens only
    decoding(s, "alert", 5, 1e-3)
    s.add(request("camera", 40, priority=10, arrival=1))
    assert chunks(step(s)) == [("alert", 3, 4), ("camera", 0, 15)]


def test_an_atomic_span_is_not_taken_whole_past_a_request_target():
    """A Gemma 3-like prompt whose next span (40 placeholders, its tower cached) is larger than what the alert's
    target leaves is not taken whole as a lone prefill would be: it waits for the alert's last token."""
    from engine.step_costs import PLANNED_SHARE

    for target, expected in ((17.5 / PLANNED_SHARE, []), (None, [("camera", 0, 40)])):
        s = timed_scheduler(target_ms=30.0)  # planned to 25.5 ms: 40 placeholders (40 ms) never fit
        decoding(s, "alert", 5, target)
        camera = photo_request("camera", first=0, tiles=1, arrival=1, rows=40)
        camera.priority, camera.mm.atomic_inputs = 10, True
        s.encoder_inputs.progress["camera"] = {0: 1}  # its tower has run
        s.add(camera)
        assert chunks(step(s))[1:] == expected
