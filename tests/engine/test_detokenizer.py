"""The incremental detokenizer gives, at every step, exactly the text of a full decode (`render`): incomplete
multi-byte characters held back, stop strings cut at their first occurrence, a tail that may still become a
stop string held back; and its work per step does not grow with the output or with other requests' stops."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer, render
from tests.engine.conftest import PROMPTS

MULTILINGUAL = [
    "Ein Mädchen überquert die Straße, während der Bus wartet.",
    "Une femme âgée porte un sac rouge près de l'entrée de la gare.",
    "一个人正在过马路，旁边有一辆蓝色的公共汽车。",
    "カメラには赤いバッグを持った女性が映っています。",
    "Два человека разговаривают на футбольном поле.",
    "Emoji: 🚌🚶‍♀️👨‍👩‍👧 and 🧑🏽‍🦯 waiting, ∑ ≈ ∞, naïve café, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "A person is walking across the street next to a blue bus.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<image>"]


def _byte_level_bpe(vocab_size: int) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained on text in several scripts, so that merged tokens end inside
    multi-byte characters as they do in real vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(MULTILINGUAL * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_utterance>", pad_token="<|endoftext|>")


def _sentencepiece_style_bpe() -> PreTrainedTokenizerFast:
    """A Llama-style BPE: spaces as U+2581, unknown bytes as <0xNN> tokens, and a decoder that drops the
    first token's leading space, so the text of a token depends on whether it comes first."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer, trained.pre_tokenizer = normalizer, pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    trained.train_from_iterator(MULTILINGUAL[::2] * 4, trainer=trainer)  # Russian and Japanese only as bytes
    state = json.loads(trained.to_str())["model"]
    # The byte tokens are ordinary vocabulary (as in Llama's), not special ones that decoding would skip.
    vocab = state["vocab"] | {f"<0x{b:02X}>": len(state["vocab"]) + b for b in range(256)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", *SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_utterance>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(checkpoint) -> dict[str, PreTrainedTokenizerFast]:
    return {
        "tiny": AutoTokenizer.from_pretrained(checkpoint),
        "byte-level": _byte_level_bpe(1200),
        "sentencepiece-style": _sentencepiece_style_bpe(),
    }


def _sequences(tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    """Uniformly random ids (lone bytes, broken characters, special tokens), real text, and real text
    with random ids spliced in."""
    vocab = len(tokenizer)
    text_ids = tokenizer(" ".join(MULTILINGUAL), add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(count):
        kind = rng.randrange(3)
        length = rng.randint(1, 60)
        if kind == 0:
            out.append([rng.randrange(vocab) for _ in range(length)])
        else:
            start = rng.randrange(len(text_ids))
            ids = text_ids[start : start + length]
            if kind == 2:
                for _ in range(rng.randint(1, 4)):
                    ids.insert(rng.randint(0, len(ids)), rng.randrange(vocab))
            out.append(ids)
    return out


def _stops_for(tokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Stop strings cut from the sequence's own text at random places (so they cross token borders and
    split multi-byte characters' tokens), some that never occur, some longer than any output."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text:
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 6)])
    if rng.random() < 0.3:
        stops.append(rng.choice(["zzqx", "\ufffd", "大", text[:3] + "zzqx" if text else "q"]))
    if rng.random() < 0.2:
        stops.append((text[-2:] if text else "a") * 50_000)
    return [s for s in stops if s]


def _check_every_step(tokenizer, ids: list[int], stops: list[str]) -> None:
    """Feed `ids` one token a step (one growing list, as the engine does) and compare with a full decode."""
    detok = IncrementalDetokenizer(tokenizer, stops)
    grown: list[int] = []
    for i, token in enumerate(ids):
        grown.append(token)
        finished = i == len(ids) - 1
        got = detok.update(grown, finished)
        want = render(tokenizer, grown, stops, finished)
        assert got == want, (tokenizer.__class__.__name__, ids[: i + 1], stops)
        if want[1]:
            return


@pytest.mark.parametrize("name", ["tiny", "byte-level", "sentencepiece-style"])
def test_incremental_text_equals_a_full_decode_at_every_step(tokenizers, name):
    tokenizer = tokenizers[name]
    rng = random.Random(name)
    for ids in _sequences(tokenizer, rng, 300):
        _check_every_step(tokenizer, ids, _stops_for(tokenizer, ids, rng))


def test_multibyte_characters_split_over_tokens_are_held_back_until_whole(tokenizers):
    tokenizer = tokenizers["sentencepiece-style"]
    ids = tokenizer("Два 🚌", add_special_tokens=False)["input_ids"]
    byte_tokens = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_tokens) >= 4  # the bus emoji alone is four byte tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    grown, texts = [], []
    for token in ids:
        grown.append(token)
        texts.append(detok.update(grown, finished=False)[0])
    assert texts[-1] == "Два 🚌" and all("\ufffd" not in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece-style"])
def test_stop_strings_across_token_borders(tokenizers, name):
    tokenizer = tokenizers[name]
    text = " ".join(MULTILINGUAL[2:])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:120]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    # Every stop string that ends at a token border, starts one, or straddles one (a character cut in half
    # at the byte level is a border inside a character).
    borders = sorted({len(tokenizer.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd"))
                      for k in range(1, len(ids))})
    checked = 0
    for border in random.Random(name).sample(borders, 12):
        for before, after in ((2, 1), (1, 2), (0, 3), (3, 0)):
            stop = full[max(0, border - before) : border + after]
            if not stop:
                continue
            _check_every_step(tokenizer, ids, [stop, "never-there"])
            _check_every_step(tokenizer, ids, ["never-there", stop * 2, stop])
            checked += 1
    assert checked >= 40


def test_work_per_step_does_not_grow_with_the_output(tokenizers):
    tokenizer = tokenizers["byte-level"]
    ids = tokenizer(" ".join(MULTILINGUAL * 30), add_special_tokens=False)["input_ids"]
    assert len(ids) > 2000
    rng = random.Random(0)
    # Sixteen stop strings of 200,000 characters that begin like the text: each step may extend a partial
    # match of any of them, and none ever matches.
    stops = [(rng.choice(MULTILINGUAL)[:3] + "#") * 50_000 for _ in range(16)]
    detok = IncrementalDetokenizer(tokenizer, stops)
    grown: list[int] = []
    decoded, scanned = [], []
    for token in ids:
        grown.append(token)
        before = (detok.tokens_decoded, detok.chars_scanned)
        text, stopped = detok.update(grown, finished=False)
        decoded.append(detok.tokens_decoded - before[0])
        scanned.append(detok.chars_scanned - before[1])
        assert not stopped
    assert text == render(tokenizer, grown, stops, False)[0]
    # A step decodes the last emitted tokens and the new one (more while a character is incomplete), and
    # scans the new text plus what is still a partial stop string: the same early and late.
    assert max(decoded) <= 8 and max(decoded[-500:]) == max(decoded[:500])
    assert max(scanned) <= 32 and max(scanned[-500:]) <= max(scanned[:500])


def test_engine_text_equals_a_full_decode_with_stops_and_preemption(make_engine):
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=3, num_kv_blocks=8)
    stops = ["e t", "zq"]
    ids = [engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=40, ignore_eos=True,
                                                                         stop=stops if i % 2 else []))
           for i in range(3)]
    outputs: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            want, stopped = render(engine.tokenizer, out.token_ids, stops if ids.index(out.request_id) % 2 else [],
                                   out.finished)
            assert out.text == want
            assert not stopped or (out.finished and out.finish_reason == "stop")
            outputs[out.request_id] = out
    assert engine.stats().num_preemptions > 0
    assert all(outputs[rid].finished for rid in ids)


class _ReversingTokenizer:
    """A tokenizer whose text of a sequence is not the text of its parts put together."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in reversed(ids))


def test_a_tokenizer_that_does_not_decode_in_windows_falls_back_to_whole_outputs():
    tokenizer = _ReversingTokenizer()
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(60) for _ in range(rng.randint(1, 30))]
        _check_every_step(tokenizer, ids, rng.sample(["ab", "c", "xyz", "q"], 2))


def test_a_run_of_skipped_tokens_does_not_widen_the_window(tokenizers):
    tokenizer = tokenizers["tiny"]
    eos = tokenizer.eos_token_id
    text_ids = tokenizer(" ".join(MULTILINGUAL[:2]), add_special_tokens=False)["input_ids"]
    # EOS generated over and over with ignore_eos, then text again.
    ids = text_ids[:10] + [eos] * 300 + text_ids[10:30]
    detok = IncrementalDetokenizer(tokenizer, ["zz"])
    grown: list[int] = []
    for token in ids:
        grown.append(token)
        before = detok.tokens_decoded
        text, _ = detok.update(grown, finished=False)
        assert detok.tokens_decoded - before <= 8
    assert text == render(tokenizer, grown, ["zz"], False)[0]
