"""A Triton kernel that attends over the paged KV cache in place: one launch per layer for the whole mixed
batch of decodes and prefill chunks.

The rule is attention.py's: a query at absolute position p sees keys 0..p of its own sequence (in a
sliding-window layer, keys p - window + 1..p). One program takes one sequence, one KV head and a tile of
that sequence's queries; its rows are the tile's tokens times the query heads that share the KV head, so
each key block is read once per KV head (grouped-query attention without repeating keys). Keys and values
are read a cache block at a time through the block table, with an online softmax in float32; no copy of
the context is made. Shapes depend only on the number of sequences and the block table's width, so a
decode-only batch of a fixed padded size is the same launch every step (CUDA graphs). An int8 cache
(engine/kv_cache.py) is read in place as well: each key and value row times its scale, rounded to the queries'
dtype (exact: the scales are powers of two), what a cache of that dtype holding the dequantized values would give.

Runs on CUDA; `TRITON_INTERPRET=1` runs it on the CPU (slowly) for tests.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without Triton; only this path needs it
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`."""
    import os

    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
        scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
        KV_HEADS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD  # query tokens per tile
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if tile * BLOCK_Q < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            first_position = seq_len - q_len  # absolute position of the sequence's first query
            rows = tl.arange(0, BLOCK_M)
            token = tile * BLOCK_Q + rows // GROUP_PAD
            head = kv_head * GROUP + rows % GROUP_PAD
            row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
            position = first_position + token
            dims = tl.arange(0, BLOCK_D)
            dim_ok = dims < HEAD_DIM
            q = tl.load(
                q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
            )
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            last_token = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
            kv_end = first_position + last_token + 1
            kv_begin = first_position * 0  # a tensor in both branches, as the compiler wants
            if window > 0:
                kv_begin = tl.maximum(first_position + tile * BLOCK_Q - window + 1, 0)
                kv_begin = kv_begin // BLOCK_SIZE * BLOCK_SIZE
            offs = tl.arange(0, BLOCK_SIZE)
            for start in range(kv_begin, kv_end, BLOCK_SIZE):
                block = tl.load(block_table_ptr + seq * stride_bt + start // BLOCK_SIZE).to(tl.int64)
                slots = block * BLOCK_SIZE + offs
                kv_offsets = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
                k = tl.load(k_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0)
                v = tl.load(v_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0)
                if QUANT:  # an int8 cache: (float)q * its row's scale, rounded to the queries' dtype
                    k_scale = tl.load(k_scale_ptr + slots * KV_HEADS + kv_head)
                    v_scale = tl.load(v_scale_ptr + slots * KV_HEADS + kv_head)
                    k = (k.to(tl.float32) * k_scale[:, None]).to(q_ptr.dtype.element_ty)
                    v = (v.to(tl.float32) * v_scale[:, None]).to(q_ptr.dtype.element_ty)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                key_position = start + offs
                visible = (key_position[None, :] <= position[:, None]) & (key_position[None, :] < seq_len)
                if window > 0:
                    visible = visible & (key_position[None, :] > position[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            o = acc / l_safe[:, None]
            tl.store(
                out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
            )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta,
    block_size: int,
    scale: float | None,
    window: int | None,
    out: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query [T, heads, d], caches [slots, kv_heads, d], `meta` a `PagedKernelMetadata` -> [T, heads, d]; an int8
    cache with its key and value `scales` ([slots, kv_heads] float32, contiguous)."""
    if triton is None:
        raise RuntimeError("the paged attention kernel needs Triton")
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    group = num_heads // kv_heads
    group_pad = _next_power_of_2(group)
    block_m = max(16 if meta.max_query_len == 1 else 64, group_pad)
    block_q = block_m // group_pad
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    quantized = key_cache.dtype == torch.int8
    if quantized != (scales is not None):
        raise ValueError(f"the paged kernel reads an int8 cache with its scales, or a cache of another dtype "
                         f"without: got {key_cache.dtype} with{'' if scales is not None else 'out'} scales")
    key_scales, value_scales = scales if quantized else (key_cache, value_cache)  # unread where not int8
    grid = (meta.num_seqs, kv_heads, triton.cdiv(meta.max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, key_scales, value_scales, meta.block_table, meta.seq_lens,
        meta.query_start_loc,
        float(scale if scale is not None else head_dim**-0.5), int(window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0), key_cache.stride(1),
        meta.block_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=max(_next_power_of_2(head_dim), 16),
        BLOCK_M=block_m, BLOCK_SIZE=block_size, IEEE=query.dtype == torch.float32, QUANT=quantized,
        KV_HEADS=kv_heads,
    )
    return out
