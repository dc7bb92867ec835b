"""What a step costs on this machine, so that the scheduler can fill each step up to an inter-token-latency
target (`EngineConfig.itl_target_ms`) instead of a fixed token count.

The rule: a step is filled up to `PLANNED_SHARE` of the target, predicting that its forward takes
`scale * (fixed + per_token * T + per_key * K)` seconds, T being the tokens it computes (decodes and prefill
chunks alike) and K the keys their queries attend to (a query at position p reads p + 1); its vision encoder
work takes `per_encoder_row * R`, R counting each encoder input's output rows
times the share of its tower's slices run. `fixed`, `per_token` and `per_key` are fitted at start-up on a few
real steps of different shapes (`fit`); `scale` then follows every step's measured forward time (an
exponential average of measured over predicted), so that the model keeps up with the machine's load without
refitting its shape from near-identical steps; `per_encoder_row` is measured at start-up on a placeholder photo
(engine/calibration.py) and follows every step's encoder time likewise.

Without a target (or before the fit) a step is budgeted by tokens alone, which is the same model with unit costs
(`TokenCosts`): a token costs one, encoder work nothing, and a step holds `max_num_batched_tokens` of them. The
scheduler plans every step against one of these two (`CostModel`), by one rule (engine/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Inter-token-latency targets by device type where `itl_target_ms` is not given: a 2-core CPU's decode step of a
# 256M model is some 40 ms, a GPU's a few.
DEFAULT_ITL_TARGET_MS = {"cpu": 250.0, "cuda": 60.0}
SMOOTHING = 0.1  # weight of the newest step in `scale`
ENCODER_SMOOTHING = 0.3  # and in `per_encoder_row` (fitted at start-up on one shape; the steps' shapes vary more)
# The share of the target a step is planned to: a step's encoder work varies by some 30% around its prediction
# (which inputs run together, which slices), so a step planned to the whole target would often overshoot it.
PLANNED_SHARE = 0.85
# Encoder inputs run together at most (engine/scheduler.py's lockstep; engine/calibration.py measures the tower
# on as many): a tower multiplies a third faster per row for two inputs than for one, and no faster past four.
ENCODER_GROUP = 4
# The most a single step may move `scale`: a step stalled by the operating system is not the machine's speed.
MAX_RATIO = 4.0


@dataclass
class StepShape:
    """What one step computes, in the terms of the cost model."""

    tokens: int = 0
    keys: int = 0
    encoder_rows: float = 0.0


def chunk_keys(start: int, num_tokens: int) -> int:
    """Keys the queries of positions start..start+n-1 attend to (causally: position p reads p + 1 keys)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class CostModel(Protocol):
    """What the scheduler reads of a cost model: a step's planned cost, its fixed part, a chunk's cost, an
    encoder output row's cost (None: not known yet), whether that cost bounds the encoder's work, what is left
    of a step for its prompts after its decodes, and a step's planned cost under a request's own target."""

    planned: float
    per_encoder_row: float | None
    bounds_encoder: bool

    def fixed_cost(self) -> float: ...

    def chunk_cost(self, start: int, num_tokens: int) -> float: ...

    def after_decodes(self, left: float) -> float: ...

    def planned_for(self, target_ms: float) -> float | None: ...


@dataclass
class TokenCosts:
    """Token budgets as a cost model: a token costs one, encoder work nothing (only the encoder budget bounds it),
    and a step holds `planned` tokens (`max_num_batched_tokens`)."""

    planned: float
    per_encoder_row: float | None = 0.0
    bounds_encoder: bool = False

    def fixed_cost(self) -> float:
        return 0.0

    def chunk_cost(self, start: int, num_tokens: int) -> float:
        return float(num_tokens)

    def after_decodes(self, left: float) -> float:
        return left

    def planned_for(self, target_ms: float) -> float | None:
        """None: tokens are no time, so a request's own target bounds nothing."""
        return None


