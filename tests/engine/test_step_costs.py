"""Steps budgeted by time (engine/step_costs.py): the cost model's fit and updates, and the scheduler filling
each step up to the inter-token-latency target, without a model (costs given, requests as token lists)."""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.kv_cache import BlockPool
from engine.request import MultimodalPrompt, Request
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.step_costs import ENCODER_GROUP, PLANNED_SHARE, StepCosts, StepShape, chunk_keys

BS = 4


def costs(planned_ms: float = 100.0, per_token_ms: float = 1.0, fixed_ms: float = 10.0,
          per_encoder_row_ms: float | None = None) -> StepCosts:
    """A fitted model whose steps are planned to `planned_ms` (its target: that over PLANNED_SHARE)."""
    model = StepCosts(planned_ms / 1e3 / PLANNED_SHARE, fixed=fixed_ms / 1e3, per_token=per_token_ms / 1e3, ready=True)
    model.per_encoder_row = None if per_encoder_row_ms is None else per_encoder_row_ms / 1e3
    return model


def request(rid: str, num_tokens: int, arrival: int = 0, mm: MultimodalPrompt | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(100 * arrival, 100 * arrival + num_tokens)),
                   sampling=SamplingParams(), priority=0, arrival=arrival, max_total_tokens=2000, mm=mm)


def image_prompt(first: int, inputs: int, rows: int, slices: int) -> MultimodalPrompt:
    """`inputs` encoder inputs of `rows` placeholders each from position `first`, towers of `slices`."""
    return MultimodalPrompt(placeholder_positions=list(range(first, first + inputs * rows)),
                            input_row_starts=[u * rows for u in range(inputs)], input_rows=[rows] * inputs,
                            encoder_inputs=[{} for _ in range(inputs)], encoder_slices=slices)


def scheduler(model: StepCosts | None, **config) -> Scheduler:
    config = {"max_num_batched_tokens": 512, "max_num_seqs": 16, "block_size": BS, "watermark": 0.0,
              "max_encoder_tokens_per_step": None} | config
    return Scheduler(EngineConfig(**config), BlockPool(512, BS), costs=model)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {c.request_id: 7 for c in out.chunks if c.samples})
    return out


def predicted(model: StepCosts, out: SchedulerOutput) -> float:
    shape = out.shape()
    return model.forward_seconds(shape.tokens, shape.keys) + (model.per_encoder_row or 0) * shape.encoder_rows


def test_chunks_fill_each_step_up_to_the_target_and_decodes_always_run():
    model = costs(planned_ms=100, per_token_ms=1, fixed_ms=10)  # 90 tokens a step
    s = scheduler(model)
    for i in range(5):
        s.add(request(f"chat{i}", 3, arrival=i))
    step(s)
    long = request("long", 400, arrival=9)
    s.add(long)
    sizes = []
    while not long.is_decoding:
        out = step(s)
        assert sum(c.num_tokens == 1 for c in out.chunks) >= 5  # every chat decodes in every step
        assert predicted(model, out) <= model.planned + 1e-9
        sizes.append(out.num_tokens)
    assert max(sizes) == 90 and len(sizes) == 5  # 85 prompt tokens a step beside 5 decodes


