/* Decode attention over the paged KV cache, read in place, for the CPU (engine/cpu_kernel.py builds and
 * calls it).
 *
 * Sequence i has one query per query head, at its last position: it attends to keys first..n-1, where n is
 * its context length and first is 0 (or n - window in a sliding-window layer). Key p lies in the cache at slot
 * block_tables[i][p / block_size] * block_size + p % block_size. The query heads that share a KV head are one
 * task's `groups` rows, so each key and value is read once per KV head; tasks (sequence, KV head) run in
 * parallel. Scores are kept for the whole context (a thread's scratch), then softmaxed in float32 and used to
 * sum the values: two passes, one over the keys, one over the values, with no copy of either.
 */
#include <math.h>
#include <stdlib.h>

#include "dtypes.h"

/* Row `offset` of the cache as float32: in place for a float32 cache, else converted into `dst`. */
static inline const float *row_as_float(const void *cache, int dtype, int64_t offset, int64_t d, float *dst) {
    if (dtype == F32) return (const float *)cache + offset;
    load_floats(cache, dtype, offset, d, dst);
    return dst;
}

/* Ask for the next block's rows (heads h0.. of each) while this block's are used: a sequence's blocks lie
 * anywhere in the cache, so the hardware's stride prefetching stops at each block's end. */
static inline void prefetch_block(const void *cache, int64_t block, int64_t block_size, int64_t width, int dtype,
                                  int64_t h0, int64_t heads, int64_t d) {
    const int64_t item = dtype == F32 ? 4 : 2;
    const char *base = (const char *)cache + (block * block_size * width + h0 * d) * item;
    for (int64_t r = 0; r < block_size; r++)
        for (int64_t b = 0; b < heads * d * item; b += 64) __builtin_prefetch(base + r * width * item + b);
}

/* One task: sequence i's KV heads h0..h1-1 (a cache row holds every head of a position, so a task that takes
 * them all reads whole rows). `d` is a constant where the caller passes one (see the switch below), so the
 * compiler unrolls and vectorises the loops over a head's dimension. `qi` holds the task's queries and `oi`
 * receives its outputs ([h1 - h0, groups, d] floats each), `scores` (h1 - h0) * groups * context floats, `row`
 * kv_heads * d. */
static inline __attribute__((always_inline)) void attend(
        int64_t i, int64_t h0, int64_t h1, const float *qi, const void *key_cache, const void *value_cache,
        int dtype, const int64_t *block_tables, const int64_t *context_lens, int64_t kv_heads, int64_t groups,
        const int64_t d, int64_t block_size, int64_t table_width, float scale, int64_t window, float *oi,
        float *scores, float *row) {
    const int64_t n = context_lens[i];
    const int64_t first = (window > 0 && n > window) ? n - window : 0;
    const int64_t len = n - first, heads = h1 - h0, rows = heads * groups, width = kv_heads * d;
    const int64_t *table = block_tables + i * table_width;
    for (int64_t p = first; p < n;) {  /* a block's run of positions at a time */
        const int64_t offset = p % block_size, run = MIN(block_size - offset, n - p);
        const int64_t slot = table[p / block_size] * block_size + offset;
        if (p + run < n) prefetch_block(key_cache, table[(p + run) / block_size], block_size, width, dtype, h0, heads, d);
        for (int64_t r = 0; r < run; r++) {
            const float *keys = row_as_float(key_cache, dtype, (slot + r) * width + h0 * d, heads * d, row);
            for (int64_t x = 0; x < rows; x++) {
                const float *qx = qi + x * d, *key = keys + (x / groups) * d;
                float dot = 0.0f;
                for (int64_t j = 0; j < d; j++) dot += qx[j] * key[j];
                scores[x * len + (p + r - first)] = dot * scale;
            }
        }
        p += run;
    }
    for (int64_t x = 0; x < rows; x++) {
        float *s = scores + x * len;
        float top = s[0];
        for (int64_t k = 1; k < len; k++) top = s[k] > top ? s[k] : top;
        float total = 0.0f;
        for (int64_t k = 0; k < len; k++) {
            s[k] = expf(s[k] - top);
            total += s[k];
        }
        const float inverse = 1.0f / total;
        for (int64_t k = 0; k < len; k++) s[k] *= inverse;
    }
    memset(oi, 0, (size_t)(rows * d) * sizeof(float));
    for (int64_t p = first; p < n;) {
        const int64_t offset = p % block_size, run = MIN(block_size - offset, n - p);
        const int64_t slot = table[p / block_size] * block_size + offset;
        if (p + run < n) prefetch_block(value_cache, table[(p + run) / block_size], block_size, width, dtype, h0, heads, d);
        for (int64_t r = 0; r < run; r++) {
            const float *values = row_as_float(value_cache, dtype, (slot + r) * width + h0 * d, heads * d, row);
            for (int64_t x = 0; x < rows; x++) {
                const float weight = scores[x * len + (p + r - first)], *value = values + (x / groups) * d;
                float *ox = oi + x * d;
                for (int64_t j = 0; j < d; j++) ox[j] += weight * value[j];
            }
        }
        p += run;
    }
}

