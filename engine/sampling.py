"""Sampling parameters and the sampler that turns one row of logits into one token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.grammar import GrammarSpec


@dataclass
class SamplingParams:
    """How a request's tokens are chosen and when it stops. Temperature 0 is greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Output constrained to a JSON schema, any JSON object or a regex (engine/grammar.py); None: unconstrained.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request's own random stream: seeded requests give the same tokens on every run whatever
    else is in the batch."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
