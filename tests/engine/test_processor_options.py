"""Processor options a request may set (`mm_processor_kwargs`): SmolVLM's `do_image_splitting`, which makes each
image one tile (an event's frames); greedy tokens equal `generate` on the same processor output; anything else
is refused by name."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.conftest import PROMPTS, oracle_for


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


@pytest.mark.parametrize(("options", "message"), [
    ({"size": {"longest_edge": 10**6}}, "'size' is not an option"),
    ({"do_image_splitting": "no"}, "must be a bool"),
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
