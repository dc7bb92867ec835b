"""Prefix caching: a request whose prompt starts like an earlier one takes its computed KV blocks (images
included, by content) instead of computing them again, and its tokens are those it would have had alone."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.presets import PRESETS, build_checkpoint
from tests.engine.conftest import DEVICE, PROMPTS, Job, oracle_for, run_jobs


def _finish(engine, prompt, images, max_tokens=10, **options):
    """Run one request (`options`: more add_request arguments) to its end, alone; its last output."""
    rid = engine.add_request(prompt=prompt, images=images, sampling=SamplingParams(max_tokens=max_tokens),
                             **options)
    out = None
    while engine.has_unfinished_requests():
        for item in engine.step():
            if item.request_id == rid:
                out = item
    return out


def test_a_chats_next_turn_over_one_photo_reuses_the_image_and_equals_generate(make_engine, oracle, photos):
    engine = make_engine(max_num_batched_tokens=64)
    first = _finish(engine, PROMPTS[1], [photos[0]])
    assert first.num_cached_tokens == 0 and first.token_ids == oracle(PROMPTS[1], [photos[0]], 10)
    encoded = engine.stats().encoder_inputs_encoded
    second_prompt = PROMPTS[1] + first.text + "<end_of_utterance>\nUser: And the colours?<end_of_utterance>\nAssistant:"
    second = _finish(engine, second_prompt, [photos[0]])
    assert second.token_ids == oracle(second_prompt, [photos[0]], 10)
    request_mm_end = engine.adapter.process(PROMPTS[1], [photos[0]])[1].placeholder_positions[-1]
    assert second.num_cached_tokens > request_mm_end  # the whole image span came from the cache
    assert second.num_cached_tokens % engine.pool.block_size == 0
    assert engine.stats().encoder_inputs_encoded == encoded  # the vision tower did not run again
    assert engine.stats().prefix_cache_hit_tokens == second.num_cached_tokens
    assert engine.stats().kv_blocks_used == 0


def test_the_same_tokens_with_another_image_are_not_reused(make_engine, oracle, photos):
    engine = make_engine()
    _finish(engine, PROMPTS[1], [photos[0]])
    other = photos[0].copy()
    other.paste((255, 0, 0), (0, 0, 64, 64))  # same size, so the same placeholder tokens; other pixels
    out = _finish(engine, PROMPTS[1], [other])
    first_image_token = engine.adapter.process(PROMPTS[1], [other])[1].placeholder_positions[0]
    assert out.num_cached_tokens <= first_image_token
    assert out.token_ids == oracle(PROMPTS[1], [other], 10)


def test_requests_that_share_blocks_while_running_and_preemption_keep_every_token(make_engine, oracle, photos):
    """Identical prompts arriving while the first still runs share its blocks; a cache this small also
    preempts, and a preempted request finds its own blocks again. Tokens equal generate, and equal the
    same run without caching."""
    bus, zidane = photos
    jobs = [Job(PROMPTS[1], [bus], max_tokens=30), Job(PROMPTS[1], [bus], max_tokens=30, arrive_at_step=8),
            Job(PROMPTS[1], [zidane], max_tokens=30, arrive_at_step=9),
            Job(PROMPTS[1], [bus], max_tokens=20, arrive_at_step=12)]
    results = {}
    for caching in (True, False):
        engine = make_engine(max_num_batched_tokens=32, num_kv_blocks=18, enable_prefix_caching=caching)
        results[caching], trace = run_jobs(engine, jobs)
        if caching:
            assert trace[-1][1].num_preemptions > 0
            assert trace[-1][1].prefix_cache_hit_tokens > 0
    assert results[True] == results[False]
    for i, job in enumerate(jobs):
        assert results[True][i] == oracle(job.prompt, job.images, job.max_tokens), i


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return str(build_checkpoint(PRESETS["tiny-gemma3"], tmp_path_factory.mktemp("tiny-gemma3")))


def test_a_cached_prefix_never_ends_inside_a_bidirectional_image_span(gemma3, photos):
    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=gemma3, device=DEVICE, dtype="float32", block_size=4,
                                 max_num_batched_tokens=64))
    prompt = engine.adapter.render_messages([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is here?"}]}])
    first = _finish(engine, prompt, [photos[0]], max_tokens=4)
    oracle = oracle_for(gemma3)
    longer = prompt + first.text + "ok"
    second = _finish(engine, longer, [photos[0]], max_tokens=6)
    assert second.token_ids == oracle(longer, [photos[0]], 6)
    mm = engine.adapter.process(longer, [photos[0]])[1]
    for unit in range(mm.num_inputs):
        assert not mm.input_first_position(unit) < second.num_cached_tokens <= mm.input_last_position(unit)
    assert second.num_cached_tokens > 0


def test_caching_off_finds_nothing(make_engine, photos):
    engine = make_engine(enable_prefix_caching=False)
    _finish(engine, PROMPTS[0], [])
    assert _finish(engine, PROMPTS[0], []).num_cached_tokens == 0
    assert engine.stats().prefix_cache_blocks == 0


def test_a_photo_sent_again_after_another_prefix_is_not_encoded_again(make_engine, oracle, photos):
    """The image's placeholders sit at other positions, so no KV block can be reused; its features can."""
    engine = make_engine(max_num_batched_tokens=64)
    _finish(engine, PROMPTS[1], [photos[0]])
    encoded = engine.stats().encoder_inputs_encoded
    tiles = engine.adapter.process(PROMPTS[1], [photos[0]])[1].num_inputs
    other = "User: Look at this.<image>Who is there?<end_of_utterance>\nAssistant:"
    out = _finish(engine, other, [photos[0]])
    assert out.token_ids == oracle(other, [photos[0]], 10)
    assert engine.stats().encoder_inputs_encoded == encoded
    assert engine.stats().encoder_cache_hits == tiles
    assert not engine.runner.encoder_features  # per-request references dropped once the spans were prefilled


def test_without_room_for_features_every_photo_is_encoded(make_engine, oracle, photos):
    engine = make_engine(encoder_cache_tokens=0)
    _finish(engine, PROMPTS[1], [photos[0]])
    encoded = engine.stats().encoder_inputs_encoded
    other = "User: Look at this.<image>Who is there?<end_of_utterance>\nAssistant:"
    assert _finish(engine, other, [photos[0]]).token_ids == oracle(other, [photos[0]], 10)
    assert engine.stats().encoder_inputs_encoded == 2 * encoded


def test_a_cached_prefix_that_ends_inside_an_image_span_resumes_exactly(make_engine, oracle, photos):
    """A first request is stopped partway through its image's placeholders; the same prompt and photo again
    finds the blocks computed so far, encodes the tile that the boundary cuts, and takes only its later rows."""
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=4, encoder_cache_tokens=0)
    first = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=10))
    mm = engine.requests[first].mm
    span_start, span_end = mm.placeholder_positions[0], mm.placeholder_positions[-1]
    middle = (span_start + span_end) // 2
    while engine.requests[first].num_computed_tokens < middle:
        engine.step()
    engine.abort(first)
    out = _finish(engine, PROMPTS[1], [photos[0]])
    assert span_start < out.num_cached_tokens <= span_end  # the boundary falls inside the span
    assert out.num_cached_tokens not in mm.placeholder_positions[:: mm.input_rows[0]]  # and inside a tile
    assert out.token_ids == oracle(PROMPTS[1], [photos[0]], 10)
