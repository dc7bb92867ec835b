/* Decode attention over the paged KV cache, read in place, for the CPU (engine/cpu/ builds and
 * calls it).
 *
 * Sequence i has one query per query head, at its last position: it attends to keys first..n-1, where n is
 * its context length and first is 0 (or n - window in a sliding-window layer). Key p lies in the cache at slot
 * block_tables[i][p / block_size] * block_size + p % block_size. The query heads that share a KV head are one
 * task's `groups` rows, so each key and value is read once per KV head; tasks (sequence, KV head) run in
 * parallel. Both paths keep the scores of the whole context (a thread's scratch), then softmax them in float32
 * and sum the values: one pass over the keys, one over the values, with no copy of either; the vector builds
 * (AVX2, AVX-512: `attend_vec`) a run of positions at a time in registers, the plain C build a position at a
 * time.
 *
 * An int8 cache (dtype I8, engine/kv_cache.py) is read in place too: its scales (key_scales / value_scales
 * [slots, kv_heads]) are powers of two (dtypes.h's kv_scale), so (float)q * s is exact, in float32 and in the
 * queries' dtype (the model's). The vector path widens the integers as they are (as cheaply as a bfloat16 row)
 * and applies s where it costs one product a position: a key's to its products with the queries, a value's to
 * its softmax weight. Multiplying by a power of two commutes with every rounding, so the results are, bit for bit,
 * those over a cache of the model's dtype holding the dequantized values; only half the bytes are read.
 */
#include <math.h>
#include <stdlib.h>

#include "dtypes.h"
#include "kernels.h"

/* Row `offset` of the cache as float32: in place for a float32 cache, else converted into `dst`. */
static inline const float *row_as_float(const void *cache, int dtype, int64_t offset, int64_t d, float *dst) {
    if (dtype == F32) return (const float *)cache + offset;
    load_floats(cache, dtype, offset, d, dst);
    return dst;
}

/* Bytes of one element of a cache in `dtype`. */
static inline int64_t item_bytes(int dtype) { return dtype == F32 ? 4 : dtype == I8 ? 1 : 2; }

/* Heads h0..h0+heads-1 of cache row `slot` (`width` elements a row) as float32: `row_as_float`, an I8 cache's
 * dequantized with its `scales`. */
static inline const float *heads_as_float(const void *cache, const float *scales, int dtype, int64_t slot,
                                          int64_t width, int64_t kv_heads, int64_t h0, int64_t heads, int64_t d,
                                          float *dst) {
    const int64_t offset = slot * width + h0 * d;
    if (dtype != I8) return row_as_float(cache, dtype, offset, heads * d, dst);
    for (int64_t h = 0; h < heads; h++)
        load_dequantized(cache, offset + h * d, d, scales[slot * kv_heads + h0 + h], dst + h * d);
    return dst;
}

/* `count` values of the cache from element `at`, asked for ahead of their use: a sequence's blocks lie anywhere
 * in the cache, so the hardware's stride prefetching stops at each block's end. */
static inline void prefetch_values(const void *cache, int64_t at, int64_t count, int dtype) {
    const int64_t item = item_bytes(dtype);
    const char *base = (const char *)cache + at * item;
    for (int64_t b = 0; b < count * item; b += 64) __builtin_prefetch(base + b);
}

/* The lines of `bytes` bytes from `p`, however they lie across lines, asked for into the L2 cache (the vector path's
 * way; `prefetch_values`, the plain path's, asks for the L1). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63), *end = (const char *)p + bytes;
    for (; line < end; line += 64) __builtin_prefetch(line, 0, 2);
}

/* The plain C path asks for the next block's rows (heads h0.. of each) while this block's are used. */
static inline void prefetch_block(const void *cache, int64_t block, int64_t block_size, int64_t width, int dtype,
                                  int64_t h0, int64_t heads, int64_t d) {
    for (int64_t r = 0; r < block_size; r++)
        prefetch_values(cache, (block * block_size + r) * width + h0 * d, heads * d, dtype);
}

/* One task: sequence i's KV heads h0..h1-1 (a cache row holds every head of a position, so a task that takes
 * them all reads whole rows). `d` is a constant where the caller passes one (see the switch below), so the
 * compiler unrolls and vectorises the loops over a head's dimension. `qi` holds the task's queries and `oi`
 * receives its outputs ([h1 - h0, groups, d] floats each), `scores` (h1 - h0) * groups * context floats, `row`
 * kv_heads * d. */
