"""Processor options a request may set (`mm_processor_kwargs`): SmolVLM's `do_image_splitting`, which makes each
image one tile (an event's frames), and `size`, the edge an image is resized to before it is tiled
(`Engine.tiling_options`: no finer than the image's own pixels); greedy tokens equal `generate` on the same
processor output; anything else is refused by name, a `size` out of its bounds by its value."""

from __future__ import annotations

import dataclasses

import pytest
from PIL import Image

from engine import Engine, EngineConfig, SamplingParams
from engine.presets import PRESETS, build_checkpoint
from tests.engine.conftest import DEVICE, PROMPTS, oracle_for


def test_unsplit_images_are_one_tile_each_and_exact(make_engine, checkpoint, photos):
    engine = make_engine(max_num_batched_tokens=13, max_num_seqs=4)
    prompt = PROMPTS[2]  # two images
    expected = oracle_for(checkpoint, do_image_splitting=False)(prompt, photos, 8)
    split = engine.add_request(prompt=prompt, images=photos, sampling=SamplingParams(max_tokens=8))
    unsplit = engine.add_request(prompt=prompt, images=photos, sampling=SamplingParams(max_tokens=8),
                                 mm_processor_kwargs={"do_image_splitting": False})
    lengths = {rid: engine.requests[rid].num_prompt_tokens for rid in (split, unsplit)}
    assert engine.requests[unsplit].mm.num_inputs == 2  # one encoder input an image
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    assert lengths[unsplit] < lengths[split] // 3
    assert tokens[unsplit] == expected


def test_an_image_is_tiled_no_finer_than_its_pixels_and_exact(tmp_path, photos):
    """With tiles of 64 px up to 4 a side, the processor resizes every image to 256 px before tiling it (17
    inputs: 16 tiles and the global view); `tiling_options` resizes it to the fewest tiles that hold its pixels."""
    checkpoint = str(build_checkpoint(dataclasses.replace(PRESETS["tiny"], max_tiles_per_side=4), tmp_path))
    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", max_num_batched_tokens=13,
                                 max_num_seqs=4))
    assert engine.tiling_options(100, 80) == {"size": {"longest_edge": 128}}
    assert engine.tiling_options(129, 20) == {"size": {"longest_edge": 192}}
    assert engine.tiling_options(64, 40) == engine.single_input_options == {"do_image_splitting": False}
    assert engine.tiling_options(193, 100) is None and engine.tiling_options(1920, 1080) is None
    prompt, small = PROMPTS[1], [photos[0].resize((100, 80))]
    options = engine.tiling_options(*small[0].size)
    expected = oracle_for(checkpoint, **options)(prompt, small, 8)
    default = engine.add_request(prompt=prompt, images=small, sampling=SamplingParams(max_tokens=8))
    tiled = engine.add_request(prompt=prompt, images=small, sampling=SamplingParams(max_tokens=8),
                               mm_processor_kwargs=options)
    assert engine.requests[default].mm.num_inputs == 17
    assert engine.requests[tiled].mm.num_inputs == 5  # 2 x 2 tiles and the global view
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    assert tokens[tiled] == expected


def test_a_processor_that_does_not_split_images_gets_no_tiling_options(tmp_path):
    """A checkpoint whose processor keeps each image one tile by default (`do_image_splitting: false` in its
    processor_config.json) is tiled as its defaults tile it, and refuses `size` by name."""
    import json

    checkpoint = build_checkpoint(dataclasses.replace(PRESETS["tiny"], max_tiles_per_side=4), tmp_path)
    config_path = checkpoint / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor"]["do_image_splitting"] = False
    config_path.write_text(json.dumps(config))
    engine = Engine(EngineConfig(model=str(checkpoint), device=DEVICE, dtype="float32", max_num_seqs=4))
    assert engine.tiling_options(100, 80) is None
    with pytest.raises(ValueError, match="'size' is not an option of this checkpoint's processor"):
        engine.add_request(prompt=PROMPTS[1], images=[Image.new("RGB", (100, 80))],
                           mm_processor_kwargs={"size": {"longest_edge": 128}})


@pytest.mark.parametrize(("options", "message"), [
    ({"size": {"longest_edge": 10**6}}, r"'size' must be \{'longest_edge': n\} with n from a tile's 64 to the "
                                         r"processor's 128 pixels, got \{'longest_edge': 1000000\}"),
    ({"size": {"longest_edge": 32}}, "from a tile's 64 .* got {'longest_edge': 32}"),
    ({"size": {"longest_edge": True}}, "got {'longest_edge': True}"),
    ({"size": {"longest_edge": 96.0}}, "got {'longest_edge': 96.0}"),
    ({"size": {"shortest_edge": 64}}, "got {'shortest_edge': 64}"),
    ({"size": {"longest_edge": 64, "height": 64}}, "'size' must be {'longest_edge': n}"),
    ({"size": {str(i): i for i in range(10**4)}}, r"got \{'0': 0, .* '9': 9,$"),  # the value cut short
    ({"size": "128"}, "'size' must be a dict, got '128'"),
    ({"do_image_splitting": "no"}, "must be a bool"),
    ({"x": 1}, "'x' is not an option"),
])
def test_other_processor_options_are_refused_by_name(make_engine, photos, options, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt=PROMPTS[1], images=photos[:1], mm_processor_kwargs=options)
    assert not engine.requests


def test_families_without_options_refuse_every_one(families):
    engine = families("tiny-qwen2-vl").engine()
    with pytest.raises(ValueError, match="allowed: none"):
        engine.add_request(prompt=families("tiny-qwen2-vl").prompt(0, "hi"), mm_processor_kwargs={"x": 1})
