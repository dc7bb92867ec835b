"""Embeddings from the served model's own vision tower and input embeddings (engine/embeddings.py, `Engine.embed`)
on the tiny model, and an event's own frames finding it first among similar events in a real store."""

from __future__ import annotations

import io
import math

import pytest
from PIL import Image

from bench.report import photo_paths
from engine import Engine, EngineConfig
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
