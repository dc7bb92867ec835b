"""What is left of one step while the scheduler fills it (`StepBudget`): every budget of a step is read and spent
here, against the step's cost model (engine/step_costs.py: seconds under an inter-token-latency target, tokens
otherwise)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.scheduler_output import EncoderWork
from engine.step_costs import CostModel, StepCosts, TokenCosts


@dataclass
class StepBudget:
    """What is left of one step: tokens (`max_num_batched_tokens`), encoder output tokens
    (`max_encoder_tokens_per_step`; None: no encoder budget) and cost (`left`, in the units of `costs`; `used`:
    what the step's work so far costs, its fixed part aside), and whether a prefill chunk and encoder work already
    run in it; `tightened`: planned under a request's own target from here on (no least progress)."""

    tokens: int
    encoder_tokens: int | None
    costs: CostModel
    left: float
    used: float = 0.0
    prefill_scheduled: bool = False
    encoder_scheduled: bool = False
    tightened: bool = False

    @classmethod
    def for_step(cls, config: EngineConfig, costs: StepCosts | None = None) -> StepBudget:
        """A step budgeted by time where `costs` is fitted and prompts are chunked, else by tokens alone."""
        timed = costs is not None and costs.ready and config.enable_chunked_prefill
        model: CostModel = costs if timed else TokenCosts(config.max_num_batched_tokens)
        return cls(config.max_num_batched_tokens, config.max_encoder_tokens_per_step, model,
                   model.planned - model.fixed_cost())

    @property
    def spent(self) -> bool:
        return self.tokens == 0

    def spend_decode(self, context: int, num_tokens: int = 1) -> None:
        self.tokens -= num_tokens
        self._spend(self.costs.chunk_cost(context, num_tokens))

    def _spend(self, cost: float) -> None:
        self.left -= cost
        self.used += cost

    def balance(self) -> None:
        """After the decodes, under the default target (engine/scheduler.py's rule)."""
        self.left = self.costs.after_decodes(self.left)

    def tighten(self, target_ms: float) -> None:
        """What is left, at most what a step planned to `target_ms` (a request's own target) leaves after the
        work so far; nothing changes under a token budget."""
        planned = self.costs.planned_for(target_ms)
        if planned is not None:
            self.left = min(self.left, planned - self.costs.fixed_cost() - self.used)
            self.tightened = True

    def spend_prefill(self, start: int, num_tokens: int, work: list[EncoderWork]) -> None:
        self.tokens = max(self.tokens - num_tokens, 0)  # a whole atomic span may take more than was left
        self.encoder_tokens = encoder_tokens_after(self.encoder_tokens, work)
        self._spend(self.costs.chunk_cost(start, num_tokens) + self.work_cost(work))
        self.prefill_scheduled = self.prefill_scheduled or num_tokens > 0
        self.encoder_scheduled = self.encoder_scheduled or any(not w.from_cache for w in work)

    def affordable_tokens(self, start: int, reserved: float, floor: int) -> int:
        """The most tokens of a chunk from `start` whose cost fits what is left (less `reserved` of encoder work);
        at least `floor`."""
        left, low, high = self.left - reserved, 0, self.tokens
        while low < high:  # the cost grows with n (quadratically, through the keys)
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.costs.chunk_cost(start, mid) <= left else (low, mid - 1)
        return max(low, min(floor, self.tokens))

    def work_cost(self, work: list[EncoderWork]) -> float:
        """The cost of `work` (slices first..end-1 of inputs' towers; nothing from the shared cache)."""
        per_row = self.costs.per_encoder_row
        if per_row is None:
            return 0.0
        return sum(per_row * w.mm.input_rows[w.index] * (w.end - w.first) / w.mm.encoder_slices
                   for w in work if not w.from_cache)

    def affordable_slices(self, rows: int, slices: int, reserved: float, first: bool) -> int:
        """How many slices of inputs of `rows` output rows in all fit in what is left, less `reserved` of encoder
        work already chosen. The step's `first` encoder work gets one slice whatever it costs (a whole tower, where
        it runs whole), and so does an input before the encoder's cost is known, unless the step is `tightened`."""
        least = 1 if first and not self.encoder_scheduled and not self.tightened else 0
        per_row = self.costs.per_encoder_row
        if per_row is None:
            return least
        per_slice = per_row * rows / slices
        return max(int((self.left - reserved) // per_slice) if per_slice > 0 else slices, least)


def encoder_tokens_after(left: int | None, work: list[EncoderWork]) -> int | None:
    """The encoder budget left after `work` (inputs taken from the encoder output cache cost nothing)."""
    if left is None:
        return None
    spent = sum(item.mm.input_rows[item.index] for item in work if not item.from_cache)
    return max(left - spent, 0)
