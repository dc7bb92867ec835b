/* Rotary embedding and the KV cache write of one decoder layer, in one call (engine/lean_layers.py calls it
 * through engine/cpu/).
 *
 * The packed projections of a step's T tokens, qkv [T, width] = [queries | keys | values] (nq, nkv and nkv
 * heads of d values), in the model's dtype: each query and key head is rotated as transformers' rotate-half
 * RoPE does, `x * cos + rotate_half(x) * sin` with each product and the sum rounded to the dtype as torch rounds
 * them; queries in place, keys into the cache row of their token's slot, values copied there as they are.
 * cos and sin [T, d] are the model's own (its rotary embedding module made them, M-RoPE's sections included);
 * with `positions` (int64 [T]; NULL: none) they are tables of `table_rows` rows and token t reads row positions[t]
 * (engine/rotary_tables.py), a position outside them refused (4) before anything is written.
 * Where the layer normalises each query and key head before the rotation (Gemma 3's q_norm and k_norm), `q_norm`
 * and `k_norm` are those norms (NULL, or a NULL weight: none), applied as rms_norm.c applies them.
 * An I8 cache (`cache_dtype`) gets each key and value head quantized (dtypes.h's `quantize_row`), its scale into
 * key_scales / value_scales [slots, nkv].
 */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"
#include "kernels.h"

/* One head's d values x (float32), rotated into `out`: each half its own loop, bfloat16's apart, so that the
 * compiler vectorises them. */
static inline void rotate(const float *restrict x, const float *restrict c, const float *restrict s, int64_t d,
                          int dtype, float *restrict out) {
    const int64_t half = d / 2;
    if (dtype == BF16) {
        for (int64_t j = 0; j < half; j++)
            out[j] = rounded_bf16(rounded_bf16(x[j] * c[j]) + rounded_bf16(-x[j + half] * s[j]));
        for (int64_t j = half; j < d; j++)
            out[j] = rounded_bf16(rounded_bf16(x[j] * c[j]) + rounded_bf16(x[j - half] * s[j]));
        return;
    }
    for (int64_t j = 0; j < half; j++)
        out[j] = rounded(rounded(x[j] * c[j], dtype) + rounded(-x[j + half] * s[j], dtype), dtype);
    for (int64_t j = half; j < d; j++)
        out[j] = rounded(rounded(x[j] * c[j], dtype) + rounded(x[j - half] * s[j], dtype), dtype);
}

#ifdef __AVX512F__
/* `rotate` of one bfloat16 head at `x` (d = 2 half values, half a multiple of 16) into `out` (bfloat16; may be x),
 * 16 values of each half at a time, with the same roundings (a decode step's 8 tokens of SmolVLM-256M, 9 query
 * and 3 key heads of 64: 7.5 us a layer on one thread through float32 rows, 5.2 us this way, a call's 1.2 us
 * included). */
static inline void rotate_bf16(const uint16_t *x, const float *c, const float *s, int64_t half, uint16_t *out) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t j = 0; j < half; j += 16) {
        const __m512 a = widen16(x, BF16, j), b = widen16(x, BF16, half + j);
        const __m512 minus_bs = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(b, _mm512_loadu_ps(s + j))), sign));
        const __m512 low = _mm512_add_ps(rounded_bf16_16(_mm512_mul_ps(a, _mm512_loadu_ps(c + j))),
                                         rounded_bf16_16(minus_bs));
        const __m512 high = _mm512_add_ps(rounded_bf16_16(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + j))),
                                          rounded_bf16_16(_mm512_mul_ps(a, _mm512_loadu_ps(s + half + j))));
        _mm256_storeu_si256((__m256i *)(out + j), bf16_words16(low));
        _mm256_storeu_si256((__m256i *)(out + half + j), bf16_words16(high));
    }
}
#endif