static inline __attribute__((always_inline)) void attend(
        int64_t i, int64_t h0, int64_t h1, const float *qi, const void *key_cache, const void *value_cache,
        const float *key_scales, const float *value_scales, int dtype, const int64_t *block_tables,
        const int64_t *context_lens, int64_t kv_heads, int64_t groups, const int64_t d, int64_t block_size,
        int64_t table_width, float scale, int64_t window, float *oi, float *scores, float *row) {
    const int64_t n = context_lens[i];
    const int64_t first = (window > 0 && n > window) ? n - window : 0;
    const int64_t len = n - first, heads = h1 - h0, rows = heads * groups, width = kv_heads * d;
    const int64_t *table = block_tables + i * table_width;
    for (int64_t p = first; p < n;) {  /* a block's run of positions at a time */
        const int64_t offset = p % block_size, run = MIN(block_size - offset, n - p);
        const int64_t slot = table[p / block_size] * block_size + offset;
        if (p + run < n) prefetch_block(key_cache, table[(p + run) / block_size], block_size, width, dtype, h0, heads, d);
        for (int64_t r = 0; r < run; r++) {
            const float *keys = heads_as_float(key_cache, key_scales, dtype, slot + r, width, kv_heads, h0, heads,
                                               d, row);
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
            const float *values = heads_as_float(value_cache, value_scales, dtype, slot + r, width, kv_heads, h0,
                                                 heads, d, row);
            for (int64_t x = 0; x < rows; x++) {
                const float weight = scores[x * len + (p + r - first)], *value = values + (x / groups) * d;
                float *ox = oi + x * d;
                for (int64_t j = 0; j < d; j++) ox[j] += weight * value[j];
            }
        }
        p += run;
    }
}

#ifdef VECTOR
/* The vector path of `attend` for d a multiple of the vector width VW (up to 256): `attend_vec` below. */
#ifdef __AVX512F__
typedef __m512 vf;
#define VW 16
#define vwiden widen16
#define vexp exp16
#define vmax _mm512_max_ps
#define vmax_of _mm512_reduce_max_ps
#define vsum_of _mm512_reduce_add_ps
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
static inline vf sums(const vf *a) {  /* r[i] = a[i][0] + ... + a[i][15] */
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
/* v's first `run` lanes, `fill` in the others */
static inline vf first_lanes(vf v, int64_t run, float fill) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), (__mmask16)((1u << run) - 1u), v);
}
/* scales[0], scales[stride], ... of `run` lanes, 1 in the others (a run's positions' scales of one KV head) */
static inline vf strided_lanes(const float *scales, int64_t stride, int64_t run) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)stride));
    return _mm512_mask_i32gather_ps(_mm512_set1_ps(1.0f), (__mmask16)((1u << run) - 1u), at, scales, 4);
}
#else
typedef __m256 vf;
#define VW 8
#define vwiden widen8
#define vexp exp8
#define vmax _mm256_max_ps
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
static inline float vmax_of(vf v) {
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
static inline float vsum_of(vf v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
static inline vf sums(const vf *a) {  /* r[i] = a[i][0] + ... + a[i][7] */
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
static inline vf first_lanes(vf v, int64_t run, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)run), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, live);
}
static inline vf strided_lanes(const float *scales, int64_t stride, int64_t run) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)run), lane));
    const __m256i at = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)stride));
    return _mm256_mask_i32gather_ps(_mm256_set1_ps(1.0f), scales, at, live, 4);
}
#endif

enum { GMAX = 3 };  /* query heads (of one KV head) scored and summed together: each key and value widened once */
enum { OB = VW == 16 ? 4 : 3 };  /* output vectors of a head that its values are summed into at a time: GMAX x OB sums,
                                     OB values and a weight in registers (32 with AVX-512, 16 with AVX2) */
/* An I8 cache's values go 2 vectors at a time with AVX-512: at 4, the loop's other live vectors (the softmax's
 * constants among them) left the third head's sums in memory, a load and a store each a position (SmolVLM-256M's
 * 3 heads a KV head, 8 sequences x 350 positions x 30 layers: 0.94x the time at 2; a bfloat16 cache 1.01x, kept at
 * OB). */