#ifdef __AVX512F__
/* The AVX-512 path of `attend` for d a multiple of 16 (up to 256): one pass over the positions with an online
 * softmax, sixteen positions at a time. Their keys and values are widened once per KV head into K and V; each
 * query row's sixteen scores come from one vector per position reduced together (`sums16`), exponentials
 * sixteen at a time (`exp16`), and the row's output stays in registers while the sixteen values are added. */
static inline __m512 sums16(__m512 *a) {  /* r[i] = a[i][0] + ... + a[i][15] */
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
        c[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xdd));
}

static inline __attribute__((always_inline)) void attend512(
        int64_t i, int64_t h0, int64_t h1, const float *qi, const void *key_cache, const void *value_cache,
        int dtype, const int64_t *block_tables, const int64_t *context_lens, int64_t kv_heads, int64_t groups,
        const int64_t d, int64_t block_size, int64_t table_width, float scale, int64_t window, float *oi) {
    enum { MAXV = 16 };
    const int64_t n = context_lens[i];
    const int64_t first = (window > 0 && n > window) ? n - window : 0;
    const int64_t rows = (h1 - h0) * groups, width = kv_heads * d, vectors = d / 16;
    const int64_t *table = block_tables + i * table_width;
    float top[rows], total[rows];
    for (int64_t x = 0; x < rows; x++) top[x] = -INFINITY, total[x] = 0.0f;
    memset(oi, 0, (size_t)(rows * d) * sizeof(float));
    float keys[16 * 256] __attribute__((aligned(64))), values[16 * 256] __attribute__((aligned(64)));
    for (int64_t p = first; p < n;) {
        const int64_t offset = p % block_size;
        const int64_t run = MIN(MIN(block_size - offset, n - p), 16);
        const int64_t slot = table[p / block_size] * block_size + offset;
        if (offset + run == block_size && p + run < n) {  /* the next block's keys and values, read next */
            prefetch_block(key_cache, table[(p + run) / block_size], block_size, width, dtype, h0, h1 - h0, d);
            prefetch_block(value_cache, table[(p + run) / block_size], block_size, width, dtype, h0, h1 - h0, d);
        }
        const __mmask16 live = (__mmask16)((1u << run) - 1u);
        for (int64_t h = h0; h < h1; h++) {
            for (int64_t r = 0; r < run; r++)
                for (int64_t v = 0; v < vectors; v++) {
                    const int64_t at = (slot + r) * width + h * d + v * 16;
                    _mm512_store_ps(keys + r * d + v * 16, widen16(key_cache, dtype, at));
                    _mm512_store_ps(values + r * d + v * 16, widen16(value_cache, dtype, at));
                }
            for (int64_t g = 0; g < groups; g++) {
                const int64_t x = (h - h0) * groups + g;
                const float *qx = qi + x * d;
                __m512 q[MAXV], acc[16];
                for (int64_t v = 0; v < vectors; v++) q[v] = _mm512_loadu_ps(qx + v * 16);
                for (int64_t r = 0; r < 16; r++) {
                    __m512 sum = _mm512_setzero_ps();
                    if (r < run)
                        for (int64_t v = 0; v < vectors; v++)
                            sum = _mm512_fmadd_ps(q[v], _mm512_load_ps(keys + r * d + v * 16), sum);
                    acc[r] = sum;
                }
                const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                                         _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale)));
                const float best = _mm512_reduce_max_ps(scores), shifted = best > top[x] ? best : top[x];
                const float correction = top[x] == -INFINITY ? 0.0f : expf(top[x] - shifted);
                const __m512 weights = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(shifted))));
                total[x] = total[x] * correction + _mm512_reduce_add_ps(weights);
                top[x] = shifted;
                float w[16] __attribute__((aligned(64)));
                _mm512_store_ps(w, weights);
                float *ox = oi + x * d;
                for (int64_t v = 0; v < vectors; v++) {
                    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ox + v * 16), _mm512_set1_ps(correction));
                    for (int64_t r = 0; r < run; r++)
                        o = _mm512_fmadd_ps(_mm512_set1_ps(w[r]), _mm512_load_ps(values + r * d + v * 16), o);
                    _mm512_storeu_ps(ox + v * 16, o);
                }
            }
        }
        p += run;
    }
    for (int64_t x = 0; x < rows; x++) {
        const float inverse = 1.0f / total[x];
        for (int64_t j = 0; j < d; j++) oi[x * d + j] *= inverse;
    }
}
#endif

