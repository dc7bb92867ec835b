"""What `Engine.step` reports for each request that advanced."""

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
