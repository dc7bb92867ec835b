/* Attention of every token to every token of the same input, no mask (a vision tower's layer), on the CPU
 * (engine/lean_vision.py calls it through engine/cpu/); and, by the same tiles, a causal prefill chunk's over the
 * paged KV cache (`chunk_attention`, at the end).
 *
 * q, k and v [batch, heads, n, d] are views of one packed projection (rows `row_stride` elements apart, heads
 * `head_stride`, inputs `batch_stride`), in `dtype`; out [batch, n, heads, d] in `dtype`, each row's heads one after
 * another (d apart), rows `out_row_stride` elements apart, inputs `out_batch_stride` (a view of some heads of a
 * wider output: a vision layer's two attention slices write their halves of one tensor). A task is
 * one input's head: its keys are packed once as float32, transposed ([d][n], each d-th value of NR keys a
 * vector), and its values as float32 rows; then each tile of MR query rows takes all its scores at once
 * (MR x NR outer products, one FMA per score and step along d), their softmax in float32, and their sum of
 * values (JB keys' values at a time for all the tile's rows, RO rows at a time, d in vectors). Where the build
 * has AVX-512's bfloat16 dot products and `mode` does not ask for widened products (PRODUCTS_WIDEN, the Linear
 * kernel's choice for this CPU), bfloat16 inputs go by vdpbf16ps instead (32 products per instruction, half the
 * instructions of FMAs on widened values): the scores from the keys packed as words of two values of d
 * ([d / 2][n_pad]) and each query's pair broadcast, scaled after;
 * the sums of values from the softmax's weights rounded to bfloat16 (as torch's flash attention rounds them for
 * bfloat16) two keys a word, against the values packed as words of two keys' ([(n + 1) / 2][d]). The softmax and
 * every sum stay float32. In the AMX build, with PRODUCTS_TILES (d a multiple of 32, the kernel permitting), those
 * same packed keys and values go through the tiles instead (tdpbf16ps): 16 query rows against 64 keys a pass for
 * the scores, left unscaled (the softmax scales them), and the weights of 32 keys a step against 64 values of d
 * (scores_amx, weighted_values_amx). torch's flash attention for bfloat16 on the CPU runs a 512 px
 * SigLIP tile's attention (1,024 patches, 12 heads of 64) at about 130 GFLOP/s on 2 AVX-512 cores: half the
 * tower's time. The vectors are GCC's, as wide as the build's instruction set.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "linear.h"  /* amx_permitted, amx_load_config */

#if defined(__AMX_BF16__)
#define FW 16
#define MR 16  /* query rows per tile: the AMX tiles' rows (2 MR sums where the dot products run instead) */
#define RO 6
#elif defined(__AVX512F__)
#define FW 16
#define MR 12  /* query rows per score tile: 2 MR sums */
#define RO 6   /* query rows per pass of the values: RO x 4 sums (d = 64) */
#elif defined(VECTOR)
#define FW 8
#define MR 6
#define RO 2   /* 2 x 4 sums, 4 values and a weight in 16 registers (3 rows spill: 1.2x slower) */
#else
#define FW 4
#define MR 4
#define RO 2
#endif
#define NR (2 * FW)  /* keys per score tile */
typedef float fv __attribute__((vector_size(FW * 4), aligned(4)));
#define SPLAT(x) ((fv){0} + (x))

/* The keys a task's buffers hold for `keys` keys, the row length of its packed keys and of its scores: a whole
 * number of score tiles (NR), and not a multiple of 1,024 (rows 4 KB apart map a column of a tile's rows to one
 * set of the L1 cache, more lines than its ways: 1,024 keys took 1.3x the time). The keys past `keys` are zeros,
 * their scores -inf. */
static inline int64_t padded_keys(int64_t keys) {
    const int64_t n_pad = (keys + NR - 1) / NR * NR;
    return n_pad % 1024 ? n_pad : n_pad + NR;
}

/* The tile's scores s[MR][n_pad] = qp ([d][MR], scaled) times the keys kt ([d][n_pad]), NR keys at a time. */
static void scores(const float *qp, const float *kt, int64_t d, int64_t n_pad, float *s) {
    for (int64_t c = 0; c < n_pad; c += NR) {
        fv sums[MR][2];
        for (int r = 0; r < MR; r++) sums[r][0] = sums[r][1] = (fv){0};
        for (int64_t t = 0; t < d; t++) {
            const fv k0 = *(const fv *)(kt + t * n_pad + c), k1 = *(const fv *)(kt + t * n_pad + c + FW);
#pragma GCC unroll 12
            for (int r = 0; r < MR; r++) {
                const fv q = SPLAT(qp[t * MR + r]);
                sums[r][0] += q * k0, sums[r][1] += q * k1;
            }
        }
        for (int r = 0; r < MR; r++) {
            *(fv *)(s + r * n_pad + c) = sums[r][0];
            *(fv *)(s + r * n_pad + c + FW) = sums[r][1];
        }
    }
}

