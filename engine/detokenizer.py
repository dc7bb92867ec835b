"""Text of a request's output, with stop strings applied, decoded incrementally.

The visible text of a request is defined by `render`: the whole output decoded with special tokens skipped,
cut before the first stop string found; while the request runs, an incomplete multi-byte character at the
end (decoded as U+FFFD until its last byte arrives) and a tail that may still become a stop string are held
back. `IncrementalDetokenizer` gives exactly that text at a cost per step that does not grow with the
output: it decodes only a window of recent tokens (a prefix window for context, as vLLM does, then the new
tokens), and looks for stop strings only where a new one can appear (after what was checked already, less
the part of the text that is still the start of that stop string).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what an incomplete or invalid UTF-8 sequence decodes to


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string: not shown yet, since
    the next token may complete the stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def render(tokenizer: Any, token_ids: list[int], stops: list[str], finished: bool) -> tuple[str, bool]:
    """The visible text and whether a stop string was reached, from a full decode (the reference that
    `IncrementalDetokenizer` equals, and its fallback)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], True
    if finished:
        return text, False
    visible = text.rstrip(REPLACEMENT)
    return visible[: len(visible) - _held_back(visible, stops)], False


def decode_function(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, calling the Rust tokenizer directly when that is
    all transformers' decode would do (a fast tokenizer without the clean-up of spaces)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is not None and hasattr(backend, "decode") and not cleans_up:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def skipped_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that decoding with `skip_special_tokens` drops wherever they are (special added tokens)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, dict):
        return frozenset(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


def _longest_stop_start(text: str, start: int, stop: str) -> int:
    """Length of the longest tail of `text` beginning at or after `start` that is a proper prefix of `stop`."""
    first = stop[0]
    i = text.find(first, start)
    while i >= 0:
        if len(text) - i < len(stop) and stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(first, i + 1)
    return 0


class IncrementalDetokenizer:
    """One request's output text, updated each step from its growing list of token ids.

    Offsets count the output's tokens less those decoding skips. Tokens before `prefix_offset` are done
    with; `prefix_text` is the decode of tokens [`prefix_offset`, `read_offset`), and `stable` the text of
    all tokens before `read_offset`, a point after which the text of the tokens does not depend on what came
    before (the text there ended with a whole character). Each step decodes the tokens from `prefix_offset`
    on; what they add past `prefix_text` is the new text, taken into `stable` unless it ends with an
    incomplete character.

    `tokens_decoded` and `chars_scanned` count the work done, for tests and benchmarks.
    """

    def __init__(self, tokenizer: Any, stops: list[str], skipped: frozenset[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self._decode = decode_function(tokenizer)
        # The output without the tokens decoding skips (EOS generated with ignore_eos, a model's special
        # tokens), so that a run of them, which adds no text, does not widen the window decoded each step.
        self._skipped = skipped_token_ids(tokenizer) if skipped is None else skipped
        self._ids: list[int] = []
        self._seen = 0
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""
        self.stable = ""
        # Length of the previous visible text (before the held-back tail was cut), and for each stop string
        # the longest tail of that text that is a proper prefix of it: no stop string starts earlier.
        self._visible_len = 0
        self._partial = [0] * len(self.stops)
        self._full_decode = False  # set for a tokenizer whose text is not a concatenation of windows
        self.tokens_decoded = 0
        self.chars_scanned = 0

    def update(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """The visible text of `token_ids` (the same list as last time, grown) and whether a stop string
        was reached; equal to `render(tokenizer, token_ids, stops, finished)`."""
        if self._full_decode:
            self.tokens_decoded += len(token_ids)
            return render(self.tokenizer, token_ids, self.stops, finished)
        self._ids.extend(t for t in token_ids[self._seen :] if t not in self._skipped)
        self._seen = len(token_ids)
        ids = self._ids
        window = self._decode(ids[self.prefix_offset :])
        self.tokens_decoded += len(ids) - self.prefix_offset
        if not window.startswith(self.prefix_text):
            log.debug("tokenizer %s does not decode in windows; decoding whole outputs", type(self.tokenizer).__name__)
            self._full_decode = True
            return self.update(token_ids, finished)
        tail = window[len(self.prefix_text) :]
        stable_len = len(self.stable)

        # The whole text is stable + tail. A stop string first found now begins in the region below.
        starts = [self._visible_len - partial for partial in self._partial]
        low = min(starts, default=stable_len)
        low = min(low, stable_len)
        region = self.stable[low:] + tail
        self.chars_scanned += len(region)
        hit = -1
        for stop, begin in zip(self.stops, starts):
            at = region.find(stop, begin - low)
            if at >= 0 and (hit < 0 or at < hit):
                hit = at
        if hit >= 0:
            return (self.stable + tail)[: low + hit], True
        if finished:
            return self.stable + tail, False

        visible_tail = tail.rstrip(REPLACEMENT)  # `stable` never ends with U+FFFD
        visible_len = stable_len + len(visible_tail)
        visible_region = region[: visible_len - low]
        held = 0
        for i, (stop, begin) in enumerate(zip(self.stops, starts)):
            begin = max(begin, visible_len - len(stop) + 1, low)
            self._partial[i] = _longest_stop_start(visible_region, begin - low, stop)
            held = max(held, self._partial[i])
        self._visible_len = visible_len
        text = (self.stable + visible_tail)[: visible_len - held]

        if tail and not tail.endswith(REPLACEMENT):
            self.stable += tail
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self.prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
            self.tokens_decoded += self.read_offset - self.prefix_offset
        return text, False
