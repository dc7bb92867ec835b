"""min_tokens and stop_token_ids against transformers' `generate` (float32, greedy): min_tokens equals
min_new_tokens (end-of-sequence held back until then), stop_token_ids equals generate's eos_token_id list."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.conftest import PROMPTS
from tests.engine.test_sampling_penalties import MAX_TOKENS, greedy, hf, hf_generate, run  # noqa: F401


def test_stop_token_ids_end_where_generate_ends_on_them(make_engine, hf):  # noqa: F811
    plain, _ = hf_generate(hf, PROMPTS[0], [])
    stop_at = plain[3]  # a token the greedy output reaches at its fourth step
    expected, _ = hf_generate(hf, PROMPTS[0], [], eos_token_id=[stop_at])
    [(tokens, _)] = run(make_engine(), [(PROMPTS[0], [], greedy(stop_token_ids=[stop_at], ignore_eos=True))])
    assert tokens == expected
    assert tokens[-1] == stop_at and len(tokens) == plain.index(stop_at) + 1


def test_min_tokens_holds_back_stop_tokens_as_min_new_tokens_does(make_engine, hf):  # noqa: F811
    plain, _ = hf_generate(hf, PROMPTS[0], [])
    stop_at = plain[1]
    expected, _ = hf_generate(hf, PROMPTS[0], [], eos_token_id=[stop_at], min_new_tokens=6)
    engine = make_engine()
    [(tokens, _), (beside, _)] = run(engine, [
        (PROMPTS[0], [], greedy(stop_token_ids=[stop_at], ignore_eos=True, min_tokens=6)),
        (PROMPTS[0], [], greedy(stop_token_ids=[stop_at], ignore_eos=True)),
    ])
    assert tokens == expected
    assert stop_at not in tokens[:6]
    assert beside == plain[: plain.index(stop_at) + 1]  # the request beside it is not held back


def test_min_tokens_past_max_tokens_and_bad_stop_token_ids_are_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=["a"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
