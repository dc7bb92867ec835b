"""Qwen2-VL and Qwen2.5-VL: dynamic resolution and multimodal rotary positions.

The processor resizes each image to a multiple of 28 px (patch 14, 2x2 merge) within its pixel limits and
expands its `<|image_pad|>` into one token per merged 2x2 patch group (`image_grid_thw` gives the grid). The
vision tower attends across all patches of an image (Qwen2.5-VL within windows, and fully in a few
blocks), never across images, so the encoder input is one image. Text positions follow M-RoPE: three
streams (time, height, width), from the model's own `get_rope_index`, computed once per prompt.
"""

from __future__ import annotations

import torch
from PIL import Image

from engine.models.base import VLMAdapter
from engine.request import MultimodalPrompt


class Qwen2VLAdapter(VLMAdapter):
    architectures = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    image_marker = "<|image_pad|>"
    rope_streams = 3

    @property
    def text_model(self) -> torch.nn.Module:
        # transformers 5 nests the text model as `language_model`; 4.x exposed it as `model` itself.
        return getattr(self.model.model, "language_model", self.model.model)

    @property
    def visual(self) -> torch.nn.Module:
        return getattr(self.model.model, "visual", None) or self.model.visual

    def expand_prompt(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], MultimodalPrompt | None]:
        batch = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        input_ids = batch["input_ids"]
        ids = input_ids[0].tolist()
        if not images:
            return ids, None
        grids = batch["image_grid_thw"]
        merge = self.visual.spatial_merge_size
        rows = (grids.prod(-1) // merge**2).tolist()
        image_token_id = self.model.config.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_token_id]
        if len(positions) != sum(rows):
            raise ValueError(
                f"the prompt expands to {len(positions)} image tokens but its {len(images)} image(s) give {sum(rows)}"
            )
        patch_starts = [0] + grids.prod(-1).cumsum(0).tolist()  # pixel_values has one row per patch
        inputs = [
            {"pixel_values": batch["pixel_values"][start:end], "image_grid_thw": grids[i : i + 1]}
            for i, (start, end) in enumerate(zip(patch_starts, patch_starts[1:]))
        ]
        # transformers 5 finds the vision spans by `mm_token_type_ids`; 4.x by the token ids themselves.
        type_ids = {"mm_token_type_ids": batch["mm_token_type_ids"]} if "mm_token_type_ids" in batch else {}
        rope_positions, delta = self.model.model.get_rope_index(input_ids, image_grid_thw=grids, **type_ids)
        return ids, MultimodalPrompt(
            placeholder_positions=positions,
            unit_row_starts=[sum(rows[:i]) for i in range(len(rows))],
            unit_rows=rows,
            encoder_inputs=inputs,
            rope_positions=rope_positions[:, 0],  # [3, batch=1, L] -> [3, L]
            rope_position_delta=int(delta.reshape(-1)[0]),
        )

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        # Several images go through the tower in one call, as transformers does for a prompt's images:
        # attention never crosses an image's patches.
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        grids = torch.cat([i["image_grid_thw"] for i in inputs]).to(self.device)
        out = self.model.model.get_image_features(pixel_values, grids)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, torch.Tensor):  # older transformers return all images' rows concatenated
            features = features.split((grids.prod(-1) // self.visual.spatial_merge_size**2).tolist())
        return list(features)
