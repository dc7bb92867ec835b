"""The engine's attention, registered with transformers' `AttentionInterface`.

Stock transformers decoder layers compute queries, keys and values (with their rotary embedding) for the
packed batch of one step and hand them to this function. It writes the new keys and values into the paged
cache, then lets each sequence's queries attend over that sequence's cached keys with a causal mask in
absolute positions: a query at position p sees keys 0..p. Sequences that decode (one query each) are
attended in one padded batch; prefill chunks one by one.
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
    """One prefill chunk in the packed batch: queries [query_start, query_end), keys at `key_slots`."""

    query_start: int
    query_end: int
    key_slots: torch.Tensor  # [context_len] cache slots of positions 0..context_len-1
    mask: torch.Tensor | None  # [q, context_len] bool, None when the chunk starts at position 0


@dataclass
class AttentionBatch:
    """Per-step metadata, built once by the model runner and shared by every layer."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key and value go
    decode_query_index: torch.Tensor | None  # [B] packed index of each decoding sequence's one query
    decode_key_slots: torch.Tensor | None  # [B, max_context] padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_context] True where a key is real
    prefills: list[PrefillSpan]


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., kv_heads, n, d] -> [..., heads, n, d] for grouped-query attention."""
    groups = num_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


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
    # [1, kv_heads, T, d] -> [T, kv_heads, d], the cache's layout.
    key_cache.index_copy_(0, batch.slot_mapping, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.index_copy_(0, batch.slot_mapping, value[0].transpose(0, 1).to(value_cache.dtype))

    q = query[0]  # [heads, T, d]
    num_heads = q.shape[0]
    out = torch.empty(q.shape[1], num_heads, q.shape[2], dtype=q.dtype, device=q.device)

    if batch.decode_query_index is not None:
        # One query per sequence: the query heads that share a KV head become that head's rows, so keys and
        # values are read once per KV head instead of being repeated for every query head.
        kv_heads = key_cache.shape[1]
        rows = len(batch.decode_query_index)
        dq = q[:, batch.decode_query_index].transpose(0, 1).reshape(rows, kv_heads, num_heads // kv_heads, -1)
        dk = key_cache[batch.decode_key_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, ctx, d]
        dv = value_cache[batch.decode_key_slots].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=batch.decode_mask, scale=scaling)
        out[batch.decode_query_index] = o.reshape(rows, num_heads, -1)

    for span in batch.prefills:
        pq = q[:, span.query_start : span.query_end]  # [heads, n, d]
        pk = _expand_kv(key_cache[span.key_slots].transpose(0, 1), num_heads).to(q.dtype)  # [heads, ctx, d]
        pv = _expand_kv(value_cache[span.key_slots].transpose(0, 1), num_heads).to(q.dtype)
        if span.mask is None:
            o = F.scaled_dot_product_attention(pq, pk, pv, is_causal=True, scale=scaling)
        else:
            o = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=span.mask, scale=scaling)
        out[span.query_start : span.query_end] = o.transpose(0, 1)

    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