/* Query head x of sequence i is q[x * q_head_stride + query_index[i] * q_token_stride], d values in q_dtype; its
 * output goes to out[(query_index[i] * kv_heads * groups + x) * d] in q_dtype (the [tokens, heads, d] layout the
 * decoder layers take back). */
int paged_decode_attention(const void *q, int q_dtype, int64_t q_head_stride, int64_t q_token_stride,
                           const int64_t *query_index, const void *key_cache, const void *value_cache, int dtype,
                           const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs,
                           int64_t kv_heads, int64_t groups, int64_t d, int64_t block_size, int64_t table_width,
                           float scale, int64_t window, void *out, int num_threads) {
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (context_lens[i] < 1 || context_lens[i] > table_width * block_size) return 1;
        if (context_lens[i] > longest) longest = context_lens[i];
    }
    /* Whole rows (every KV head of a sequence) per task where there are sequences enough to keep every thread
     * busy; one KV head per task otherwise. */
    const int64_t heads = num_seqs >= 2 * num_threads ? kv_heads : 1, per_seq = kv_heads / heads;
    const int64_t rows = heads * groups;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc((size_t)(rows * longest + kv_heads * d + 2 * rows * d) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 2;
        }
        float *row = scores ? scores + rows * longest : NULL;
        float *qi = row ? row + kv_heads * d : NULL, *oi = qi ? qi + rows * d : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * per_seq; task++) {
            if (!scores) continue;
            const int64_t i = task / per_seq, h0 = task % per_seq * heads, h1 = h0 + heads;
            const int64_t token = query_index[i];
            for (int64_t x = 0; x < rows; x++)
                load_floats(q, q_dtype, (h0 * groups + x) * q_head_stride + token * q_token_stride, d, qi + x * d);
            switch (d) {
#ifdef __AVX512F__
#define CASE(D) case D: attend512(i, h0, h1, qi, key_cache, value_cache, dtype, block_tables, context_lens, \
                                  kv_heads, groups, D, block_size, table_width, scale, window, oi); break;
#else
#define CASE(D) case D: attend(i, h0, h1, qi, key_cache, value_cache, dtype, block_tables, context_lens, \
                               kv_heads, groups, D, block_size, table_width, scale, window, oi, scores, row); break;
#endif
                CASE(16) CASE(32) CASE(64) CASE(80) CASE(96) CASE(128) CASE(256)
#undef CASE
                default: attend(i, h0, h1, qi, key_cache, value_cache, dtype, block_tables, context_lens, kv_heads,
                                groups, d, block_size, table_width, scale, window, oi, scores, row);
            }
            store_floats(oi, rows * d, out, q_dtype, (token * kv_heads * groups + h0 * groups) * d);
        }
        free(scores);
    }
    return failed;
}
