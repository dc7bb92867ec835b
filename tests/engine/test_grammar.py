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
from engine.grammar import TOOL_CALL_BEGIN, GrammarCompiler, GrammarSpec, apply_token_masks, tool_calls_tag
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
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=4, jump_forward=True)
    free = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=24))
    ids = [engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=MAX_TOKENS, grammar=spec)) for p in prompts]
    outputs = drain(engine)
    assert [outputs[rid].token_ids for rid in ids] == expected
    assert engine.num_forced_tokens > 0  # jump-forward appended some of them, computed in chunks of 8
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


def test_choice_output_is_one_of_the_strings(make_engine):
    engine = make_engine()
    choice = ("standing", "lying down", 'say "hi"', "é\n")
    spec = GrammarSpec(choice=choice)
    rids = [engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=spec))
            for i, p in enumerate(TEXT_PROMPTS[:6])]
    outputs = drain(engine)
    assert all(outputs[rid].finish_reason == "stop" and outputs[rid].text in choice for rid in rids)


def test_ebnf_grammar_output_matches(make_engine):
    engine = make_engine()
    spec = GrammarSpec(grammar='root ::= "count: " [0-9] [0-9]? (" person" | " people")')
    rid = engine.add_request(prompt=TEXT_PROMPTS[0], sampling=SamplingParams(max_tokens=40, grammar=spec))
    out = drain(engine)[rid]
    assert out.finish_reason == "stop" and re.fullmatch(r"count: [0-9]{1,2} (person|people)", out.text), out.text


def test_schema_properties_keep_their_order(make_engine):
    schema = {"type": "object", "properties": {p: {"type": "integer", "minimum": 0, "maximum": 9}
                                               for p in ("zebra", "apple", "mango")},
              "required": ["zebra", "apple", "mango"], "additionalProperties": False}
    assert json.loads(GrammarSpec.from_schema(schema).json_schema) == schema
    assert list(json.loads(GrammarSpec.from_schema(schema).json_schema)["properties"]) == ["zebra", "apple", "mango"]
    engine = make_engine()
    rid = engine.add_request(prompt=TEXT_PROMPTS[1], sampling=SamplingParams(
        max_tokens=80, grammar=GrammarSpec.from_schema(schema)))
    assert list(json.loads(drain(engine)[rid].text)) == ["zebra", "apple", "mango"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}


def calls_in(text: str) -> list[dict]:
    """The complete tool calls of a constrained output: each marker's JSON (the grammar put it there)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(piece.lstrip("\n"))[0] for piece in text.split(TOOL_CALL_BEGIN)[1:]
            if "</tool_call>" in piece]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_validate_against_their_function(make_engine, parallel):
    engine = make_engine(max_num_seqs=8)
    spec = tool_calls_tag([("weather", WEATHER), ("clock", CLOCK)], "required", parallel)
    rids = [engine.add_request(prompt=p, sampling=SamplingParams(max_tokens=200, temperature=1.0, seed=i, grammar=spec))
            for i, p in enumerate(TEXT_PROMPTS[:8])]
    outputs = drain(engine)
    validators = {"weather": jsonschema_rs.validator_for(WEATHER), "clock": jsonschema_rs.validator_for(CLOCK)}
    for rid in rids:
        out = outputs[rid]
        # Parallel calls may go on until max_tokens (the random model does not stop): its complete calls count.
        assert out.finish_reason == "stop" or parallel, out.text
        assert out.text.startswith(TOOL_CALL_BEGIN), out.text
        calls = calls_in(out.text)
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            validators[call["name"]].validate(call["arguments"])


def test_auto_tool_calls_allow_text_and_hold_each_call(make_engine):
    engine = make_engine(max_num_seqs=8)
    spec = tool_calls_tag([("weather", WEATHER)], "auto")
    # The trigger is forced in after some free text, as a model would write it: the call must then validate.
    rid = engine.add_request(prompt=TEXT_PROMPTS[0], sampling=SamplingParams(max_tokens=60, grammar=spec))
    free = drain(engine)[rid]
    assert TOOL_CALL_BEGIN not in free.text or calls_in(free.text)
    compiler = engine.grammars
    matcher = compiler.matcher(spec)
    for token in engine.tokenizer.encode("Let me check." + TOOL_CALL_BEGIN + '\n{"name": "weather", "arguments": ',
                                         add_special_tokens=False):
        assert matcher.accept(token)
    assert not matcher.accept(engine.tokenizer.encode("[", add_special_tokens=False)[0])  # not an object


def test_tool_schemas_count_together_against_the_limits(make_engine):
    from engine.grammar_limits import GrammarLimitError

    engine = make_engine()
    many = [(f"f{i}", {"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(10)}})
            for i in range(10)]  # 100 properties in all, over max_properties = 64, each tool within it
    with pytest.raises(GrammarLimitError, match="max_properties"):
        engine.grammars.compile(tool_calls_tag(many, "required"))
    with pytest.raises(GrammarLimitError, match="max_enum_values"):
        engine.grammars.compile(GrammarSpec(choice=tuple(str(i) for i in range(1000))))


@pytest.mark.parametrize("fields,message", [
    (dict(choice=()), "non-empty tuple"), (dict(choice=("a", 3)), "non-empty tuple"),
    (dict(grammar=""), "non-empty string"), (dict(structural_tag="{}"), "structural tag is an object"),
    (dict(choice=("a",), regex="a"), "exactly one of"),
])
def test_new_spec_kinds_refuse_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        GrammarSpec(**fields)
    assert hash(GrammarSpec(choice=("a", "b"))) == hash(GrammarSpec(choice=("a", "b")))


def test_constrained_strings_stay_well_formed_utf8_whatever_the_model_prefers(checkpoint):
    """xgrammar lets a surrogate's bytes (ED A0-BF xx) into a string; Python decodes them as three U+FFFD each, so
    a `maxLength: 8` string came back longer. A model that prefers exactly those bytes still writes a string of
    at most 8 well-formed characters, and the masks allow the lawful continuations only."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    compiler = GrammarCompiler(tokenizer, 512, [tokenizer.eos_token_id])
    vocab = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512).decoded_vocab  # each token's bytes
    byte_token = {bytes_[0]: t for t, bytes_ in enumerate(vocab) if len(bytes_) == 1}
    assert len(byte_token) == 256  # the tiny tokenizer is byte-level: every byte is a token
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    matcher = compiler.matcher(GrammarSpec.from_schema(schema))
    for byte in b'{"city": "\xed':
        assert matcher.accept(byte_token[byte])
    logits = torch.zeros(1, 512)
    apply_token_masks(logits, [matcher])
    allowed = {b for b, t in byte_token.items() if logits[0, t] == 0.0}
    assert allowed == set(range(0x80, 0xA0))  # after ED: a continuation below A0, never a surrogate's
    # The preferred bytes, from the most: a surrogate's, then other non-ASCII bytes, ASCII last.
    preference = [0xED, 0xA0, 0x80, *range(0xC2, 0xF5), *range(0x80, 0xC0), *range(0x20, 0x7F)]
    scores = torch.full((1, 512), -1e4)
    for rank, byte in enumerate(preference):
        scores[0, byte_token[byte]] = 1e3 - rank
    scores[0, tokenizer.eos_token_id] = -1e3
    matcher = compiler.matcher(GrammarSpec.from_schema(schema))
    out: list[int] = []
    while not matcher.is_terminated and len(out) < 200:
        logits = scores.clone()
        apply_token_masks(logits, [matcher])
        token = int(logits.argmax())
        assert matcher.accept(token)
        out.append(token)
    text = b"".join(vocab[t] for t in out if t != tokenizer.eos_token_id).decode("utf-8")  # strict
    city = json.loads(text)["city"]
    assert 1 <= len(city) <= 8 and "\ufffd" not in city and tokenizer.decode(out, skip_special_tokens=True) == text
    compiler.close()