@pytest.mark.parametrize("target_set", [True, False])
def test_a_prompt_progresses_even_when_the_decodes_alone_reach_the_target(target_set):
    """12 chats' decodes take 22 ms of a step planned to 20. A target that was set is kept to: the prompt gets
    its one block a step. Under the default target it gets as much time as the decodes take, up to the planned
    20 ms: 20 tokens, or (an image) 20 ms of tower slices; the chats' gaps at most double."""
    model = costs(planned_ms=20, per_token_ms=1, fixed_ms=10, per_encoder_row_ms=1)  # a 50th of 100 rows: 2 ms
    s = scheduler(model, itl_target_ms=model.target * 1e3 if target_set else None)
    chats = [request(f"chat{i}", 2, arrival=i) for i in range(12)]
    for chat in chats:
        s.add(chat)
    while not all(chat.is_decoding for chat in chats):
        step(s)
    prompt = request("prompt", 40, arrival=20)
    s.add(prompt)
    out = step(s)
    assert [c.num_tokens for c in out.chunks if c.request_id == "prompt"] == [BS if target_set else 20]
    decodes = model.fixed + 12 * model.per_token
    assert predicted(model, out) <= decodes + (BS * model.per_token if target_set else model.planned) + 1e-9
    while not prompt.is_decoding:
        step(s)
    s.add(request("image", 110, arrival=21, mm=image_prompt(first=2, inputs=1, rows=100, slices=50)))
    assert [(w.first, w.end) for w in step(s).encoder_work] == [(0, 1) if target_set else (0, 10)]


def test_without_a_fitted_model_the_token_budget_alone_decides():
    for model in (None, StepCosts(0.001)):  # none, and one not fitted yet
        s = scheduler(model, max_num_batched_tokens=64)
        s.add(request("long", 400))
        assert step(s).num_tokens == 64


def test_the_vision_tower_runs_as_many_slices_a_step_as_fit():
    """Tower slices of 10 ms (an input of 10 rows at 5 ms a row, in five slices); 60 ms left a step: the two
    inputs in lockstep, three slices each (60 ms), then the last two."""
    model = costs(planned_ms=70, per_token_ms=0.01, fixed_ms=10, per_encoder_row_ms=5)
    s = scheduler(model)
    image = request("image", 30, mm=image_prompt(first=2, inputs=2, rows=10, slices=5))
    s.add(image)
    runs = []
    while not image.is_decoding:
        out = step(s)
        runs.append([(w.index, w.first, w.end) for w in out.encoder_work])
        assert predicted(model, out) <= model.planned + BS * model.per_token + 1e-9  # a chunk's first block at most
    assert runs[0] == [(0, 0, 3), (1, 0, 3)] and runs[1] == [(0, 3, 5), (1, 3, 5)]
    assert sum(end - first for run in runs for _, first, end in run) == 10


@pytest.mark.parametrize(("encoder_budget", "groups"), [(None, [[0, 1, 2, 3, 4, 5]]), (20, [[0, 1], [2, 3], [4, 5]])])
def test_inputs_run_in_lockstep_up_to_the_group_and_the_encoder_budget(encoder_budget, groups):
    """Six inputs of 10 rows whose towers all fit a step: ENCODER_GROUP at a time, the next group in the same step
    where the time allows, fewer where the encoder budget (in output rows) leaves less; an input that stands at
    another slice than the next ones runs alone."""
    assert ENCODER_GROUP == 4
    model = costs(planned_ms=1000, per_token_ms=0.01, fixed_ms=10, per_encoder_row_ms=0.1)
    s = scheduler(model, max_encoder_tokens_per_step=encoder_budget)
    image = request("image", 70, mm=image_prompt(first=2, inputs=6, rows=10, slices=5))
    s.add(image)
    runs = []
    while not image.is_decoding:
        out = step(s)
        if out.encoder_work:
            runs.append(out.encoder_work)
    assert [[w.index for w in run] for run in runs] == groups
    assert all((w.first, w.end) == (0, 5) for run in runs for w in run)
    capped = scheduler(model, encoder_slices_per_step=2)
    other = request("other", 70, mm=image_prompt(first=2, inputs=6, rows=10, slices=5))
    capped.add(other)
    capped.encoder_inputs.progress[other.request_id] = {0: 1}  # the first input one slice ahead of the others
    first = step(capped).encoder_work
    assert [(w.index, w.first, w.end) for w in first] == [(0, 1, 3)]


