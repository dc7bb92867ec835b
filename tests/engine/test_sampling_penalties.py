"""Log-probabilities and penalties against transformers' `generate` (float32, greedy): logprobs equal the
log-softmax of `output_scores`, repetition_penalty equals RepetitionPenaltyLogitsProcessor, presence and frequency
penalties equal OpenAI's formula run as a logits processor; a request beside them keeps its own tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import DEVICE, PROMPTS

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    return processor, model


def hf_generate(hf, prompt: str, images: list, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    processor, model = hf
    inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt").to(DEVICE)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(score[0].float(), dim=-1) for score in out.scores]


def run(engine, requests: list[tuple[str, list, SamplingParams]]) -> list[tuple[list[int], list]]:
    ids = [engine.add_request(prompt=prompt, images=images, sampling=params) for prompt, images, params in requests]
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
            logprobs[out.request_id] += out.new_logprobs or []
    return [(tokens[rid], logprobs[rid]) for rid in ids]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, **kwargs)


@pytest.mark.parametrize("prompt", [0, 1])
def test_logprobs_equal_the_log_softmax_of_generate_scores(make_engine, hf, photos, prompt):
    images = photos[:1] if prompt == 1 else []
    expected_tokens, expected = hf_generate(hf, PROMPTS[prompt], images)
    [(tokens, logprobs)] = run(make_engine(), [(PROMPTS[prompt], images, greedy(logprobs=5))])
    assert tokens == expected_tokens
    for step, (got, want) in enumerate(zip(logprobs, expected, strict=True)):
        assert got.token_id == tokens[step]
        assert got.logprob == pytest.approx(want[got.token_id].item(), abs=1e-4)
        top_values, top_ids = want.topk(5)
        assert [token for token, _ in got.top] == top_ids.tolist()
        assert [value for _, value in got.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("penalty", [0.3, 3.0])
def test_repetition_penalty_equals_transformers_processor(make_engine, hf, penalty):
    plain, _ = hf_generate(hf, PROMPTS[0], [])
    expected, expected_logprobs = hf_generate(hf, PROMPTS[0], [], repetition_penalty=penalty)
    assert expected != plain  # the penalty changes this output, so the comparison below can fail
    [(tokens, logprobs)] = run(make_engine(), [(PROMPTS[0], [], greedy(repetition_penalty=penalty, logprobs=0))])
    assert tokens == expected
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        [want[t].item() for want, t in zip(expected_logprobs, tokens)], abs=1e-4)


def test_presence_and_frequency_penalties_follow_openai_formula_and_spare_neighbours(make_engine, hf):
    from transformers import LogitsProcessor, LogitsProcessorList

    presence, frequency = 2.0, 1.5
    prompt_len = hf[0](text=[PROMPTS[0]], return_tensors="pt")["input_ids"].shape[1]

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            counts = torch.zeros_like(scores).scatter_add_(
                1, input_ids[:, prompt_len:], torch.ones_like(input_ids[:, prompt_len:], dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    plain, _ = hf_generate(hf, PROMPTS[0], [])
    expected, _ = hf_generate(hf, PROMPTS[0], [],
                              logits_processor=LogitsProcessorList([OpenAIPenalties()]))
    assert expected != plain
    (penalized, _), (neighbour, _) = run(make_engine(), [
        (PROMPTS[0], [], greedy(presence_penalty=presence, frequency_penalty=frequency)),
        (PROMPTS[0], [], greedy()),
    ])
    assert penalized == expected and neighbour == plain


@pytest.mark.parametrize("field,value", [
    ("top_k", 10**400), ("top_k", -2), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", float("-inf")), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-320), ("logprobs", 21), ("max_tokens", 10**400), ("seed", 2**64),
])
def test_values_the_sampler_cannot_compute_are_value_errors(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_over_the_vocabulary_is_refused_by_the_engine(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="top_k is 100000, over the model's vocabulary"):
        engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(top_k=100_000, temperature=1.0))
    assert SamplingParams(top_k=-1).top_k == 0


def _dense_penalties(logits: torch.Tensor, params: list[SamplingParams], histories) -> torch.Tensor:
    """The penalties' formula over whole rows (what `apply_penalties` computes on the cells it touches)."""
    out = logits.clone()
    for row, (p, (prompt, output)) in enumerate(zip(params, histories)):
        x = out[row]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[torch.tensor(prompt + output, dtype=torch.long)] = True
            x = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x)
        counts = torch.zeros_like(x)
        counts.index_put_((torch.tensor(output, dtype=torch.long),), torch.ones(len(output)), accumulate=True)
        out[row] = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
    return out


def test_penalties_touch_only_their_tokens_bit_for_bit_as_the_whole_rows_formula():
    """`apply_penalties` gathers the (row, token) cells of the rows' histories: the same bits as the formula over
    whole rows, for rows with each penalty, none, repeats in the prompt and output, negative and zero logits; a
    history token outside the logits' columns is refused by name."""
    from engine.sampling import apply_penalties

    torch.manual_seed(4)
    vocab = 1000
    logits = torch.randn(6, vocab) * 3
    logits[:, :4] = torch.tensor([0.0, -0.0, -2.5, 2.5])
    params = [SamplingParams(repetition_penalty=1.1), SamplingParams(), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-1.3, repetition_penalty=0.8),
              SamplingParams(frequency_penalty=-0.4, presence_penalty=1.9, repetition_penalty=3.0),
              SamplingParams(repetition_penalty=1.1)]
    histories = [(list(range(4)) + [7, 7, 999], [3, 3, 500]), ([1, 2], [3]), ([5], [6, 6, 6, 0]),
                 ([], [9, 9, 1]), (list(range(0, 1000, 7)), list(range(0, 1000, 11)) * 2), ([], [])]
    want = _dense_penalties(logits, params, histories)
    got = logits.clone()
    apply_penalties(got, params, histories)
    assert torch.equal(got, want) and not torch.equal(got, logits)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[5], logits[5])  # no penalty; no history
    distinct = logits.clone()  # prompts as the distinct ids a request keeps (Request.distinct_prompt_ids)
    apply_penalties(distinct, params, [(np.unique(np.array(prompt, dtype=np.int64)), output)
                                       for prompt, output in histories])
    assert torch.equal(distinct, want)
    with pytest.raises(ValueError, match="outside the logits' 1000 columns"):
        apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=1.2)], [([3, 1000], [])])