@dataclass
class StepCosts:
    """The cost model (see the module's docstring); `ready` once fitted."""

    target: float  # seconds a step should take at most
    fixed: float = 0.0
    per_token: float = 0.0
    per_key: float = 0.0
    scale: float = 1.0
    per_encoder_row: float | None = None
    ready: bool = False
    bounds_encoder = True  # a class constant: the encoder's work costs time

    @property
    def planned(self) -> float:
        """Seconds a step is filled to (`PLANNED_SHARE` of the target)."""
        return self.target * PLANNED_SHARE

    def forward_seconds(self, tokens: int, keys: int) -> float:
        return self.scale * (self.fixed + self.per_token * tokens + self.per_key * keys)

    def fixed_cost(self) -> float:
        return self.forward_seconds(0, 0)

    def chunk_cost(self, start: int, num_tokens: int) -> float:
        """Seconds that computing tokens start..start+num_tokens-1 adds to a step."""
        return self.scale * (self.per_token * num_tokens + self.per_key * chunk_keys(start, num_tokens))

    def after_decodes(self, left: float) -> float:
        """Under the default target (engine/scheduler.py's rule): a step's prompts get at least as much time as its
        decodes took (`planned - left`), at most the planned time."""
        return max(left, min(self.planned - left, self.planned))

    def planned_for(self, target_ms: float) -> float | None:
        """Seconds a step is filled to under a request's own target of `target_ms` (`Request.itl_target_ms`)."""
        return target_ms * 1e-3 * PLANNED_SHARE

    def fit(self, shapes: list[StepShape], seconds: list[float]) -> None:
        """Least squares of the steps' seconds over [1, tokens, keys], coefficients kept non-negative."""
        # Each step weighted by the inverse of its time: relative errors count, so that short decode steps are
        # predicted as well as long prefills.
        weights = [1.0 / max(t, 1e-6) for t in seconds]
        rows = [(w, w * s.tokens, w * s.keys) for s, w in zip(shapes, weights)]
        coefficients = _nonnegative_least_squares(rows, [w * t for w, t in zip(weights, seconds)])
        self.fixed, self.per_token, self.per_key = coefficients
        self.scale = 1.0
        self.ready = True

    def observe(self, shape: StepShape, forward_seconds: float, encoder_seconds: float) -> None:
        """One step's measured times."""
        if not self.ready:
            return
        if shape.tokens:
            predicted = self.forward_seconds(shape.tokens, shape.keys) / self.scale
            if predicted > 0:
                ratio = min(max(forward_seconds / predicted, self.scale / MAX_RATIO), self.scale * MAX_RATIO)
                self.scale += SMOOTHING * (ratio - self.scale)
        if shape.encoder_rows > 0 and encoder_seconds > 0:
            measured = encoder_seconds / shape.encoder_rows
            if self.per_encoder_row is None:
                self.per_encoder_row = measured
            else:
                measured = min(max(measured, self.per_encoder_row / MAX_RATIO), self.per_encoder_row * MAX_RATIO)
                self.per_encoder_row += ENCODER_SMOOTHING * (measured - self.per_encoder_row)

    def as_dict(self) -> dict[str, float | None]:
        return {"target_ms": self.target * 1e3, "fixed_ms": self.fixed * 1e3, "per_token_ms": self.per_token * 1e3,
                "per_key_us": self.per_key * 1e6, "scale": self.scale,
                "per_encoder_row_ms": None if self.per_encoder_row is None else self.per_encoder_row * 1e3}


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (None for a singular system)."""
    n = len(vector)
    a = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-30:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _nonnegative_least_squares(rows: list[tuple[float, ...]], values: list[float]) -> list[float]:
    """Least squares over the columns of `rows`, dropping any column whose coefficient comes out negative (it
    is then 0) and solving again: a cost never decreases with more work."""
    columns = list(range(len(rows[0])))
    while columns:
        normal = [[sum(r[i] * r[j] for r in rows) for j in columns] for i in columns]
        right = [sum(r[i] * v for r, v in zip(rows, values)) for i in columns]
        solved = _solve(normal, right)
        if solved is None:
            columns = columns[:-1]
            continue
        negative = [c for c, x in zip(columns, solved) if x < 0]
        if not negative:
            result = [0.0] * len(rows[0])
            for c, x in zip(columns, solved):
                result[c] = x
            return result
        columns = [c for c in columns if c not in negative]
    return [0.0] * len(rows[0])