int rope_store(void *qkv, int dtype, int64_t tokens, int64_t width, int64_t nq, int64_t nkv, int64_t d,
               const norm_weights *q_norm, const norm_weights *k_norm, const void *cos, const void *sin,
               const int64_t *positions, int64_t table_rows, const int64_t *slots, void *key_cache,
               void *value_cache, float *key_scales, float *value_scales, int cache_dtype, int num_threads) {
    if (cache_dtype == I8 && !(key_scales && value_scales)) return 1;
    if (positions)
        for (int64_t t = 0; t < tokens; t++)
            if (positions[t] < 0 || positions[t] >= table_rows) return 4;
    int failed = 0;
    const int norm_q = q_norm && q_norm->weight, norm_k = k_norm && k_norm->weight;
#ifdef __AVX512F__
    /* bfloat16 heads without norms by rotate_bf16: the queries in place, the keys into a bfloat16 cache, whose
     * values are copied as they are */
    const int vector_q = dtype == BF16 && !norm_q && d % 32 == 0;
    const int vector_kv = vector_q && !norm_k && cache_dtype == BF16;
#endif
    /* tokens over the threads from 2 on: a decode step's 8 tokens of SmolVLM-256M (12 heads each, an int8 cache's
     * rows quantized) took 15 us a layer on one thread, 10 us on two */
#pragma omp parallel num_threads(num_threads) if (tokens >= 2)
    {
        float *buffer = thread_scratch((size_t)(6 * d) * sizeof(float));
        float *c = buffer, *s = buffer ? buffer + d : NULL, *x = s ? s + d : NULL, *y = x ? x + d : NULL;
        float *qw = y ? y + d : NULL, *kw = qw ? qw + d : NULL;
        if (!buffer) {
#pragma omp atomic write
            failed = 2;
        } else {
            if (norm_q) load_floats(q_norm->weight, q_norm->dtype, 0, d, qw);
            if (norm_k) load_floats(k_norm->weight, k_norm->dtype, 0, d, kw);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            if (!buffer) continue;
            const int64_t at = (positions ? positions[t] : t) * d;
            load_floats(cos, dtype, at, d, c);
            load_floats(sin, dtype, at, d, s);
            const int64_t row = t * width;
            for (int64_t h = 0; h < nq; h++) {
#ifdef __AVX512F__
                if (vector_q) {
                    uint16_t *head = (uint16_t *)qkv + row + h * d;
                    rotate_bf16(head, c, s, d / 2, head);
                    continue;
                }
#endif
                load_floats(qkv, dtype, row + h * d, d, x);
                if (norm_q) normalize_row(x, d, qw, q_norm->eps, q_norm->flavor, dtype);
                rotate(x, c, s, d, dtype, y);
                store_floats(y, d, qkv, dtype, row + h * d);
            }
            const int64_t slot = slots[t] * nkv * d;
            for (int64_t h = 0; h < nkv; h++) {
#ifdef __AVX512F__
                if (vector_kv) {
                    rotate_bf16((const uint16_t *)qkv + row + (nq + h) * d, c, s, d / 2,
                                (uint16_t *)key_cache + slot + h * d);
                    memcpy((uint16_t *)value_cache + slot + h * d, (const uint16_t *)qkv + row + (nq + nkv + h) * d,
                           (size_t)d * sizeof(uint16_t));
                    continue;
                }
#endif
                load_floats(qkv, dtype, row + (nq + h) * d, d, x);
                if (norm_k) normalize_row(x, d, kw, k_norm->eps, k_norm->flavor, dtype);
                rotate(x, c, s, d, dtype, y);
                load_floats(qkv, dtype, row + (nq + nkv + h) * d, d, x);
                if (cache_dtype == I8) {
                    const int64_t at = slots[t] * nkv + h;
                    key_scales[at] = quantize_row(y, d, (int8_t *)key_cache + slot + h * d, dtype);
                    value_scales[at] = quantize_row(x, d, (int8_t *)value_cache + slot + h * d, dtype);
                } else {
                    store_floats(y, d, key_cache, cache_dtype, slot + h * d);
                    store_floats(x, d, value_cache, cache_dtype, slot + h * d);
                }
            }
        }
    }
    return failed;
}