#define OB_OF(dtype) ((dtype) == I8 && VW == 16 ? 2 : OB)

/* Three passes, VW positions (a run within one block) at a time, GMAX query heads of a KV head at a time: the keys'
 * scores into `scores` (the task's rows, `stride` floats apart), the softmax over each row, the values summed by
 * its weights. Each key is widened once, into registers, and scored against each of the heads: one product vector
 * per position and head, the run's VW of them reduced together (`sums`). Each value is widened once into registers
 * too and added to the heads' sums, OB_OF(dtype) vectors of each (kept in registers over the run). One pass with an
 * online softmax left each run's maximum, exponentials and sums, a chain of dependent steps, between its keys and
 * its values: 40% of the loop's perf samples with the cache in the L2. Apart, each pass is a loop of independent
 * runs and the scores, a few KB a task, stay in the L1 between them: SmolVLM-256M's 3 heads a KV head, 8 sequences
 * at 300 positions, 2 threads, AMX machine, 0.92x the time with the cache in the L2, 0.986x a decode step. */
static inline __attribute__((always_inline)) void attend_vec(
        int64_t i, int64_t h0, int64_t h1, const float *qi, const void *key_cache, const void *value_cache,
        const float *key_scales, const float *value_scales, int dtype, const int64_t *block_tables,
        const int64_t *context_lens, int64_t kv_heads, int64_t groups, const int64_t d, int64_t block_size,
        int64_t table_width, float scale, int64_t window, const int dot, float *oi, float *scores, int64_t stride) {
    enum { MAXV = 256 / VW };
#ifdef __AVX512BF16__
    /* `dot` (bfloat16 queries, a bfloat16 or I8 cache, d a multiple of 32): the keys are scored by vdpbf16ps, 32
     * products an instruction, against the queries as bfloat16 (exactly: they came from bfloat16), straight from a
     * bfloat16 cache, an I8 cache's integers converted to bfloat16 (exactly: 7 bits) and their products scaled as
     * the widened ones are; the products are exact in float32 either way, only their order of summing differs. */
    __m512bh qb[dot ? (h1 - h0) * groups * (d / 32) : 1];
    if (dot)
        for (int64_t x = 0; x < (h1 - h0) * groups; x++)
            for (int64_t v = 0; v < d / 32; v++)
                qb[x * (d / 32) + v] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qi + x * d + v * 32 + 16),
                                                           _mm512_loadu_ps(qi + x * d + v * 32));
#else
    (void)dot;