#ifdef __AVX512BF16__
/* Word t of p: two bfloat16 (or 4 bytes of any type) as the dot products take them, read without type punning. */
static inline uint32_t word_at(const void *p, int64_t t) {
    uint32_t word;
    memcpy(&word, (const char *)p + 4 * t, sizeof(word));
    return word;
}

/* The tile's scores s[MR][n_pad] = scale * qw ([d / 2][MR] words: two bfloat16 of a query row each) times kw
 * ([d / 2][n_pad] words: two bfloat16 of a key each), NR keys at a time. */
static void scores_dot(const uint32_t *qw, const uint32_t *kw, int64_t pairs, int64_t n_pad, float scale, float *s) {
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < n_pad; c += NR) {
        __m512 sums[MR][2];
        for (int r = 0; r < MR; r++) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
        for (int64_t t = 0; t < pairs; t++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kw + t * n_pad + c);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kw + t * n_pad + c + FW);
#pragma GCC unroll 12
            for (int r = 0; r < MR; r++) {
                const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qw[t * MR + r]);
                sums[r][0] = _mm512_dpbf16_ps(sums[r][0], k0, q);
                sums[r][1] = _mm512_dpbf16_ps(sums[r][1], k1, q);
            }
        }
        for (int r = 0; r < MR; r++) {
            _mm512_storeu_ps(s + r * n_pad + c, _mm512_mul_ps(sums[r][0], scaled));
            _mm512_storeu_ps(s + r * n_pad + c + FW, _mm512_mul_ps(sums[r][1], scaled));
        }
    }
}
#endif

/* Rows of s [rows][n_pad]: their first n values exponentiated less the row's largest, their sums in `total`. */
static void softmax_rows(float *s, int64_t rows, int64_t n, int64_t n_pad, float *total) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * n_pad, top = row[0], sum = 0.0f;
        for (int64_t j = 1; j < n; j++) top = row[j] > top ? row[j] : top;
        for (int64_t j = 0; j < n; j++) {
            row[j] = expf(row[j] - top);
            sum += row[j];
        }
        total[r] = sum;
    }
}

/* Keys a block of weighted_values: their values (64 x d float32, 16 KB for d = 64) stay in the L1 cache while every
 * row of the tile takes them. */
#define JB 64

/* o[r][0..d) = sum over j < n of p[r][j] * v[j][..] / total[r] for a tile's `rows` (<= MR) rows, into out rows
 * (dtype), `out_stride` elements apart. The keys go in blocks of JB, each block's values read by all the rows
 * (RO rows at a time, 4 vectors of d), whose sums wait in `sums` between blocks: read per RO rows instead, a tile's
 * values (256 KB for 1,024 keys of 64) came from the L2 cache once for every RO rows, and that reading, not the
 * FMAs, bounded the loop. Each sum still adds its keys in order, so the result is the unblocked loop's. */
