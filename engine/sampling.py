"""Sampling parameters and the sampler that turns a step's rows of logits into one token each."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.grammar import GrammarSpec

GREEDY_BELOW = 1e-5


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
        """Temperatures below `GREEDY_BELOW` sample the likeliest token (as vLLM does): no float32
        distribution is sharper than that."""
        return self.temperature < GREEDY_BELOW


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


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[bool]]:
    """One token for each row of float32 logits [rows, vocab], and whether that row failed (its distribution
    had no finite mass: the model's logits for it were not finite). All rows in tensor ops, one read-back.

    Greedy rows take the argmax. The others are scaled by their temperature after subtracting the row's
    maximum (so any temperature the parameters allow stays finite), cut to their top_k tokens and to the
    smallest prefix of the sorted distribution whose mass reaches top_p (the likeliest token always
    stays), and sampled by the exponential race (argmax of p / E with E ~ Exp(1), which draws from p),
    each row's E from its request's own generator, so a seeded request repeats whatever else is batched.
    """
    tokens = logits.argmax(dim=-1)
    failed = torch.zeros_like(tokens)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        settings = torch.tensor([[params[i].temperature, params[i].top_k, params[i].top_p] for i in rows],
                                dtype=torch.float32, device=logits.device)
        x = logits[index]
        sorted_x, order = torch.sort(x - x.max(dim=-1, keepdim=True).values, dim=-1, descending=True)
        sorted_x = sorted_x / settings[:, :1]
        rank = torch.arange(x.shape[-1], device=x.device)
        top_k = settings[:, 1:2]
        sorted_x = sorted_x.masked_fill((top_k > 0) & (rank >= top_k), float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= settings[:, 2:3]
        probs = probs.masked_fill(drop & (rank > 0), 0.0)
        race = torch.empty_like(probs)
        for row, i in enumerate(rows):
            race[row].exponential_(generator=generators[i])
        picked = order.gather(-1, (probs / race).argmax(dim=-1, keepdim=True)).squeeze(-1)
        bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
        tokens = tokens.index_copy(0, index, picked)
        failed = failed.index_copy(0, index, bad.to(failed.dtype))
    both = torch.stack([tokens, failed]).tolist()  # the one read-back
    return both[0], [bool(f) for f in both[1]]
