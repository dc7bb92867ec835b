"""The sampler's distribution against transformers' own logits warpers (temperature, top_k, top_p): what it draws
from each row is what `generate` would sample from, on every path (the whole vocabulary, top_k candidates, top_p
within the likeliest tokens, top_p over a sorted vocabulary)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import engine.sampling
from engine.sampling import SamplingParams, sample

VOCAB = 50
ROWS = 2000  # rows a call, each with its own generator
CALLS = 10


def reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return torch.softmax(warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0], dim=-1)


# TOP_P_CANDIDATES's first set is within VOCAB, its others over it: top_p rows race among their 32 likeliest where
# those hold the prefix, else sort the whole vocabulary; (8,) likewise with 8 (the flat row's prefix sorted);
# (2, 12, 30): sets of 2, 12 and 30 in turn (the peaked row's prefix held by 2, the flat row's by 30).
@pytest.mark.parametrize("candidates", [engine.sampling.TOP_P_CANDIDATES, (8,), (2, 12, 30)])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),  # with 8 candidates: a prefix longer than they are, sorted
    SamplingParams(temperature=0.5, top_p=0.5),  # a prefix within 8
    SamplingParams(temperature=0.9, top_k=20, top_p=0.6),
], ids=["whole", "top_k", "top_p", "top_p_peaked", "top_k_top_p"])
def test_draws_follow_transformers_warped_distribution(params, candidates, monkeypatch):
    monkeypatch.setattr(engine.sampling, "TOP_P_CANDIDATES", candidates)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 2
    expected = reference(logits, params)
    counts = torch.zeros(VOCAB)
    for call in range(CALLS):
        generators = [torch.Generator().manual_seed(call * ROWS + row) for row in range(ROWS)]
        tokens, failed, _ = sample(logits.expand(ROWS, VOCAB).clone(), [params] * ROWS, generators)
        assert not any(failed)
        counts += torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    drawn = counts / counts.sum()
    assert set(drawn.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())  # never cut ones
    assert 0.5 * (drawn - expected).abs().sum() < 0.02  # total variation, 20,000 draws


def test_a_row_of_nan_or_without_a_finite_logit_fails_alone():
    logits = torch.randn(3, VOCAB)
    logits[0, 4] = float("nan")
    logits[1] = float("-inf")
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=1.0)]
    tokens, failed, _ = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert failed == [True, True, False] and 0 <= tokens[2] < VOCAB


def test_a_seeded_row_draws_the_same_token_whatever_the_other_rows_ask():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    alone, _, _ = sample(logits[:1].clone(), [mine], [torch.Generator().manual_seed(5)])
    others = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.0), SamplingParams()]
    batched, _, _ = sample(logits.clone(), [mine, *others], [torch.Generator().manual_seed(5)] + [
        torch.Generator().manual_seed(9), torch.Generator().manual_seed(10), None])
    assert batched[0] == alone[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=1.0, top_k=40, seed=3),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=3),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.5, seed=3)],
                         ids=["whole", "top_k", "top_p", "top_k_top_p"])
def test_a_forced_tokens_draws_are_those_of_sampling_it(params):
    """Jump-forward appends a token its grammar forces without sampling (engine/output_processor.py): it draws
    what sampling that token would have, so the request's next sampled token is the same either way."""
    from engine.sampling import draw_as_sampled

    vocab = 1000
    forced = torch.full((1, vocab), float("-inf"))
    forced[0, 17] = 3.0  # the grammar's mask leaves one token
    sampled, skipped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert sample(forced, [params], [sampled])[0] == [17]
    draw_as_sampled(params, skipped, vocab, torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=sampled), torch.rand(4, generator=skipped))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_s_argmax_ties_nan_and_infinities_too(dtype):
    """`engine.sampling.argmax` (max's indices, for speed) picks what torch.argmax picks: the first of equal maxima
    however far apart in a 49,152-token row, a NaN over any number, +inf, a row of -inf's first."""
    torch.manual_seed(0)
    rows = torch.randn(9, 49152).to(dtype)
    rows[0, [5, 30000, 49151]] = 50.0  # ties far apart
    rows[1, [40000, 49000]] = 50.0
    rows[2, 777] = float("nan")
    rows[2, 12] = float("inf")
    rows[3] = float("-inf")
    rows[4, [100, 200]] = float("inf")
    rows[5] = 0.0
    rows[6, 49151] = 50.0  # the last column
    got = engine.sampling.argmax(rows)
    assert torch.equal(got, rows.argmax(dim=-1))
    assert got[:7].tolist() == [5, 40000, 777, 0, 100, 0, 49151]