def test_the_utf8_rule_allows_exactly_the_well_formed_continuations():
    """Random walks over a vocabulary of every byte, some whole characters and some invalid sequences, under the
    rule alone: every walk decodes strictly, and at each step a token is allowed exactly when the bytes so far
    plus its own are the start of well-formed UTF-8 (Python's incremental decoder is the oracle)."""
    import codecs
    import random

    from engine.grammar_utf8 import Utf8Guard

    vocab = [bytes([b]) for b in range(256)] + ["é".encode(), "€".encode(), "😀".encode(), b"ab\xe2\x82",
                                                b"\xac!", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b""]
    guard = Utf8Guard(vocab, len(vocab) + 5, neutral=[len(vocab) - 1])
    # Every proper start of a character's encoding (Python's incremental decoder holds some that are not, ED A0);
    # a proper start depends on the code point's bits above its last 6 only, so one code point of each 64.
    starts = {b""} | {code[:n] for c in range(0x80, 0x110000, 64) if not 0xD800 <= c < 0xE000
                      for code in [chr(c).encode()] for n in range(1, len(code))}
    rng = random.Random(0)
    for _ in range(40):
        state, written = 0, b""
        for _ in range(30):
            row = torch.full((1, guard.masks.shape[1]), -1, dtype=torch.int32)
            guard.restrict(row, [0], [state])
            bits = [(int(row[0, t // 32]) >> (t % 32)) & 1 for t in range(len(vocab))]
            for t, bit in enumerate(bits):
                decoder = codecs.getincrementaldecoder("utf-8")()
                try:
                    decoder.decode(written + vocab[t])
                    lawful = decoder.getstate()[0] in starts  # what it holds back can still become a character
                except UnicodeDecodeError:
                    lawful = False
                assert bit == lawful, (written, vocab[t])
            token = rng.choice([t for t, bit in enumerate(bits) if bit])
            state, written = guard.after(state, token), written + vocab[token]
        decoder = codecs.getincrementaldecoder("utf-8")()
        decoder.decode(written)  # never raises: well-formed so far
    # A row the rule would empty (after ED, the grammar allows only a surrogate's A0) keeps the grammar's own.
    row = torch.zeros((1, guard.masks.shape[1]), dtype=torch.int32)
    row[0, 0xA0 // 32] = 1 << (0xA0 % 32)
    guard.restrict(row, [0], [guard.after(0, 0xED)])
    assert int(row[0, 0xA0 // 32]) == 1 << (0xA0 % 32) and int(row.count_nonzero()) == 1
