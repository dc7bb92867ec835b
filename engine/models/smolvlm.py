"""SmolVLM and Idefics3: a SigLIP tower encodes each 512 px tile (plus a global view) on its own; a pixel
shuffle connector turns a tile into `image_seq_len` rows that replace that many `<image>` tokens in order.
The encoder input is therefore one tile: encoding tiles one at a time gives the same features as
encoding the whole image at once. A video (SmolVLM2's processor) is its frames, each one global view with its
timestamp written before it ("Frame from 00:03:"), so its encoder inputs are frames, encoded as tiles are."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from engine.models.base import EncoderInput, VLMAdapter, place_inputs, video_processor_kwargs
from engine.models.sliced_tower import SLICES_PER_LAYER, in_groups, join, run_slices, split
from engine.request import MultimodalPrompt
from engine.video import Video


class SmolVLMAdapter(VLMAdapter):
    architectures = ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
    image_marker = "<image>"
    video_marker = "<video>"

    def __init__(self, model: Any, processor: Any, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model, processor, device, dtype)
        if getattr(processor, "video_processor", None) is None:  # Idefics3's processor has no video path
            self.video_marker = None

    @property
    def text_model(self) -> torch.nn.Module:
        return self.model.model.text_model

    @property
    def encoder_slices(self) -> int:
        """`SLICES_PER_LAYER` slices per layer of the SigLIP tower; the embeddings run with the first slice, the
        final norm and the connector with the last."""
        return SLICES_PER_LAYER * len(self.model.model.vision_model.encoder.layers)

    slices_per_layer = SLICES_PER_LAYER
    processor_options = {"do_image_splitting": bool, "size": dict}
    single_input_options = {"do_image_splitting": False}  # each image one 512 px tile: 64 image tokens

    def _edges(self) -> tuple[int, int] | None:
        """A tile's edge and the longest edge the processor resizes an image to before tiling it (512 and 2,048
        for SmolVLM-256M: up to 16 tiles and the global view); None where its image processor names no such edges
        or does not split images (its defaults are then one tile an image already)."""
        images = getattr(self.processor, "image_processor", None)
        try:
            edges = int(images.max_image_size["longest_edge"]), int(images.size["longest_edge"])
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
        return edges if getattr(images, "do_image_splitting", True) else None

    def option_problem(self, name: str, value: Any) -> str | None:
        """`size`: {"longest_edge": n}, the edge an image is resized to before it is tiled, from a tile's edge up
        to the processor's own (fewer tiles than the defaults, never more)."""
        if name != "size":
            return None
        edges = self._edges()
        if edges is None:
            return "is not an option of this checkpoint's processor (it names no tile edges, or does not tile)"
        tile, default = edges
        edge = value.get("longest_edge") if set(value) == {"longest_edge"} else None
        if type(edge) is not int or not tile <= edge <= default:
            return (f"must be {{'longest_edge': n}} with n from a tile's {tile} to the processor's {default} "
                    f"pixels, got {value!r:.80}")
        return None

    def tiling_options(self, width: int, height: int) -> dict[str, Any]:
        """The image resized to the smallest multiple of a tile's edge that holds its longest side (a 640 x 480
        frame: 1,024 px, 4 tiles and the global view, where the defaults upscale it to 2,048 px and 12 tiles of
        interpolated pixels and the global view); one tile as `single_input_options` makes it where one holds it."""
        edges = self._edges()
        if edges is None:
            return {}
        tile, default = edges
        edge = max(1, -(-max(width, height) // tile)) * tile
        if edge >= default:
            return {}
        return dict(self.single_input_options) if edge == tile else {"size": {"longest_edge": edge}}

    def expand_prompt(
        self, prompt: str, images: list[Image.Image], videos: list[Video], options: dict | None = None
    ) -> tuple[list[int], MultimodalPrompt | None]:
        if not images and not videos:  # tokenized exactly as the processor does for transformers' own generate
            return self.processor(text=[prompt], return_tensors="pt")["input_ids"][0].tolist(), None
        if images and videos:
            raise ValueError(f"{self.family}'s processor takes images or videos in one prompt, not both "
                             f"(got {len(images)} image(s) and {len(videos)} video(s))")
        if videos:
            batch = self.processor(text=[prompt], return_tensors="pt", **video_processor_kwargs(videos))
        else:
            batch = self.processor(text=[prompt], images=[images], return_tensors="pt", **(options or {}))
        ids = batch["input_ids"][0].tolist()
        # Images: [1, tiles, 3, H, W], every image's tiles in the one row. Videos: [videos, frames, 3, H, W], a row
        # per video padded with zero frames to the longest (transformers' model drops those), so each video's own
        # frames are taken, in the prompt's order.
        pixel_values = batch["pixel_values"]
        pixel_mask = batch.get("pixel_attention_mask")
        counts = [video.num_frames for video in videos] if videos else [pixel_values.shape[1]]
        found = []
        for row, count in enumerate(counts):
            for tile in range(count):
                item = {"pixel_values": pixel_values[row, tile : tile + 1]}
                if pixel_mask is not None:
                    item["pixel_attention_mask"] = pixel_mask[row, tile : tile + 1]
                found.append(EncoderInput(self.model.model.image_seq_len, item))
        return ids, place_inputs(ids, {self.model.config.image_token_id: found})

    @property
    def vision_layers(self) -> torch.nn.ModuleList:
        return self.model.model.vision_model.encoder.layers

    @torch.inference_mode()
    def encode_whole(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        masks = [i.get("pixel_attention_mask") for i in inputs]
        pixel_mask = None if any(m is None for m in masks) else torch.cat(masks).to(self.device)
        out = self.model.model.get_image_features(
            pixel_values=pixel_values.unsqueeze(0),
            pixel_attention_mask=None if pixel_mask is None else pixel_mask.unsqueeze(0),
        )
        # transformers 5 returns an output object whose pooler_output holds the projected features.
        features = getattr(out, "pooler_output", out)
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features))
        rows = features.reshape(len(inputs), -1, features.shape[-1])
        return list(rows.unbind(0))

    @torch.inference_mode()
    def encode_slices(
        self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
    ) -> list[Any]:
        """The same operations as SmolVLM's `get_image_features` and its encoder layers' own forward, a
        range of slices (engine/models/sliced_tower.py) at a time. A state is (hidden states [1, patches, dim], the
        tower's attention mask or None when no patch is padding, what the last slice left for the next one or
        None)."""
        return in_groups(inputs, states, self.model.model.vision_model.config, self.dtype,
                         lambda group, held: self._encode_group(group, held, first, end))

    def _encode_group(self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
                      ) -> list[Any]:
        vision = self.model.model.vision_model
        if first == 0:
            states = [(*self._embed_tile(vision, item), None) for item in inputs]
        hidden = join([state[0] for state in states])
        masks = [state[1] for state in states]
        mask = None if all(m is None for m in masks) else torch.cat([self._full_mask(h, m) for h, m, _ in states])
        hidden, carried = run_slices(vision.encoder.layers, first, end, hidden, mask,
                                     join([state[2] for state in states]))
        if end < self.encoder_slices:
            return list(zip(hidden.split(1), masks, split(carried, [1] * len(states))))
        features = self.model.model.connector(vision.post_layernorm(hidden))
        return list(features.unbind(0))

    def _embed_tile(self, vision: torch.nn.Module, item: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        from transformers.masking_utils import create_bidirectional_mask

        pixel_values = item["pixel_values"].to(self.device, self.dtype)
        pixel_mask = item.get("pixel_attention_mask")
        if pixel_mask is None:
            pixel_mask = torch.ones(pixel_values.shape[0], *pixel_values.shape[2:], dtype=torch.bool)
        patch = vision.patch_size
        patches = pixel_mask.to(self.device).unfold(1, patch, patch).unfold(2, patch, patch)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = vision.embeddings(pixel_values=pixel_values, patch_attention_mask=patch_mask)
        mask = create_bidirectional_mask(
            config=vision.config, inputs_embeds=hidden, attention_mask=patch_mask.view(1, -1)
        )
        return hidden, mask

    @staticmethod
    def _full_mask(hidden: torch.Tensor, mask: Any) -> torch.Tensor:
        """A tile without padding has no mask; batched beside one that has, it needs an all-visible one."""
        if mask is not None:
            return mask
        n = hidden.shape[1]
        return torch.ones(1, 1, n, n, dtype=torch.bool, device=hidden.device)
