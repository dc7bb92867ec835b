"""Sampling parameters and the sampler that turns a step's rows of logits into one token each."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cpu import build
from engine.grammar import GrammarSpec

GREEDY_BELOW = 1e-5
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives a request may ask for at each token (OpenAI's top_logprobs cap)


@dataclass(frozen=True)
class Range:
    """The values a numeric sampling field may take: finite, in [low, high] (low excluded when `low_open`),
    an integer when `integer`. The API's request schemas take their bounds from these (api/openai_schemas.py)."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False

    def check(self, name: str, value: object) -> None:
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(f"{name} must be {'an integer' if self.integer else 'a number'}, got {value!r}")
        finite = self.integer or math.isfinite(value)
        inside = finite and (value > self.low if self.low_open else value >= self.low) and value <= self.high
        if not inside:
            left = "(" if self.low_open else "["
            raise ValueError(f"{name} must be in {left}{self.low:g}, {self.high:g}], got {_shown(value)}")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


# What the sampler can compute, per field; the engine also holds top_k to the model's vocabulary (Engine.add_request).
SAMPLING_RANGES: dict[str, Range] = {
    "max_tokens": Range(1, INT64_MAX, integer=True),
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, INT64_MAX, integer=True),  # -1 and 0: off
    "seed": Range(-(2**63), 2**64 - 1, integer=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.01, 100.0),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "min_tokens": Range(0, INT64_MAX, integer=True),
}


@dataclass
class SamplingParams:
    """How a request's tokens are chosen and when it stops. Temperature 0 is greedy. Each numeric field's range is
    in `SAMPLING_RANGES`.

    top_k: keep the k likeliest tokens (0 or -1: all). presence_penalty / frequency_penalty: OpenAI's, subtracted
    from the logits of tokens already generated (once / per occurrence). repetition_penalty: transformers' (and
    vLLM's), dividing positive and multiplying negative logits of every token in the prompt or the output (1: off).
    logprobs: return the log-probability of each generated token and of its `logprobs` likeliest alternatives
    (None: none), from the logits the token was chosen from (after penalties and grammar, before temperature).
    min_tokens: the end-of-sequence tokens (unless ignore_eos) and `stop_token_ids` cannot be sampled before this
    many tokens are generated (transformers' min_new_tokens, vLLM's min_tokens); stop strings still apply.
    stop_token_ids: tokens that end the request like end-of-sequence (kept in the output's token ids, as vLLM).
    prompt_logprobs: return the log-probability of each prompt token after the first (from the model's logits at
    the position before it, as transformers' forward gives them: no penalty, grammar or temperature) and of its
    `prompt_logprobs` likeliest alternatives (vLLM's prompt_logprobs; None: none). Such a request computes every
    prompt position it has not scored yet, not starting from a cached prefix (engine/kv_cache_manager.py).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Output constrained to a JSON schema, any JSON object or a regex (engine/grammar.py); None: unconstrained.
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    # Filled by the engine when it admits the request (Engine.add_request): the tokens min_tokens holds back.
    min_tokens_suppressed: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, allowed in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if value is not None or name not in ("seed", "logprobs", "prompt_logprobs"):
                allowed.check(name, value)
        if self.top_k < 0:
            self.top_k = 0
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Temperatures below `GREEDY_BELOW` sample the likeliest token (as vLLM does): no float32
        distribution is sharper than that."""
        return self.temperature < GREEDY_BELOW


ARRAY_CODES = {torch.int64: "q", torch.float32: "f", torch.float64: "d"}  # `host_tensor`'s dtypes


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `values` (int64, float32 or float64) made through an array: a quarter of torch.tensor's time
    for a short list, which a step pays for each of its per-row columns."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(ARRAY_CODES[dtype], values), dtype=dtype)


DRAW_BLOCK = 64  # a CPU stream's draws taken at once (`RandomStream`)


class RandomStream(torch.Generator):
    """A request's generator whose uniform draws (`uniform`: float64 in [0, 1)) are taken DRAW_BLOCK at a time on
    the CPU, one torch operator a block instead of one a draw: the same values in the same order, since torch's CPU
    generator draws a tensor's values one after another (tests/engine/test_sampler.py checks it)."""

    def uniform(self) -> float:
        if "block" not in self.__dict__:
            self.block, self.taken = array("d", bytes(8 * DRAW_BLOCK)), DRAW_BLOCK
        if self.taken == DRAW_BLOCK:  # drawn into the array's memory: no read-back
            torch.frombuffer(self.block, dtype=torch.float64).uniform_(generator=self)
            self.taken = 0
        self.taken += 1
        return self.block[self.taken - 1]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request's own random stream: seeded requests give the same tokens on every run whatever
    else is in the batch."""
    if params.greedy:
        return None
    generator = RandomStream(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


@dataclass
class TokenLogprobs:
    """A token's log-probability and its likeliest alternatives (id, log-probability), best first; `rank`: its
    place among all tokens, 1 the likeliest (given for prompt tokens)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


