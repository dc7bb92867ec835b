"""Every model family is exact under chunked prefill: greedy tokens equal transformers' `generate` on the same
saved checkpoint for budgets that cut image spans at odd offsets, with requests of different image sizes
arriving while others decode, and under preemption; the vision encoder runs once per image."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from engine import Engine, EngineConfig, SamplingParams, lean_paths
from engine.models import ADAPTERS, resolve_checkpoint
from engine.models.base import image_tokens_attend_bidirectionally
from engine.presets import PRESETS
from engine.presets.checkpoints import FAMILY_BUILDERS
from engine.step_costs import ENCODER_GROUP
from tests.engine.conftest import Family, Job, run_jobs

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-llava", "tiny-llava-onevision", "tiny-gemma3"]
QWEN_FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]


def mixed_jobs(family: Family, images: dict[str, Image.Image]) -> list[Job]:
    bus, zidane, square = images["bus"], images["zidane"], images["square"]
    return [
        Job(family.prompt(0, "What is in a street scene?"), [], max_tokens=14),
        Job(family.prompt(1, "Describe the people."), [bus], max_tokens=10, arrive_at_step=1),
        Job(family.prompt(2, "Compare the two pictures."), [bus, zidane], max_tokens=8, arrive_at_step=3),
        Job(family.prompt(1, "Describe the people."), [square], max_tokens=9, arrive_at_step=6),
        Job(family.prompt(0, "Say something short."), [], max_tokens=6, arrive_at_step=7),
    ]


@pytest.mark.parametrize("budget", [7, 13, 64, 4096])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_generate_and_each_image_is_encoded_once(families, images, name, budget):
    family = families(name)
    jobs = mixed_jobs(family, images)
    engine = family.engine(max_num_batched_tokens=budget, max_num_seqs=min(4, budget))
    tokens, trace = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == family.oracle(job.prompt, job.images, job.max_tokens), f"{name} job {i} budget {budget}"
    assert max(stats.last_step_num_tokens for _, stats in trace) <= budget
    stats = engine.stats()  # the bus photo comes twice: encoded once, then its features reused
    assert stats.encoder_inputs_encoded + stats.encoder_cache_hits == sum(len(job.images) for job in jobs) == 4
    assert stats.encoder_inputs_encoded >= 3
    assert not engine.runner.encoder_features
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_generate_under_preemption(families, images, name):
    family = families(name)
    bus, zidane, square = images["bus"], images["zidane"], images["square"]
    describe = family.prompt(1, "Describe the people.")
    jobs = [
        Job(describe, [bus], max_tokens=60),
        Job(describe, [zidane], max_tokens=60, arrive_at_step=1),
        Job(family.prompt(0, "What is in a street scene?"), [], max_tokens=40, arrive_at_step=2),
        Job(describe, [square], max_tokens=20, priority=-1, arrive_at_step=12),
    ]
    block_size = 16
    probe = family.engine(num_kv_blocks=1024, block_size=block_size)
    longest = max(len(probe.adapter.process(job.prompt, job.images)[0]) for job in jobs)
    # Room for two of the longest prompts, not for both to grow by 60 tokens (nor for one grown by 60 beside the
    # other's prompt, however far apart their prefills run); one alone always fits.
    num_blocks = max(2 * -(-longest // block_size) + 1, -(-(longest + 60) // block_size))
    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4, num_kv_blocks=num_blocks, block_size=block_size)
    tokens, _ = run_jobs(engine, jobs)
    assert engine.stats().num_preemptions > 0
    for i, job in enumerate(jobs):
        assert tokens[i] == family.oracle(job.prompt, job.images, job.max_tokens), f"{name} job {i}"
    assert engine.stats().kv_blocks_used == 0


# Families whose vision tower runs a slice of a layer at a time (besides SmolVLM), and its slices: five a layer of
# the CLIP and SigLIP towers (LLaVA-1.5's features come from its second-to-last layer: the last never runs), two a
# block of Qwen2-VL's.
SLICED_TOWERS = {"tiny-llava": 5, "tiny-llava-onevision": 10, "tiny-gemma3": 10, "tiny-qwen2-vl": 10,
                 "tiny-qwen2.5-vl": 10}
LEAN_TOWERS = {"tiny-llava-onevision", "tiny-gemma3"}  # SigLIP's layers (CLIP's quick GELU and Qwen's run stock)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("name", SLICED_TOWERS)
@pytest.mark.parametrize("count", [1, 2])
def test_a_sliced_tower_gives_the_whole_tower_s_features(families, images, name, lean, count):
    """Slice by slice, the features of transformers' own get_image_features (a lone image, which LLaVA-OneVision
    tiles, and two of different sizes, which Qwen2-VL gives grids of their own), bit for bit with the stock
    layers and to float32's rounding with the lean ones (engine/lean_vision.py)."""
    from engine.cpu.routing import ROUTED

    engine = families(name).engine(lean_layers=lean)
    adapter = engine.adapter
    # Every row count through torch's GEMM: the whole tower and its slices may multiply different row counts, and
    # the row range each layer takes the C kernel for is a timing of this machine at start-up (engine/cpu/tuning.py).
    for module in adapter.model.modules():
        if isinstance(module, ROUTED):
            module.rows = (0, 0)
    assert adapter.encoder_slices == SLICED_TOWERS[name]
    lean_vision = lean_paths.vision_layers(adapter.vision_layers)
    assert (lean_vision is not None) == (lean and name in LEAN_TOWERS)
    photos = [images["bus"], images["zidane"]][:count]
    _, mm = adapter.process(families(name).prompt(count, "Compare."), photos)
    inputs = mm.encoder_inputs
    lean_paths.set_vision(adapter.vision_layers, None)
    whole = adapter.encode(inputs)  # transformers' own features
    lean_paths.set_vision(adapter.vision_layers, lean_vision)
    sliced = [None] * len(inputs)
    for stage in range(adapter.encoder_slices):
        sliced = adapter.encode_slices(inputs, sliced, stage, stage + 1)
    assert len(sliced) == len(whole) == count
    for want, got in zip(whole, sliced):
        if lean_vision is not None:
            assert (want - got).abs().max().item() <= 1e-4 * want.abs().max().item()
        else:
            assert torch.equal(want, got)


