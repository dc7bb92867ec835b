"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`, vLLM's) against transformers' forward (float32): each
prompt token's score is the log-softmax of the model's logits at the position before it, with its rank and its
likeliest alternatives, for text and image prompts cut into chunks; a request that asks for them computes the whole
prompt even where its blocks are cached, and the others still find them."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from tests.engine.conftest import DEVICE, PROMPTS
from tests.engine.test_sampling_penalties import hf  # noqa: F401  (the fixture: transformers on the checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    """One engine for the module, its steps small enough that a prompt is scored over several chunks."""
    return Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", max_num_batched_tokens=32,
                               max_num_seqs=16))


def forward_logprobs(hf, prompt: str, images: list) -> tuple[list[int], torch.Tensor]:  # noqa: F811
    processor, model = hf
    inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt").to(DEVICE)
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return inputs["input_ids"][0].tolist(), torch.log_softmax(logits.float(), dim=-1)


def run(engine, prompt: str, images: list, params: SamplingParams):
    rid = engine.add_request(prompt=prompt, images=images, sampling=params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == rid]
    return outputs


@pytest.mark.parametrize("prompt", [0, 1])
def test_prompt_logprobs_equal_the_log_softmax_of_the_forward_logits(engine, hf, photos, prompt):  # noqa: F811
    images = photos[:1] if prompt == 1 else []
    ids, want = forward_logprobs(hf, PROMPTS[prompt], images)
    outputs = run(engine, PROMPTS[prompt], images, SamplingParams(max_tokens=3, prompt_logprobs=3))
    scored = outputs[0].prompt_logprobs
    assert all(out.prompt_logprobs is None for out in outputs[1:])
    assert len(scored) == len(ids) and scored[0] is None
    for position, got in enumerate(scored[1:]):
        row = want[position]
        assert got.token_id == ids[position + 1]
        assert got.logprob == pytest.approx(row[got.token_id].item(), abs=1e-4)
        assert got.rank == int((row > row[got.token_id]).sum()) + 1
        assert [token for token, _ in got.top] == row.topk(3).indices.tolist()
        assert [value for _, value in got.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_a_cached_prompt_is_scored_again_and_still_shared(engine):
    prompt = "User: Count the buses and the people waiting at the stop, one by one.<end_of_utterance>\nAssistant:"
    plain = run(engine, prompt, [], SamplingParams(max_tokens=2))
    first = run(engine, prompt, [], SamplingParams(max_tokens=2, prompt_logprobs=0))
    again = run(engine, prompt, [], SamplingParams(max_tokens=2, prompt_logprobs=0))
    after = run(engine, prompt, [], SamplingParams(max_tokens=2))
    assert plain[0].num_cached_tokens == 0 and after[0].num_cached_tokens > 0
    assert first[0].num_cached_tokens == again[0].num_cached_tokens == 0  # every position computed to be scored
    assert [lp.logprob for lp in first[0].prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in again[0].prompt_logprobs[1:]], abs=1e-4)
    assert first[-1].token_ids == plain[-1].token_ids == again[-1].token_ids
    assert all(lp.top == [] for lp in first[0].prompt_logprobs[1:])


def test_prompt_logprobs_out_of_range_name_the_field():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
