"""LLaVA-style models: a CLIP or SigLIP vision tower, a projector, and a Llama-family or Qwen2 text model.

LLaVA-1.5 encodes each image as one fixed-size view. LLaVA-OneVision tiles a lone image (any resolution: a
base view plus the tiles of the best grid, unpadded, a newline row end), and encodes each image of a
multi-image prompt as its base view alone. Tiles are packed row by row across the whole image, so a tile's
rows are not contiguous in the prompt: the encoder input is one image for both. A OneVision video is its
frames through the tower, each frame's features pooled 2x2, then one newline row: the encoder input is the
whole video (its rows end with that newline, which follows the last frame). LLaVA-1.5 has no video path.
"""

from __future__ import annotations

import torch
from PIL import Image

from engine.models.base import EncoderUnit, VLMAdapter, place_units, video_processor_kwargs
from engine.request import MultimodalPrompt
from engine.video import Video


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
        units = {config.image_token_id: self._equal_units(ids, config.image_token_id, [
            self.encoder_input(batch, i, len(images)) for i in range(len(images))])}
        if videos:
            units[config.video_token_id] = self._equal_units(ids, config.video_token_id, [
                {"pixel_values_videos": batch["pixel_values_videos"][v : v + 1]} for v in range(len(videos))])
        return ids, place_units(ids, units)

    @staticmethod
    def _equal_units(ids: list[int], token: int, inputs: list[dict[str, torch.Tensor]]) -> list[EncoderUnit]:
        rows, left = divmod(sum(1 for t in ids if t == token), max(len(inputs), 1))
        if inputs and (left or not rows):
            raise ValueError(f"the prompt expands to {rows * len(inputs) + left} tokens of id {token} for "
                             f"{len(inputs)} input(s)")
        return [EncoderUnit(rows, item) for item in inputs]

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        return self._image_features(pixel_values=pixel_values)


class LlavaOnevisionAdapter(LlavaAdapter):
    architectures = ("LlavaOnevisionForConditionalGeneration",)
    video_marker = "<video>"

    def encoder_input(self, batch: dict[str, torch.Tensor], image: int, num_images: int) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": batch["pixel_values"][image : image + 1],  # [1, views, 3, H, W]
            "image_sizes": batch["image_sizes"][image : image + 1],
            # The model tiles an image only when it is its prompt's only one; it reads this count per image.
            "batch_num_images": torch.tensor([num_images]),
        }

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        # One image or video a call: images differ in their number of views and in whether they are tiled.
        return [self._video_features(i["pixel_values_videos"]) if "pixel_values_videos" in i else
                self._image_features(
                    pixel_values=i["pixel_values"].to(self.device, self.dtype),
                    image_sizes=i["image_sizes"].to(self.device),
                    batch_num_images=i["batch_num_images"],
                    vision_aspect_ratio=self.model.config.vision_aspect_ratio,
                )[0]
                for i in inputs]

    def _video_features(self, pixel_values_videos: torch.Tensor) -> torch.Tensor:
        """A video's rows: its frames' pooled features, then the newline row."""
        config = self.model.config
        out = self.model.model.get_video_features(
            pixel_values_videos=pixel_values_videos.to(self.device, self.dtype),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
        return getattr(out, "pooler_output", out)[0]
