"""Gemma 3: each image is one fixed-size view through a SigLIP tower, average-pooled to `mm_tokens_per_image`
tokens between `<start_of_image>` and `<end_of_image>`; a Gemma 3 text model whose local layers attend within
a sliding window and whose image tokens attend to all tokens of their own image, both ways. The scheduler
keeps each image's span in one chunk (`atomic_inputs`), and the runner gives the attention that block
(see `ReferenceBackend.prefill_masks`, engine/attention_backends.py). The tower (4,096 patches of an
896 px view through 27 layers at google/gemma-3-4b-it's sizes: seconds of a CPU's time) runs a slice of a layer
at a time (engine/models/sliced_tower.py), so that an image prompt's encoding is spread over the steps of the
chats running beside it."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.image_tower import ImageTowerAdapter
from engine.models.sliced_tower import join


class Gemma3Adapter(ImageTowerAdapter):
    """One view an image, every image the same number of tokens (`ImageTowerAdapter`); the image features and
    the text model are Gemma 3's."""

    architectures = ("Gemma3ForConditionalGeneration",)
    image_marker = "<start_of_image>"

    def __init__(self, model: Any, processor: Any, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model, processor, device, dtype)
        text_config = self.text_model.config
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(text_config, name, None) is not None:
                raise ValueError(f"Gemma 3 checkpoints with {name}={getattr(text_config, name)} are not supported")
        if getattr(text_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 checkpoints with use_bidirectional_attention (text attends both ways) are "
                             "not supported: their prompts cannot be prefilled in causal chunks")

    def encoder_input(self, batch: dict[str, torch.Tensor], image: int, num_images: int) -> dict[str, torch.Tensor]:
        if batch["pixel_values"].shape[0] != num_images:
            raise ValueError(f"the processor made {batch['pixel_values'].shape[0]} views of {num_images} image(s); "
                             "pan-and-scan crops are not supported (set do_pan_and_scan false)")
        return super().encoder_input(batch, image, num_images)

    def _depth(self) -> int:
        return len(self._tower.encoder.layers)  # the features come after the whole tower

    def _finish(self, items: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tower's final norm, then the projector (pooling, norm, projection), as `get_image_features`."""
        return list(self.model.model.multi_modal_projector(self._tower.post_layernorm(join(hidden))).unbind(0))

    @torch.inference_mode()
    def encode_whole(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        out = self.model.get_image_features(pixel_values=pixel_values)
        return list(getattr(out, "pooler_output", out).unbind(0))
