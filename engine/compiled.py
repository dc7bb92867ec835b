"""The text model's decoder layers compiled with torch.compile (`EngineConfig.compile_model`).

Each decoder layer is compiled on its own, with dynamic shapes (a step's token count varies), so all layers
share one compiled code: the normalisations, projections, rotary embedding, activation and residual adds
become a few fused kernels instead of a hundred small operators a layer. The paged attention in the middle
stays eager (its per-step metadata is Python structure), as do the CPU kernels, which the graph calls as
opaque operators. Compilation happens here, at start-up, on a warm-up forward, so no request waits for it;
its time is returned. The eager model stays the exactness reference.
"""

from __future__ import annotations

import time

import torch

from engine.attention import AttentionBatch
from engine.kv_cache import KVCache
from engine.models.base import VLMAdapter


def compile_text_model(adapter: VLMAdapter, kv_cache: KVCache, block_size: int) -> float:
    """Compile every decoder layer of `adapter`'s text model in place and warm it up on forwards of 1 token
    (a graph of its own: dynamo specialises size 1), 2 and 64 tokens (one dynamic graph, on both sides of the
    CPU kernels' row limit); returns the seconds it took."""
    began = time.perf_counter()
    for layer in adapter.text_model.layers:
        layer.compile(dynamic=True)
    scratch = kv_cache.scratch_block * block_size  # the warm-up writes its keys where graph padding does
    with torch.inference_mode():
        for tokens in (1, 2, 64):
            embeds = adapter.embed_tokens(torch.zeros(tokens, dtype=torch.long, device=adapter.device))
            positions = torch.arange(tokens, device=adapter.device)
            streams = adapter.rope_streams or 1
            if streams > 1:
                positions = positions.expand(streams, tokens)
            slots = scratch + torch.arange(tokens, device=adapter.device) % block_size
            batch = AttentionBatch(kv_cache, slots, [], [])
            adapter.forward_text(embeds, positions, batch)
    return time.perf_counter() - began
