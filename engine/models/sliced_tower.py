"""A SigLIP-style vision tower run a slice of a layer at a time, so that a step carries only as much of an
image's encoding as the step's budget allows (engine/scheduler.py; `VLMAdapter.encode_slices`): SmolVLM's and
Idefics3's 512 px tiles, Gemma 3's 896 px views, LLaVA's and LLaVA-OneVision's views (CLIP and SigLIP towers).

An encoder layer (LayerNorm, q/k/v/out projections, an MLP fc1 -> act -> fc2; SigLIP's, and CLIP's likewise)
runs in five slices of similar work: (0) the normed input's query, key and value projections; (1) attention of
the first half of the heads; (2) attention of the other half and the output projection, added to the residual;
(3) the MLP's first linear layer and activation on the normed sum; (4) its second linear layer, added to the
residual. A slice leaves what the next one needs (`carried`). Each slice runs the very operations the layer's
own forward runs (each head's attention is computed on its own, whichever heads run beside it), or their fused
equivalents where the layer runs lean (engine/lean_vision.py): the features are those of the whole tower.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from engine import lean_paths
from engine.host_memory import MMAP_THRESHOLD
from engine.lean_vision import LeanVisionLayer

SLICES_PER_LAYER = 5


def run_slice(layer: torch.nn.Module, which: int, hidden: torch.Tensor, mask: Any, carried: Any,
              lean: LeanVisionLayer | None = None) -> tuple[Any, Any]:
    """Slice `which` (0-4, see the module's docstring) of `layer`'s forward: (hidden, carried) -> the same after
    it."""
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
        heads = half_of_heads(count, first=which == 1)
        if lean is not None:  # each slice's heads written into their place in one [batch, patches, heads, d] tensor
            attended = done[0] if done else queries.new_empty(queries.shape[0], queries.shape[2], count,
                                                              queries.shape[3])
            if heads.start < heads.stop:
                lean.attend(queries[:, heads], keys[:, heads], values[:, heads], mask, attended[:, :, heads])
            if which == 1:
                return hidden, (queries, keys, values, attended)
            return lean.attended_out(attended.view(*hidden.shape[:-1], -1), hidden), None
        if heads.start < heads.stop:
            attended, _ = _attention_function(attention)(
                attention, queries[:, heads], keys[:, heads], values[:, heads], mask,
                is_causal=False, scaling=attention.scale, dropout=0.0,
            )  # [batch, patches, heads, head_dim]
            done.append(attended)
        if which == 1:
            return hidden, (queries, keys, values, *done)
        attended = torch.cat(done, dim=2).reshape(*hidden.shape[:-1], -1).contiguous()
        return hidden + attention.out_proj(attended), None
    if which == 3:
        if lean is not None:
            return hidden, lean.mlp_in(hidden)
        return hidden, mlp.activation_fn(mlp.fc1(layer.layer_norm2(hidden)))
    if lean is not None:
        return lean.mlp_out(carried, hidden), None
    return hidden + mlp.fc2(carried), None


def half_of_heads(count: int, first: bool) -> slice:
    """The heads of `count` an attention slice takes: the first half (with the odd head: a one-head tower's only
    one) or the rest (which may be none)."""
    half = (count + 1) // 2
    return slice(0, half) if first else slice(half, count)


def run_slices(layers: torch.nn.ModuleList, first: int, end: int, hidden: torch.Tensor, mask: Any, carried: Any
               ) -> tuple[torch.Tensor, Any]:
    """Slices first..end-1 of the tower whose encoder layers are `layers` (each lean where the platform runs it
    lean: engine/lean_paths.py)."""
    for index in range(first, end):
        layer = layers[index // SLICES_PER_LAYER]
        hidden, carried = run_slice(layer, index % SLICES_PER_LAYER, hidden, mask, carried, lean_paths.vision(layer))
    return hidden, carried


def _attention_function(attention: torch.nn.Module) -> Any:
    """The attention function the module's own forward picks for the model's attention implementation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = attention.config._attn_implementation
    if implementation == "eager":
        return sys.modules[type(attention).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def join(carried: list[Any]) -> Any:
    """The carried tensors of inputs at the same slice, batched (a tuple of tensors stays a tuple)."""
    if carried[0] is None:
        return None
    if len(carried) == 1:  # one input: its own tensors, no copy
        return carried[0]
    if isinstance(carried[0], tuple):
        return tuple(torch.cat(tensors) for tensors in zip(*carried))
    return torch.cat(carried)


def split(carried: Any, sizes: list[int]) -> list[Any]:
    """`join`'s inverse: each input's carried tensors, `sizes[i]` rows (views) of them for input i."""
    if carried is None:
        return [None] * len(sizes)
    if isinstance(carried, tuple):
        return list(zip(*(tensor.split(sizes) for tensor in carried)))
    return list(carried.split(sizes))


def in_groups(inputs: list[Any], states: list[Any], vision_config: Any, dtype: torch.dtype,
              run: Callable[[list[Any], list[Any]], list[Any]], views: list[int] | None = None) -> list[Any]:
    """`run` over the inputs (and their states) in groups whose largest tensor (the MLP's activations of a tower
    of `vision_config` in `dtype`, for `views[i]` views of input i, one each by default) stays within what the heap
    serves (engine/host_memory.py): more inputs at once would not multiply faster, only fault in fresh pages. A
    group holds one input at least."""
    patches = (vision_config.image_size // vision_config.patch_size) ** 2
    per_view = patches * vision_config.intermediate_size * dtype.itemsize
    views = views or [1] * len(inputs)
    results: list[Any] = []
    start = 0
    while start < len(inputs):
        end, held = start + 1, views[start] * per_view
        while end < len(inputs) and held + views[end] * per_view <= MMAP_THRESHOLD:
            held += views[end] * per_view
            end += 1
        results += run(inputs[start:end], states[start:end])
        start = end
    return results
