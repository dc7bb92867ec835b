"""Bad input gets a clear ValueError and the engine keeps serving; sampling and stop conditions."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from engine import EngineConfig, SamplingParams
from tests.engine.conftest import PROMPTS


def drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def truncated_jpeg(photo) -> bytes:
    buf = io.BytesIO()
    photo.save(buf, format="JPEG")
    return buf.getvalue()[:200]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt=PROMPTS[1]), "1 <image> marker"),
        (dict(prompt=PROMPTS[0], images="one"), "0 <image> marker"),
        (dict(prompt=PROMPTS[2], images="one"), "2 <image> marker"),
        (dict(prompt=PROMPTS[1], images="truncated"), "image 0 could not be read"),
        (dict(prompt=PROMPTS[1], images="not-an-image"), "image 0 could not be read"),
        (dict(prompt="word " * 300), "max_model_len"),
        (dict(prompt=PROMPTS[0], messages=[]), "exactly one of prompt or messages"),
        (dict(prompt=""), "non-empty"),
        (dict(prompt=PROMPTS[0], priority="high"), "priority"),
        (dict(messages=[{"role": "user", "content": 5}]), "chat template"),
    ],
)
def test_bad_requests_are_refused_and_running_ones_finish_unchanged(
    make_engine, oracle, photos, kwargs, message
):
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    keep = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=8))
    engine.step()
    images = {"one": [photos[1]], "truncated": [truncated_jpeg(photos[0])], "not-an-image": [b"GIF89a nonsense"]}
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("images"), str):
        kwargs["images"] = images[kwargs["images"]]
    with pytest.raises(ValueError, match=message):
        engine.add_request(**kwargs)
    assert drain(engine)[keep].token_ids == oracle(PROMPTS[1], [photos[0]], 8)


def test_a_request_preprocessed_then_queued_runs_as_one_added_at_once(make_engine, oracle, photos):
    """`add_request` in two halves: `preprocess_request` (no step waits for it; the engine queues nothing) then
    `enqueue`; the request runs as transformers' generate does, and one queued twice is refused by its id."""
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    running = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=6))
    engine.step()
    preprocessed = engine.preprocess_request(prompt=PROMPTS[1], images=[photos[0]],
                                             sampling=SamplingParams(max_tokens=8), request_id="later")
    assert preprocessed.request.request_id == "later" and "later" not in engine.requests
    engine.step()
    assert engine.enqueue(preprocessed) == "later"
    with pytest.raises(ValueError, match="request id 'later' is already in use"):
        engine.enqueue(preprocessed)
    outputs = drain(engine)
    assert outputs["later"].token_ids == oracle(PROMPTS[1], [photos[0]], 8)
    assert outputs[running].token_ids == oracle(PROMPTS[0], [], 6)


def test_a_request_queued_while_a_step_runs_is_taken_in_by_the_next(make_engine, oracle):
    """`enqueue` does not wait for a step in progress (the engine's lock held here, as a step holds it): the request
    waits in the engine, counts as unfinished, and the next step takes it in; its tokens are generate's."""
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    preprocessed = engine.preprocess_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=5))
    request_id = preprocessed.request.request_id
    with engine._lock:  # a step in progress
        queuer = threading.Thread(target=engine.enqueue, args=(preprocessed,))
        queuer.start()
        queuer.join(30)
        assert not queuer.is_alive()
        assert engine.has_unfinished_requests() and request_id not in engine.requests
        with pytest.raises(ValueError, match="already in use"):
            engine.enqueue(preprocessed)
    assert drain(engine)[request_id].token_ids == oracle(PROMPTS[0], [], 5)


def test_a_prompt_that_can_never_fit_in_the_kv_cache_is_refused(make_engine, photos):
    engine = make_engine(num_kv_blocks=8)
    with pytest.raises(ValueError, match="more than the KV cache can ever hold"):
        engine.add_request(prompt=PROMPTS[2], images=photos)
    rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=3))
    assert len(drain(engine)[rid].token_ids) <= 3


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_values_name_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(block_size=-1), "block_size"),
        (dict(max_encoder_tokens_per_step=0), "max_encoder_tokens_per_step"),
    ],
)
def test_invalid_engine_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_unknown_model_names_what_is_supported(make_engine, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*SmolVLMForConditionalGeneration"):
        make_engine(model=str(tmp_path))
    with pytest.raises(ValueError, match="unknown dummy preset"):
        make_engine(model="dummy:nope")


def test_seeded_sampling_repeats_whatever_else_is_batched(make_engine, photos):
    params = dict(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine()
    rid = alone.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(**params))
    first = drain(alone)[rid].token_ids

    busy = make_engine(max_num_batched_tokens=16, max_num_seqs=4)
    busy.add_request(prompt=PROMPTS[2], images=photos, sampling=SamplingParams(max_tokens=20))
    busy.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=9, temperature=1.0))
    again = busy.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(**params))
    assert drain(busy)[again].token_ids == first

    other = make_engine()
    changed = other.add_request(
        prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(**{**params, "seed": 99})
    )
    assert drain(other)[changed].token_ids != first


