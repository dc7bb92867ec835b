"""How the runner packs decodes and masks prefill chunks for attention (exactness of the result is
test_exactness's and test_families's job)."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.presets import PRESETS, build_checkpoint
from engine.scheduler import ScheduledChunk
from tests.engine.conftest import DEVICE


def _groups(runner, decodes):
    """The runner's decode batches, each with the masks and tables it builds for them."""
    built = []
    for group in runner._decode_groups(decodes):
        width = max(len(blocks) for _, _, blocks in group)
        tables = torch.tensor([blocks + [0] * (width - len(blocks)) for _, _, blocks in group])
        built.append(runner._decode_group(torch.tensor([i for i, _, _ in group]),
                                          torch.tensor([n for _, n, _ in group]), tables))
    return built


def test_a_long_context_among_short_ones_is_attended_in_its_own_batch(make_engine):
    runner = make_engine(block_size=16).runner
    # (packed query index, context length, cache blocks)
    short = [(i, 40 + i, [i * 3, i * 3 + 1, i * 3 + 2]) for i in range(8)]
    long = (8, 1700, list(range(100, 207)))
    groups = _groups(runner, [*short, long])
    assert [group.query_index.tolist() for group in groups] == [[8], [7, 6, 5, 4, 3, 2, 1, 0]]
    alone, together = groups
    assert alone.block_tables.shape == (1, 107) and alone.mask.sum() == 1700
    assert together.block_tables.shape == (8, 3)
    assert together.mask[:, 0, 0].sum(dim=1).tolist() == [47, 46, 45, 44, 43, 42, 41, 40]
    assert together.block_tables[0].tolist() == [21, 22, 23]


def test_similar_contexts_share_one_batch(make_engine):
    runner = make_engine(block_size=16).runner
    contexts = [100 + 10 * i for i in range(6)]
    groups = _groups(runner, [(i, n, list(range(20 * i, 20 * i + -(-n // 16)))) for i, n in enumerate(contexts)])
    assert len(groups) == 1 and groups[0].query_index.tolist() == [5, 4, 3, 2, 1, 0]
    assert groups[0].block_tables.shape == (6, 10)  # 150 positions in blocks of 16
    assert groups[0].mask[:, 0, 0].sum(dim=1).tolist() == contexts[::-1]


def test_gemma3_masks_are_transformers_own_block_and_window_rules(tmp_path, photos):
    """Gemma 3's image tokens see every token of their own image, and its local layers only keys less than
    the window behind; the runner's masks for prefill chunks equal transformers' own mask functions."""
    from transformers import AutoProcessor
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    checkpoint = build_checkpoint(PRESETS["tiny-gemma3"], tmp_path)
    engine = Engine(EngineConfig(model=str(checkpoint), device=DEVICE, dtype="float32"))
    prompt = engine.adapter.render_messages([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Left, right:"}, {"type": "image"}]}])
    rid = engine.add_request(prompt=prompt, images=photos, sampling=SamplingParams(max_tokens=1))
    request = engine.requests[rid]
    processor = AutoProcessor.from_pretrained(checkpoint)
    types = processor(text=[prompt], images=[photos], return_tensors="pt")["token_type_ids"]
    blocks = get_block_sequence_ids_for_mask(types)
    full = or_masks(causal_mask_function, blockwise_overlay(blocks))
    window = engine.adapter.sliding_window
    local = and_masks(full, sliding_window_overlay(window))
    n = request.num_prompt_tokens
    queries, keys = torch.arange(n)[:, None], torch.arange(n)[None, :]
    expected_full, expected_local = full(0, 0, queries, keys), local(0, 0, queries, keys)
    second_image = request.mm.unit_first_position(1)
    assert window < request.mm.unit_rows[0]  # the window cuts into an image's own block
    for start, end in [(0, n), (0, second_image), (second_image, n)]:
        mask, sliding = engine.runner._prefill_masks(ScheduledChunk(request, start, end - start))
        if mask is None:  # plain causal
            mask = torch.ones(end - start, end, dtype=torch.bool).tril(start)
        assert torch.equal(mask, expected_full[start:end, :end]), (start, end)
        assert torch.equal(sliding, expected_local[start:end, :end]), (start, end)
