"""Embeddings from the served model itself, no second model: an image's is its vision features (the tower and the
projection into the language model's space, as a caption's prompt gets them) mean-pooled over every feature row
and L2-normalised; a text's is the language model's input embeddings of its tokens, mean-pooled and
L2-normalised. Both have the language model's hidden size, so the camera memory can keep one vector an event.

An image is encoded as one encoder input where the family allows it (`VLMAdapter.single_input_options`: SmolVLM's
one 512 px tile, not its 17), so an embedding costs one tile of the tower. These functions run the tower on the
calling thread, outside the step loop (`Engine.embed`); they change no engine state.

A request's own images need no second run: `Engine.add_request(..., embed_images=True)` pools each encoder input's
features as the step loop computes them for the request's prompt (`pooled`), so a caption made with each image one
encoder input gives its images' embeddings with it (the camera memory keeps an event's so): `Engine.embed`'s, to
float32 rounding (the CPU kernels route a product by its rows, so a tile encoded beside others may round otherwise
in the last bit than one encoded alone)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image

from engine.models.base import VLMAdapter

MAX_EMBED_INPUTS = 64  # images or texts in one call


def _unit(vector: torch.Tensor) -> list[float]:
    vector = vector.float()
    norm = vector.norm()
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError("the input's features are all zeros or not finite; it has no embedding")
    return (vector / norm).tolist()


def pooled(features: Sequence[torch.Tensor]) -> list[float]:
    """Encoder inputs' features ([rows, hidden] each) mean-pooled over all of their rows, L2-normalised: an image's
    embedding from its inputs' features, here and where the engine reuses a request's own (`Engine.add_request`'s
    `embed_images`)."""
    rows = torch.cat([f.reshape(-1, f.shape[-1]).float() for f in features])
    return _unit(rows.mean(dim=0))


def image_embedding(adapter: VLMAdapter, image: Image.Image) -> list[float]:
    """One image's embedding: its encoder inputs' features (one input where the family allows: `single_input_options`),
    mean-pooled over all rows, L2-normalised."""
    prompt = adapter.image_prompt or adapter.image_marker
    _, mm = adapter.process(prompt, [image], (), dict(adapter.single_input_options) or None)
    if mm is None or not mm.encoder_inputs:
        raise ValueError(f"{adapter.family} made no encoder input of the image")
    return pooled(adapter.encode(mm.encoder_inputs))


def text_embedding(adapter: VLMAdapter, text: str, max_tokens: int) -> list[float]:
    """One text's embedding: its tokens' input embeddings, mean-pooled, L2-normalised."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a text to embed must be a non-empty string, got {str(text)[:80]!r}")
    ids = adapter.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, over the limit of {max_tokens}")
    weight = adapter.embed_tokens.weight
    rows = adapter.embed_tokens(torch.tensor(ids, device=weight.device))
    return _unit(rows.float().mean(dim=0))


def embed(adapter: VLMAdapter, images: Sequence[Image.Image], texts: Sequence[str],
          max_tokens: int) -> list[list[float]]:
    """The embeddings of `images`, then of `texts`, in order (ValueError naming a bad input)."""
    if len(images) + len(texts) > MAX_EMBED_INPUTS:
        raise ValueError(f"{len(images) + len(texts)} inputs to embed, over the limit of {MAX_EMBED_INPUTS}")
    with torch.inference_mode():
        return ([image_embedding(adapter, image) for image in images]
                + [text_embedding(adapter, text, max_tokens) for text in texts])