def test_top_k_one_is_greedy(make_engine, oracle, photos):
    engine = make_engine()
    rid = engine.add_request(
        prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=8, temperature=0.7, top_k=1)
    )
    assert drain(engine)[rid].token_ids == oracle(PROMPTS[1], [photos[0]], 8)


def test_stop_string_ends_the_request_and_is_cut_from_the_text(make_engine):
    engine = make_engine()
    probe = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=16, ignore_eos=True))
    full = drain(engine)[probe]
    assert len(full.text) > 6
    stop = full.text[3:6]
    rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))
    out = drain(engine)[rid]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert len(out.token_ids) < 16


def test_max_tokens_and_max_model_len_end_with_length(make_engine):
    engine = make_engine(max_model_len=40)
    prompt_len = len(engine.adapter.process(PROMPTS[0], [])[0])
    rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=100, ignore_eos=True))
    out = drain(engine)[rid]
    assert out.finish_reason == "length" and prompt_len + len(out.token_ids) == 40
    rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    out = drain(engine)[rid]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_eos_ends_the_request_unless_ignored(make_engine, oracle):
    engine = make_engine()
    eos = next(iter(engine.eos_token_ids))
    # Strengthen EOS's row of the output head so that greedy decoding reaches it within a few tokens.
    with_eos_bias = engine.adapter.lm_head.weight
    saved = with_eos_bias[eos].clone()
    with torch.no_grad():  # in place on the parameter: a layer that keeps packed weights sees the change
        with_eos_bias[eos] = with_eos_bias.abs().max(dim=0).values * 50
    try:
        rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=8))
        stopped = drain(engine)[rid]
        assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos and len(stopped.token_ids) < 8
        rid = engine.add_request(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=8, ignore_eos=True))
        ignored = drain(engine)[rid]
        assert ignored.finish_reason == "length" and len(ignored.token_ids) == 8
        assert ignored.token_ids[: len(stopped.token_ids)] == stopped.token_ids
    finally:
        with torch.no_grad():
            with_eos_bias[eos] = saved


def test_a_failing_step_ends_only_its_requests_and_the_engine_keeps_serving(make_engine, oracle, photos):
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4)
    broken = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=4))
    engine.requests[broken].mm.encoder_inputs[0] = {}  # the vision encoder will fail on this tile
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [(broken, True, "error")]
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()
    rid = engine.add_request(prompt=PROMPTS[1], images=[photos[0]], sampling=SamplingParams(max_tokens=6))
    assert drain(engine)[rid].token_ids == oracle(PROMPTS[1], [photos[0]], 6)


def test_budget_must_cover_one_token_per_running_request():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_batched_tokens=8, max_num_seqs=16)


def test_prompt_token_ids_run_as_given_exactly_as_generate(make_engine, checkpoint):
    from transformers import AutoModelForImageTextToText

    engine = make_engine()
    ids = engine.tokenizer("User: a person at the gate", add_special_tokens=False).input_ids
    ids = ids + [engine.tokenizer.convert_tokens_to_ids(c) for c in "door"]  # not what the tokenizer would give
    rid = engine.add_request(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=8))
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.request_id == rid), tokens)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert tokens == expected.tolist()
    image_token = engine.adapter.model.config.image_token_id
    for bad, match in [([], "non-empty"), ([1, -1], r"prompt_token_ids\[1\] is -1"),
                       ([1, 10**9], r"\[1\] is 1000000000"), ([1, image_token], "placeholder"), (["a"], "'a'")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt_token_ids=bad)
    with pytest.raises(ValueError, match="exactly one"):
        engine.add_request(prompt="x", prompt_token_ids=ids)
    with pytest.raises(ValueError, match="no images"):
        engine.add_request(prompt_token_ids=ids, images=[b"x"])
    assert not engine.has_unfinished_requests()
