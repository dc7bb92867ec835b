"""A request's state as it moves through the engine: waiting, running (prefill, then decode), finished."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import Matcher
from engine.sampling import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class MultimodalPrompt:
    """Where encoder outputs go in a prompt.

    `placeholder_positions[r]` is the prompt position that takes feature row `r`; rows are grouped into
    encoder inputs (a SmolVLM tile, a Qwen2-VL or LLaVA image), input `i` covering rows `input_row_starts[i]`
    to `input_row_starts[i] + input_rows[i]`. `encoder_inputs[i]` is what the model's vision encoder takes
    for input `i`.

    `rope_positions` ([streams, prompt_len]) holds the rotary positions of families whose positions are
    not the token index (Qwen2-VL's M-RoPE), computed once by the model's own rule; a token past the
    prompt sits at its index plus `rope_position_delta`.

    `encoder_slices`: an input's vision tower can run in this many slices (its layers), one step after
    another, carrying the hidden state between steps; 1 for towers that run whole.

    `atomic_inputs`: the placeholder tokens of one encoder input attend to each other both ways (Gemma 3),
    so each input's span, from its first to its last placeholder, must be computed in one chunk.
    """

    placeholder_positions: list[int]
    input_row_starts: list[int]
    input_rows: list[int]
    encoder_inputs: list[dict[str, torch.Tensor]]
    rope_positions: torch.Tensor | None = None
    rope_position_delta: int = 0
    atomic_inputs: bool = False
    encoder_slices: int = 1
    input_hashes: list[bytes] = field(default_factory=list)  # content hash of each encoder input (prefix caching)

    @property
    def num_inputs(self) -> int:
        return len(self.input_rows)

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The feature rows whose positions lie in prompt positions [start, end)."""
        return (
            bisect.bisect_left(self.placeholder_positions, start),
            bisect.bisect_left(self.placeholder_positions, end),
        )

    def inputs_in(self, start: int, end: int) -> range:
        """The encoder inputs with at least one row in prompt positions [start, end)."""
        first_row, end_row = self.rows_in(start, end)
        if first_row == end_row:
            return range(0)
        first = bisect.bisect_right(self.input_row_starts, first_row) - 1
        last = bisect.bisect_right(self.input_row_starts, end_row - 1) - 1
        return range(first, last + 1)

    def input_first_position(self, index: int) -> int:
        return self.placeholder_positions[self.input_row_starts[index]]

    def input_last_position(self, index: int) -> int:
        return self.placeholder_positions[self.input_row_starts[index] + self.input_rows[index] - 1]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    arrival: int
    max_total_tokens: int
    mm: MultimodalPrompt | None = None
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far (engine/block_hash.py)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted
    cache_salt: str | None = None  # shares cached blocks and image features only with the same salt (block_hash.py)
    itl_target_ms: float | None = None  # its own inter-token-latency target against less urgent work (scheduler.py)
    finish_reason: str | None = None
    text: str = ""
    # Turns output_token_ids into `text` a step at a time; preemption keeps output_token_ids, so it stays valid.
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    # Where the output stands in its grammar (None without one); it is fed each sampled token once, and a
    # preempted request keeps its output tokens, so it stays valid across recompute.
    matcher: Matcher | None = field(default=None, repr=False)
    # Output tokens its grammar forced (jump-forward, `EngineConfig.jump_forward`) appended since its last forward:
    # computed with the last sampled token as one chunk in the next step; 0 again after that chunk or preemption.
    num_forced: int = 0
    # The scores of prompt tokens 1, 2, ... so far (`SamplingParams.prompt_logprobs`); kept across preemption.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)
    # The prompt's distinct token ids, made once (`distinct_prompt_ids`).
    _distinct_prompt_ids: np.ndarray | None = field(default=None, init=False, repr=False)

    def distinct_prompt_ids(self) -> np.ndarray:
        """The prompt's distinct token ids (int64, sorted), made at the first call and kept: the penalties ask only
        whether a token occurs in the prompt, every step (engine/sampling.py's `apply_penalties`)."""
        if self._distinct_prompt_ids is None:
            self._distinct_prompt_ids = np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))
        return self._distinct_prompt_ids

    @property
    def prompt_positions_to_score(self) -> int:
        """The first prompt position whose logits score a prompt token not scored yet (position p scores token
        p + 1); the prompt's last position when every token is scored or none is asked for."""
        if self.sampling.prompt_logprobs is None:
            return max(self.num_prompt_tokens - 1, 0)
        return len(self.prompt_logprobs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Everything but the last sampled token (and the forced tokens after it) is in the KV cache: one token a
        step from now on (with the forced ones, in one chunk)."""
        return self.num_uncomputed_tokens == 1 + self.num_forced and bool(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1: the prompt's, then the generated ones (replayed after preemption)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        outputs = self.output_token_ids[max(start - prompt_len, 0) : end - prompt_len]
        return self.prompt_token_ids[start:prompt_len] + outputs if start < prompt_len else outputs

    def sort_key(self) -> tuple[int, int]:
        """Lower priority value first, then first come first served."""
        return (self.priority, self.arrival)


@dataclass(frozen=True)
class Preprocessed:
    """A request `Engine.preprocess_request` checked and preprocessed, not yet queued (`Engine.enqueue`)."""

    request: Request
    embed_images: bool