static void weighted_values(const float *p, int64_t rows, int64_t n, int64_t n_pad, const float *vrows, int64_t d,
                            const float *total, void *out, int dtype, int64_t out_offset, int64_t out_stride) {
    float sums[MR][256] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rows; r++) memset(sums[r], 0, (size_t)d * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += JB) {
        const int64_t j1 = MIN(n, j0 + JB);
        for (int64_t r0 = 0; r0 < rows; r0 += RO) {
            const int64_t count = MIN(RO, rows - r0);
            const float *weights = p + r0 * n_pad;
            for (int64_t c = 0; c < d; c += 4 * FW) {
                const int span = (int)MIN(4, (d - c) / FW);
                fv o[RO][4];
                for (int r = 0; r < RO; r++)
                    for (int b = 0; b < 4; b++)
                        if (r < count && b < span) o[r][b] = *(const fv *)(sums[r0 + r] + c + b * FW);
                for (int64_t j = j0; j < j1; j++) {
                    fv value[4];
#pragma GCC unroll 4
                    for (int b = 0; b < 4; b++)
                        if (b < span) value[b] = *(const fv *)(vrows + j * d + c + b * FW);
#pragma GCC unroll 6
                    for (int r = 0; r < RO; r++) {
                        if (r >= count) break;
                        const fv weight = SPLAT(weights[r * n_pad + j]);
#pragma GCC unroll 4
                        for (int b = 0; b < 4; b++)
                            if (b < span) o[r][b] += weight * value[b];
                    }
                }
                for (int r = 0; r < RO; r++)
                    for (int b = 0; b < 4; b++)
                        if (r < count && b < span) *(fv *)(sums[r0 + r] + c + b * FW) = o[r][b];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const fv inverse = SPLAT(1.0f / total[r]);
        for (int64_t t = 0; t < d; t += FW) *(fv *)(sums[r] + t) *= inverse;
        store_floats(sums[r], d, out, dtype, out_offset + r * out_stride);
    }
}

#ifdef __AVX512BF16__
/* 2^t of the softmax's scaled, shifted scores (t <= 0), 16 at a time: 2^floor(t) 2^f, f = t - floor(t) in [0, 1) by
 * vreduceps (exact), 2^f by a degree-4 polynomial (fitted for relative error: at most 2.7e-6, where the weights are
 * then rounded to bfloat16, a relative step of 2^-8, and their float32 sum divides the output, itself rounded to
 * the inputs' dtype), 2^floor(t) by vscalefps, which floors its exponent itself; 0 below -125 (-inf, a key the row
 * does not see, included), where 2^t would leave the normal floats: a denormal result costs the core a slow assist.
 * Eight operations (with the caller's fused product) where e^x of the shifted score (exp16, its clamp, the shift's
 * product and the mask) took eighteen. The softmax's vector work bounds a SigLIP tile's attention, not the tiles'
 * products: degree 6 (Cephes', a float's precision) on t - round(t) took it 1.09x as long, the rounding and
 * subtraction for vreduceps's one operation 1.07x. */
static inline __m512 weight16(__m512 t) {
    const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  /* t - floor(t), exact */
    static const float c[5] = {1.0000026226043701f, 0.6930038332939148f, 0.2414427548646927f, 0.05201146379113197f,
                               0.013534167781472206f};
    return _mm512_maskz_scalef_ps(normal, polynomial16(f, c, 4), t);  /* 2^f 2^floor(t) */
}

/* One row of softmax_rows_dot after its maximum `shift`: 2^(x * scaled - shift * scaled) (`scaled`: the scale times
 * log2 e; one fused product), summed into *total, rounded to bfloat16 and paired in place. */
static inline void softmax_row_dot(float *row, int64_t n_pad, __m512 shift, __m512 scaled, float *total) {
    __m512 low_sum = _mm512_setzero_ps(), high_sum = _mm512_setzero_ps();
    const __m512 offset = _mm512_mul_ps(shift, scaled);
    for (int64_t j = 0; j < n_pad; j += 2 * FW) {
        const __m512 low = weight16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), scaled, offset));
        const __m512 high = weight16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j + FW), scaled, offset));
        low_sum = _mm512_add_ps(low_sum, low);
        high_sum = _mm512_add_ps(high_sum, high);
        _mm512_storeu_si512((uint32_t *)row + j / 2, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    *total = _mm512_reduce_add_ps(_mm512_add_ps(low_sum, high_sum));
}

/* softmax_rows for the dot products, in one pass after the maximum (`tops[r]` where given: the tiles read it as they
 * stored the scores): each row's first n values less the row's largest, times `scale` (the tiles' scores come
 * unscaled; 1 for the dot products'), exponentiated (float32, their sum in `total`), rounded to bfloat16 and paired
 * in place, two keys' weights a word, a zero weight past n (each 32 weights read before their 16 words are written
 * over them). */
static void softmax_rows_dot(float *s, int64_t rows, int64_t n, int64_t n_pad, float scale, const float *tops,
                             float *total) {
    const __m512 scaled = _mm512_set1_ps(scale * 1.44269504088896341f);
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * n_pad;
        for (int64_t j = n; j < n_pad; j++) row[j] = -INFINITY;
        if (tops) {
            softmax_row_dot(row, n_pad, _mm512_set1_ps(tops[r]), scaled, total + r);
            continue;
        }
        __m512 top[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                         _mm512_set1_ps(-INFINITY)};  /* four chains: one waits on each maximum's latency */
        int64_t j = 0;
        for (; j + 4 * FW <= n_pad; j += 4 * FW)
            for (int c = 0; c < 4; c++) top[c] = _mm512_max_ps(top[c], _mm512_loadu_ps(row + j + c * FW));
        for (; j < n_pad; j += FW) top[0] = _mm512_max_ps(top[0], _mm512_loadu_ps(row + j));
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3]))));
        softmax_row_dot(row, n_pad, shift, scaled, total + r);
    }
}

/* weighted_values by vdpbf16ps: the rows of p (in place in s, as softmax_rows_dot leaves them: words of two keys'
 * weights in bfloat16) against the values as words of two keys' values (vw: [pairs][d]), the sums float32. */
