"""SmolVLM and Idefics3: a SigLIP tower encodes each 512 px tile (plus a global view) on its own; a pixel
shuffle connector turns a tile into `image_seq_len` rows that replace that many `<image>` tokens in order.
The encoder input is therefore one tile: encoding tiles one at a time gives the same features as
encoding the whole image at once."""

from __future__ import annotations

import torch
from PIL import Image

from engine.models.base import VLMAdapter
from engine.request import MultimodalPrompt


class SmolVLMAdapter(VLMAdapter):
    architectures = ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
    image_marker = "<image>"

    @property
    def text_model(self) -> torch.nn.Module:
        return self.model.model.text_model

    def expand_prompt(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], MultimodalPrompt | None]:
        if not images:  # tokenized exactly as the processor does for transformers' own generate
            return self.processor(text=[prompt], return_tensors="pt")["input_ids"][0].tolist(), None
        batch = self.processor(text=[prompt], images=[images], return_tensors="pt")
        ids = batch["input_ids"][0].tolist()
        pixel_values = batch["pixel_values"][0]  # [tiles, 3, H, W]
        pixel_mask = batch.get("pixel_attention_mask")
        image_token_id = self.model.config.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_token_id]
        rows_per_tile = self.model.model.image_seq_len
        num_tiles = pixel_values.shape[0]
        if len(positions) != num_tiles * rows_per_tile:
            raise ValueError(
                f"the prompt expands to {len(positions)} image tokens but its {len(images)} image(s) give "
                f"{num_tiles} tiles of {rows_per_tile} tokens"
            )
        inputs = []
        for tile in range(num_tiles):
            item = {"pixel_values": pixel_values[tile : tile + 1]}
            if pixel_mask is not None:
                item["pixel_attention_mask"] = pixel_mask[0, tile : tile + 1]
            inputs.append(item)
        mm = MultimodalPrompt(
            placeholder_positions=positions,
            unit_row_starts=[tile * rows_per_tile for tile in range(num_tiles)],
            unit_rows=[rows_per_tile] * num_tiles,
            encoder_inputs=inputs,
        )
        return ids, mm

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
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