@pytest.mark.parametrize("name", SLICED_TOWERS)
def test_greedy_tokens_equal_generate_with_the_tower_a_slice_a_step(families, images, name):
    """One slice of the tower a step: the image prompts' encodings spread over the steps of the others' decodes,
    every slice run once an input, the tokens generate's."""
    family = families(name)
    jobs = mixed_jobs(family, images)
    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4, encoder_slices_per_step=1)
    tokens, trace = run_jobs(engine, jobs)
    for i, job in enumerate(jobs):
        assert tokens[i] == family.oracle(job.prompt, job.images, job.max_tokens), f"{name} job {i}"
    stats = engine.stats()
    assert stats.encoder_slices_run == engine.adapter.encoder_slices * stats.encoder_inputs_encoded > 0
    slices = [b.encoder_slices_run - a.encoder_slices_run for (_, a), (_, b) in zip(trace, trace[1:])]
    # one slice a step of each input in lockstep (at most ENCODER_GROUP of them), over as many steps as slices
    assert max(slices) <= ENCODER_GROUP and sum(1 for n in slices if n) >= engine.adapter.encoder_slices


@pytest.mark.parametrize(("heads", "hidden"), [(1, 32), (3, 48)])  # the one head in the first half; an odd split
@pytest.mark.parametrize("name", QWEN_FAMILIES)
def test_a_qwen_tower_with_any_head_count_sliced_gives_its_features(images, tmp_path, name, heads, hidden):
    """Qwen's five slices a block split the heads into halves (the odd head in the first): with one head and with
    three, two images of different grids a slice at a time give the whole tower's features bit for bit."""
    from engine.presets.checkpoints import build_checkpoint

    preset = PRESETS[name]
    preset = dataclasses.replace(preset, vision=dataclasses.replace(preset.vision, heads=heads, hidden=hidden))
    engine = Engine(EngineConfig(model=str(build_checkpoint(preset, tmp_path)), device="cpu", dtype="float32"))
    adapter = engine.adapter
    assert adapter.visual.blocks[0].attn.num_heads == heads and adapter.encoder_slices == 5 * preset.vision.layers
    processor_prompt = Family(name, engine.config.model, None).prompt(2, "Compare.")
    _, mm = adapter.process(processor_prompt, [images["bus"], images["zidane"]])
    whole = adapter.encode(mm.encoder_inputs)
    sliced = [None] * len(mm.encoder_inputs)
    for stage in range(adapter.encoder_slices):
        sliced = adapter.encode_slices(mm.encoder_inputs, sliced, stage, stage + 1)
    assert len(sliced) == len(whole) == 2
    for want, got in zip(whole, sliced):
        assert torch.equal(want, got)


