"""Embeddings from the served model's own vision tower and input embeddings (engine/embeddings.py, `Engine.embed`)
on the tiny model, and an event's own frames finding it first among similar events in a real store."""

from __future__ import annotations

import io
import math

import pytest
from PIL import Image

from bench.report import photo_paths
from engine import Engine, EngineConfig, SamplingParams
from memory import Event, EventFrame, EventQuery, open_store_at


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(model="tiny", dtype="float32", max_num_batched_tokens=1024, max_num_seqs=4))
    yield engine
    engine.close()


def jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG")
    return out.getvalue()


def test_an_image_embedding_is_the_towers_pooled_features(engine):
    photos = [Image.open(path).convert("RGB") for path in photo_paths()]
    first, again, other = engine.embed(images=[photos[0], jpeg(photos[0]), photos[1]])
    hidden = engine.adapter.text_model.config.hidden_size
    assert len(first) == hidden
    assert math.isclose(sum(v * v for v in first), 1.0, rel_tol=1e-5)
    assert max(abs(a - b) for a, b in zip(first, again)) < 0.05  # the same photo through JPEG
    assert first != other


def test_a_text_embedding_has_the_same_size(engine):
    text, same = engine.embed(texts=["a person in a red coat", "a person in a red coat"])
    assert text == same and len(text) == engine.adapter.text_model.config.hidden_size
    with pytest.raises(ValueError, match="non-empty"):
        engine.embed(texts=[" "])
    with pytest.raises(ValueError, match="image 0"):
        engine.embed(images=[b"not an image"])
    with pytest.raises(ValueError, match="over the limit"):
        engine.embed(texts=["word"] * 65)


def test_an_events_own_frames_make_it_the_first_of_its_similar(engine, tmp_path):
    store = open_store_at(str(tmp_path / "events.db"))
    photos = [Image.open(path).convert("RGB") for path in photo_paths()]
    crops = [photo.crop((0, 0, photo.width // (k + 1), photo.height // (k + 1))) for photo in photos for k in range(3)]
    for index, crop in enumerate(crops):
        frames = [jpeg(crop)]
        vector = engine.embed(images=frames)[0]
        store.add(Event(id=f"job-{index}", camera_id="gate", kind="event", start_ts=float(index),
                        end_ts=float(index), finished_at=float(index), frames=[EventFrame(frames[0], float(index))],
                        embedding=vector))
    for index in range(len(crops)):
        event = store.get(f"job-{index}")
        assert store.similar(event.embedding, EventQuery(limit=3))[0][0].id == f"job-{index}"
        uploaded = engine.embed(images=[event.frames[0].jpeg])[0]  # search by one of its frames
        assert store.similar(uploaded, EventQuery(limit=3))[0][0].id == f"job-{index}"
    store.close()


def test_the_engine_answers_what_the_server_asks_of_the_model(engine):
    """api/ sizes prompts and checks inputs through the engine's own API (`tokenize`, `single_input_options`, ...),
    never its adapter: a prompt's tokens are those `add_request` runs."""
    photo = Image.open(photo_paths()[0]).convert("RGB")
    prompt = engine.user_prompt([{"type": "image"}, {"type": "text", "text": "what is there?"}])
    single = engine.single_input_options
    assert single == {"do_image_splitting": False}  # the tiny model is a SmolVLM: it tiles images
    tiled, one_tile = engine.tokenize(prompt, [photo]), engine.tokenize(prompt, [photo], single)
    assert len(one_tile) < len(tiled)
    request_id = engine.add_request(prompt=prompt, images=[photo], mm_processor_kwargs=single,
                                    sampling=SamplingParams(max_tokens=1))
    assert engine.requests[request_id].prompt_token_ids == one_tile
    engine.abort(request_id)
    with pytest.raises(ValueError, match="0 image"):
        engine.tokenize(prompt)
    assert engine.vocab_size == engine.adapter.lm_head.weight.shape[0]
    assert engine.takes_videos and engine.model_family == "SmolVLMForConditionalGeneration"
    assert engine.render_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]).endswith(
        engine.user_prompt([{"type": "text", "text": "hi"}])[-20:])


def run_to_end(engine, request_id: str):
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def assert_same_vectors(found: list, expected: list[list[float]]) -> None:
    """The same vectors up to float32 rounding: the CPU kernels route a product by its rows, so a tile encoded
    beside another (a caption's frames) may round differently in the last bit than one encoded alone."""
    assert len(found) == len(expected)
    for vector, wanted in zip(found, expected):
        assert len(vector) == len(wanted) and max(abs(a - b) for a, b in zip(vector, wanted)) < 1e-6


def test_a_captions_own_encoder_run_gives_its_images_embeddings(engine):
    """`embed_images`: each image of a caption made with one encoder input an image gets, on the finished output,
    the embedding `Engine.embed` computes for it (POST /v1/embeddings), pooled from the caption's own features,
    also when those came from the encoder output cache; an image in a prompt's cached prefix is not encoded (None);
    a request not asking gets none, and a tiled image's inputs are its tiles."""
    photos = [Image.open(path).convert("RGB") for path in photo_paths()]
    frames = [jpeg(photos[0]), jpeg(photos[1].crop((0, 0, 300, 200)))]
    single = engine.single_input_options
    expected = engine.embed(images=frames)
    hits = engine.stats().encoder_cache_hits
    for lead in ("What happened here?", "And in these frames, who is there?"):  # encoded, then found by content
        prompt = engine.user_prompt([{"type": "text", "text": lead}, {"type": "image"}, {"type": "image"}])
        request_id = engine.add_request(prompt=prompt, images=frames, mm_processor_kwargs=single, embed_images=True,
                                        sampling=SamplingParams(max_tokens=3, temperature=0.0))
        assert_same_vectors(run_to_end(engine, request_id).image_embeddings, expected)
    assert engine.stats().encoder_cache_hits == hits + 2
    again = engine.add_request(prompt=prompt, images=frames, mm_processor_kwargs=single, embed_images=True,
                               sampling=SamplingParams(max_tokens=1))
    cached = run_to_end(engine, again).image_embeddings  # the first image lies in the prompt's cached prefix
    assert cached[0] is None and (cached[1] is None or assert_same_vectors(cached[1:], expected[1:]) is None)
    plain = engine.add_request(prompt=prompt + " ", images=frames, mm_processor_kwargs=single,
                               sampling=SamplingParams(max_tokens=1))
    assert run_to_end(engine, plain).image_embeddings is None
    tiled = engine.add_request(prompt=engine.user_prompt([{"type": "image"}, {"type": "text", "text": "hi"}]),
                               images=frames[:1], embed_images=True, sampling=SamplingParams(max_tokens=1))
    tiles = run_to_end(engine, tiled).image_embeddings
    assert len(tiles) > 1 and all(len(v) == len(expected[0]) for v in tiles)
    assert not engine._image_embeddings, "nothing held once the requests finished"
