"""Constrained output is well-formed UTF-8.

xgrammar matches a grammar's characters byte by byte, and its character classes let the encodings of the UTF-16
surrogates (U+D800-U+DFFF: ED A0-BF xx) through. Those three bytes are not UTF-8: they decode as three U+FFFD, so a
string the grammar held to `maxLength: 8` came back longer than 8 characters, and the text was not what the grammar
matched. `Utf8Guard` closes that class of fault whatever the grammar: a constrained row may only take a token whose
bytes continue a well-formed UTF-8 sequence (Unicode's table 3-7) from where its output stands.

The rule is a deterministic automaton over bytes: state 0 is "between characters", the others say how many
continuation bytes a character still needs and the range its next one must fall in. For each state the tokens that
stay well-formed are one packed bitmask row in xgrammar's layout (bit j of word w is token 32*w + j), built once per
tokenizer with numpy over all tokens at once; a row's mask is ANDed with its state's row. A row's state moves with
each accepted token by one table lookup. Tokens with no bytes of their own (special tokens, stop tokens) are neutral:
allowed in every state, leaving it as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

# States: 0 between characters; then (continuation bytes still needed, the next one's range).
_NEXT_RANGE = [None, (0x80, 0xBF), (0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x80, 0xBF), (0x90, 0xBF), (0x80, 0x8F)]
_AFTER_CONTINUATION = [None, 0, 1, 1, 1, 2, 2, 2]
STATES = len(_NEXT_RANGE)
_REJECT = STATES  # absorbing: the bytes are not UTF-8


def _transitions() -> np.ndarray:
    """[STATES + 1, 256] int8: the state after a byte, from each state (REJECT stays REJECT)."""
    table = np.full((STATES + 1, 256), _REJECT, dtype=np.int8)
    first = table[0]
    first[:0x80] = 0
    first[0xC2:0xE0] = 1
    first[0xE0] = 3
    first[0xE1:0xED] = 2
    first[0xED] = 4
    first[0xEE:0xF0] = 2
    first[0xF0] = 6
    first[0xF1:0xF4] = 5
    first[0xF4] = 7
    for state in range(1, STATES):
        low, high = _NEXT_RANGE[state]
        table[state, low : high + 1] = _AFTER_CONTINUATION[state]
    return table


class Utf8Guard:
    """The UTF-8 rule for one tokenizer: `token_bytes[t]` is token t's bytes as decoded text has them; `neutral`
    the tokens that are no bytes of the output (special and stop tokens); `vocab_size` the logits' width (tokens
    past `token_bytes` are left to the grammar)."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, neutral: Iterable[int] = ()) -> None:
        count = len(token_bytes)
        lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=count)
        width = int(lengths.max(initial=0))
        matrix = np.zeros((count, width), dtype=np.uint8)
        matrix[np.arange(width) < lengths[:, None]] = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
        table = _transitions()
        # after[s, t]: the state after token t's bytes from state s (REJECT if they are not UTF-8 from there).
        after = np.repeat(np.arange(STATES, dtype=np.int8)[:, None], count, axis=1)
        for column in range(width):
            present = column < lengths
            after[:, present] = table[after[:, present], matrix[present, column]]
        neutral_ids = np.array([t for t in neutral if 0 <= t < count], dtype=np.int64)
        after[:, neutral_ids] = np.arange(STATES, dtype=np.int8)[:, None]
        self._after = after
        allowed = np.ones((STATES, vocab_size), dtype=bool)
        allowed[:, : min(count, vocab_size)] = (after != _REJECT)[:, :vocab_size]
        words = (vocab_size + 31) // 32
        padded = np.ones((STATES, words * 32), dtype=bool)
        padded[:, :vocab_size] = allowed
        packed = np.packbits(padded.reshape(STATES, words, 32), axis=-1, bitorder="little")
        self.masks = torch.from_numpy(packed.reshape(STATES, words * 4).view(np.int32).copy())  # [STATES, words]

    def after(self, state: int, token_id: int) -> int:
        """The state after `token_id` from `state` (a token this rule allowed there; others leave state 0)."""
        if not 0 <= token_id < self._after.shape[1]:
            return state
        nxt = int(self._after[state, token_id])
        return 0 if nxt == _REJECT else nxt

    def restrict(self, bitmask: torch.Tensor, rows: list[int], states: list[int]) -> None:
        """AND rows `rows` of `bitmask` ([rows, words] int32, on the host) with their states' masks. A row the rule
        would leave empty keeps the grammar's own (a grammar that allows nothing well-formed there still ends)."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long)
        current = bitmask.index_select(0, index)
        held = current & self.masks.index_select(0, torch.tensor(states, dtype=torch.long))
        empty = ~held.any(dim=1)
        if bool(empty.any()):
            held[empty] = current[empty]
        bitmask.index_copy_(0, index, held)