#endif
    const int64_t n = context_lens[i];
    const int64_t first = (window > 0 && n > window) ? n - window : 0, len = n - first;
    const int64_t rows = (h1 - h0) * groups, width = kv_heads * d, vectors = d / VW;
    const int64_t *table = block_tables + i * table_width;
    const int64_t item = item_bytes(dtype), lines = (d * item + 63) / 64;  /* cache lines of a head's row */
    const char *keys = key_cache, *values = value_cache;
    float total[rows];
    /* The scores: scores[x * stride + p - first], each run's VW lanes stored whole (-inf past the run). The slot a
     * block ahead (the same position of the next block), or -1 in the last block: each key scored asks for that
     * one's, one head at a time, spread over the work; the last block's ask for the first block's values. Asking
     * for the whole next block at once (up to 192 lines) stalled the loop on the prefetches, a sixth of its time.
     * Into the L2 cache (prefetcht1), not the L1, whose few miss buffers the lines in flight filled: 8 sequences
     * at 800 positions through 30 layers of SmolVLM-256M's cache, 2 threads, Zen 4, 10.4 ms into the L1, 6.0 ms
     * into the L2 (a block further ahead, 7.0 ms). */
    for (int64_t p = first; p < n;) {
        const int64_t offset = p % block_size;
        const int64_t run = MIN(MIN(block_size - offset, n - p), VW);
        const int64_t slot = table[p / block_size] * block_size + offset;
        const int64_t ahead = p - offset + block_size < n ? table[p / block_size + 1] * block_size + offset : -1;
        const char *next = ahead >= 0 ? keys : values;
        const int64_t next_slot = ahead >= 0 ? ahead : table[first / block_size] * block_size + first % block_size;
        if (dtype == I8)  /* that run's scales (the run's first key waited on their lines) */
            prefetch_span((ahead >= 0 ? key_scales : value_scales) + next_slot * kv_heads,
                          run * kv_heads * (int64_t)sizeof(float));
        for (int64_t h = h0; h < h1; h++) {
            const int64_t row0 = slot * width + h * d;  /* the run's position r: row0 + r * width */
            for (int64_t g0 = 0; g0 < groups; g0 += GMAX) {
                const int64_t count = MIN(GMAX, groups - g0), x0 = (h - h0) * groups + g0;
                vf prod[GMAX][VW];
                for (int64_t r = 0; r < VW; r++) {
                    if (r >= run) {
                        for (int g = 0; g < GMAX; g++) prod[g][r] = (vf){0};
                        continue;
                    }
                    if (g0 == 0) {
                        const int64_t at = ((next_slot + r) * width + h * d) * item;
                        for (int64_t line = 0; line < lines; line++) __builtin_prefetch(next + at + 64 * line, 0, 2);
                    }
#ifdef __AVX512BF16__
                    if (dot) {
                        __m512bh words[MAXV / 2];
                        for (int64_t v = 0; v < d / 32; v++) {
                            const int64_t at = row0 + r * width + v * 32;
                            words[v] = dtype == I8
                                ? _mm512_cvtne2ps_pbh(widen16(keys, I8, at + 16), widen16(keys, I8, at))
                                : (__m512bh)_mm512_loadu_si512(keys + at * 2);
                        }
#pragma GCC unroll 3
                        for (int g = 0; g < GMAX; g++) {
                            if (g >= count) break;
                            const __m512bh *qx = qb + (x0 + g) * (d / 32);
                            vf sum[2] = {(vf){0}, (vf){0}};
                            for (int64_t v = 0; v < d / 32; v++)
                                sum[v % 2] = _mm512_dpbf16_ps(sum[v % 2], words[v], qx[v]);
                            prod[g][r] = sum[0] + sum[1];
                        }
                        continue;
                    }
#endif
                    vf key[MAXV];
                    for (int64_t v = 0; v < vectors; v++) key[v] = vwiden(key_cache, dtype, row0 + r * width + v * VW);
#pragma GCC unroll 3
                    for (int g = 0; g < GMAX; g++) {
                        if (g >= count) break;
                        const float *qx = qi + (x0 + g) * d;
                        vf sum[2] = {(vf){0}, (vf){0}};  /* two chains of FMAs, each half as long */
                        for (int64_t v = 0; v < vectors; v++) sum[v % 2] += key[v] * vloadu(qx + v * VW);
                        prod[g][r] = sum[0] + sum[1];
                    }
                }
                /* an I8 cache's key scales, applied to the run's scores at once (powers of two: the same bits as
                 * each key's products scaled on its own) */
                const int64_t at = slot * kv_heads + h;
                const vf to_scores = dtype == I8 ? strided_lanes(key_scales + at, kv_heads, run) * scale
                                                 : (vf){0} + scale;
                for (int g = 0; g < count; g++)
                    vstoreu(scores + (x0 + g) * stride + (p - first), first_lanes(sums(prod[g]) * to_scores, run,
                                                                                  -INFINITY));
            }
        }
        p += run;
    }
    /* each row's softmax weights, unnormalised (exp(score - its row's maximum)) in place, and their total; the
     * lanes past len count as -inf */
    const int64_t whole = len / VW * VW, rest = len - whole;
    for (int64_t x = 0; x < rows; x++) {
        float *s = scores + x * stride;
        vf top = (vf){0} + -INFINITY;
        for (int64_t v = 0; v < whole; v += VW) top = vmax(top, vloadu(s + v));
        if (rest) top = vmax(top, first_lanes(vloadu(s + whole), rest, -INFINITY));
        const vf best = (vf){0} + vmax_of(top);
        vf sum = (vf){0};
        for (int64_t v = 0; v < whole; v += VW) {
            const vf e = vexp(vloadu(s + v) - best);
            vstoreu(s + v, e);
            sum += e;
        }
        if (rest) {
            const vf e = first_lanes(vexp(vloadu(s + whole) - best), rest, 0.0f);
            vstoreu(s + whole, e);
            sum += e;
        }
        total[x] = vsum_of(sum);
    }
    memset(oi, 0, (size_t)(rows * d) * sizeof(float));
    for (int64_t p = first; p < n;) {
        const int64_t offset = p % block_size;
        const int64_t run = MIN(MIN(block_size - offset, n - p), VW);
        const int64_t slot = table[p / block_size] * block_size + offset;
        const int64_t ahead = p - offset + block_size < n ? table[p / block_size + 1] * block_size + offset : -1;
        if (dtype == I8 && ahead >= 0)
            prefetch_span(value_scales + ahead * kv_heads, run * kv_heads * (int64_t)sizeof(float));
        for (int64_t h = h0; h < h1; h++) {
            const int64_t row0 = slot * width + h * d;
            /* an I8 cache's value scales, applied to the run's weights at once (powers of two: the same bits as
             * each value scaled on its own) */
            vf to_weights = (vf){0} + 1.0f;
            if (dtype == I8) to_weights = strided_lanes(value_scales + slot * kv_heads + h, kv_heads, run);
            for (int64_t g0 = 0; g0 < groups; g0 += GMAX) {
                const int64_t count = MIN(GMAX, groups - g0), x0 = (h - h0) * groups + g0;
                float w[GMAX][VW] __attribute__((aligned(64)));  /* the heads' weights of the run */
                for (int g = 0; g < count; g++) {
                    const vf weights = vloadu(scores + (x0 + g) * stride + (p - first));
                    *(vf *)w[g] = dtype == I8 ? (vf)(weights * to_weights) : weights;
                }
                for (int64_t v0 = 0; v0 < vectors; v0 += OB_OF(dtype)) {
                    const int64_t span = MIN(OB_OF(dtype), vectors - v0);
                    vf o[GMAX][OB];
#pragma GCC unroll 3
                    for (int g = 0; g < GMAX; g++)
#pragma GCC unroll 4
                        for (int b = 0; b < OB; b++)
                            if (g < count && b < span) o[g][b] = vloadu(oi + (x0 + g) * d + (v0 + b) * VW);
                    for (int64_t r = 0; r < run; r++) {
                        if (ahead >= 0 && g0 == 0 && v0 == 0) {
                            const int64_t at = ((ahead + r) * width + h * d) * item;
                            for (int64_t line = 0; line < lines; line++)
                                __builtin_prefetch(values + at + 64 * line, 0, 2);
                        }
                        vf value[OB];
#pragma GCC unroll 4
                        for (int b = 0; b < OB; b++)
                            if (b < span) value[b] = vwiden(value_cache, dtype, row0 + r * width + (v0 + b) * VW);
#pragma GCC unroll 3
                        for (int g = 0; g < GMAX; g++) {
                            if (g >= count) break;
                            const float weight = w[g][r];
#pragma GCC unroll 4
                            for (int b = 0; b < OB; b++)
                                if (b < span) o[g][b] += weight * value[b];
                        }
                    }
#pragma GCC unroll 3
                    for (int g = 0; g < GMAX; g++)
#pragma GCC unroll 4
                        for (int b = 0; b < OB; b++)
                            if (g < count && b < span) vstoreu(oi + (x0 + g) * d + (v0 + b) * VW, o[g][b]);
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

#ifdef VECTOR
/* Each head size's vector loops are a function of their own (`attend_d<D>`, not inlined): an I8 cache's loop
 * compiled apart (dtype a constant there), so that neither pays the other's branches, and likewise the dot
 * products' (AVX-512 BF16 builds). Inlined together into the parallel region's one function, the 7 sizes' 28 copies
 * took the compiler 34 s a build (its register dataflow passes grow faster than the function). */
#define ATTEND_PARAMS                                                                                               \
    int64_t i, int64_t h0, int64_t h1, const float *qi, const void *key_cache, const void *value_cache,           \
        const float *key_scales, const float *value_scales, int dtype, const int64_t *block_tables,                \
        const int64_t *context_lens, int64_t kv_heads, int64_t groups, int64_t block_size, int64_t table_width,   \
        float scale, int64_t window, int dot, float *oi, float *scores, int64_t stride
#define ATTEND_VEC(DTYPE, D, DOT)                                                                                  \
    attend_vec(i, h0, h1, qi, key_cache, value_cache, key_scales, value_scales, DTYPE, block_tables, context_lens, \
               kv_heads, groups, D, block_size, table_width, scale, window, DOT, oi, scores, stride)
#ifdef __AVX512BF16__
#define DOT_CASE(D)                                                                                                \
    if ((D) % 32 == 0 && dot) {                                                                                    \
        if (dtype == I8) ATTEND_VEC(I8, D, 1);                                                                     \
        else ATTEND_VEC(BF16, D, 1);                                                                               \
        return;                                                                                                    \
    }
#else
#define DOT_CASE(D) (void)dot;
#endif
#define ATTEND_D(D)                                                                                                \
    static __attribute__((noinline)) void attend_d##D(ATTEND_PARAMS) {                                             \
        DOT_CASE(D)                                                                                                \
        if (dtype == I8) ATTEND_VEC(I8, D, 0);                                                                     \
        else ATTEND_VEC(dtype, D, 0);                                                                              \
    }
ATTEND_D(16) ATTEND_D(32) ATTEND_D(64) ATTEND_D(80) ATTEND_D(96) ATTEND_D(128) ATTEND_D(256)
#undef ATTEND_D
#undef DOT_CASE
#undef ATTEND_VEC
#undef ATTEND_PARAMS
#endif

/* Query head x of sequence i is q[x * q_head_stride + query_index[i] * q_token_stride], d values in q_dtype; its
 * output goes to out[(query_index[i] * kv_heads * groups + x) * d] in q_dtype (the [tokens, heads, d] layout the
 * decoder layers take back). An I8 cache needs its scales (else 3). */
int paged_decode_attention(const void *q, int q_dtype, int64_t q_head_stride, int64_t q_token_stride,
                           const int64_t *query_index, const void *key_cache, const void *value_cache,
                           const float *key_scales, const float *value_scales, int dtype,
                           const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs,
                           int64_t kv_heads, int64_t groups, int64_t d, int64_t block_size, int64_t table_width,
                           float scale, int64_t window, void *out, int mode, int num_threads) {
    if (dtype == I8 && !(key_scales && value_scales)) return 3;
#ifdef __AVX512BF16__
    const int dot = (dtype == BF16 || dtype == I8) && q_dtype == BF16 && !(mode & PRODUCTS_WIDEN) && d % 32 == 0;
#else
    const int dot = 0;
    (void)mode, (void)dot;
#endif
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
    /* each thread's buffer (its scratch, kept across calls): the plain path's scores and a row, then the task's
     * queries and outputs, each part starting on a 64-byte line (the vector loops load and store them whole) */
    const int64_t stride = (longest + 15) / 16 * 16 + 16;  /* a row's scores: whole vectors past its last run */
    const int64_t scores_floats = rows * stride, row_floats = (kv_heads * d + 15) / 16 * 16;
    const int64_t head_floats = (rows * d + 15) / 16 * 16;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = thread_scratch((size_t)(scores_floats + row_floats + 2 * head_floats) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 2;
        }
        float *row = scores ? scores + scores_floats : NULL;
        float *qi = row ? row + row_floats : NULL, *oi = qi ? qi + head_floats : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * per_seq; task++) {
            if (!scores) continue;
            const int64_t i = task / per_seq, h0 = task % per_seq * heads, h1 = h0 + heads;
            const int64_t token = query_index[i];
            for (int64_t x = 0; x < rows; x++)
                load_floats(q, q_dtype, (h0 * groups + x) * q_head_stride + token * q_token_stride, d, qi + x * d);
            switch (d) {
#ifdef VECTOR
#define CASE(D) case D: attend_d##D(i, h0, h1, qi, key_cache, value_cache, key_scales, value_scales, dtype, \
                                    block_tables, context_lens, kv_heads, groups, block_size, table_width, scale, \
                                    window, dot, oi, scores, stride); break;
#else
#define CASE(D) case D: attend(i, h0, h1, qi, key_cache, value_cache, key_scales, value_scales, dtype, \
                               block_tables, context_lens, kv_heads, groups, D, block_size, table_width, scale, \
                               window, oi, scores, row); break;
#endif
                CASE(16) CASE(32) CASE(64) CASE(80) CASE(96) CASE(128) CASE(256)
#undef CASE
                default: attend(i, h0, h1, qi, key_cache, value_cache, key_scales, value_scales, dtype, block_tables,
                                context_lens, kv_heads, groups, d, block_size, table_width, scale, window, oi, scores,
                                row);
            }
            store_floats(oi, rows * d, out, q_dtype, (token * kv_heads * groups + h0 * groups) * d);
        }
    }
    return failed;
}
