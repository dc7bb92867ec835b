/* A decode step's lean decoder layers in one call (engine/lean_layers.py makes it; engine/cpu_kernel.py's
 * `decode_layers` calls it): the same kernels, in the same order and on the same buffers as the layer-by-layer
 * forward, so the same bits, without a trip through Python between them. A step of 8 decodes through 30 layers
 * is 240 kernel calls; each one's Python wrapper (argument checks, tensors' data pointers, ctypes' conversions)
 * costs about as much as a small kernel, all of it on one core while the other threads wait.
 *
 * Per layer, with h the residual stream and `pending` the last layer's output not yet added to it:
 *   normed = rms_norm(h += pending); qkv = normed W_qkv^T (+ b); rotary embedding of q and k, k and v written
 *   to the cache; attended = attention(q, cache); o = attended W_o^T; normed = rms_norm(h += o);
 *   gate_up = SiLU(normed W_g^T) * (normed W_u^T); pending = gate_up W_d^T.
 * and after the last layer normed = final_norm(h += pending).
 */
#include "dtypes.h"
#include "kernels.h"

/* One projection: weight [n, k] (rows `stride` elements apart, `dtype`), float32 bias or NULL. */
typedef struct {
    const void *weight;
    int64_t n, k, stride;
    const float *bias;
    int dtype;
} projection;

/* One layer's weights and cache (engine/cpu_kernel.py's `LeanLayerArgs` mirrors it). */
typedef struct {
    const void *input_norm, *post_norm;
    float input_eps, post_eps;
    projection qkv, o, gate_up, down;
    void *key_cache, *value_cache;
    float scaling;
} lean_layer;

/* What a step's call reads and writes besides the layers (engine/cpu_kernel.py's `DecodeStepArgs`). */
typedef struct {
    void *h, *normed, *qkv, *attended, *o, *gate_up, *down;  /* [tokens, width] buffers, io_dtype */
    const void *cos, *sin;                                     /* [tokens, head_dim], io_dtype */
    const int64_t *slots, *query_index, *block_tables, *context_lens;
    const void *final_norm;
    float final_eps;
    int64_t tokens, hidden, heads, kv_heads, head_dim, num_seqs, block_size, table_width;
    int io_dtype, cache_dtype, mode, num_threads;
} decode_step;

/* Returns 0, or 10 * (the layer + 1) + what its failing kernel returned (the final norm: layer = count). */
int decode_layers(const decode_step *s, const lean_layer *layers, int64_t count) {
    const int dt = s->io_dtype, threads = s->num_threads;
    const int64_t t = s->tokens, width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const void *pending = NULL;
    for (int64_t l = 0; l < count; l++) {
        const lean_layer *L = layers + l;
        int failed = add_rms_norm(s->h, pending, dt, t, s->hidden, L->input_norm, dt, L->input_eps, s->normed,
                                  threads);
        if (!failed)
            failed = linear(s->normed, dt, t, L->qkv.k, L->qkv.weight, L->qkv.dtype, L->qkv.stride, L->qkv.n,
                            L->qkv.bias, s->mode, s->qkv, threads);
        if (!failed)
            failed = rope_store(s->qkv, dt, t, width, s->heads, s->kv_heads, s->head_dim, s->cos, s->sin, s->slots,
                                L->key_cache, L->value_cache, s->cache_dtype, threads);
        if (!failed)  /* the queries [heads, tokens, d]: head stride d, token stride a qkv row */
            failed = paged_decode_attention(s->qkv, dt, s->head_dim, width, s->query_index, L->key_cache,
                                            L->value_cache, s->cache_dtype, s->block_tables, s->context_lens,
                                            s->num_seqs, s->kv_heads, s->heads / s->kv_heads, s->head_dim,
                                            s->block_size, s->table_width, L->scaling, 0, s->attended, threads);
        if (!failed)
            failed = linear(s->attended, dt, t, L->o.k, L->o.weight, L->o.dtype, L->o.stride, L->o.n, L->o.bias,
                            s->mode, s->o, threads);
        if (!failed)
            failed = add_rms_norm(s->h, s->o, dt, t, s->hidden, L->post_norm, dt, L->post_eps, s->normed, threads);
        if (!failed)
            failed = linear(s->normed, dt, t, L->gate_up.k, L->gate_up.weight, L->gate_up.dtype, L->gate_up.stride,
                            L->gate_up.n, L->gate_up.bias, s->mode | MODE_GLU, s->gate_up, threads);
        if (!failed)
            failed = linear(s->gate_up, dt, t, L->down.k, L->down.weight, L->down.dtype, L->down.stride,
                            L->down.n, L->down.bias, s->mode, s->down, threads);
        if (failed) return (int)(10 * (l + 1)) + failed;
        pending = s->down;
    }
    const int failed = add_rms_norm(s->h, pending, dt, t, s->hidden, s->final_norm, dt, s->final_eps, s->normed,
                                    threads);
    return failed ? (int)(10 * (count + 1)) + failed : 0;
}