static void weighted_values_dot(float *p, int64_t rows, int64_t n, int64_t n_pad, const uint32_t *vw, int64_t d,
                                const float *total, void *out, int dtype, int64_t out_offset, int64_t out_stride) {
    const int64_t pairs = (n + 1) / 2;
    float done[RO][256] __attribute__((aligned(64)));
    for (int64_t c = 0; c < d; c += 4 * FW) {
        const int span = (int)MIN(4, (d - c) / FW);
        __m512 o[RO][4];
        for (int r = 0; r < RO; r++)
            for (int b = 0; b < 4; b++) o[r][b] = _mm512_setzero_ps();
        for (int64_t t = 0; t < pairs; t++) {
            __m512bh value[4];
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++)
                if (b < span) value[b] = (__m512bh)_mm512_loadu_si512(vw + t * d + c + b * FW);
#pragma GCC unroll 6
            for (int r = 0; r < RO; r++) {
                if (r >= rows) break;
                const __m512bh weight = (__m512bh)_mm512_set1_epi32((int)word_at(p + r * n_pad, t));
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++)
                    if (b < span) o[r][b] = _mm512_dpbf16_ps(o[r][b], value[b], weight);
            }
        }
        for (int r = 0; r < RO; r++)
            for (int b = 0; b < 4; b++)
                if (r < rows && b < span)
                    _mm512_store_ps(done[r] + c + b * FW, _mm512_mul_ps(o[r][b], _mm512_set1_ps(1.0f / total[r])));
    }
    for (int64_t r = 0; r < rows; r++) store_floats(done[r], d, out, dtype, out_offset + r * out_stride);
}
#endif

#ifdef __AMX_BF16__
/* The tiles as the attention uses them: 0-3 sums (MR rows of 16 float32), 4 MR rows of 32 bfloat16 (queries, or
 * the softmax's weights of 32 keys), 5-7 16 rows of 16 words (pairs of d of 16 keys, or pairs of keys of 16 values
 * of d), in turn, so that a tile loads while the one before it multiplies. */
static void amx_attention_configure(void) {
    const uint8_t rows[8] = {MR, MR, MR, MR, MR, 16, 16, 16};
    const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(rows, colsb);
}

/* scores_dot by the tiles, unscaled (softmax_rows_dot scales them): the tile's queries qb [MR][d] (bfloat16, d a
 * multiple of 32) against kw ([d / 2][n_pad] words), 64 keys a pass (four sums); where `tops` is given, each row's
 * largest score over the first `keys` keys into it, read back from the L1 cache as each pass stores them (the
 * softmax then skips its own pass over the row for it). */
