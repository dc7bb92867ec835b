"""Qwen2-VL and Qwen2.5-VL: dynamic resolution and multimodal rotary positions.

The processor resizes each image to a multiple of 28 px (patch 14, 2x2 merge) within its pixel limits and
expands its `<|image_pad|>` into one token per merged 2x2 patch group (`image_grid_thw` gives the grid). A
video is the same with time: its frames, two by two, make temporal patches (`video_grid_thw`), each of
which expands `<|video_pad|>` into as many tokens as one image of that size. The vision tower attends
across the patches of one image or one temporal patch of a video (Qwen2.5-VL within windows, and fully in
a few blocks), never further, so the encoder input is one image or one temporal patch, encoded alike.
Text positions follow M-RoPE: three streams (time, height, width), from the model's own `get_rope_index`
over all of the prompt's grids (Qwen2.5-VL spaces a video's time by its frame rate), computed once.

The tower runs five slices a block (`SLICES_PER_BLOCK`, as engine/models/sliced_tower.py's SigLIP layers): (0) the
normed input's query, key and value projection with the rotary positions applied; (1) attention of the first half
of the heads; (2) attention of the other half, the output projection and the residual add; (3) the MLP's first
part on the normed sum (Qwen2-VL's fc1 and activation, Qwen2.5-VL's gate and up projections); (4) its last linear
layer and the residual add; so that an image's encoding spreads over the steps of the chats beside it in pieces of
similar work (a 2B tower's attention or MLP on a photo's thousands of patches, whole, is a second of a 2-core
CPU: a step carrying one would hold the chats that long). Each slice runs the operations of the block's own
forward, each head's attention on its own segment (an image, or a Qwen2.5-VL window) as transformers runs it: the
features are the tower's. The per-input metadata (rotary positions, attention segments, Qwen2.5-VL's windows)
comes from transformers' own `vision_utils`, and where those are missing (older transformers) the tower runs
whole.
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image

from engine.models.base import EncoderInput, VLMAdapter, place_inputs, video_processor_kwargs
from engine.models.sliced_tower import half_of_heads, join, split
from engine.request import MultimodalPrompt
from engine.video import Video

SLICES_PER_BLOCK = 5


@functools.cache
def _vision_utils() -> SimpleNamespace | None:
    """transformers' helpers for a vision tower's per-input metadata (None where this version lacks them)."""
    try:
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import (
            get_vision_attention_seqlens,
            get_vision_position_ids,
            get_vision_window_index,
        )
    except ImportError:
        return None
    return SimpleNamespace(get_max_seqlen=get_max_seqlen, get_vision_attention_seqlens=get_vision_attention_seqlens,
                           get_vision_position_ids=get_vision_position_ids,
                           get_vision_window_index=get_vision_window_index)


class Qwen2VLAdapter(VLMAdapter):
    architectures = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    image_marker = "<|image_pad|>"
    video_marker = "<|video_pad|>"
    image_prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    video_prompt = "<|vision_start|><|video_pad|><|vision_end|>"
    rope_streams = 3

    @property
    def text_model(self) -> torch.nn.Module:
        # transformers 5 nests the text model as `language_model`; 4.x exposed it as `model` itself.
        return getattr(self.model.model, "language_model", self.model.model)

    @property
    def visual(self) -> torch.nn.Module:
        return getattr(self.model.model, "visual", None) or self.model.visual

    def expand_prompt(
        self, prompt: str, images: list[Image.Image], videos: list[Video]
    ) -> tuple[list[int], MultimodalPrompt | None]:
        batch = self.processor(text=[prompt], images=images or None, return_tensors="pt",
                               **video_processor_kwargs(videos))
        input_ids = batch["input_ids"]
        ids = input_ids[0].tolist()
        if not images and not videos:
            return ids, None
        config = self.model.config
        inputs = self._encoder_inputs
        found = {config.image_token_id: inputs(batch.get("pixel_values"), batch.get("image_grid_thw")),
                 config.video_token_id: inputs(batch.get("pixel_values_videos"), batch.get("video_grid_thw"),
                                               batch.get("second_per_grid_ts"))}
        mm = place_inputs(ids, found)
        # transformers 5 finds the vision spans by `mm_token_type_ids`; 4.x by the token ids themselves.
        grids = {name: batch[name] for name in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts",
                                                "mm_token_type_ids") if name in batch}
        if "second_per_grid_ts" in grids:
            grids["second_per_grid_ts"] = torch.as_tensor(grids["second_per_grid_ts"])
        rope_positions, _ = self.model.model.get_rope_index(input_ids, **grids)
        mm.rope_positions = rope_positions[:, 0]  # [3, batch=1, L] -> [3, L]
        # Tokens past the prompt continue one past its last position, as transformers' generate places them.
        # get_rope_index's own delta counts from the largest position instead: the same unless a Qwen2.5-VL
        # video's temporal positions (spaced by its frame rate) run past the text that follows it.
        mm.rope_position_delta = int(mm.rope_positions[:, -1].max()) + 1 - len(ids)
        return ids, mm

    def _encoder_inputs(self, pixel_values: torch.Tensor | None, grids: torch.Tensor | None,
               seconds_per_patch: list[float] | torch.Tensor | None = None) -> list[EncoderInput]:
        """One encoder input per image, or per temporal patch of a video: `pixel_values` has one row per
        patch, grid by grid, time first. A Qwen2.5-VL video's seconds per temporal patch go with each of its
        inputs: they set its rotary positions, so its content hash (and the prefix-cache blocks it fills) must
        differ between frame rates; the tower does not read them."""
        if grids is None:
            return []
        merge = self.visual.spatial_merge_size
        found = []
        row = 0
        for index, (t, h, w) in enumerate(grids.tolist()):
            timing = {} if seconds_per_patch is None else {
                "second_per_grid_ts": torch.as_tensor(seconds_per_patch, dtype=torch.float64)[index : index + 1]}
            for _ in range(t):
                found.append(EncoderInput(h * w // merge**2, {
                    "pixel_values": pixel_values[row : row + h * w], "image_grid_thw": torch.tensor([[1, h, w]]),
                    **timing}))
                row += h * w
        return found

    @property
    def encoder_slices(self) -> int:
        return SLICES_PER_BLOCK * len(self.visual.blocks) if _vision_utils() is not None else 1

    slices_per_layer = SLICES_PER_BLOCK

    @torch.inference_mode()
    def encode_slices(
        self, inputs: list[dict[str, torch.Tensor]], states: list[Any], first: int, end: int
    ) -> list[Any]:
        """The same operations as the tower's own forward, slices first..end-1 (`SLICES_PER_BLOCK` a block) on
        the inputs together (attention never crosses an input's patches). A state is an input's hidden states
        [patches, dim] (Qwen2.5-VL: in its windows' order) and what the last slice left for the next one (None
        after a block's last), each tensor a row per patch."""
        visual, utils = self.visual, _vision_utils()
        grids = torch.cat([i["image_grid_thw"] for i in inputs]).to(self.device)
        windowed = hasattr(visual, "fullatt_block_indexes")  # Qwen2.5-VL
        if windowed:
            window_index, cu_window = utils.get_vision_window_index(
                grids, spatial_merge_size=visual.spatial_merge_size, window_size=visual.window_size,
                patch_size=visual.patch_size)
            max_window = utils.get_max_seqlen(cu_window, visual.config, kwarg_name="max_window_seqlen")
        patches = grids.prod(-1).tolist()
        if first == 0:
            hidden = visual.patch_embed(torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype))
            if windowed:
                hidden = visual.permute_input_for_window_attn(hidden, window_index, seq_len=hidden.shape[0])
            carried = None
        else:
            hidden = torch.cat([state[0] for state in states])
            carried = join([state[1] for state in states])
        cu, max_length = utils.get_vision_attention_seqlens(grids, visual.config)
        rotary = None
        if any(index % SLICES_PER_BLOCK == 0 for index in range(first, end)):
            rotary = visual.rotary_pos_emb(hidden, utils.get_vision_position_ids(grids, visual.spatial_merge_size))
            if windowed:
                rotary = tuple(visual.permute_input_for_window_attn(f, window_index, seq_len=hidden.shape[0])
                               for f in rotary)
        for index in range(first, end):
            number = index // SLICES_PER_BLOCK
            whole = not windowed or number in visual.fullatt_block_indexes
            segments = (cu, max_length) if whole else (cu_window, max_window)
            hidden, carried = _run_slice(visual.blocks[number], index % SLICES_PER_BLOCK, hidden, carried, rotary,
                                         *segments)
        if end < self.encoder_slices:
            return list(zip(hidden.split(patches), split(carried, patches)))
        merged = visual.merger(hidden)
        if windowed:
            merged = merged[torch.argsort(window_index)]
        return list(merged.split([count // visual.spatial_merge_size**2 for count in patches]))

    @torch.inference_mode()
    def encode_whole(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        # Several inputs go through the tower in one call, as transformers does for a prompt's images:
        # attention never crosses an input's patches.
        pixel_values = torch.cat([i["pixel_values"] for i in inputs]).to(self.device, self.dtype)
        grids = torch.cat([i["image_grid_thw"] for i in inputs]).to(self.device)
        out = self.model.model.get_image_features(pixel_values, grids)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, torch.Tensor):  # older transformers return all images' rows concatenated
            features = features.split((grids.prod(-1) // self.visual.spatial_merge_size**2).tolist())
        return list(features)


def _run_slice(block: torch.nn.Module, which: int, hidden: torch.Tensor, carried: tuple[torch.Tensor, ...] | None,
               rotary: tuple[torch.Tensor, torch.Tensor] | None, cu: torch.Tensor, max_length: Any
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Slice `which` (0-4, see the module's docstring) of a vision block's forward: (hidden, carried) -> the same
    after it. The attention's segments are `cu` (cumulative lengths, as the block's own forward takes them)."""
    attention, mlp = block.attn, block.mlp
    module = sys.modules[type(attention).__module__]
    if which == 0:
        normed = block.norm1(hidden)
        queries, keys, values = attention.qkv(normed).reshape(normed.shape[0], 3, attention.num_heads, -1).permute(
            1, 0, 2, 3).unbind(0)
        queries, keys = module.apply_rotary_pos_emb_vision(queries, keys, *rotary)
        return hidden, (queries, keys, values)  # each [patches, heads, head_dim]
    if which in (1, 2):
        queries, keys, values, *done = carried
        heads = half_of_heads(queries.shape[1], first=which == 1)
        if heads.start < heads.stop:
            done.append(_attend(attention, module, queries[:, heads], keys[:, heads], values[:, heads], cu,
                                max_length))
        if which == 1:
            return hidden, (queries, keys, values, *done)
        attended = torch.cat(done, dim=1).reshape(hidden.shape[0], -1).contiguous()
        return hidden + attention.proj(attended), None
    if which == 3:
        normed = block.norm2(hidden)
        if hasattr(mlp, "fc1"):  # Qwen2-VL: fc2(act(fc1(x)))
            return hidden, (mlp.act(mlp.fc1(normed)),)
        return hidden, (mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed),)  # Qwen2.5-VL
    inner = carried[0]
    return hidden + (mlp.fc2(inner) if hasattr(mlp, "fc2") else mlp.down_proj(inner)), None


def _attend(attention: torch.nn.Module, module: Any, queries: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor, cu: torch.Tensor, max_length: Any) -> torch.Tensor:
    """Some heads' attention ([patches, heads, head_dim] each) within the segments `cu`, as the block's own
    forward computes it (each head's on its own): [patches, heads, head_dim]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    queries, keys, values = (tensor.transpose(0, 1).unsqueeze(0) for tensor in (queries, keys, values))
    function = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation,
                                                     module.eager_attention_forward)
    options = dict(attention_mask=None, scaling=attention.scaling, dropout=0.0, is_causal=False)
    if module.is_flash_attention_requested(attention.config):
        longest = module.get_max_seqlen(cu, attention.config, kwargs={"max_seqlen": max_length})
        out, _ = function(attention, queries, keys, values, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=longest, max_length_k=longest, **options)
    else:
        lengths = (cu[1:] - cu[:-1]).tolist()
        parts = zip(*(torch.split(tensor, lengths, dim=2) for tensor in (queries, keys, values)))
        out = torch.cat([function(attention, q, k, v, **options)[0] for q, k, v in parts], dim=1)
    return out.reshape(out.shape[-3], out.shape[-2], out.shape[-1])
