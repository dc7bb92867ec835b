"""The engine's attention, registered with transformers' `AttentionInterface`.

Stock transformers decoder layers compute queries, keys and values (with their rotary embedding) for the
packed batch of one step and hand them to this function. It writes the new keys and values into the paged
cache, then lets each sequence's queries attend over that sequence's cached keys with a causal mask in
absolute positions: a query at position p sees keys 0..p. Sequences that decode (one query each) are
attended in padded batches of similar context lengths (`DecodeGroup`); prefill chunks one by one. Keys
and values are read a whole cache block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_cache import KVCache

ATTN_IMPLEMENTATION = "vlmcap_paged"


@dataclass
class PrefillSpan:
    """One prefill chunk in the packed batch: queries [query_start, query_end) over the sequence's first
    `context_len` cached positions, which lie in the cache blocks `block_table`."""

    query_start: int
    query_end: int
    block_table: torch.Tensor  # [blocks]
    context_len: int
    mask: torch.Tensor | None  # [q, context_len] bool; None for plain causal attention over the chunk alone
    sliding_mask: torch.Tensor | None = None  # `mask` within the sliding window, for models that have one


@dataclass
class DecodeGroup:
    """Sequences with one query each, attended in one padded batch."""

    query_index: torch.Tensor  # [B] packed index of each sequence's query
    block_tables: torch.Tensor  # [B, max_blocks] padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] True where a key is real
    sliding_mask: torch.Tensor | None = None  # `mask` within the sliding window, for models that have one


@dataclass
class AttentionBatch:
    """Per-step metadata, built once by the model runner and shared by every layer."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key and value go
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[slots, kv_heads, d] cache, [..., blocks] tables -> [..., kv_heads, blocks * block_size, d]. Whole
    blocks are copied, not one position at a time."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])[block_tables]  # [..., blocks, block_size, kv, d]
    return blocks.flatten(-4, -3).transpose(-3, -2)


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[kv_heads, n, d] -> [heads, n, d] for grouped-query attention."""
    groups = num_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[heads, n, d] -> [kv_heads, groups * n, d]: the query heads that share a KV head become its rows,
    so keys and values are read once per KV head instead of being repeated for every query head."""
    heads, n, d = q.shape
    return q.reshape(kv_heads, heads // kv_heads * n, d)


def _pick(item: PrefillSpan | DecodeGroup, sliding: bool) -> torch.Tensor | None:
    if not sliding:
        return item.mask
    if item.sliding_mask is None:
        raise RuntimeError("a sliding-window layer got no sliding-window mask (the adapter's sliding_window)")
    return item.sliding_mask


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vlmcap_batch: AttentionBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if vlmcap_batch is None:
        raise RuntimeError("vlmcap_paged attention called without the engine's batch metadata")
    batch = vlmcap_batch
    layer = module.layer_idx
    key_cache, value_cache = batch.kv_cache.keys[layer], batch.kv_cache.values[layer]
    block_size = batch.kv_cache.block_size
    # [1, kv_heads, T, d] -> [T, kv_heads, d], the cache's layout.
    key_cache.index_copy_(0, batch.slot_mapping, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.index_copy_(0, batch.slot_mapping, value[0].transpose(0, 1).to(value_cache.dtype))

    q = query[0]  # [heads, T, d]
    num_heads, kv_heads = q.shape[0], key_cache.shape[1]
    # Layers with a sliding window (Gemma 3's local layers) see only keys less than the window behind.
    sliding = getattr(module, "sliding_window", None) is not None
    out = torch.empty(q.shape[1], num_heads, q.shape[2], dtype=q.dtype, device=q.device)

    for group in batch.decodes:
        rows = len(group.query_index)
        dq = q[:, group.query_index].transpose(0, 1).reshape(rows, kv_heads, num_heads // kv_heads, -1)
        dk = _gather_blocks(key_cache, group.block_tables, block_size).to(q.dtype)  # [B, kv_heads, ctx, d]
        dv = _gather_blocks(value_cache, group.block_tables, block_size).to(q.dtype)
        o = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=_pick(group, sliding), scale=scaling)
        out[group.query_index] = o.reshape(rows, num_heads, -1)

    for span in batch.prefills:
        pq = q[:, span.query_start : span.query_end]  # [heads, n, d]
        n = pq.shape[1]
        pk = _gather_blocks(key_cache, span.block_table, block_size)[:, : span.context_len].to(q.dtype)
        pv = _gather_blocks(value_cache, span.block_table, block_size)[:, : span.context_len].to(q.dtype)
        mask = _pick(span, sliding)
        if mask is None:  # the chunk is the whole context so far: plain causal attention
            o = F.scaled_dot_product_attention(pq, _expand_kv(pk, num_heads), _expand_kv(pv, num_heads),
                                               is_causal=True, scale=scaling)
        else:
            mask = mask.repeat(num_heads // kv_heads, 1)
            o = F.scaled_dot_product_attention(_by_kv_head(pq, kv_heads), pk, pv, attn_mask=mask, scale=scaling)
            o = o.reshape(num_heads, n, -1)
        out[span.query_start : span.query_end] = o.transpose(0, 1)

    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
