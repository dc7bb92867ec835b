"""Chunking and batching change when tokens are computed, never what is computed: greedy tokens equal
transformers' `generate` for any budget, arrival order, and with or without preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import Engine, EngineConfig
from engine.presets import PRESETS, build_checkpoint
from tests.engine.conftest import DEVICE, PROMPTS, Job, run_jobs


def mixed_jobs(photos) -> list[Job]:
    bus, zidane = photos
    return [
        Job(PROMPTS[0], [], max_tokens=14),
        Job(PROMPTS[1], [bus], max_tokens=10, arrive_at_step=1),
        Job(PROMPTS[2], [bus, zidane], max_tokens=8, arrive_at_step=3),
        Job(PROMPTS[1], [zidane], max_tokens=9, arrive_at_step=6),
        Job("User: Say something short.<end_of_utterance>\nAssistant:", [], max_tokens=6, arrive_at_step=7),
    ]


@pytest.mark.parametrize("budget", [8, 13, 64, 4096])
def test_greedy_tokens_equal_generate_for_any_budget(make_engine, oracle, photos, budget):
    jobs = mixed_jobs(photos)
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=min(8, budget))
    tokens, trace = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i} at budget {budget}"
    assert max(stats.last_step_num_tokens for _, stats in trace) <= budget
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize(("backend", "cpu_linear", "compiled"),
                         [("reference", False, False), *(pytest.param(*case, marks=pytest.mark.skipif(
                             DEVICE != "cpu", reason="the CPU kernels' own paths")) for case in
                             [("cpu", False, False), ("reference", True, False), ("cpu", True, True)])])
def test_each_fast_path_gives_generate_s_tokens(make_engine, oracle, photos, backend, cpu_linear, compiled):
    """The reference path (gather+SDPA, torch's Linear, eager), then each CPU kernel alone (in-place decode
    attention, the small-batch Linear), then the compiled model over both, in float32."""
    jobs = mixed_jobs(photos)
    engine = make_engine(max_num_batched_tokens=13, max_num_seqs=8, attention_backend=backend, cpu_linear=cpu_linear,
                         compile_model=compiled)
    assert (engine.attention_backend, engine.cpu_linear, engine.compile_seconds > 0) == (backend, cpu_linear, compiled)
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        expected = oracle(job.prompt, job.images, job.max_tokens)
        assert tokens[i] == expected, f"job {i}, {backend}, {cpu_linear}, {compiled}"


def test_chunk_boundaries_fall_inside_image_spans(make_engine, photos):
    """The odd budgets above really cut image spans: some step computes image tokens of a tile that an
    earlier step had started."""
    engine = make_engine(max_num_batched_tokens=13, max_num_seqs=8)
    rid = engine.add_request(prompt=PROMPTS[1], images=[photos[0]])
    request = engine.requests[rid]
    positions = set(request.mm.placeholder_positions)
    cuts = []
    while engine.has_unfinished_requests() and request.num_computed_tokens < request.num_prompt_tokens:
        engine.step()
        cut = request.num_computed_tokens
        cuts.append(cut in positions and cut - 1 in positions)
    assert any(cuts)


@pytest.mark.parametrize("budget", [13, 64])
def test_greedy_tokens_equal_generate_under_preemption(make_engine, oracle, photos, budget):
    bus, zidane = photos
    # Each one-image prompt is about 100 tokens (7 blocks of 16) and grows to 9 blocks: 16 blocks admit
    # two or three prompts, which then cannot all grow.
    jobs = [
        Job(PROMPTS[1], [bus], max_tokens=40),
        Job(PROMPTS[1], [zidane], max_tokens=40, arrive_at_step=1),
        Job(PROMPTS[0], [], max_tokens=40, arrive_at_step=2),
        Job(PROMPTS[1], [zidane], max_tokens=20, priority=-1, arrive_at_step=12),
    ]
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=8, num_kv_blocks=16)
    tokens, _ = run_jobs(engine, jobs)
    assert engine.stats().num_preemptions > 0
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i}"
    assert engine.stats().kv_blocks_used == 0


def test_chunked_prefill_off_is_exact_too(make_engine, oracle, photos):
    jobs = mixed_jobs(photos)
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False)
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens)


def test_chat_messages_use_the_model_template(make_engine, oracle, photos):
    engine = make_engine()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    from engine import SamplingParams

    rid = engine.add_request(messages=messages, images=[photos[0]], sampling=SamplingParams(max_tokens=8))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    rendered = engine.adapter.render_messages(messages)
    assert rendered.count("<image>") == 1 and rendered.endswith("Assistant:")
    assert outputs[rid].token_ids == oracle(rendered, [photos[0]], 8)


@pytest.mark.parametrize("budget", [8, 13, 64])
def test_greedy_tokens_equal_generate_with_the_vision_tower_sliced_over_steps(make_engine, oracle, photos, budget):
    jobs = mixed_jobs(photos)
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=min(8, budget), encoder_slices_per_step=1)
    tokens, _ = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == oracle(job.prompt, job.images, job.max_tokens), f"job {i} at budget {budget}"
    # 2 layers of 5 slices a tile
    assert engine.stats().encoder_slices_run == 10 * engine.stats().encoder_inputs_encoded


@pytest.mark.parametrize("vision_heads", [2, 1])  # the tiny tower's two, and one (all in the first half)
def test_sliced_vision_tower_gives_the_same_features_bit_for_bit(photos, tmp_path, vision_heads):
    preset = PRESETS["tiny"]
    preset = replace(preset, vision=replace(preset.vision, heads=vision_heads))
    engine = Engine(EngineConfig(model=str(build_checkpoint(preset, tmp_path)), device=DEVICE, dtype="float32"))
    adapter = engine.adapter
    _, mm = adapter.process(PROMPTS[2], photos)
    inputs = mm.encoder_inputs
    whole = adapter.encode(inputs)
    sliced = [None] * len(inputs)
    for stage in range(adapter.encoder_slices):  # one fifth of a layer at a time
        sliced = adapter.encode_slices(inputs, sliced, stage, stage + 1)
    assert adapter.encoder_slices == 10 and len(sliced) == len(whole) == 10
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
