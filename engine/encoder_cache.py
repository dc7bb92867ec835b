"""Vision features shared across requests by image content.

A chat client re-sends its images on every turn, and cameras send the same frame to several prompts. When an
encoder input (a SmolVLM tile, a Qwen2-VL or LLaVA image) with the same content hash (engine/block_hash.py)
was encoded recently, its features are taken from here instead of running the vision tower again. The cache
is bounded in feature rows (the encoder's output tokens, what `max_encoder_tokens_per_step` also counts) and
drops the least recently used entry first. The scheduler asks whether an input is held when it plans the
step (a held input costs no encoder budget); the runner takes the features before it encodes anything in that
step, so nothing it finds can be dropped in between.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderOutputCache:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.hits = 0  # encoder inputs whose features were taken from here

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def get(self, content_hash: bytes) -> torch.Tensor:
        self._entries.move_to_end(content_hash)
        self.hits += 1
        return self._entries[content_hash]

    def put(self, content_hash: bytes, features: torch.Tensor) -> None:
        rows = features.shape[0]
        if rows > self.max_rows or content_hash in self._entries:
            return
        while self.rows + rows > self.max_rows:
            _, dropped = self._entries.popitem(last=False)
            self.rows -= dropped.shape[0]
        self._entries[content_hash] = features
        self.rows += rows
