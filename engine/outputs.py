"""What `Engine.step` reports for each request that advanced, and where a step's time went."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # every token generated so far
    text: str  # their text, without any stop string and without a tail that may still become one
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", "abort", "error" (the step failed)
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed again


@dataclass
class StepTimings:
    """Seconds of host time in each phase of one step. On CUDA the forward is asynchronous: its time shows
    where sampling's one read-back waits for it."""

    schedule: float = 0.0
    encode: float = 0.0  # the vision tower
    prepare: float = 0.0  # the step's inputs and attention metadata
    forward: float = 0.0  # the text model (launches, on CUDA)
    sample: float = 0.0
    update: float = 0.0  # the scheduler's bookkeeping, stop conditions and detokenizing

    @property
    def total(self) -> float:
        return self.schedule + self.encode + self.prepare + self.forward + self.sample + self.update
