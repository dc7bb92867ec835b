"""Jump-forward (`EngineConfig.jump_forward`): a token that a request's grammar forces is appended without
sampling and computed with the next step's chunk. The oracle is the same engine with it off: the same tokens,
text, finish reasons and logprobs, greedy and seeded, under every stop condition, in fewer steps. (test_grammar.py
checks greedy output against transformers' `generate` with the grammar, with jump-forward on.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.grammar import GrammarSpec
from tests.engine.conftest import DEVICE

xgrammar = pytest.importorskip("xgrammar")

PROMPT = "User: Describe the scene.<end_of_utterance>\nAssistant:"
# Long keys and an enum whose values share no prefix past their first letters: runs of forced tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "number_of_people_in_view": {"type": "integer", "minimum": 0, "maximum": 9},
        "what_they_are_doing": {"enum": ["standing_still_near_the_door", "walking_towards_the_camera"]},
    },
    "required": ["number_of_people_in_view", "what_they_are_doing"],
}
JSON = GrammarSpec.from_schema(SCHEMA)
REGEX = GrammarSpec(regex=r"a person (standing|walking) at [0-9]{2}:00 was seen by the camera")
CHOICE = GrammarSpec(choice=("a person is standing near the door", "nobody is there"))
SAMPLED = {"temperature": 1.0, "seed": 7}
PARAMS = [
    *(SamplingParams(max_tokens=100, grammar=g, **extra) for g in (JSON, REGEX, CHOICE) for extra in ({}, SAMPLED)),
    SamplingParams(max_tokens=60, grammar=REGEX, stop=["camera"]),  # a stop string completed inside a forced run
    SamplingParams(max_tokens=60, grammar=REGEX, stop=[" at 0", " at 1"], **SAMPLED),
    SamplingParams(max_tokens=9, grammar=JSON),  # the length reached inside a run
    SamplingParams(max_tokens=6, grammar=CHOICE, **SAMPLED),
    # The grammar's end forces the end-of-sequence token, which min_tokens holds back: no token can be sampled.
    SamplingParams(max_tokens=60, min_tokens=59, grammar=CHOICE),
    SamplingParams(max_tokens=100, grammar=REGEX, logprobs=2),  # decoded token by token
]


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = Engine(EngineConfig(model=checkpoint, device=DEVICE, dtype="float32", max_num_seqs=16, itl_target_ms=0))
    yield engine
    engine.close()


def run(engine: Engine, jump_forward: bool, **extra) -> tuple[list, list[list], list[list], int]:
    """Every request of PARAMS at once, stepped to the end: each one's last output, its outputs by step, its
    logprobs, and the steps taken."""
    engine.config = replace(engine.config, jump_forward=jump_forward)  # read by each step
    ids = [engine.add_request(prompt=PROMPT, sampling=p, **extra) for p in PARAMS]
    steps_before = engine.stats().num_steps
    streamed: dict[str, list] = {rid: [] for rid in ids}
    logprobs: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed[output.request_id].append(output)
            logprobs[output.request_id] += output.new_logprobs or []
    return ([streamed[rid][-1] for rid in ids], [streamed[rid] for rid in ids], [logprobs[rid] for rid in ids],
            engine.stats().num_steps - steps_before)


def test_jump_forward_gives_the_output_of_decoding_every_token_in_fewer_steps(engine):
    forced_before = engine.num_forced_tokens
    off, _, off_logprobs, off_steps = run(engine, jump_forward=False)
    assert engine.num_forced_tokens == forced_before
    on, streamed, on_logprobs, on_steps = run(engine, jump_forward=True)
    assert engine.num_forced_tokens - forced_before > 20
    assert on_steps < off_steps
    assert [(o.token_ids, o.text, o.finish_reason) for o in on] == [(o.token_ids, o.text, o.finish_reason) for o in off]
    assert [o.finish_reason for o in on] == ["stop"] * 8 + ["length", "length", "error", "stop"]
    assert on[6].text.endswith("by the ")
    # Logprobs, asked for by the last request only: one per token, the same numbers (to the rounding of the
    # batch's other rows, which differ between the runs).
    assert len(on_logprobs[-1]) == len(on[-1].token_ids) and not any(on_logprobs[:-1])
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in on_logprobs[-1]] == [
        (lp.token_id, [t for t, _ in lp.top]) for lp in off_logprobs[-1]]
    assert [lp.logprob for lp in on_logprobs[-1]] == pytest.approx([lp.logprob for lp in off_logprobs[-1]], abs=1e-4)
    # Streamed: some outputs carry several new tokens; each extends the one before.
    assert any(len(b.token_ids) - len(a.token_ids) > 1 for outs in streamed for a, b in zip(outs, outs[1:]))
    for outs in streamed:
        assert all(b.token_ids[: len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
                   for a, b in zip(outs, outs[1:]))


def test_a_next_turn_reads_the_forced_tokens_from_the_prefix_cache_exactly(engine):
    """A request whose prompt is the first's prompt and output finds the blocks its forced tokens filled (computed
    as chunks after sampled tokens), and continues as one that computes them as prompt (another cache salt)."""
    engine.config = replace(engine.config, jump_forward=True)
    first = engine.add_request(prompt=PROMPT, sampling=PARAMS[0], cache_salt="turns")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    follow = outputs[first].prompt_token_ids + outputs[first].token_ids
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    again = engine.add_request(prompt_token_ids=follow, sampling=params, cache_salt="turns")
    fresh = engine.add_request(prompt_token_ids=follow, sampling=params, cache_salt="fresh")
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[again].num_cached_tokens > len(outputs[first].prompt_token_ids)
    assert outputs[fresh].num_cached_tokens == 0
    assert outputs[again].token_ids == outputs[fresh].token_ids
