"""`cache_salt` (vLLM's name and meaning): requests with different salts share no cached block and no image
features, so `num_cached_tokens` tells one client nothing of another's prompts or photos; requests with the
same salt share as before; tokens are those each request has alone, with or without a salt."""

from __future__ import annotations

import pytest

from engine.block_hash import MAX_CACHE_SALT
from tests.engine.conftest import PROMPTS
from tests.engine.test_prefix_cache import _finish


def finish(engine, prompt, images, cache_salt=None):
    return _finish(engine, prompt, images, max_tokens=6, cache_salt=cache_salt)


def test_different_salts_share_no_block_and_no_image_features(make_engine, oracle, photos):
    engine = make_engine(max_num_batched_tokens=64)
    expected = oracle(PROMPTS[1], [photos[0]], 6)
    first = finish(engine, PROMPTS[1], [photos[0]], cache_salt="alice")
    assert (first.num_cached_tokens, first.token_ids) == (0, expected)
    encoded = engine.stats().encoder_inputs_encoded
    for salt in ("bob", None, "alice "):  # another client, the unsalted cache, a near miss
        other = finish(engine, PROMPTS[1], [photos[0]], cache_salt=salt)
        assert (other.num_cached_tokens, other.token_ids) == (0, expected), salt
        assert engine.stats().encoder_inputs_encoded > encoded, salt  # its photo was encoded again
        encoded = engine.stats().encoder_inputs_encoded
    again = finish(engine, PROMPTS[1], [photos[0]], cache_salt="alice")
    assert again.num_cached_tokens > 0 and again.token_ids == expected
    assert engine.stats().encoder_inputs_encoded == encoded  # the same salt: features and blocks reused


def test_text_prompts_with_the_same_salt_share_blocks_and_others_do_not(make_engine, oracle):
    engine = make_engine()
    prompt = PROMPTS[0] * 4
    assert finish(engine, prompt, [], cache_salt="s1").num_cached_tokens == 0
    assert finish(engine, prompt, [], cache_salt="s2").num_cached_tokens == 0
    unsalted = finish(engine, prompt, [])
    assert unsalted.num_cached_tokens == 0
    assert finish(engine, prompt, []).num_cached_tokens > 0
    shared = finish(engine, prompt, [], cache_salt="s2")
    assert shared.num_cached_tokens > 0 and shared.token_ids == unsalted.token_ids == oracle(prompt, [], 6)


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT + 1), 7, b"bytes"])
def test_a_bad_salt_is_refused_naming_it(make_engine, salt):
    engine = make_engine()
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt=PROMPTS[0], cache_salt=salt)
    assert not engine.has_unfinished_requests()
