"""SmolVLM and Idefics3: a SigLIP tower encodes each 512 px tile (plus a global view) on its own; a pixel
shuffle connector turns a tile into `image_seq_len` rows that replace that many `<image>` tokens in order.
The encoder input is therefore one tile: encoding tiles one at a time gives the same features as
encoding the whole image at once. A video (SmolVLM2's processor) is its frames, each one global view with its
timestamp written before it ("Frame from 00:03:"), so its encoder inputs are frames, encoded as tiles are."""

from __future__ import annotations

import sys
from typing import Any

import torch
from PIL import Image

from engine.host_memory import MMAP_THRESHOLD
from engine.lean_vision import LeanVisionLayer
from engine.models.base import EncoderUnit, VLMAdapter, place_units, video_processor_kwargs
from engine.request import MultimodalPrompt
from engine.video import Video

# A SigLIP encoder layer runs in five slices of similar work (on a CPU, some 10-20 ms each for a 512 px
# tile of SmolVLM-256M), so that a step carries only one slice of a layer: (0) the normed input's query, key
# and value projections; (1) attention of the first half of the heads; (2) attention of the other half and
# the output projection, added to the residual; (3) the MLP's first linear layer and activation on the
# normed sum; (4) its second linear layer, added to the residual. A slice leaves what the next one needs.
SLICES_PER_LAYER = 5


def _run_slice(layer: torch.nn.Module, which: int, hidden: torch.Tensor, mask: Any, carried: Any,
               lean: LeanVisionLayer | None = None) -> tuple[Any, Any]:
    """One slice of an encoder layer's forward, with the very operations the layer's own forward runs (each
    head's attention is computed on its own, whichever heads run beside it), or their fused equivalents where
    the layer runs lean (engine/lean_vision.py)."""
    attention, mlp = layer.self_attn, layer.mlp
    if which == 0:
        if lean is not None:
            return hidden, lean.project(hidden)
        normed = layer.layer_norm1(hidden)
        heads = (*normed.shape[:-1], -1, attention.head_dim)
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        return hidden, tuple(project(normed).view(heads).transpose(1, 2) for project in projections)
    if which in (1, 2):
        queries, keys, values, *done = carried
        count = queries.shape[1]
        half = (count + 1) // 2  # the first slice takes the odd head (a one-head tower's only one)
        heads = slice(0, half) if which == 1 else slice(half, count)
        if heads.start < heads.stop:
            if lean is not None:
                attended = lean.attend(queries[:, heads], keys[:, heads], values[:, heads], mask)
            else:
                attended, _ = _attention_function(attention)(
                    attention, queries[:, heads], keys[:, heads], values[:, heads], mask,
                    is_causal=False, scaling=attention.scale, dropout=0.0,
                )  # [batch, patches, heads, head_dim]
            done.append(attended)
        if which == 1:
            return hidden, (queries, keys, values, *done)
        attended = torch.cat(done, dim=2).reshape(*hidden.shape[:-1], -1).contiguous()
        if lean is not None:
            return lean.attended_out(attended, hidden), None
        return hidden + attention.out_proj(attended), None
    if which == 3:
        if lean is not None:
            return hidden, lean.mlp_in(hidden)
        return hidden, mlp.activation_fn(mlp.fc1(layer.layer_norm2(hidden)))
    if lean is not None:
        return lean.mlp_out(carried, hidden), None
    return hidden + mlp.fc2(carried), None


def _attention_function(attention: torch.nn.Module) -> Any:
    """The attention function the module's own forward picks for the model's attention implementation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = attention.config._attn_implementation
    if implementation == "eager":
        return sys.modules[type(attention).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _join(carried: list[Any]) -> Any:
    """The carried tensors of inputs at the same slice, batched (a tuple of tensors stays a tuple)."""
    if carried[0] is None:
        return None
    if len(carried) == 1:  # one input: its own tensors, no copy
        return carried[0]
    if isinstance(carried[0], tuple):
        return tuple(torch.cat(tensors) for tensors in zip(*carried))
    return torch.cat(carried)


def _split(carried: Any, count: int) -> list[Any]:
    if carried is None:
        return [None] * count
    if isinstance(carried, tuple):
        return list(zip(*(tensor.split(1) for tensor in carried)))
    return list(carried.split(1))


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
    processor_options = {"do_image_splitting": bool}
    single_input_options = {"do_image_splitting": False}  # each image one 512 px tile: 64 image tokens

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
        pixel_values = batch["pixel_values"][0]  # [tiles or frames, 3, H, W]
        pixel_mask = batch.get("pixel_attention_mask")
        units = []
        for tile in range(pixel_values.shape[0]):
            item = {"pixel_values": pixel_values[tile : tile + 1]}
            if pixel_mask is not None:
                item["pixel_attention_mask"] = pixel_mask[0, tile : tile + 1]
            units.append(EncoderUnit(self.model.model.image_seq_len, item))
        return ids, place_units(ids, {self.model.config.image_token_id: units})

    @property
    def vision_layers(self) -> torch.nn.ModuleList:
        return self.model.model.vision_model.encoder.layers

    @torch.inference_mode()
    def encode(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        if self.lean_vision is not None:  # the same slices, all of them: the lean layers' path
            return self.encode_slices(inputs, [None] * len(inputs), 0, self.encoder_slices)
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
        range of slices (five a layer) at a time. A state is (hidden states [1, patches, dim], the tower's
        attention mask or None when no patch is padding, what the last slice left for the next one or None).
        Inputs run in groups whose largest tensor (the MLP's activations) stays within what the heap serves
        (engine/host_memory.py): more tiles at once would not multiply faster, only fault in fresh pages."""
        config = self.model.model.vision_model.config
        per_input = (config.image_size // config.patch_size) ** 2 * config.intermediate_size * self.dtype.itemsize
        group = max(1, MMAP_THRESHOLD // per_input)
        results: list[Any] = []
        for at in range(0, len(inputs), group):
            results += self._encode_group(inputs[at : at + group], states[at : at + group], first, end)
        return results

    def _encode_group(self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
                      ) -> list[Any]:
        vision = self.model.model.vision_model
        if first == 0:
            states = [(*self._embed_tile(vision, item), None) for item in inputs]
        hidden = states[0][0] if len(states) == 1 else torch.cat([state[0] for state in states])
        masks = [state[1] for state in states]
        mask = None if all(m is None for m in masks) else torch.cat([self._full_mask(h, m) for h, m, _ in states])
        carried = _join([state[2] for state in states])
        lean = self.lean_vision or [None] * len(vision.encoder.layers)
        for index in range(first, end):
            layer = index // SLICES_PER_LAYER
            hidden, carried = _run_slice(vision.encoder.layers[layer], index % SLICES_PER_LAYER, hidden, mask,
                                         carried, lean[layer])
        if end < self.encoder_slices:
            return list(zip(hidden.split(1), masks, _split(carried, len(states))))
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
