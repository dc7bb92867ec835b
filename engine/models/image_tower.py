"""The base of adapters whose vision tower encodes each image as views of one size (LLaVA-1.5's one view,
OneVision's base view and tiles, Gemma 3's one view): every image of a prompt gives as many feature rows, and the
tower runs a slice of a layer at a time (engine/models/sliced_tower.py), from its embeddings through the layers
the features need (`_depth`), then the family's own finishing (`_finish`: feature selection, projector).
A family says its depth, its finish and how it encodes whole (`encode`)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from engine.models.base import EncoderInput, VLMAdapter, place_inputs, video_processor_kwargs
from engine.models.sliced_tower import SLICES_PER_LAYER, in_groups, join, run_slices, split
from engine.request import MultimodalPrompt
from engine.video import Video


class ImageTowerAdapter(VLMAdapter):
    @property
    def text_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    def encoder_input(self, batch: dict[str, torch.Tensor], image: int, num_images: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": batch["pixel_values"][image : image + 1]}

    def expand_prompt(
        self, prompt: str, images: list[Image.Image], videos: list[Video]
    ) -> tuple[list[int], MultimodalPrompt | None]:
        batch = self.processor(text=[prompt], images=[images] if images else None, return_tensors="pt",
                               **video_processor_kwargs(videos))
        ids = batch["input_ids"][0].tolist()
        if not images and not videos:
            return ids, None
        config = self.model.config
        # Every image of a prompt gives as many rows: LLaVA's views all have one size, and OneVision tiles
        # only a lone image; so does every video of a prompt (frames of one size, as many of them).
        inputs_by_token = {config.image_token_id: self._equal_inputs(ids, config.image_token_id, [
            self.encoder_input(batch, i, len(images)) for i in range(len(images))])}
        if videos:
            inputs_by_token[config.video_token_id] = self._equal_inputs(ids, config.video_token_id, [
                {"pixel_values_videos": batch["pixel_values_videos"][v : v + 1]} for v in range(len(videos))])
        return ids, place_inputs(ids, inputs_by_token)

    @staticmethod
    def _equal_inputs(ids: list[int], token: int, inputs: list[dict[str, torch.Tensor]]) -> list[EncoderInput]:
        rows, left = divmod(sum(1 for t in ids if t == token), max(len(inputs), 1))
        if inputs and (left or not rows):
            raise ValueError(f"the prompt expands to {rows * len(inputs) + left} tokens of id {token} for "
                             f"{len(inputs)} input(s)")
        return [EncoderInput(rows, item) for item in inputs]

    # -- the tower in slices (engine/models/sliced_tower.py) --------------------------------------------------
    @property
    def _tower(self) -> torch.nn.Module:
        return self.model.model.vision_tower

    def _depth(self) -> int | None:
        """How many of the tower's layers the features come after (None: they come from several layers)."""
        raise NotImplementedError

    @property
    def vision_layers(self) -> torch.nn.ModuleList | None:
        depth = self._depth()
        return None if depth is None else self._tower.encoder.layers[:depth]

    @property
    def encoder_slices(self) -> int:
        """`SLICES_PER_LAYER` slices per layer the features need; the embeddings run with the first slice, the
        feature selection and the projector with the last (1: the tower runs whole)."""
        depth = self._depth()
        return 1 if depth is None else max(SLICES_PER_LAYER * depth, 1)

    slices_per_layer = SLICES_PER_LAYER

    def _views(self, item: dict[str, torch.Tensor]) -> torch.Tensor:
        """The input's views through the tower, [views, channels, H, W]."""
        return item["pixel_values"]

    def _embed(self, views: torch.Tensor) -> torch.Tensor:
        """The tower's embeddings of the views (CLIP's pre-layer norm included): its first layer's input."""
        tower = self._tower
        hidden = tower.embeddings(views.to(self.device, self.dtype))
        norm = getattr(tower, "pre_layrnorm", None)
        return hidden if norm is None else norm(hidden)

    def _finish(self, items: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """Features of the inputs from their last needed layer's output (each [views, patches, dim])."""
        raise NotImplementedError

    @torch.inference_mode()
    def encode_slices(
        self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
    ) -> list[Any]:
        """The same operations as the model's own image (and video) features, a range of slices at a time. A state
        is (the views' hidden states [views, patches, dim], what the last slice left for the next one or None)."""
        views = [self._views(item).shape[0] for item in inputs]
        return in_groups(inputs, states, self._tower.config, self.dtype,
                         lambda group, held: self._encode_group(group, held, first, end), views)

    def _encode_group(self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
                      ) -> list[Any]:
        if first == 0:
            states = [(self._embed(self._views(item)), None) for item in inputs]
        sizes = [state[0].shape[0] for state in states]
        hidden, carried = run_slices(self.vision_layers, first, end, join([s[0] for s in states]),
                                     None, join([s[1] for s in states]))
        if end < self.encoder_slices:
            return list(zip(hidden.split(sizes), split(carried, sizes)))
        return self._finish(inputs, list(hidden.split(sizes)))