@pytest.mark.parametrize("name", QWEN_FAMILIES)
def test_qwen_positions_are_mrope_with_a_delta_not_the_token_index(families, images, name, monkeypatch):
    family = families(name)
    job = Job(family.prompt(2, "Compare the two pictures."), [images["bus"], images["zidane"]], max_tokens=10)
    expected = family.oracle(job.prompt, job.images, job.max_tokens)

    engine = family.engine(max_num_batched_tokens=13, max_num_seqs=4)
    tokens, _ = run_jobs(engine, [job])
    assert tokens[0] == expected
    mm = engine.adapter.process(job.prompt, job.images)[1]
    grids = [tuple(unit["image_grid_thw"][0].tolist()) for unit in mm.encoder_inputs]
    assert grids[0] != grids[1]  # two resolutions, two token grids
    # An image of h x w tokens advances the positions by max(h, w) only: later tokens sit before their index.
    assert mm.rope_position_delta < 0
    assert not torch.equal(mm.rope_positions[0], torch.arange(mm.rope_positions.shape[1]))

    # The comparison above can fail: with positions taken from the token index the tokens differ.
    plain = family.engine(max_num_batched_tokens=13, max_num_seqs=4)
    token_index = lambda request, start, end: [range(start, end)] * 3  # noqa: E731
    monkeypatch.setattr(plain.adapter, "rope_positions", token_index)
    tokens, _ = run_jobs(plain, [job])
    assert tokens[0] != expected


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_messages_use_the_family_template(families, images, name):
    family = families(name)
    engine = family.engine()
    content = [{"type": "image"}, {"type": "text", "text": "Describe."}]
    rid = engine.add_request(
        messages=[{"role": "user", "content": content}], images=[images["bus"]], sampling=SamplingParams(max_tokens=8)
    )
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    rendered = family.prompt(1, "Describe.")
    assert rendered.count(engine.adapter.image_marker) == 1
    assert outputs[rid].token_ids == family.oracle(rendered, [images["bus"]], 8)


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_presets_resolve_by_name_and_load_with_their_adapter(name, monkeypatch, tmp_path):
    monkeypatch.setenv("VLMCAP_CACHE", str(tmp_path))
    engine = Engine(EngineConfig(model=name, device="cpu", dtype="float32"))
    assert type(engine.adapter).__name__ == {
        "tiny-qwen2-vl": "Qwen2VLAdapter",
        "tiny-qwen2.5-vl": "Qwen2VLAdapter",
        "tiny-llava": "LlavaAdapter",
        "tiny-llava-onevision": "LlavaOnevisionAdapter",
        "tiny-gemma3": "Gemma3Adapter",
    }[name]
    assert resolve_checkpoint(name).startswith(str(tmp_path))
    assert engine.adapter.atomic_inputs == (name == "tiny-gemma3")


# Parameter counts of the hub checkpoints these presets stand in for.
@pytest.mark.parametrize(
    "name,params",
    [
        ("qwen2-vl-2b", 2_208_985_600),
        ("qwen2.5-vl-3b", 3_754_622_976),
        ("llava-onevision-0.5b", 894e6),
        ("smolvlm-256m", 256e6),
        ("smolvlm-500m", 507e6),
        ("gemma3-4b", 4_300_079_472),
    ],
)
def test_dummy_presets_have_the_real_models_sizes(name, params):
    # The parameters do not depend on the tokenizer (the vocabulary is the text model's): a small one spares
    # training a real-size BPE (10 s or more for Qwen2's 151k tokens).
    preset = dataclasses.replace(PRESETS[name], tokenizer_vocab=1024)
    model_cls, config, _ = FAMILY_BUILDERS[type(preset)](preset)
    assert model_cls.__name__ in ADAPTERS
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = model_cls(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.005)


def test_bidirectional_image_attention_is_detected_from_the_model_type():
    from transformers import Gemma3Config, Qwen2VLConfig

    assert image_tokens_attend_bidirectionally(Gemma3Config())
    assert not image_tokens_attend_bidirectionally(Qwen2VLConfig())