static void scores_amx(const uint16_t *qb, const uint32_t *kw, int64_t d, int64_t n_pad, int64_t keys, float *s,
                       float *tops) {
    const int64_t pitch = n_pad * 4;
    __m512 top[MR];
    for (int r = 0; r < MR; r++) top[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n_pad; c += 64) {
        const int four = n_pad - c >= 64;  /* else 32 keys (n_pad is a multiple of NR = 32) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < d; t += 32) {
            const uint32_t *pairs = kw + t / 2 * n_pad + c;
            _tile_loadd(4, qb + t, d * 2);
            _tile_loadd(5, pairs, pitch);
            _tile_loadd(6, pairs + 16, pitch);
            _tile_dpbf16ps(0, 4, 5);
            if (four) _tile_loadd(7, pairs + 32, pitch);
            _tile_dpbf16ps(1, 4, 6);
            if (four) {
                _tile_loadd(5, pairs + 48, pitch);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, s + c, pitch);
        _tile_stored(1, s + c + 16, pitch);
        if (four) {
            _tile_stored(2, s + c + 32, pitch);
            _tile_stored(3, s + c + 48, pitch);
        }
        for (int64_t col = c; tops && col < MIN(c + (four ? 64 : 32), keys); col += 16) {
            const __mmask16 lanes = keys - col >= 16 ? 0xffff : (__mmask16)((1u << (keys - col)) - 1);
            for (int r = 0; r < MR; r++)
                top[r] = _mm512_mask_max_ps(top[r], lanes, top[r], _mm512_loadu_ps(s + r * n_pad + col));
        }
    }
    for (int r = 0; tops && r < MR; r++) tops[r] = _mm512_reduce_max_ps(top[r]);
}

/* weighted_values_dot by the tiles, every row of the tile at once: the weights (in place in s, as
 * softmax_rows_dot leaves them) of 32 keys a step against vw ([n_pad / 2][d] words, zeros past the keys), 64 values
 * of d a pass (four sums); the first `rows` rows out. */
static void weighted_values_amx(const float *p, int64_t rows, int64_t n_pad, const uint32_t *vw, int64_t d,
                                const float *total, void *out, int dtype, int64_t out_offset, int64_t out_stride) {
    float done[MR][256] __attribute__((aligned(64)));
    for (int64_t c = 0; c < d; c += 64) {
        const int span = (int)MIN(4, (d - c) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < n_pad / 2; j += 16) {  /* pairs of keys */
            const uint32_t *values = vw + j * d + c;
            _tile_loadd(4, p + j, n_pad * 4);
            _tile_loadd(5, values, d * 4);
            if (span > 1) _tile_loadd(6, values + 16, d * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (span > 2) _tile_loadd(7, values + 32, d * 4);
            if (span > 1) _tile_dpbf16ps(1, 4, 6);
            if (span > 3) _tile_loadd(5, values + 48, d * 4);
            if (span > 2) _tile_dpbf16ps(2, 4, 7);
            if (span > 3) _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, done[0] + c, sizeof(done[0]));
        if (span > 1) _tile_stored(1, done[0] + c + 16, sizeof(done[0]));
        if (span > 2) _tile_stored(2, done[0] + c + 32, sizeof(done[0]));
        if (span > 3) _tile_stored(3, done[0] + c + 48, sizeof(done[0]));
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        for (int64_t t = 0; t < d; t += FW)
            _mm512_store_ps(done[r] + t, _mm512_mul_ps(_mm512_load_ps(done[r] + t), inverse));
        store_floats(done[r], d, out, dtype, out_offset + r * out_stride);
    }
}
#endif

/* A row of d values of k or v at element `offset` as float32 into dst: `load_floats`, or where the source is an
 * int8 cache (src_dtype I8) dequantized with its row's scale (scales[offset / d]): values of the queries' dtype,
 * exactly (dtypes.h's kv_scale). */
static inline void source_row(const void *src, const float *scales, int src_dtype, int64_t offset, int64_t d,
                              float *dst) {
    if (src_dtype == I8) load_dequantized(src, offset, d, scales[offset / d], dst);
    else load_floats(src, src_dtype, offset, d, dst);
}

#ifdef __AVX512BF16__
/* The same row as bfloat16 bits (a bfloat16 source's in place; an int8 cache's dequantized, bfloat16 values). */
static inline const uint16_t *source_row_bf16(const void *src, const float *scales, int src_dtype, int64_t offset,
                                              int64_t d, uint16_t *dst) {
    if (src_dtype != I8) return (const uint16_t *)src + offset;
    float row[256];
    load_dequantized(src, offset, d, scales[offset / d], row);
    for (int64_t t = 0; t < d; t++) {
        uint32_t bits;
        memcpy(&bits, row + t, sizeof(bits));
        dst[t] = (uint16_t)(bits >> 16);  /* exact: the value is a bfloat16 already */
    }
    return dst;
}
#endif

/* A thread's buffers for tasks of up to `keys` keys (one allocation, grown as needed): the keys [d][n_pad] (kt), the
 * values [n_pad][d] (the tiles read pairs of keys up to n_pad), a tile's queries [d][MR], its scores [MR][n_pad] and
 * their sums [MR], and the keys' element offsets [keys]. 0, with `failed` set to 2, where memory runs out. */
typedef struct {
    float *kt, *vrows, *qp, *s, *total;
    int64_t *at;
} task_buffers;

static int task_scratch(int64_t d, int64_t keys, task_buffers *b, int *failed) {
    const int64_t n_pad = padded_keys(keys);
    const size_t floats = (size_t)(d * n_pad + n_pad * d + d * MR + MR * n_pad + MR + 1) / 2 * 2;  /* `at` aligned */
    b->kt = thread_scratch(floats * sizeof(float) + (size_t)keys * sizeof(int64_t));
    if (!b->kt) {
#pragma omp atomic write
        *failed = 2;
        return 0;
    }
    b->vrows = b->kt + d * n_pad, b->qp = b->vrows + n_pad * d, b->s = b->qp + d * MR, b->total = b->s + MR * n_pad;
    b->at = (int64_t *)(b->kt + floats);
    return 1;
}

/* The task's keys and values, whose rows start at elements at[0..keys) of k and v (`src_dtype`, an I8 cache's with
 * their scales), packed as the tiles read them: the keys as float32 transposed (kt [d][n_pad], zeros past `keys`)
 * and the values as float32 rows, or, for the dot products, the keys as words of two bfloat16 of d ([d / 2][n_pad])
 * and the values as words of two keys' ([(keys + 1) / 2][d]). */
static void pack_task(const void *k, const void *v, const float *k_scales, const float *v_scales, int src_dtype,
                      const int64_t *at, int64_t keys, int64_t d, int dot, task_buffers *b) {
    const int64_t n_pad = padded_keys(keys);
    float block[FW][256];
#ifdef __AVX512BF16__
    uint16_t bits[16][256];
    uint32_t *kw = (uint32_t *)b->kt, *vw = (uint32_t *)b->vrows;
    const int whole = d % 32 == 0;  /* a key's words in vectors of 16 (else one at a time, below) */
    for (int64_t j0 = 0; dot && whole && j0 < n_pad; j0 += 16) {
        /* 16 keys' words transposed 16 x 16 at a time: each of kw's rows gets its 16 words in one store, where a
         * word a store down 16 rows n_pad words apart took a twelfth of a SigLIP tile's attention */
        const uint16_t *key[16];
        for (int i = 0; i < 16; i++)
            key[i] = j0 + i < keys ? source_row_bf16(k, k_scales, src_dtype, at[j0 + i], d, bits[i]) : NULL;
        for (int64_t w0 = 0; w0 < d / 2; w0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = key[i] ? _mm512_loadu_si512(key[i] + 2 * w0) : _mm512_setzero_si512();
            transpose16(r);
            for (int t = 0; t < 16; t++) _mm512_storeu_si512(kw + (w0 + t) * n_pad + j0, r[t]);
        }
    }
    for (int64_t j = 0; dot && !whole && j < n_pad; j++) {
        const uint16_t *key = source_row_bf16(k, k_scales, src_dtype, at[MIN(j, keys - 1)], d, bits[0]);
        for (int64_t t = 0; t < d / 2; t++) kw[t * n_pad + j] = j < keys ? word_at(key, t) : 0u;
    }
    uint16_t pick[2][32] __attribute__((aligned(64)));  /* word 2i: the even key's value 16 h + i, 2i + 1: the odd's */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 16; i++) {
            pick[h][2 * i] = (uint16_t)(16 * h + i);
            pick[h][2 * i + 1] = (uint16_t)(32 + 16 * h + i);
        }
    for (int64_t j = 0; dot && whole && j < keys; j += 2) {  /* two keys' values interleaved by vpermt2w */
        const uint16_t *even = source_row_bf16(v, v_scales, src_dtype, at[j], d, bits[0]);
        const uint16_t *odd = j + 1 < keys ? source_row_bf16(v, v_scales, src_dtype, at[j + 1], d, bits[1]) : NULL;
        for (int64_t t0 = 0; t0 < d; t0 += 32) {
            const __m512i e = _mm512_loadu_si512(even + t0);
            const __m512i o = odd ? _mm512_loadu_si512(odd + t0) : _mm512_setzero_si512();
            for (int h = 0; h < 2; h++)
                _mm512_storeu_si512(vw + j / 2 * d + t0 + 16 * h,
                                    _mm512_permutex2var_epi16(e, _mm512_load_si512(pick[h]), o));
        }
    }
    for (int64_t j = 0; dot && !whole && j < keys; j += 2) {
        const uint16_t *even = source_row_bf16(v, v_scales, src_dtype, at[j], d, bits[0]);
        const uint16_t *odd = j + 1 < keys ? source_row_bf16(v, v_scales, src_dtype, at[j + 1], d, bits[1]) : NULL;
        for (int64_t t = 0; t < d; t++) vw[j / 2 * d + t] = (uint32_t)even[t] | (odd ? (uint32_t)odd[t] << 16 : 0u);
    }
    if (dot)  /* the pairs past the keys, which the tiles read (times a weight of 0: they must not be NaN) */
        memset(vw + (keys + 1) / 2 * d, 0, (size_t)(n_pad / 2 - (keys + 1) / 2) * (size_t)d * sizeof(uint32_t));
#endif
    for (int64_t j0 = 0; !dot && j0 < n_pad; j0 += FW) {  /* FW keys at a time, so that kt is written by vectors */
        for (int64_t j = j0; j < j0 + FW; j++) {
            if (j < keys) source_row(k, k_scales, src_dtype, at[j], d, block[j - j0]);
            else memset(block[j - j0], 0, (size_t)d * sizeof(float));
        }
        for (int64_t t = 0; t < d; t++)
            for (int j = 0; j < FW; j++) b->kt[t * n_pad + j0 + j] = block[j][t];
    }
    for (int64_t j = 0; !dot && j < keys; j++) source_row(v, v_scales, src_dtype, at[j], d, b->vrows + j * d);
}

/* Query rows first..last (elements q_base + row * q_row_stride of q) over the task's packed keys, MR at a time: their
 * scores, the keys a row does not see set to -inf (with `sees` >= 0, row i sees the packed keys up to sees + i, and
 * with `window` > 0 only the last `window` of those), the softmax, the weighted values into out (row i at element
 * out_base + i * out_row_stride). */
static void attend_rows(const void *q, int dtype, int64_t q_base, int64_t q_row_stride, int64_t first_row,
                        int64_t last_row, float scale, int dot, int tiles, int64_t keys, int64_t d, int64_t sees,
                        int64_t window, task_buffers *b, void *out, int64_t out_base, int64_t out_row_stride) {
    const int64_t n_pad = padded_keys(keys);
    float row[256], tops[MR], *s = b->s;  /* tops: the tiles' maxima where no key is hidden (sees < 0) */
    (void)tiles, (void)tops;
    for (int64_t first = first_row; first <= last_row; first += MR) {
        const int64_t rows = MIN(MR, last_row + 1 - first);
#ifdef __AMX_BF16__
        if (tiles) {
            uint16_t *qb = (uint16_t *)b->qp;  /* [MR][d] bfloat16; rows past the last repeat it */
            for (int64_t r = 0; r < MR; r++)
                memcpy(qb + r * d, (const uint16_t *)q + q_base + MIN(first + r, last_row) * q_row_stride,
                       (size_t)d * sizeof(uint16_t));
            scores_amx(qb, (const uint32_t *)b->kt, d, n_pad, keys, s, sees < 0 ? tops : NULL);
        }
#endif
#ifdef __AVX512BF16__
        if (dot && !tiles) {
            uint32_t *qw = (uint32_t *)b->qp;
            for (int64_t r = 0; r < MR; r++) {  /* rows past the last repeat it; their results are dropped */
                const uint16_t *query = (const uint16_t *)q + q_base + MIN(first + r, last_row) * q_row_stride;
                for (int64_t t = 0; t < d / 2; t++) qw[t * MR + r] = word_at(query, t);
            }
            scores_dot(qw, (const uint32_t *)b->kt, d / 2, n_pad, scale, s);
        }
#endif
        for (int64_t r = 0; !dot && r < MR; r++) {  /* as above */
            load_floats(q, dtype, q_base + MIN(first + r, last_row) * q_row_stride, d, row);
            for (int64_t t = 0; t < d; t++) b->qp[t * MR + r] = row[t] * scale;
        }
        if (!dot) scores(b->qp, b->kt, d, n_pad, s);
        for (int64_t r = 0; sees >= 0 && r < rows; r++) {  /* row first + r sees packed keys [from, to] */
            const int64_t to = sees + first + r, from = window > 0 && to + 1 - window > 0 ? to + 1 - window : 0;
            float *scored = s + r * n_pad;
            for (int64_t j = 0; j < from; j++) scored[j] = -INFINITY;
            for (int64_t j = to + 1; j < keys; j++) scored[j] = -INFINITY;
        }
#ifdef __AVX512BF16__
        if (dot)
            softmax_rows_dot(s, rows, keys, n_pad, tiles ? scale : 1.0f, tiles && sees < 0 ? tops : NULL, b->total);
#endif
#ifdef __AMX_BF16__
        if (tiles)
            weighted_values_amx(s, rows, n_pad, (const uint32_t *)b->vrows, d, b->total, out, dtype,
                                out_base + first * out_row_stride, out_row_stride);
#endif
#ifdef __AVX512BF16__
        for (int64_t r0 = 0; dot && !tiles && r0 < rows; r0 += RO)
            weighted_values_dot(s + r0 * n_pad, MIN(RO, rows - r0), keys, n_pad, (const uint32_t *)b->vrows, d,
                                b->total + r0, out, dtype, out_base + (first + r0) * out_row_stride, out_row_stride);
#endif
        if (!dot) softmax_rows(s, rows, keys, n_pad, b->total);
        if (!dot)
            weighted_values(s, rows, keys, n_pad, b->vrows, d, b->total, out, dtype, out_base + first * out_row_stride,
                            out_row_stride);
    }
}

/* Whether `dtype` and `mode` take the AMX tiles (bfloat16, PRODUCTS_TILES, an AMX build the kernel lets use them, d a
 * multiple of 32). */
static int tile_products(int dtype, int mode, int64_t d) {
#ifdef __AMX_BF16__
    return dtype == BF16 && (mode & PRODUCTS_TILES) && d % 32 == 0 && amx_permitted();
#else
    (void)dtype, (void)mode, (void)d;
    return 0;
#endif
}

/* Whether `dtype` and `mode` take the dot products (bfloat16 with the build's vdpbf16ps, not asked to widen), or
 * the tiles, which read the keys and values packed as the dot products do. */
static int dot_products(int dtype, int mode, int64_t d) {
#ifdef __AVX512BF16__
    return tile_products(dtype, mode, d) || (dtype == BF16 && !(mode & PRODUCTS_WIDEN));
#else
    (void)dtype, (void)mode, (void)d;
    return 0;
#endif
}

/* The tiles configured for the calling thread where it takes them. */
static void configure_tiles(int tiles) {
#ifdef __AMX_BF16__
    if (tiles) amx_attention_configure();
#else
    (void)tiles;
#endif
}

/* Returns 0; 1 where d is not a multiple of the vector width (or above 256); 2 where memory runs out. */
int full_attention(const void *q, const void *k, const void *v, int dtype, int64_t batch, int64_t heads, int64_t n,
                   int64_t d, int64_t batch_stride, int64_t head_stride, int64_t row_stride, float scale, void *out,
                   int64_t out_batch_stride, int64_t out_row_stride, int mode, int num_threads) {
    if (d % FW || d > 256 || n < 1) return 1;
    const int dot = dot_products(dtype, mode, d), tiles = tile_products(dtype, mode, d);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        task_buffers b;
        const int ready = task_scratch(d, n, &b, &failed);
        configure_tiles(tiles);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * heads; task++) {
            if (!ready) continue;
            const int64_t i = task / heads, h = task % heads, base = i * batch_stride + h * head_stride;
            for (int64_t j = 0; j < n; j++) b.at[j] = base + j * row_stride;
            pack_task(k, v, NULL, NULL, dtype, b.at, n, d, dot, &b);
            attend_rows(q, dtype, base, row_stride, 0, n - 1, scale, dot, tiles, n, d, -1, 0, &b, out,
                        i * out_batch_stride + h * d, out_row_stride);
        }
    }
    return failed;
}

