"""The scheduler's one owner of encoder inputs (engine/encoder_inputs.py): progress is committed with the step's
tokens, in `update`, so a step that fails leaves nothing recorded that the runner does not hold."""

from __future__ import annotations

from engine import SamplingParams
from tests.engine.conftest import PROMPTS


def _image_engine(make_engine):
    """Token budgets (no time budget) and one slice of the tower a step: an image prompt's chunk stops before its
    first placeholder while the tower runs, so some steps carry its encoder work alone."""
    return make_engine(max_num_batched_tokens=16, max_num_seqs=4, encoder_slices_per_step=1, itl_target_ms=0)


def test_progress_is_committed_in_update_not_when_scheduled(make_engine, photos):
    engine = _image_engine(make_engine)
    engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=2))
    scheduler, inputs = engine.scheduler, engine.scheduler.encoder_inputs
    out = scheduler.schedule()
    assert out.encoder_work and all(w.first == 0 and w.end == 1 for w in out.encoder_work)
    assert inputs.progress == {}  # scheduled, not run yet
    engine.runner.execute(out)
    scheduler.update(out, {})
    request_id = out.encoder_work[0].request_id
    assert inputs.progress == {request_id: {w.index: 1 for w in out.encoder_work}}


def test_a_step_that_fails_during_encoding_ends_the_request_it_carried_by_its_encoder_work_alone(
        make_engine, photos, oracle, monkeypatch):
    """The failing step carries the image prompt only through its tower's slices (no chunk): the request ends
    with "error" all the same, nothing of its inputs stays recorded or held, and the same image afterwards gets
    `generate`'s tokens (no stale tower state is read)."""
    engine = _image_engine(make_engine)
    rid = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=4))
    outputs = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: outputs.append(schedule()) or outputs[-1])
    encode_slices = engine.adapter.encode_slices
    calls = []

    def failing(inputs, states, first, end):
        calls.append(first)
        if len(calls) == 2:
            raise RuntimeError("the tower failed")
        return encode_slices(inputs, states, first, end)

    monkeypatch.setattr(engine.adapter, "encode_slices", failing)
    ended = []
    while not ended:
        ended = [o for o in engine.step() if o.finished]
    failed = outputs[-1]
    assert not failed.chunks and {w.request_id for w in failed.encoder_work} == {rid}
    assert [(o.request_id, o.finish_reason) for o in ended] == [(rid, "error")]
    assert engine.num_step_failures == 1 and not engine.has_unfinished_requests()
    assert engine.scheduler.encoder_inputs.progress == {}

    monkeypatch.setattr(engine.adapter, "encode_slices", encode_slices)
    again = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=4))
    tokens = None
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.request_id == again and o.finished), tokens)
    assert tokens == oracle(PROMPTS[1], [photos[0]], 4)
    engine.step()  # the freed inputs reach the runner with the next step
    assert engine.runner.encoder_features == {} and engine.scheduler.encoder_inputs.progress == {}
