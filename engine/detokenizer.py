"""Text of a request's output, with stop strings applied."""

from __future__ import annotations

from typing import Any


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
    """The visible text and whether a stop string was reached."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], True
    if finished:
        return text, False
    # An incomplete multi-byte character decodes as U+FFFD until its last byte arrives.
    visible = text.rstrip("\ufffd")
    return visible[: len(visible) - _held_back(visible, stops)], False
