"""What the scheduler hands the runner each step, as data: the chunks of tokens to compute (each with its
tokens, the blocks that hold its context, its prompt's encoder inputs, and what sampling its next token reads),
the encoder work, and the encoder inputs to free. The runner, the attention backends, the CUDA graphs and the
cost model read these and never a live `Request`; the scheduler alone advances requests (`Scheduler.update`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.grammar import Matcher
from engine.request import MultimodalPrompt, Request
from engine.sampling import SamplingParams
from engine.step_costs import StepShape, chunk_keys


@dataclass
class SamplingInputs:
    """What sampling a request's next token reads: its parameters, its random stream, where its output stands in
    its grammar, and its tokens so far (penalties: the prompt's distinct ids, the output's in order)."""

    sampling: SamplingParams
    generator: torch.Generator | None
    matcher: Matcher | None
    prompt_ids: np.ndarray
    output_token_ids: list[int]


@dataclass
class PromptScoring:
    """Prompt positions first..end-1 of a chunk score the prompt tokens after them (`targets`) and their `top`
    likeliest alternatives (`SamplingParams.prompt_logprobs`)."""

    first: int
    end: int
    targets: list[int]
    top: int


@dataclass
class ScheduledChunk:
    """Tokens start..start+num_tokens-1 of request `request_id` (`token_ids`), computed this step; `block_ids`
    are the KV cache blocks of its positions 0..end-1; `sample` is set where the chunk reaches the request's last
    token, so that this step yields its next token."""

    request_id: str
    start: int
    num_tokens: int
    num_prompt_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    mm: MultimodalPrompt | None = None
    sample: SamplingInputs | None = None
    scoring: PromptScoring | None = None

    @classmethod
    def of(cls, request: Request, start: int, num_tokens: int, block_size: int) -> ScheduledChunk:
        """The chunk of `request` from `start`, its blocks and sampling inputs taken as they are now."""
        end = start + num_tokens
        sample = None
        if end == request.num_tokens:
            sample = SamplingInputs(request.sampling, request.generator, request.matcher,
                                    request.distinct_prompt_ids(), request.output_token_ids)
        scoring = None
        first, last = max(start, request.prompt_positions_to_score), min(end, request.num_prompt_tokens - 1)
        if first < last:
            scoring = PromptScoring(first, last, request.prompt_token_ids[first + 1 : last + 1],
                                    request.sampling.prompt_logprobs)
        return cls(request.request_id, start, num_tokens, request.num_prompt_tokens,
                   request.token_ids_between(start, end), request.block_ids[: -(-end // block_size)], request.mm,
                   sample, scoring)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so this step yields its next token."""
        return self.sample is not None


@dataclass
class EncoderWork:
    """Slices first..end-1 of the vision tower on encoder input `index` of request `request_id` (whose prompt's
    encoder inputs are `mm`)."""

    request_id: str
    mm: MultimodalPrompt
    index: int
    first: int
    end: int
    from_cache: bool = False  # the features are taken from the encoder output cache; no tower runs

    @property
    def finishes(self) -> bool:
        """After this step the input's features are ready for the chunks that reach its placeholders."""
        return self.end == self.mm.encoder_slices

    @property
    def key(self) -> tuple[str, int]:
        """The encoder input's key: (request id, input)."""
        return (self.request_id, self.index)


@dataclass
class SchedulerOutput:
    """What the runner runs this step, and what it frees first: the encoder inputs (request id, input) whose
    features or tower state no chunk will read again, freed since the last step (a request finished,
    aborted or preempted, or its chunks went past the input's placeholders). `preempted`: the ids of the
    requests preempted while scheduling it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    freed_encoder_inputs: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def shape(self) -> StepShape:
        """The step in the cost model's terms (engine/step_costs.py)."""
        rows = sum(w.mm.input_rows[w.index] * (w.end - w.first) / w.mm.encoder_slices
                   for w in self.encoder_work if not w.from_cache)
        return StepShape(self.num_tokens, sum(chunk_keys(c.start, c.num_tokens) for c in self.chunks), rows)
