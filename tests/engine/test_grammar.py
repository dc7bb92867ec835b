"""Grammar-constrained decoding: with random weights only the constraint can make the output valid, so every
answer parsing and validating is the constraint at work; with a greedy request the output equals transformers'
`generate` with the same grammar as a logits processor; rows without a grammar are untouched."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from engine import SamplingParams
from engine.grammar import GrammarCompiler, GrammarSpec, apply_token_masks
from tests.engine.conftest import DEVICE, PROMPTS

xgrammar = pytest.importorskip("xgrammar")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

# Nested, with enums, arrays, required fields, integers and numbers; every string, number and array is bounded,
# so the grammar itself ends the output within MAX_TOKENS whatever the random model prefers.
SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "people": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "action": {"enum": ["standing", "walking", "sitting", "lying"]},
                    "position": {
                        "type": "object",
                        "properties": {
                            "x": {"type": "number", "minimum": 0, "maximum": 1},
                            "y": {"type": "integer", "minimum": -5, "maximum": 5},
                        },
                        "required": ["x", "y"],
                    },
                },
                "required": ["action", "position"],
            },
        },
        "fallen": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 16},
    },
    "required": ["count", "people", "fallen", "summary"],
}
MAX_TOKENS = 320
TEXT_PROMPTS = [f"User: Describe scene {i}.<end_of_utterance>\nAssistant:" for i in range(20)]


def drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_twenty_of_twenty_answers_validate_against_a_nested_schema(make_engine):
    engine = make_engine(max_num_batched_tokens=128, max_num_seqs=20)
    spec = GrammarSpec.from_schema(SCHEMA)
    ids = []
    for i, prompt in enumerate(TEXT_PROMPTS):
        # Half greedy, half sampled: the mask holds for both.
        extra = {} if i % 2 == 0 else dict(temperature=1.0, seed=i)
        params = SamplingParams(max_tokens=MAX_TOKENS, grammar=spec, **extra)
        ids.append(engine.add_request(prompt=prompt, sampling=params))
    outputs = drain(engine)
    validator = jsonschema_rs.validator_for(SCHEMA)
    for rid in ids:
        out = outputs[rid]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        validator.validate(json.loads(out.text))  # strict json: no raw control characters in strings


def test_greedy_output_equals_generate_with_the_grammar_as_logits_processor(make_engine, checkpoint):
    from transformers import AutoModelForImageTextToText, AutoProcessor, LogitsProcessor, LogitsProcessorList

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    compiler = GrammarCompiler(processor.tokenizer, model.lm_head.out_features, [processor.tokenizer.eos_token_id])
    spec = GrammarSpec.from_schema(SCHEMA)

    class GrammarProcessor(LogitsProcessor):
        """Feeds each generated token to a matcher and masks the next scores, as the engine does."""

        def __init__(self) -> None:
            self.matcher = compiler.matcher(spec)
            self.prompt_len: int | None = None

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if self.prompt_len is None:
                self.prompt_len = input_ids.shape[1]
            else:
                assert self.matcher.accept(int(input_ids[0, -1]))
            apply_token_masks(scores, [self.matcher])
            return scores

    prompts = [TEXT_PROMPTS[0], PROMPTS[0]]
    expected = []
    for prompt in prompts:
        inputs = processor(text=[prompt], return_tensors="pt").to(DEVICE)
        with torch.no_grad():
            masks = LogitsProcessorList([GrammarProcessor()])
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, logits_processor=masks)
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())

    # A small budget chunks the prompts; an unconstrained request rides in the same batches.
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=4)
    free = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=24))
    ids = [engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=MAX_TOKENS, grammar=spec)) for p in prompts]
    outputs = drain(engine)
    assert [outputs[rid].token_ids for rid in ids] == expected
    unconstrained = make_engine(max_num_batched_tokens=8, max_num_seqs=4)
    alone = unconstrained.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=24))
    assert outputs[free].token_ids == drain(unconstrained)[alone].token_ids


def test_preempted_requests_keep_their_grammar_state(make_engine):
    """Preemption replays a request's output as prompt; its matcher must not be fed those tokens again."""
    spec = GrammarSpec.from_schema(SCHEMA)
    prompts = TEXT_PROMPTS[:4]

    def run(**settings) -> tuple[list, int]:
        engine = make_engine(max_num_batched_tokens=64, max_num_seqs=4, **settings)
        params = SamplingParams(max_tokens=MAX_TOKENS, grammar=spec)
        ids = [engine.add_request(prompt=p, sampling=params) for p in prompts]
        outputs = drain(engine)
        return [outputs[rid] for rid in ids], engine.stats().num_preemptions

    roomy, _ = run()
    tight, preemptions = run(num_kv_blocks=40)
    assert preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "stop" for o in tight)


def test_regex_output_matches(make_engine):
    engine = make_engine()
    pattern = r"(yes|no), [0-9]{1,3} (people|persons)"
    rids = [
        engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=40, grammar=GrammarSpec(regex=pattern)))
        for p in TEXT_PROMPTS[:4]
    ]
    outputs = drain(engine)
    for rid in rids:
        assert outputs[rid].finish_reason == "stop"
        assert re.fullmatch(pattern, outputs[rid].text), outputs[rid].text


def test_masks_touch_only_rows_with_a_matcher(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    compiler = GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id])
    matcher = compiler.matcher(GrammarSpec(regex="[0-9]+"))
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_token_masks(logits, [None, matcher, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1])
    assert torch.equal(logits[1][allowed], before[1][allowed])
    texts = {tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert texts and all(t.isdigit() for t in texts), texts


@pytest.mark.parametrize(
    "spec,message",
    [
        (lambda: GrammarSpec.from_schema({"type": "bogus"}), "bogus"),
        (lambda: GrammarSpec(json_schema="{not json"), "not valid JSON"),
        (lambda: GrammarSpec(regex="[a-"), "regex grammar could not be compiled"),
        (lambda: GrammarSpec(json_schema="{}", regex="a"), "exactly one of"),
        (lambda: SamplingParams(grammar={"type": "object"}), "grammar must be a GrammarSpec"),
    ],
)
def test_bad_grammars_are_value_errors_naming_the_problem(make_engine, spec, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(grammar=spec()))
    assert not engine.has_unfinished_requests()


def test_the_engine_imports_and_serves_without_xgrammar(make_engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    engine = make_engine()
    rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=4))
    assert len(drain(engine)[rid].token_ids) == 4
    with pytest.raises(ValueError, match="needs the xgrammar package"):
        engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(grammar=GrammarSpec(json_object=True)))


def test_bounded_strings_refuse_raw_control_characters(checkpoint):
    """xgrammar 0.2.8's own rule for minLength/maxLength strings lets a raw tab through (invalid JSON)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    compiler = GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id])
    matcher = compiler.matcher(GrammarSpec.from_schema({"type": "string", "maxLength": 5}))
    [quote], [tab], [letter] = (tokenizer.encode(t, add_special_tokens=False) for t in ('"', "\t", "a"))
    assert matcher.accept(quote)
    logits = torch.zeros(1, 512)
    apply_token_masks(logits, [matcher])
    assert logits[0, tab] == float("-inf") and logits[0, letter] == 0.0
