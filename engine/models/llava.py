"""LLaVA-style models: a CLIP or SigLIP vision tower, a projector, and a Llama-family or Qwen2 text model.

LLaVA-1.5 encodes each image as one fixed-size view. LLaVA-OneVision tiles a lone image (any resolution: a
base view plus the tiles of the best grid, unpadded, a newline row end), and encodes each image of a
multi-image prompt as its base view alone. Tiles are packed row by row across the whole image, so a tile's
rows are not contiguous in the prompt: the encoder input is one image for both.
"""

from __future__ import annotations

import torch
from PIL import Image

from engine.models.base import VLMAdapter
from engine.request import MultimodalPrompt


class LlavaAdapter(VLMAdapter):
    architectures = ("LlavaForConditionalGeneration",)
    image_marker = "<image>"

    @property
    def text_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    def _image_features(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
        config = self.model.config
        out = self.model.get_image_features(
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            **inputs,
        )
        features = getattr(out, "pooler_output", out)
        return list(features.unbind(0) if isinstance(features, torch.Tensor) else features)

    def encoder_input(self, batch: dict[str, torch.Tensor], image: int, num_images: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": batch["pixel_values"][image : image + 1]}

    def expand_prompt(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], MultimodalPrompt | None]:
        batch = self.processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
        ids = batch["input_ids"][0].tolist()
        if not images:
            return ids, None
        image_token_id = self.model.config.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_token_id]
        # Every image of a prompt gives as many rows: LLaVA's views all have one size, and OneVision tiles
        # only a lone image.
        rows, left = divmod(len(positions), len(images))
        if left or not rows:
            raise ValueError(f"the prompt expands to {len(positions)} image tokens for {len(images)} image(s)")
        return ids, MultimodalPrompt(
            placeholder_positions=positions,
            unit_row_starts=[i * rows for i in range(len(images))],
            unit_rows=[rows] * len(images),
            encoder_inputs=[self.encoder_input(batch, i, len(images)) for i in range(len(images))],
        )

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        return self._image_features(pixel_values=pixel_values)


class LlavaOnevisionAdapter(LlavaAdapter):
    architectures = ("LlavaOnevisionForConditionalGeneration",)

    def encoder_input(self, batch: dict[str, torch.Tensor], image: int, num_images: int) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": batch["pixel_values"][image : image + 1],  # [1, views, 3, H, W]
            "image_sizes": batch["image_sizes"][image : image + 1],
            # The model tiles an image only when it is its prompt's only one; it reads this count per image.
            "batch_num_images": torch.tensor([num_images]),
        }

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        # One image a call: images differ in their number of views and in whether they are tiled.
        return [
            self._image_features(
                pixel_values=i["pixel_values"].to(self.device, self.dtype),
                image_sizes=i["image_sizes"].to(self.device),
                batch_num_images=i["batch_num_images"],
                vision_aspect_ratio=self.model.config.vision_aspect_ratio,
            )[0]
            for i in inputs
        ]
