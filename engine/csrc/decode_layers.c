/* A decode step's lean decoder layers in one call (engine/lean_layers.py makes it; engine/cpu/ops.py's
 * `decode_layers` calls it): the same kernels, in the same order and on the same buffers as the layer-by-layer
 * forward, so the same bits, without a trip through Python between them. A step of 8 decodes through 30 layers
 * is 240 kernel calls; each one's Python wrapper (argument checks, tensors' data pointers, ctypes' conversions)
 * costs about as much as a small kernel, all of it on one core while the other threads wait.
 *
 * Per layer, with h the residual stream and `pending` the last layer's output not yet added to it:
 *   normed = input_norm(h += mlp_out_norm'(pending)); qkv = normed W_qkv^T (+ b); q and k normalised per head
 *   (q_norm, k_norm) and rotated, k and v written to the cache; attended = attention(q, cache, window);
 *   o = attended W_o^T; normed = mlp_norm(h += attn_out_norm(o)); gate_up = act(normed W_g^T) * (normed W_u^T);
 *   pending = gate_up W_d^T.
 * and after the last layer normed = final_norm(h += mlp_out_norm'(pending)), mlp_out_norm' being the previous
 * layer's. Llama-style layers have no attn_out_norm, mlp_out_norm, q_norm or k_norm (NULL weights: none); Gemma 3's
 * have all four, GELU's tanh approximation as act, a sliding window and their own rotary tables in local layers.
 */
#include <string.h>

#include "dtypes.h"
#include "kernels.h"

/* Returns 0, or 10 * (the layer + 1) + what its failing kernel returned (the final norm: layer = count); 5 where
 * a token id lies outside the embedding (nothing is computed then). */
int decode_layers(const decode_step *s, const lean_layer *layers, int64_t count) {
    const int dt = s->io_dtype, threads = s->num_threads;
    const int64_t t = s->tokens, width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    if (s->ids) {  /* h = the ids' rows of the embedding, as torch's embedding copies them */
        const size_t row = (size_t)s->hidden * (dt == F32 ? 4 : 2);
        for (int64_t i = 0; i < t; i++)
            if (s->ids[i] < 0 || s->ids[i] >= s->embedding_rows) return 5;
        for (int64_t i = 0; i < t; i++)
            memcpy((char *)s->h + i * row, (const char *)s->embedding + s->ids[i] * row, row);
    }
    const void *pending = NULL;
    const norm_weights *pending_norm = NULL;
    for (int64_t l = 0; l < count; l++) {
        const lean_layer *L = layers + l;
        const void *cos = L->local_rope ? s->local_cos : s->cos, *sin = L->local_rope ? s->local_sin : s->sin;
        int failed = add_rms_norm(s->h, pending, pending_norm, dt, t, s->hidden, &L->input_norm, s->normed, threads);
        if (!failed)
            failed = linear(s->normed, dt, t, L->qkv.k, L->qkv.weight, L->qkv.dtype, L->qkv.stride, L->qkv.n,
                            L->qkv.bias, L->qkv.scale, L->qkv.row_sums, s->mode, s->qkv, NULL, threads);
        if (!failed)
            failed = rope_store(s->qkv, dt, t, width, s->heads, s->kv_heads, s->head_dim, &L->q_norm, &L->k_norm,
                                cos, sin, s->positions, s->rope_rows, s->slots, L->key_cache, L->value_cache,
                                L->key_scales, L->value_scales, s->cache_dtype, threads);
        if (!failed)  /* the queries [heads, tokens, d]: head stride d, token stride a qkv row */
            failed = paged_decode_attention(s->qkv, dt, s->head_dim, width, s->query_index, L->key_cache,
                                            L->value_cache, L->key_scales, L->value_scales, s->cache_dtype,
                                            s->block_tables, s->context_lens,
                                            s->num_seqs, s->kv_heads, s->heads / s->kv_heads, s->head_dim,
                                            s->block_size, s->table_width, L->scaling, L->window, s->attended,
                                            s->mode, threads);
        if (!failed)
            failed = linear(s->attended, dt, t, L->o.k, L->o.weight, L->o.dtype, L->o.stride, L->o.n, L->o.bias,
                            L->o.scale, L->o.row_sums, s->mode, s->o, NULL, threads);
        if (!failed)
            failed = add_rms_norm(s->h, s->o, &L->attn_out_norm, dt, t, s->hidden, &L->mlp_norm, s->normed, threads);
        if (!failed)
            failed = linear(s->normed, dt, t, L->gate_up.k, L->gate_up.weight, L->gate_up.dtype, L->gate_up.stride,
                            L->gate_up.n, L->gate_up.bias, L->gate_up.scale, L->gate_up.row_sums, s->mode | L->act,
                            s->gate_up, NULL, threads);
        if (!failed)
            failed = linear(s->gate_up, dt, t, L->down.k, L->down.weight, L->down.dtype, L->down.stride,
                            L->down.n, L->down.bias, L->down.scale, L->down.row_sums, s->mode, s->down, NULL,
                            threads);
        if (failed) return (int)(10 * (l + 1)) + failed;
        pending = s->down;
        pending_norm = &L->mlp_out_norm;
    }
    const int failed = add_rms_norm(s->h, pending, pending_norm, dt, t, s->hidden, &s->final_norm, s->normed,
                                    threads);
    return failed ? (int)(10 * (count + 1)) + failed : 0;
}