PROMPT_LOGPROB_ROWS = 512  # prompt positions whose full vocabulary of logits is held at once


def prompt_token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: list[int],
                          top: int) -> list[TokenLogprobs]:
    """The log-probabilities (log-softmax of the float32 logits) of `targets[i]` at hidden state row i, their rank
    and the `top` likeliest alternatives: the prompt tokens' scores. `PROMPT_LOGPROB_ROWS` rows at a time, each
    slice read back once."""
    scored: list[TokenLogprobs] = []
    for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        rows = hidden[at : at + PROMPT_LOGPROB_ROWS]
        wanted = torch.tensor(targets[at : at + PROMPT_LOGPROB_ROWS], device=rows.device)[:, None]
        logprobs = torch.log_softmax(lm_head(rows).float(), dim=-1)
        chosen = logprobs.gather(-1, wanted)
        rank = (logprobs > chosen).sum(dim=-1, keepdim=True).to(chosen.dtype) + 1
        top_values, top_ids = logprobs.topk(top, dim=-1) if top else (chosen[:, :0], wanted[:, :0])
        values, ids = torch.cat([chosen, rank, top_values], dim=-1).tolist(), top_ids.tolist()
        scored += [TokenLogprobs(token, row[0], list(zip(row_ids, row[2:])), int(row[1]))
                   for token, row, row_ids in zip(targets[at : at + PROMPT_LOGPROB_ROWS], values, ids)]
    return scored


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int] | np.ndarray, list[int]]]) -> None:
    """Penalize, in place, the rows of requests with penalties. histories[i] is row i's (prompt, output) tokens.
    Repetition (transformers' RepetitionPenaltyLogitsProcessor): a token in the prompt or the output has its logit
    divided by the penalty when positive, multiplied when negative. Presence and frequency (OpenAI's): the logit of
    a token generated c times loses frequency_penalty * c + presence_penalty * (c > 0). Only the logits of those
    tokens change, so only they are gathered, penalized and written back (every other logit would lose 0, and the
    penalties are finite): a few hundred cells a row, not passes over whole rows of the vocabulary. A prompt may
    come as its distinct ids in an array (only whether a token occurs there counts), which a request computes once
    (`Request.distinct_prompt_ids`), not every step."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    outputs = {i: np.asarray(histories[i][1], dtype=np.int64) for i in rows}  # numpy reads lists faster than torch
    repeated = [(i, np.asarray(histories[i][0], dtype=np.int64)) for i in rows if params[i].repetition_penalty != 1.0]
    # the repetition penalty's tokens (prompt and output) first, then the outputs (for their counts)
    parts = [part for i, prompt in repeated for part in (prompt, outputs[i])] + list(outputs.values())
    row_of = [i for i, _ in repeated for _ in (0, 1)] + list(outputs)
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    seen_count = sum(len(prompt) + len(outputs[i]) for i, prompt in repeated)
    if len(ids) == 0:
        return
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"a penalized row's history holds token ids outside the logits' {vocab} columns: "
                         f"{int(ids.min())}..{int(ids.max())}")
    ids = ids + np.repeat(np.array(row_of, dtype=np.int64) * vocab, [len(part) for part in parts])
    cells, inverse = torch.unique(torch.from_numpy(ids).to(device), return_inverse=True)  # row * vocab + token
    seen = torch.zeros(len(cells), dtype=torch.bool, device=device)
    seen[inverse[:seen_count]] = True
    generated = torch.zeros(len(cells), dtype=logits.dtype, device=device)
    generated.index_add_(0, inverse[seen_count:], torch.ones(len(ids) - seen_count, dtype=logits.dtype,
                                                             device=device))
    settings = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                            dtype=logits.dtype, device=device)[cells // vocab]
    flat = logits.view(-1)
    x = flat[cells]
    if seen_count:
        penalty = settings[:, 0]
        x = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    flat[cells] = x - settings[:, 1] * generated - settings[:, 2] * (generated > 0).to(x.dtype)


def suppress_before_min_tokens(logits: torch.Tensor, params: list[SamplingParams],
                               histories: list[tuple[list[int] | np.ndarray, list[int]]]) -> None:
    """Set to -inf, in place, the logits of the tokens `min_tokens` holds back in the rows that have generated fewer
    than `min_tokens` tokens (transformers' MinNewTokensLengthLogitsProcessor)."""
    cells = [(row, token) for row, p in enumerate(params)
             if p.min_tokens_suppressed and len(histories[row][1]) < p.min_tokens
             for token in p.min_tokens_suppressed if token < logits.shape[-1]]
    if cells:
        rows, tokens = zip(*cells)
        logits[torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)] = float("-inf")


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum along the last dimension and its argmax: argmax's rule (the first of equal maxima, a NaN
    the largest), the maxima as float32. Float32 or bfloat16 rows [rows, vocab] on the CPU by the kernel
    (engine/csrc/sampling.c's `row_max`: 8 rows of a 49,280-token vocabulary took 0.25 ms of a decode step by torch's
    `max`), else by `max` (one pass, a third of `argmax`'s time)."""
    if x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.is_contiguous() and x.shape[1] and _kernel(
            x.device):
        from engine.cpu import ops

        return ops.row_max(x)
    values, indices = x.max(dim=-1)
    return values.float(), indices


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    histories: list[tuple[list[int] | np.ndarray, list[int]]] | None = None,
) -> tuple[list[int], list[bool], dict[int, TokenLogprobs]]:
    """One token for each row of logits [rows, vocab], whether that row failed (its distribution had no finite
    mass: the model's logits for it were not finite), and the log-probabilities of the rows whose request asks for
    them (by row). All rows in tensor ops, one read-back (two when a row asks for log-probabilities). The logits are
    float32, or a bfloat16 head's as it wrote them: the CPU's kernels read those as they are (the same tokens as
    from their float32 copy, which is exact), others take that copy (penalties, torch's path).

    Penalties first (`apply_penalties`, in place; `histories` are needed only when a request has one). Greedy rows
    take the argmax. The others weigh each token by e^((logit - the row's maximum) / temperature) (finite at any
    temperature the parameters allow), keep the weights top_k and top_p leave (`choose`'s rule: no sort of the
    vocabulary on the CPU) and draw one of them with probability its share of their total: by the inverse of their
    cumulative sum at one uniform draw u from the request's own generator (one draw a sampled token, whatever the
    parameters, the logits or the other rows: a seeded request repeats whatever else is batched).
    """
    if logits.dtype != torch.float32 and (logits.dtype != torch.bfloat16 or any(p.penalized for p in params)
                                          or not _kernel(logits.device) or not logits.is_contiguous()):
        logits = logits.float()  # penalized in float32, or torch's sampling (the kernels read bfloat16 as it is)
    if histories is not None:
        apply_penalties(logits, params, histories)
        suppress_before_min_tokens(logits, params, histories)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    top, tokens = row_max(logits)  # each row's maximum, and the greedy rows' tokens
    if not rows:  # greedy rows do not fail
        chosen = tokens.tolist()  # the one read-back
        return chosen, [False] * len(chosen), token_logprobs(logits, params, tokens, chosen)
    every = len(rows) == len(params)
    index = torch.tensor(rows, device=logits.device)
    chosen_top = top if every else top[index]
    picked = choose(logits, index, chosen_top, [params[i] for i in rows], draws([generators[i] for i in rows],
                                                                              logits.device))
    tokens = picked if every else tokens.index_copy(0, index, picked)
    # the one read-back: a sampled row whose maximum is not finite (NaN somewhere, no finite logit at all, or +inf)
    # has token -1 (`choose`'s rule) and fails; greedy rows do not
    chosen = tokens.tolist()
    failed = [token < 0 for token in chosen]
    if any(failed):
        chosen = [max(token, 0) for token in chosen]
        tokens = tokens.clamp(min=0)  # the log-probabilities' gather of a failed row's (unused) token
    return chosen, failed, token_logprobs(logits, params, tokens, chosen)