/* A causal prefill chunk's attention over the paged KV cache, read in place (engine/attention.py's CPU path calls
 * it through engine/cpu/).
 *
 * The chunk's n queries are rows query_start.. of q ([heads][tokens][d]: heads `q_head_stride` elements apart,
 * rows `q_row_stride`), at positions start..start + n - 1 of their sequence, whose keys and values lie in the
 * [slots][kv_heads][d] caches (position p in block block_table[p / block_size], at p % block_size); query heads h
 * share KV head h / groups. Query i sees keys 0..start + i (in a sliding-window layer, `window` > 0: only the last
 * `window` of them); its output goes to out row query_start + i ([tokens][heads][d], contiguous). q and out are
 * `dtype`. The arithmetic is `full_attention`'s, a task being one query head and BLOCK_ROWS queries: the keys those
 * queries see packed once, each tile of MR queries' scores at once, the keys a query does not see set to -inf
 * before the softmax. An int8 cache (I8, with its key and value scales [slots][kv_heads]) is read as paged_decode.c
 * reads it: each row dequantized and rounded to `dtype`, so the results are those over a cache of `dtype` holding
 * those values. Returns 0; 1 where d is not a multiple of the vector width (or above 256) or the cache is neither
 * `dtype` nor I8; 2 where memory runs out. */
