"""LLaVA-style models: a CLIP or SigLIP vision tower, a projector, and a Llama-family or Qwen2 text model.

LLaVA-1.5 encodes each image as one fixed-size view. LLaVA-OneVision tiles a lone image (any resolution: a
base view plus the tiles of the best grid, unpadded, a newline row end), and encodes each image of a
multi-image prompt as its base view alone. Tiles are packed row by row across the whole image, so a tile's
rows are not contiguous in the prompt: the encoder input is one image for both. A OneVision video is its
frames through the tower, each frame's features pooled 2x2, then one newline row: the encoder input is the
whole video (its rows end with that newline, which follows the last frame). LLaVA-1.5 has no video path.

The tower (CLIP or SigLIP) runs a slice of a layer at a time (engine/models/sliced_tower.py), through the layers
whose output the features are taken from (`vision_feature_layer`: LLaVA-1.5's second-to-last, so its last layer
is never run); the views of an input (its tiles, or a video's frames) go through it together. Features taken from
several layers at once make the tower run whole.
"""

from __future__ import annotations

import math

import torch

from engine.models.image_tower import ImageTowerAdapter
from engine.models.sliced_tower import join


class LlavaAdapter(ImageTowerAdapter):
    architectures = ("LlavaForConditionalGeneration",)
    image_marker = "<image>"

    def _image_features(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
        config = self.model.config
        out = self.model.get_image_features(
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            **inputs,
        )
        features = getattr(out, "pooler_output", out)
        return list(features.unbind(0) if isinstance(features, torch.Tensor) else features)

    @torch.inference_mode()
    def encode_whole(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        return self._image_features(pixel_values=pixel_values)

    def _depth(self) -> int | None:
        """How many of the tower's layers the features come after (None: they come from several layers)."""
        layer, count = self.model.config.vision_feature_layer, len(self._tower.encoder.layers)
        if not isinstance(layer, int):
            return None
        return layer if layer >= 0 else count + 1 + layer

    def _finish(self, items: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """Features of the inputs from their last needed layer's output (each [views, patches, dim])."""
        selected = join(hidden)
        if self.model.config.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
        return list(self.model.model.multi_modal_projector(selected).unbind(0))


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
    def encode_whole(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
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
        out = self.model.model.get_video_features(  # positional: `pixel_values` in transformers 5.17, renamed since
            pixel_values_videos.to(self.device, self.dtype),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
        features = getattr(out, "pooler_output", out)[0]
        side = math.ceil(config.vision_config.image_size // config.vision_config.patch_size / 2)
        if features.shape[0] == pixel_values_videos.shape[1] * side * side:  # 5.17 leaves the newline to forward
            features = torch.cat([features, self.model.model.image_newline[None].to(features)])
        return features

    def _views(self, item: dict[str, torch.Tensor]) -> torch.Tensor:
        """A video's frames; an image's views as the model takes them: all of its tiles where it is its prompt's
        only image, else its base view (the processor pads every image to as many views as the most tiled)."""
        if "pixel_values_videos" in item:
            return item["pixel_values_videos"][0]
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        config = self.model.config
        views = 1
        if int(item["batch_num_images"][0]) == 1:
            views = image_size_to_num_patches(image_size=item["image_sizes"][0],
                                              grid_pinpoints=config.image_grid_pinpoints,
                                              patch_size=config.vision_config.image_size)
        return item["pixel_values"][0, :views]

    def _finish(self, items: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each input's rows, as `_image_features` and `_video_features` make them: projected, then an image's
        views packed (unpadded, a newline row a tile row), a video's frames pooled 2x2 and one newline row."""
        model, config = self.model.model, self.model.config
        features = []
        for item, views in zip(items, hidden):
            if config.vision_feature_select_strategy == "default":
                views = views[:, 1:]
            projected = model.multi_modal_projector(views)
            if "pixel_values_videos" in item:
                pooled = model.apply_pooling(projected)
                pooled = pooled.reshape(1, pooled.shape[0] * pooled.shape[1], -1)
                newline = model.image_newline[None, None, :].to(pooled.device)
                features.append(torch.cat((pooled, newline), dim=1)[0])
            else:
                packed, _ = model.pack_image_features([projected], item["image_sizes"].to(self.device),
                                                      image_newline=model.image_newline,
                                                      vision_aspect_ratio=config.vision_aspect_ratio)
                features.append(packed[0])
        return features