def draws(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform draw in [0, 1) (float64) from each generator (None: torch's global one), in order: a CPU
    `RandomStream`'s from its block, any other's by an operator of its own."""
    values = [g.uniform() if isinstance(g, RandomStream) and g.device.type == "cpu" else None for g in generators]
    if device.type == "cpu" and None not in values:
        return host_tensor(values, torch.float64)
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    for row, (generator, value) in enumerate(zip(generators, values)):
        if value is None:
            u[row : row + 1].uniform_(generator=generator)
        else:
            u[row] = value
    return u


def draw_as_sampled(generator: torch.Generator, device: torch.device) -> None:
    """Advance `generator` as `sample` does for a row: a token jump-forward appends without sampling draws alike,
    so that a seeded request's later tokens are those of sampling every token."""
    draws([generator], device)


def _kernel(device: torch.device) -> bool:
    """Whether `choose` runs the CPU kernel (engine/csrc/sampling.c) on `device`, else torch's operations."""
    return build.available(device)


def choose(logits: torch.Tensor, index: torch.Tensor, top: torch.Tensor, params: list[SamplingParams],
           u: torch.Tensor) -> torch.Tensor:
    """The token of each row `index[r]` of float32 `logits` whose maximum is `top[r]`, for `params[r]` and the draw
    `u[r]` (float64, in [0, 1)). The rule, the same on every path: weights w = e^((logit - top) / temperature); top_k
    keeps the weights of which fewer than k are larger (ties with the k-th kept, as transformers' TopKLogitsWarper
    keeps them); top_p then keeps those the mass of the larger kept ones stays under top_p times the kept total (the
    smallest prefix, largest first, whose mass reaches top_p; tied weights kept together); the token is the first,
    in token order, whose running sum of kept weights exceeds u times their total (a weight of 0 is never drawn).
    On the CPU the kernel finds the least kept weight by a radix selection of the weights' bits, with no sort
    (engine/csrc/sampling.c); elsewhere torch sorts the cut rows. A row whose maximum is not finite gets -1 (the
    caller fails it)."""
    vocab = logits.shape[-1]
    if _kernel(logits.device) and logits.is_contiguous():
        from engine.cpu import ops

        return ops.sample_rows(logits, index, top.contiguous(), host_tensor([1.0 / p.temperature for p in params],
                               torch.float32), host_tensor([p.top_k for p in params], torch.int64),
                               host_tensor([p.top_p for p in params], torch.float32), u)
    device = logits.device
    temperature = torch.tensor([[p.temperature] for p in params], dtype=torch.float32, device=device)
    w = torch.exp((logits[index] - top[:, None]) / temperature)
    cut = [r for r, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if cut:
        at = torch.tensor(cut, device=device)
        rows = w[at]
        values = torch.sort(rows, dim=-1, descending=True).values
        k = torch.tensor([[params[r].top_k if 0 < params[r].top_k < vocab else vocab] for r in cut], device=device)
        least = values.gather(-1, k - 1)  # the k-th largest weight
        total = torch.where(rows >= least, rows, 0.0).sum(dim=-1, keepdim=True, dtype=torch.float64)
        before = values.cumsum(dim=-1, dtype=torch.float64) - values  # the mass of the weights before each
        bound = torch.tensor([[params[r].top_p if params[r].top_p < 1.0 else math.inf] for r in cut],
                             dtype=torch.float64, device=device) * total
        kept = (before < bound).sum(dim=-1, keepdim=True).clamp(min=1)
        least = torch.maximum(least, values.gather(-1, kept - 1))
        w[at] = torch.where(rows >= least, rows, 0.0)
    running = w.cumsum(dim=-1, dtype=torch.float64)
    token = torch.searchsorted(running, u[:, None] * running[:, -1:], right=True)[:, 0]
    positions = torch.arange(vocab, device=device)
    last = torch.where(w > 0, positions, -1).max(dim=-1).values  # where rounding leaves the draw past the end
    return torch.where(top.isfinite(), torch.minimum(token, last).clamp(min=0), -1)


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor,
                   picked: list[int]) -> dict[int, TokenLogprobs]:
    """Log-softmax of the rows that ask for log-probabilities (float32, the logits tokens were chosen from): the
    chosen token's (`tokens` on the device, `picked` on the host) and the top `logprobs` alternatives', read back
    once."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[index][:, None])
    k = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], chosen[:, :0].long())
    values, ids = torch.cat([chosen, top_values], dim=-1).tolist(), top_ids.tolist()
    return {
        i: TokenLogprobs(picked[i], values[row][0],
                         list(zip(ids[row][: params[i].logprobs], values[row][1 : 1 + params[i].logprobs])))
        for row, i in enumerate(rows)
    }