def test_the_first_slice_of_a_step_runs_whatever_it_costs_and_unknown_costs_run_one_slice():
    model = costs(planned_ms=30, per_token_ms=0.01, fixed_ms=10, per_encoder_row_ms=50)  # a slice: 100 ms
    s = scheduler(model)
    s.add(request("image", 30, mm=image_prompt(first=2, inputs=1, rows=10, slices=5)))
    assert [(w.first, w.end) for w in step(s).encoder_work] == [(0, 1)]
    model.per_encoder_row = None
    assert [(w.first, w.end) for w in step(s).encoder_work] == [(1, 2)]


def test_encoder_slices_per_step_stays_an_upper_bound():
    model = costs(planned_ms=1000, per_token_ms=0.01, fixed_ms=10, per_encoder_row_ms=0.1)
    s = scheduler(model, encoder_slices_per_step=2)
    s.add(request("image", 30, mm=image_prompt(first=2, inputs=1, rows=10, slices=5)))
    assert [(w.first, w.end) for w in step(s).encoder_work] == [(0, 2)]


def test_the_fit_recovers_a_linear_cost_and_the_scale_follows_the_machine():
    truth = StepCosts(0.1, fixed=0.02, per_token=0.0005, per_key=2e-7)
    shapes = [StepShape(t, k) for t, k in ((1, 300), (8, 2400), (128, 8256), (130, 2500), (6, 700))]
    seconds = [truth.fixed + truth.per_token * s.tokens + truth.per_key * s.keys for s in shapes]
    model = StepCosts(0.1)
    model.fit(shapes, seconds)
    assert model.ready
    for shape, expected in zip(shapes, seconds):
        assert model.forward_seconds(shape.tokens, shape.keys) == pytest.approx(expected, rel=1e-6)
    for _ in range(60):  # the machine becomes twice as slow
        model.observe(StepShape(8, 2400), 2 * (truth.fixed + truth.per_token * 8 + truth.per_key * 2400), 0.0)
    assert model.scale == pytest.approx(2.0, rel=0.02)
    model.observe(StepShape(8, 2400), 100.0, 0.0)  # one step stalled by the system moves it by a bounded amount
    assert model.scale < 2.0 * (1 + 0.1 * (4 - 1)) + 1e-9


def test_a_step_is_planned_below_its_target():
    model = StepCosts(0.25)
    assert model.planned == pytest.approx(0.25 * PLANNED_SHARE) and PLANNED_SHARE < 1


def test_the_engine_measures_the_encoder_s_cost_at_start_up(make_engine):
    """Before any image arrives (a placeholder photo through the tower at start-up)."""
    engine = make_engine()
    assert engine.stats().step_costs["per_encoder_row_ms"] > 0
    assert engine.stats().encoder_inputs_encoded == 0


def test_the_encoder_cost_is_learnt_from_its_first_run():
    model = costs()
    model.observe(StepShape(0, 0, encoder_rows=64), 0.0, 1.28)
    assert model.per_encoder_row == pytest.approx(0.02)


def test_chunk_keys_count_causal_reads():
    assert chunk_keys(0, 1) == 1 and chunk_keys(10, 1) == 11 and chunk_keys(0, 3) == 6 and chunk_keys(5, 2) == 13


def test_the_start_up_fit_times_no_shape_before_its_first_call_ran_untimed(make_engine):
    """The calibration's warm-up is as long as its longest prompt: a shape's first call (lazy initialisation, the
    first touch of its buffers) took several times its later time, and the fit charged it to the keys."""
    from engine import calibration

    engine = make_engine()
    calls: list[int] = []
    execute = engine.runner.execute

    def recorded(out: SchedulerOutput):
        calls.append(max((c.num_tokens for c in out.chunks), default=0))  # its longest chunk
        return execute(out)

    engine.runner.execute = recorded
    model = StepCosts(0.25)
    calibration.calibrate(model, engine.config, engine.pool, engine.runner, engine.max_model_len, token_id=5)
    assert model.ready and len(calls) >= 8
    assert calls[0] == max(calls)  # the warm-up's prefill: the longest chunk, untimed