#define BLOCK_ROWS (4 * MR)
int chunk_attention(const void *q, int dtype, int64_t q_head_stride, int64_t q_row_stride, int64_t query_start,
                    int64_t n, int64_t start, const void *key_cache, const void *value_cache, const float *key_scales,
                    const float *value_scales, int cache_dtype, const int64_t *block_table, int64_t block_size,
                    int64_t kv_heads, int64_t groups, int64_t d, float scale, int64_t window, void *out, int mode,
                    int num_threads) {
    if (d % FW || d > 256 || n < 1 || (cache_dtype != dtype && cache_dtype != I8)) return 1;
    const int dot = dot_products(dtype, mode, d), tiles = tile_products(dtype, mode, d);
    const int64_t heads = kv_heads * groups, blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        task_buffers b;
        const int ready = task_scratch(d, start + n, &b, &failed);
        configure_tiles(tiles);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * blocks; task++) {
            if (!ready) continue;
            const int64_t h = task % heads, g = h / groups, first = task / heads * BLOCK_ROWS;
            const int64_t last = MIN(first + BLOCK_ROWS, n) - 1;
            /* the keys the task's queries see: positions [lo, hi) */
            const int64_t lo = window > 0 && start + first + 1 - window > 0 ? start + first + 1 - window : 0;
            const int64_t hi = start + last + 1;
            for (int64_t p = lo; p < hi; p++)
                b.at[p - lo] = ((block_table[p / block_size] * block_size + p % block_size) * kv_heads + g) * d;
            pack_task(key_cache, value_cache, key_scales, value_scales, cache_dtype, b.at, hi - lo, d, dot, &b);
            attend_rows(q, dtype, h * q_head_stride + (query_start + first) * q_row_stride, q_row_stride, 0,
                        last - first, scale, dot, tiles, hi - lo, d, start + first - lo, window, &b, out,
                        ((query_start + first) * heads + h) * d, heads * d);
        }
    }
    return failed;
}
