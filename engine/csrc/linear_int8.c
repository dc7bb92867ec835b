/* y = x W^T for int8 weights (linear() in linear.c hands this file every I8 weight; engine/quantization.py states
 * the numeric rule, which its PyTorch reference reproduces bit for bit): W [n, k] int8 quantized per output
 * channel (float32 `scale` [n], int32 `row_sums` [n] = each row's sum), x [m, k] quantized per row at every call
 * (s = max|x| / 127, qx = round(x / s), into a reusable buffer), the products summed exactly in int32, then
 * y = float(acc) * (s * scale) and linear.c's epilogue (bias, glu, rounding: finish_row; without glu, y's GELU where
 * linear() asks for it: gelu.c's gelu_floats on the rounded values).
 *
 * The products go as linear.c's float ones: a block of four weight rows streams through registers against up to
 * RX rows of x, the sums vectors along k reduced once at the end of the row; each block prefetches the next
 * block's rows (a decode step reads every weight once: its cost is that read, a quarter of a float32 weight's,
 * half of a bfloat16's). Columns go out to the threads in tasks of NB blocks (`deal` / `next_task`). Many rows of
 * x (a prefill chunk, a vision tile) go in passes over the weights, each pass as many rows as stay in the L2
 * cache while every block of weight rows streams past them (X_BYTES), each weight row then read once a pass
 * from memory (or the L3 cache) and used from L1 for the pass's rows. What the build targets decides the inner
 * loop:
 *   - AVX-512 VNNI (`vpdpbusd`, 64 products per instruction): x as unsigned bytes qx + 128, the weights signed;
 *     the offset's 128 * row_sums[c] taken off the sum at the end;
 *   - AVX-512BW without VNNI, AVX2: `vpmaddubsw` on |x| (unsigned) and the weights with x's sign (signed; pairs
 *     of products at most 2 * 127^2, never saturating 16 bits), `vpmaddwd` by ones into 32-bit sums;
 *   - AMX-INT8 (`tdpbusd`, AMX_INT8_MIN_ROWS rows of x or more, k a multiple of 64): a task's 32 weight rows
 *     packed once into the quads the tiles multiply by, then every 16 rows of x (two blocks of 16 where the packed
 *     rows outgrow the L1), as they lie, against them (two tiles of sums a block); x past AMX_PASS_BYTES in passes
 *     of rows against every task's weights packed beforehand, each pass's rows quantized as it starts; fewer rows
 *     than AMX_INT8_MIN_ROWS but more than a vector block's (a decode step's) the other way round (`tdpbsud`, the
 *     weight rows first as they lie, against x's quads: amx_few_tasks; where the tiles take every column, each
 *     thread quantizes all of x for itself, so that no thread waits at a barrier for another's rows: a decode
 *     product 0.95-0.99x); the columns past the last whole tile pair through the vector blocks;
 *   - anything else: plain C.
 * A whole task's sums are finished in vectors on AVX-512, many rows at once (32 consecutive columns: `finish32_rows`;
 * glu, 16 gate and their 16 up outputs: `finish16_glu_rows`), a partial task's and float16's by `finish_sums`.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "linear.h"

#define MCI 192         /* the most rows of x a pass over the weights multiplies (their sums on the stack: 24 KB) */
#define X_BYTES (64 << 10) /* the most bytes of quantized x a pass reads (for every block of weight rows) */
#define MAX(a, b) ((a) > (b) ? (a) : (b))

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#define KB 64   /* bytes of k per step */
#define RX 6    /* rows of x per block: 24 sums, 4 weights and x in 32 registers */
#elif defined(__AVX512BW__)
#define KB 64
#define RX 4    /* 16 sums, 4 weights, |x|, x's sign mask and two steps' temporaries */
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define VNNI 1
#define KB 32
#define RX 2    /* 8 sums, 4 weights and x in 16 registers */
#elif defined(__AVX2__)
#define KB 32
#define RX 2
#else
#define KB 32
#define RX 6
#endif

#ifdef VNNI
#define OFFSET 128  /* x's bytes are qx + OFFSET (unsigned) */
#else
#define OFFSET 0
#endif

#if KB == 64 && defined(__AVX512BW__)
typedef __m512i vi;
static inline vi izero(void) { return _mm512_setzero_si512(); }
static inline vi xload(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi wload(const int8_t *p) { return _mm512_loadu_si512((const void *)p); }
/* The last `count` (< 64) bytes of a row, zeros after them. */
static inline vi wload_tail(const int8_t *p, int64_t count) {
    return _mm512_maskz_loadu_epi8((__mmask64)((1ull << count) - 1ull), p);
}
/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128i reduce4(vi a, vi b, vi c, vi d) {
    const vi ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const vi cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    const vi abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#ifdef VNNI
/* In an asm statement: the intrinsic made GCC copy every sum to another register and back around each product
 * (32 moves a step beside the 16 products), about a fifth of a decode step's products' time. */
#define DOT(acc, xv, wv) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(xv), "v"(wv))
#define X_PREP(xv)
#else
/* |x| times the weights with x's sign, in pairs into 16 bits, then by ones into 32. */
#define X_PREP(xv) \
    const vi xa = _mm512_abs_epi8(xv); \
    const __mmask64 xm = _mm512_movepi8_mask(xv);
#define DOT(acc, xv, wv) \
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16( \
        _mm512_maddubs_epi16(xa, _mm512_mask_sub_epi8(wv, xm, _mm512_setzero_si512(), wv)), \
        _mm512_set1_epi16(1)))
#endif
#elif defined(__AVX2__)
typedef __m256i vi;
static inline vi izero(void) { return _mm256_setzero_si256(); }
static inline vi xload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi wload(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi wload_tail(const int8_t *p, int64_t count) {
    int8_t padded[32] = {0};
    memcpy(padded, p, (size_t)count);
    return _mm256_loadu_si256((const __m256i *)padded);
}
static inline __m128i reduce4(vi a, vi b, vi c, vi d) {
    const vi abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}
#ifdef VNNI
#define DOT(acc, xv, wv) acc = _mm256_dpbusd_avx_epi32(acc, xv, wv)
#define X_PREP(xv)
#else
#define X_PREP(xv) const vi xa = _mm256_abs_epi8(xv);
#define DOT(acc, xv, wv) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv, xv)), \
                                                  _mm256_set1_epi16(1)))
#endif
#endif

/* Row `i` of x (k values of `dtype`) quantized into `out` (kp bytes: the k values, then qx = 0 up to kp), as
 * qx + OFFSET; returns its scale s. `row` is k floats of room. engine/quantization.py's rule for activations:
 * s = max|x| / 127, q = x / s rounded half to even (IEEE divisions: div16, div8; OPAQUE as dtypes.h's).
 * The vector loops multiply by r = 1 / s instead, cheaper than a vector division (a 256 x 3,072 x in the cache
 * took 0.94x the time on the AMX machine; from memory, its reading takes the time): |x r - x / s| < 2^-16 and
 * x / s's float is within 2^-17 of it (|x / s| <= 127), so x r rounds to the division's integer unless it lies
 * within 2^-15 of a half; a vector with a value within 2^-14 of one (about one in 500 of random rows' vectors) is
 * divided. r is an IEEE division too (under -ffast-math a reciprocal estimate would be less exact); where s is
 * outside [2^-100, 2^100] (or not finite) r may not be finite: the row is divided. Where `ahead` (row i + 2 of x
 * exists), the AVX-512 loop asks for that row's lines as it widens this one's: x comes from memory (a layer's
 * output, megabytes for a vision tile), and the rows' reading waited on each line. */
static float quantize_x(const void *x, int dtype, int64_t i, int64_t k, int64_t kp, int ahead, float *row,
                        uint8_t *out) {
    float amax = 0.0f;
    int64_t w = 0;
    int64_t direct = 0;  /* bfloat16 x: values [0, direct) are read from x where they are quantized, not from row */
#ifdef __AVX512F__
    if (dtype == BF16 && k >= 32) {
        /* the largest magnitude in bfloat16 itself, 32 values a step: without the sign bit a bfloat16's bits order
         * as its magnitude does (a NaN's above infinity's, counted as infinity: min with 0x7f80) */
        const uint16_t *words = (const uint16_t *)x + i * k, *next = (const uint16_t *)x + (i + 2) * k;
        const __m512i magnitude = _mm512_set1_epi16(0x7fff);
        __m512i top = _mm512_setzero_si512();
        for (; w + 32 <= k; w += 32) {
            if (ahead) __builtin_prefetch(next + w, 0, 3);
            top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512(words + w), magnitude));
        }
        const __m256i half = _mm256_max_epu16(_mm512_castsi512_si256(top), _mm512_extracti64x4_epi64(top, 1));
        __m128i q = _mm_max_epu16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
        q = _mm_max_epu16(q, _mm_srli_si128(q, 8));
        q = _mm_max_epu16(q, _mm_srli_si128(q, 4));
        q = _mm_max_epu16(q, _mm_srli_si128(q, 2));
        const uint32_t bits = (uint32_t)MIN(_mm_extract_epi16(q, 0), 0x7f80) << 16;
        memcpy(&amax, &bits, sizeof amax);
        direct = w;
    }
    {  /* widened and its largest magnitude taken in one pass */
        __m512 top = _mm512_setzero_ps();
        const int64_t item = dtype == F32 ? 4 : 2;
        const char *next = (const char *)x + (i + 2) * k * item;
        for (; w + 16 <= k; w += 16) {
            if (ahead && w * item % 64 == 0) __builtin_prefetch(next + w * item, 0, 3);
            const __m512 v = widen16(x, dtype, i * k + w);
            _mm512_storeu_ps(row + w, v);
            top = _mm512_max_ps(top, _mm512_abs_ps(v));
        }
        amax = fmaxf(amax, _mm512_reduce_max_ps(top));
    }
#else
    (void)ahead, (void)direct;
#endif
    load_floats(x, dtype, i * k + w, k - w, row + w);
    for (int64_t t = w; t < k; t++) amax = fmaxf(amax, fabsf(row[t]));
    float limit = INT8_LIMIT;
    OPAQUE(limit);
    const float s = amax == 0.0f ? 1.0f : amax / limit;
    uint32_t s_bits;
    memcpy(&s_bits, &s, sizeof s_bits);
    const uint32_t exponent = s_bits >> 23 & 0xff;  /* bits, not comparisons: -ffast-math assumes no NaN */
    const int by_reciprocal = exponent >= 127 - 100 && exponent <= 127 + 100;
    int64_t t = 0;
#ifdef __AVX512F__
    const __m512 divisor = _mm512_set1_ps(s), low = _mm512_set1_ps(-INT8_LIMIT), high = _mm512_set1_ps(INT8_LIMIT);
    const __m512 reciprocal = div16(_mm512_set1_ps(1.0f), divisor), near_half = _mm512_set1_ps(0.5f - 0x1p-14f);
    const __m512i lowest = _mm512_set1_epi32(-(int)INT8_LIMIT);
    /* bfloat16 x read where it lies, 64 values a step: their integers packed to bytes together (the packs'
     * saturation and the max with -127 keep a NaN's -127) */
    const __m512i in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; by_reciprocal && t + 64 <= direct; t += 64) {
        __m512i q[4];
        __mmask16 near = 0;
        for (int j = 0; j < 4; j++) {
            const __m512 y = _mm512_mul_ps(widen16(x, BF16, i * k + t + 16 * j), reciprocal);
            q[j] = _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            near |= _mm512_cmp_ps_mask(
                _mm512_abs_ps(_mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), near_half,
                _CMP_GT_OQ);
        }
        if (near)  /* the division's integers (the products' where no value lies near a half) */
            for (int j = 0; j < 4; j++)
                q[j] = _mm512_cvt_roundps_epi32(div16(widen16(x, BF16, i * k + t + 16 * j), divisor),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        /* per 128-bit lane l the packs leave q0's values 4l..4l+3, q1's, q2's, q3's: words put back in order */
        __m512i bytes = _mm512_permutexvar_epi32(in_order, _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]),
                                                                              _mm512_packs_epi32(q[2], q[3])));
        bytes = _mm512_max_epi8(bytes, _mm512_set1_epi8((char)-(int)INT8_LIMIT));
        if (OFFSET) bytes = _mm512_xor_si512(bytes, _mm512_set1_epi8((char)0x80));
        _mm512_storeu_si512(out + t, bytes);
    }
    for (; t + 16 <= k; t += 16) {
        const __m512 v = t < direct ? widen16(x, BF16, i * k + t) : _mm512_loadu_ps(row + t);
        __m512i q;
        if (by_reciprocal) {
            /* |x r| <= 127 (1 + 2^-22): the integers need no clamp but a NaN's (the conversion's INT_MIN), which
             * becomes -127 as the clamp below makes it */
            const __m512 y = _mm512_mul_ps(v, reciprocal);
            q = _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 off = _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  /* y - q */
            if (_mm512_cmp_ps_mask(_mm512_abs_ps(off), near_half, _CMP_GT_OQ))
                q = _mm512_cvt_roundps_epi32(div16(v, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_max_epi32(q, lowest);
        } else {
            q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(
                div16(v, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), low), high));
        }
        __m128i bytes = _mm512_cvtsepi32_epi8(q);
        if (OFFSET) bytes = _mm_xor_si128(bytes, _mm_set1_epi8((char)0x80));
        _mm_storeu_si128((__m128i *)(out + t), bytes);
    }
#elif defined(__AVX2__)
    const __m256 divisor = _mm256_set1_ps(s), low = _mm256_set1_ps(-INT8_LIMIT), high = _mm256_set1_ps(INT8_LIMIT);
    const __m256 reciprocal = div8(_mm256_set1_ps(1.0f), divisor), near_half = _mm256_set1_ps(0.5f - 0x1p-14f);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; t + 8 <= k; t += 8) {
        const __m256 v = _mm256_loadu_ps(row + t);
        __m256 q;
        if (by_reciprocal) {
            const __m256 y = _mm256_mul_ps(v, reciprocal);
            q = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256 off = _mm256_and_ps(_mm256_sub_ps(y, q), magnitude);
            if (_mm256_movemask_ps(_mm256_cmp_ps(off, near_half, _CMP_GT_OQ)))
                q = _mm256_round_ps(div8(v, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        } else {
            q = _mm256_round_ps(div8(v, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        int32_t whole[8];
        _mm256_storeu_si256((__m256i *)whole, _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, low), high)));
        for (int l = 0; l < 8; l++) out[t + l] = (uint8_t)(whole[l] + OFFSET);
    }
#else
    (void)by_reciprocal;
#endif
    for (; t < k; t++) {
        float d = s;
        OPAQUE(d);
        const float q = rintf(row[t] / d);
        out[t] = (uint8_t)((int32_t)fminf(fmaxf(q, -INT8_LIMIT), INT8_LIMIT) + OFFSET);
    }
    memset(out + k, OFFSET, (size_t)(kp - k));
    return s;
}

#ifdef DOT
#define A(r, i) a##r##i
#define DECL(i) vi A(0, i) = izero(), A(1, i) = A(0, i), A(2, i) = A(0, i), A(3, i) = A(0, i);
#define ROW_STEP(i) \
    if (rows > i) { \
        const vi xv = xload(x + i * x_stride + t); \
        X_PREP(xv) \
        DOT(A(0, i), xv, w0); \
        DOT(A(1, i), xv, w1); \
        DOT(A(2, i), xv, w2); \
        DOT(A(3, i), xv, w3); \
    }
#define STORE_ROW(i) \
    if (rows > i) _mm_storeu_si128((__m128i *)(out + i * stride), reduce4(A(0, i), A(1, i), A(2, i), A(3, i)));
#if RX == 6
#define EACH_ROW(M) M(0) M(1) M(2) M(3) M(4) M(5)
#elif RX == 4
#define EACH_ROW(M) M(0) M(1) M(2) M(3)
#else
#define EACH_ROW(M) M(0) M(1)
#endif
/* Quantized x (rows 0..R-1, `x_stride` bytes apart, padded to whole steps) against weight rows w[0..3] (k
 * bytes each): the four int32 sums of x row i into out[i * stride ..] (with the x's offset in them), the rows
 * `next` prefetched meanwhile: one function per R. */
#define BLOCK(R) \
    static void block_##R(const uint8_t *x, int64_t x_stride, int64_t k, const int8_t *const w[RW], \
                          const void *const next[RW], int32_t *out, int64_t stride) { \
        const int rows = R; \
        EACH_ROW(DECL) \
        const int8_t *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3]; \
        int64_t t = 0; \
        for (; t + KB <= k; t += KB) { \
            if (t % 64 == 0) prefetch_rows(next, t); \
            const vi w0 = wload(p0 + t), w1 = wload(p1 + t), w2 = wload(p2 + t), w3 = wload(p3 + t); \
            EACH_ROW(ROW_STEP) \
        } \
        if (t < k) { \
            const vi w0 = wload_tail(p0 + t, k - t), w1 = wload_tail(p1 + t, k - t); \
            const vi w2 = wload_tail(p2 + t, k - t), w3 = wload_tail(p3 + t, k - t); \
            EACH_ROW(ROW_STEP) \
        } \
        EACH_ROW(STORE_ROW) \
    }
#if RX == 6
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
#define FNS {block_1, block_2, block_3, block_4, block_5, block_6}
#elif RX == 4
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4)
#define FNS {block_1, block_2, block_3, block_4}
#else
BLOCK(1) BLOCK(2)
#define FNS {block_1, block_2}
#endif
typedef void (*block_fn)(const uint8_t *, int64_t, int64_t, const int8_t *const[RW], const void *const[RW],
                         int32_t *, int64_t);
static const block_fn BLOCK_FNS[RX] = FNS;
#endif

#ifndef DOT
/* The same in plain C (`rows` rows of x, signed bytes: no offset). */
static void block_plain(const uint8_t *x, int64_t x_stride, int64_t k, const int8_t *const w[RW], int rows,
                        int32_t *out, int64_t stride) {
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < RW; r++) {
            int32_t sum = 0;
            for (int64_t t = 0; t < k; t++) sum += (int32_t)(int8_t)x[i * x_stride + t] * w[r][t];
            out[i * stride + r] = sum;
        }
}
#endif

/* What a task's columns scale their sums by: scale_of[c] = scale[rows_of[c]], and offset_of[c] = `offset` *
 * row_sums[rows_of[c]], the part of the sums that x's offset put in them (none: offset 0, row_sums unread). */
static void task_scales(const int64_t *rows_of, int64_t blocks, const float *scale, const int32_t *row_sums,
                        int offset, float *scale_of, int32_t *offset_of) {
    for (int64_t c = 0; c < blocks * RW; c++) {
        scale_of[c] = scale[rows_of[c]];
        offset_of[c] = offset ? offset * row_sums[rows_of[c]] : 0;
    }
}

/* One row of x's sums for `blocks` blocks (acc[c] for the weight rows rows_of[c]) scaled (task_scales; s: the
 * row's scale), finished (linear.c's finish_row) and stored as y's `cols` columns from `first_col` of row `row`;
 * with `gelu` (no glu), the stored values' GELU as gelu_tanh takes it. s * scale[c] is computed first, and kept
 * from being reassociated into the product by the fast-math build (an asm statement sees the array): the
 * reference's order. */
static void finish_sums(const int32_t *acc, const float *scale_of, const int32_t *offset_of, int64_t blocks,
                        const int64_t *rows_of, float s, int glu_mode, int gelu, const float *bias, int dtype,
                        void *y, const void *residual, int64_t row, int64_t out_cols, int64_t first_col,
                        int64_t cols) {
    float factor[NB * RW], sums[NB * RW], done[NB * RW];
    for (int64_t c = 0; c < blocks * RW; c++) factor[c] = s * scale_of[c];
    __asm__ volatile("" : : "r"(factor) : "memory");
    for (int64_t c = 0; c < blocks * RW; c++) sums[c] = (float)(acc[c] - offset_of[c]) * factor[c];
    finish_row(sums, blocks, glu_mode, bias, rows_of, dtype, done);
    store_floats(done, cols, y, dtype, row * out_cols + first_col);
    if (gelu) {  /* read back rounded, as gelu_tanh reads them */
        load_floats(y, dtype, row * out_cols + first_col, cols, done);
        gelu_floats(done, cols);
        store_floats(done, cols, y, dtype, row * out_cols + first_col);
    }
    if (residual) add_residual(y, residual, dtype, row * out_cols + first_col, cols);
}

#ifdef __AVX512F__
/* 16 float32 sums as `dtype` (bfloat16 or float32) into `out`, rounded as store_floats rounds them. */
static inline void store16(__m512 v, int dtype, void *out) {
    if (dtype == F32) {
        _mm512_storeu_ps(out, v);
        return;
    }
    _mm256_storeu_si256(out, bf16_words16(v));
}

/* 32 output columns as a row's sums are finished: 16 consecutive from `first` and 16 from `second` (no glu: first
 * + 16; glu: a task's 16 gate rows and the same 16 up rows), their scales, x's offset times their row sums, their
 * bias (0 without). */
typedef struct {
    __m512 scale[2], bias[2];
    __m512i offset[2];
    int has_bias, gelu;  /* gelu: the outputs' GELU (no glu) */
} columns32;

static inline columns32 columns32_of(const float *scale, const int32_t *row_sums, const float *bias, int64_t first,
                                     int64_t second, int gelu) {
    columns32 c;
    c.has_bias = bias != NULL;
    c.gelu = gelu;
    for (int t = 0; t < 2; t++) {
        const int64_t at = t ? second : first;
        c.scale[t] = _mm512_loadu_ps(scale + at);
        c.bias[t] = bias ? _mm512_loadu_ps(bias + at) : _mm512_setzero_ps();
        c.offset[t] = _mm512_mullo_epi32(_mm512_loadu_si512(row_sums + at), _mm512_set1_epi32(OFFSET));
    }
    return c;
}

/* Half t of those columns' sums `acc` for a row of scale s, as finish_sums computes them before finish_row's
 * rounding, bit for bit: float(acc - offset) * (s * scale) (the factor first; asm statements keep the product from
 * fusing with the bias's add), + bias. */
static inline __m512 sums16(const columns32 *c, int t, const int32_t *acc, float s) {
    __m512 factor = _mm512_mul_ps(_mm512_set1_ps(s), c->scale[t]);
    __asm__("" : "+v"(factor));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc), c->offset[t])), factor);
    __asm__("" : "+v"(v));
    return c->has_bias ? _mm512_add_ps(v, c->bias[t]) : v;
}

/* 16 finished values into `out` (bfloat16 or float32), rounded as store_floats rounds them; with a residual `res`
 * (its same 16 values; NULL: none) first rounded, then the residual added and the sum rounded, as add_residual. */
static inline void store16_adding(__m512 v, int dtype, void *out, const void *res) {
    if (res) {
        if (dtype != F32) v = rounded_bf16_16(v);
        __asm__("" : "+v"(v));
        v = _mm512_add_ps(v, widen16(res, dtype, 0));
    }
    store16(v, dtype, out);
}

/* `rows` rows' sums of 32 consecutive columns (row r's first 16 at lo + r * stride, the next 16 at hi + r *
 * stride; its scale s[r]) finished as finish_sums finishes them, bit for bit, in vectors, into row r's first of the
 * columns at `out` + r * out_stride bytes (bfloat16 or float32), + the residual's same columns at `res` (same
 * strides; NULL: none); with the columns' `gelu`, the values rounded to `dtype`, then gelu_tanh's own steps
 * (gelu_floats) over up to 16 rows at once: a row's 32 values alone left its steps' chains of dependent products
 * unhidden (a 1,024 x 768 x 3,072 product with its GELU took 1.7x its time without, 1.5x with 16 rows a call). */
static inline void finish32_rows(const columns32 *c, const int32_t *lo, const int32_t *hi, int64_t stride,
                                 const float *s, int64_t rows, int dtype, char *out, const char *res,
                                 int64_t out_stride) {
    const int64_t item = dtype == F32 ? 4 : 2;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t count = MIN(16, rows - r0);
        float values[16 * 32] __attribute__((aligned(64)));
        for (int64_t r = r0; r < r0 + count; r++) {
            const __m512 v[2] = {sums16(c, 0, lo + r * stride, s[r]), sums16(c, 1, hi + r * stride, s[r])};
            for (int t = 0; t < 2; t++) {
                if (!c->gelu) {
                    store16_adding(v[t], dtype, out + r * out_stride + 16 * t * item,
                                   res ? res + r * out_stride + 16 * t * item : NULL);
                    continue;
                }
                _mm512_store_ps(values + (r - r0) * 32 + 16 * t, dtype == F32 ? v[t] : rounded_bf16_16(v[t]));
            }
        }
        if (!c->gelu) continue;
        gelu_floats(values, count * 32);
        for (int64_t r = r0; r < r0 + count; r++)
            for (int t = 0; t < 2; t++)
                store16_adding(_mm512_load_ps(values + (r - r0) * 32 + 16 * t), dtype,
                               out + r * out_stride + 16 * t * item,
                               res ? res + r * out_stride + 16 * t * item : NULL);
    }
}

/* `rows` rows' sums of 16 gate columns and their 16 up columns finished as finish_sums finishes them in glu
 * mode, bit for bit: row r's 32 sums are the 16 at lo + r * stride then the 16 at hi + r * stride, its gate sums
 * the lanes order[0] picks of them and its up sums those order[1] picks; in vectors (sums16), then act(gate) * up
 * by finish_row's own `glu_tail` over up to 16 rows a call (a row's 16 alone left its exponentials and divisions
 * waiting on each other), into row r's 16 outputs at `out` + r * out_stride bytes (+ the residual's at `res`, same
 * strides; NULL: none). finish_sums took a decode step's gate/up product a third longer than its reading. */
static inline void finish16_glu_rows(const columns32 *c, const int32_t *lo, const int32_t *hi, int64_t stride,
                                     const __m512i order[2], const float *s, int64_t rows, int glu_mode, int dtype,
                                     char *out, const char *res, int64_t out_stride) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t count = MIN(16, rows - r0);
        float g[GLU_MOST], u[GLU_MOST], done[GLU_MOST];
        for (int64_t r = r0; r < r0 + count; r++) {
            const __m512i a = _mm512_loadu_si512(lo + r * stride), b = _mm512_loadu_si512(hi + r * stride);
            int32_t gate[16], up[16];
            _mm512_storeu_si512(gate, _mm512_permutex2var_epi32(a, order[0], b));
            _mm512_storeu_si512(up, _mm512_permutex2var_epi32(a, order[1], b));
            _mm512_storeu_ps(g + (r - r0) * 16, sums16(c, 0, gate, s[r]));
            _mm512_storeu_ps(u + (r - r0) * 16, sums16(c, 1, up, s[r]));
        }
        glu_tail(g, u, count * 16, glu_mode, dtype, done);
        for (int64_t r = r0; r < r0 + count; r++)
            store16_adding(_mm512_loadu_ps(done + (r - r0) * 16), dtype, out + r * out_stride,
                           res ? res + r * out_stride : NULL);
    }
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define AMX_INT8_MIN_ROWS 32  /* fewer rows go the other way round (amx_few_tasks): packing a task's weights costs */
/* From this many rows of x (fewer than AMX_INT8_MIN_ROWS) amx_few_tasks' tiles; fewer rows are one block of the
 * vector loop, each weight byte read once, as fast or faster (weights of SmolVLM-256M's decode products, 1 to 6 rows:
 * the blocks 0.8-1.0x the tiles' time; 8 rows, two blocks of 4: 1.05-1.2x). */
#define AMX_INT8_FEW_ROWS (RX + 1)

#if OFFSET
#define AMX_DP _tile_dpbusd  /* x's bytes unsigned (qx + 128), the weights signed */
#define AMX_DP_WX _tile_dpbsud  /* the same with the weights first */
#else
#define AMX_DP _tile_dpbssd
#define AMX_DP_WX _tile_dpbssd
#endif

/* Tiles 0-1: sums of x's first block (`rows` rows x 16 weight rows, int32); 2-3: of its second block (`rows2`
 * rows, none where 0); 4-5: the two blocks of x (64 bytes of k); 6-7: weight quads. */
static void amx_configure_rows(int rows, int rows2) {
    const uint8_t r2 = (uint8_t)rows2, c2 = rows2 ? 64 : 0;
    const uint8_t tile_rows[8] = {(uint8_t)rows, (uint8_t)rows, r2, r2, (uint8_t)rows, r2, 16, 16};
    const uint16_t colsb[8] = {64, 64, c2, c2, 64, c2, 64, 64};
    amx_load_config(tile_rows, colsb);
}

/* A task's packed weights larger than this go two blocks of x a pass (four sums, each weight tile loaded
 * multiplied twice): from the L2 cache, three tiles loaded for two products bound the loop (a scratch loop, 1,024
 * rows, k = 3,072: 0.64-0.72 TMAC/s a core one block a pass, 0.88-0.95 two); from the L1 (k = 768) one block a
 * pass is the faster (1.95-2.3 against 1.4-1.95). */
#define AMX_PAIR_BYTES (48 << 10)

/* Quantized x larger than this goes through the tiles in passes of rows of about this size (at least
 * AMX_PASS_ROWS, so that a long k's passes are not a few rows each), every task's weights packed once beforehand
 * into one buffer (the weight's size) and read again each pass: a task that streams all of x reads it from the L3
 * cache (SigLIP's products for 4 tiles at once, 4,096 rows, took 1.3-1.5x the time a row that 1,024 rows take). */
#define AMX_PASS_BYTES (1 << 20)
#define AMX_PASS_ROWS 256
#define AMX_PACKED_MAX (32 << 20)  /* a larger weight (a 7B model's gate/up: 136 MB) keeps each task's own packing */

/* Weight rows [first, first + 16) and [second, second + 16) as the tiles' second operand: for each 64 bytes of k
 * and each of the two, 16 rows of quads (row q: the 16 weight rows' bytes 4q..4q+3), [k / 64][2][16][16] words. */
static void amx_pack_weights(const int8_t *w, int64_t w_stride, int64_t k, int64_t first, int64_t second,
                             uint32_t *packed) {
    for (int64_t step = 0; step < k / 64; step++)
        for (int t = 0; t < 2; t++) {
            const int8_t *rows = w + (t ? second : first) * w_stride + step * 64;
            __m512i r[16];
            for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512(rows + n * w_stride);
            transpose16(r);
            for (int q = 0; q < 16; q++) _mm512_storeu_si512(packed + (step * 2 + t) * 256 + q * 16, r[q]);
        }
}

/* A task's 32 columns (or 16 gate and their 16 up rows) as its blocks' sums are finished: the first weight row of
 * each tile; where y is bfloat16 or float32 what the vector epilogue reads (`vector`: finish32_rows,
 * finish16_glu_rows), else their blocks' rows (block_rows), scales and x's offset (task_scales) for finish_sums. */
typedef struct {
    int64_t first, second;
    int64_t rows_of[NB * RW];
    float scale_of[NB * RW];
    int32_t offset_of[NB * RW];
    columns32 columns;
    int vector, gelu;
} amx_columns;

static void amx_columns_of(int64_t task, int glu_mode, int gelu, int64_t n, const float *scale,
                           const int32_t *row_sums, const float *bias, int dtype, amx_columns *c) {
    const int64_t out_cols = glu_mode ? n / 2 : n;
    c->first = glu_mode ? 16 * task : 32 * task;
    c->second = glu_mode ? out_cols + c->first : c->first + 16;
    c->vector = dtype != F16;
    c->gelu = gelu;
    if (c->vector) {
        c->columns = columns32_of(scale, row_sums, bias, c->first, c->second, gelu);
        return;
    }
    const int64_t first_block = glu_mode ? c->first / 2 : c->first / RW;
    for (int b = 0; b < NB; b++) block_rows(first_block + b, glu_mode, n, out_cols, c->rows_of + b * RW);
    task_scales(c->rows_of, NB, scale, row_sums, OFFSET, c->scale_of, c->offset_of);
}

/* A block's sums (`rows` rows of x from `row0`: tiles `sums[0]`, `sums[1]`) finished: in vectors where the task
 * has its `columns` (y bfloat16 or float32), else each row put in the blocks' order and finished as theirs. */
static void amx_finish_block(int32_t sums[2][16][16], int64_t rows, int64_t row0, const float *xs, int glu_mode,
                             const amx_columns *c, const float *bias, int dtype, void *y, const void *residual,
                             int64_t out_cols) {
    const int64_t first = c->first;
    if (c->vector) {
        const columns32 *columns = &c->columns;
        const int64_t item = dtype == F32 ? 4 : 2, at = (row0 * out_cols + first) * item;
        if (!glu_mode) {
            finish32_rows(columns, sums[0][0], sums[1][0], 16, xs + row0, rows, dtype, (char *)y + at,
                          residual ? (const char *)residual + at : NULL, out_cols * item);
            return;
        }
        /* a row's gate sums in the first tile, its up sums in the second */
        const __m512i order[2] = {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                  _mm512_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31)};
        finish16_glu_rows(columns, sums[0][0], sums[1][0], 16, order, xs + row0, rows, glu_mode, dtype,
                          (char *)y + at, residual ? (const char *)residual + at : NULL, out_cols * item);
        return;
    }
    /* glu: block b's columns are gate rows 2b, 2b + 1 (the first tile's) and the same two up rows (the second's) */
    const __m512i glu_low = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
    const __m512i glu_high = _mm512_add_epi32(glu_low, _mm512_set1_epi32(8));
    for (int64_t r = 0; r < rows; r++) {
        int32_t acc[NB * RW] __attribute__((aligned(64)));
        const __m512i a = _mm512_load_si512(sums[0][r]), b = _mm512_load_si512(sums[1][r]);
        _mm512_store_si512(acc, glu_mode ? _mm512_permutex2var_epi32(a, glu_low, b) : a);
        _mm512_store_si512(acc + 16, glu_mode ? _mm512_permutex2var_epi32(a, glu_high, b) : b);
        finish_sums(acc, c->scale_of, c->offset_of, NB, c->rows_of, xs[row0 + r], glu_mode, c->gelu, bias, dtype,
                    y, residual, row0 + r, out_cols, first, glu_mode ? 16 : 32);
    }
}

/* A pass's products into the tiles (0-1, and 2-3 for a second block), from row block rb: one block of 16 rows of
 * x, or two where per_pass is 2, against the task's packed weights (the configuration changed where its rows did:
 * `configured` is its key); their rows into *rows, *rows2 (0: one block). The next pass's outputs are fetched for
 * writing, and the residual's lines its epilogue reads, spread over the steps: y's lines, written once each, are not
 * in the cache (a vision tile's outputs are megabytes), a store or a residual load waiting for its line stalls the
 * loop, and a burst of them stalls it on the core's outstanding misses. They are fetched into the L2 cache, not the
 * L1, whose miss buffers the tiles' loads of x from the L2 need (the tile 0.98x). */
static inline void amx_issue(const uint8_t *xq, int64_t rb, int64_t m, int64_t k, const uint32_t *packed,
                             int64_t per_pass, int64_t first, int64_t out_cols, void *y, const void *residual,
                             int dtype, int64_t *configured, int64_t *rows_out, int64_t *rows2_out) {
    const int64_t row_blocks = (m + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t rows = MIN(AMX_ROWS, m - rb * AMX_ROWS);
    const int64_t rows2 = per_pass == 2 && rb + 1 < row_blocks ? MIN(AMX_ROWS, m - (rb + 1) * AMX_ROWS) : 0;
    *rows_out = rows, *rows2_out = rows2;
    if (rows * 32 + rows2 != *configured)  /* the configuration's key: both blocks' rows */
        amx_configure_rows((int)rows, (int)rows2), *configured = rows * 32 + rows2;
    const int64_t next0 = (rb + per_pass) * AMX_ROWS;
    const int64_t next_rows = MAX(0, MIN((rb + 2 * per_pass) * AMX_ROWS, m) - next0);
    const int64_t item = dtype == F32 ? 4 : 2, lines = residual ? 2 * next_rows : next_rows;
    const int64_t per_step = (lines + k / 64 - 1) / (k / 64);
    int64_t line = 0;
#define PREFETCH_NEXT()                                                                                              \
    for (int64_t e = 0; e < per_step && line < lines; e++, line++) {                                                 \
        const int64_t row = line < next_rows ? line : line - next_rows; /* y's lines, then the residual's */        \
        const int64_t at = ((next0 + row) * out_cols + first) * item;                                                \
        if (line < next_rows) __builtin_prefetch((char *)y + at, 1, 1);                                              \
        else __builtin_prefetch((const char *)residual + at, 0, 1);                                                  \
    }
    const uint8_t *x0 = xq + rb * AMX_ROWS * k, *x1 = x0 + AMX_ROWS * k;  /* rows k bytes apart (k % 64 == 0) */
    _tile_zero(0);
    _tile_zero(1);
    if (rows2) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t step = 0; step < k / 64; step++) {
            _tile_loadd(6, packed + step * 512, 64);
            _tile_loadd(7, packed + step * 512 + 256, 64);
            _tile_loadd(4, x0 + step * 64, k);
            AMX_DP(0, 4, 6);
            AMX_DP(1, 4, 7);
            _tile_loadd(5, x1 + step * 64, k);
            AMX_DP(2, 5, 6);
            AMX_DP(3, 5, 7);
            PREFETCH_NEXT()
        }
    } else {
        for (int64_t step = 0; step < k / 64; step++) {
            _tile_loadd(4, x0 + step * 64, k);
            _tile_loadd(6, packed + step * 512, 64);
            _tile_loadd(7, packed + step * 512 + 256, 64);
            AMX_DP(0, 4, 6);
            AMX_DP(1, 4, 7);
            PREFETCH_NEXT()
        }
    }
#undef PREFETCH_NEXT
}

/* Task `task` through the tiles: 32 weight columns (or 16 gate and their 16 up rows), packed (`amx_pack_weights`,
 * into `packed`, where `pack`; else packed there before), against rows r0..m-1 of x (r0 a multiple of 32) read as
 * they lie (x's bytes are qx + OFFSET, multiplied as unsigned where OFFSET is 128), one block of 16 rows a pass, or
 * two where the packed weights exceed AMX_PAIR_BYTES; each block's sums finished by `amx_finish_block`. */
static void amx_task(const uint8_t *xq, int64_t r0, int64_t m, int64_t k, const int8_t *w, int64_t w_stride,
                     int64_t n, const float *scale, const int32_t *row_sums, const float *xs, int glu_mode, int gelu,
                     int64_t task, const float *bias, void *y, const void *residual, int dtype, uint32_t *packed,
                     int pack, int64_t *configured) {
    const int64_t out_cols = glu_mode ? n / 2 : n, row_blocks = (m + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t per_pass = k * 32 > AMX_PAIR_BYTES ? 2 : 1;
    amx_columns c;
    amx_columns_of(task, glu_mode, gelu, n, scale, row_sums, bias, dtype, &c);
    const int64_t first = c.first, second = c.second;
    if (pack) amx_pack_weights(w, w_stride, k, first, second, packed);
    int32_t sums[2][2][16][16] __attribute__((aligned(64)));  /* [block][tile][row of x][weight row] */
    /* each pass's products are issued once the pass before has stored its sums and before that pass's epilogue:
     * the tiles multiply while the vectors finish the pass before (in program order the epilogue came first, and
     * the core's window of instructions did not reach past a block's epilogue to the next block's products) */
    int64_t rb = r0 / AMX_ROWS;
    int64_t rows = 0, rows2 = 0;
    if (rb < row_blocks)
        amx_issue(xq, rb, m, k, packed, per_pass, first, out_cols, y, residual, dtype, configured, &rows, &rows2);
    while (rb < row_blocks) {
        _tile_stored(0, sums[0][0], 64);
        _tile_stored(1, sums[0][1], 64);
        if (rows2) {
            _tile_stored(2, sums[1][0], 64);
            _tile_stored(3, sums[1][1], 64);
        }
        const int64_t done = rb, done_rows = rows, done_rows2 = rows2;
        rb += per_pass;
        if (rb < row_blocks)
            amx_issue(xq, rb, m, k, packed, per_pass, first, out_cols, y, residual, dtype, configured, &rows, &rows2);
        for (int b = 0; b < (done_rows2 ? 2 : 1); b++)
            amx_finish_block(sums[b], b ? done_rows2 : done_rows, (done + b) * AMX_ROWS, xs, glu_mode, &c, bias, dtype,
                             y, residual, out_cols);
    }
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
/* Fewer than AMX_INT8_MIN_ROWS rows of x (a decode step's) go through the tiles the other way round, as linear.c's
 * bfloat16 tiles do: the weights are the first operand, read as they lie (16 weight rows of 64 bytes, w_stride
 * apart, a tile), x the second, as quads of k, so that nothing of the weights is packed and the sums come out
 * [weight row][row of x], transposed back for the epilogue. The vector loop's sums take an instruction per 64
 * bytes of a weight row and row of x (two blocks of x and each weight read twice from the L1 past RX rows); the
 * tiles' take a few cycles per kilobyte of weights, whose reading is then what is left.
 *
 * x's quantized rows (xq, kp bytes apart) as the tiles' second operand, into the calling thread's own xt: for each
 * 64 bytes of k and each block of 16 rows, 16 rows of quads (row q: the rows' bytes 4q..4q+3, one word a row of x;
 * rows past m zero), [k / 64][blocks][16][16] words. Each thread lays out all of x for itself: where each wrote the
 * words of its own rows of x, the two threads wrote into the same lines (a decode product took 1.5x its time). */
static void few_x_quads(const uint8_t *xq, int64_t kp, int64_t m, int64_t k, uint32_t *xt) {
    const int64_t blocks = (m + AMX_ROWS - 1) / AMX_ROWS;
    for (int64_t step = 0; step < k / 64; step++)
        for (int64_t b = 0; b < blocks; b++) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = b * 16 + i < m ? _mm512_loadu_si512(xq + (b * 16 + i) * kp + step * 64) : _mm512_setzero_si512();
            transpose16(r);
            for (int q = 0; q < 16; q++) _mm512_store_si512(xt + ((step * blocks + b) * 16 + q) * 16, r[q]);
        }
}

/* Tiles 0-1: the first block's sums (16 weight rows x `rows` rows of x, int32), 2-3 the second's (`rows2` rows;
 * 0: none); 4-5: the two blocks' quads of x; 6-7: 16 weight rows of 64 bytes. */
static void amx_configure_few(int rows, int rows2) {
    const uint8_t r2 = rows2 ? 16 : 0;
    const uint16_t c = (uint16_t)(4 * rows), c2 = (uint16_t)(4 * rows2);
    const uint8_t tile_rows[8] = {16, 16, r2, r2, 16, r2, 16, 16};
    const uint16_t colsb[8] = {c, c, c2, c2, c, c2, 64, 64};
    amx_load_config(tile_rows, colsb);
}

/* Task `task` (amx_task's columns, `c`) against the m (< 2 * AMX_ROWS) rows of x as `few_x_quads` laid them out in
 * xt, issued into tiles 0-1 (2-3: the second block of x): every weight tile loaded once and multiplied by each block
 * of x, the next task's weights asked for meanwhile. `amx_few_store` stores the sums and `amx_few_finish` finishes
 * them; the caller finishes a task after issuing the next one's products, so that the tiles multiply while the
 * vectors transpose and finish the task before (as amx_task's passes). */
static inline void amx_few_issue(const uint32_t *xt, int64_t m, int64_t k, const int8_t *w, int64_t w_stride,
                                 int64_t n, int glu_mode, int64_t task, const amx_columns *c) {
    const int64_t out_cols = glu_mode ? n / 2 : n, blocks = (m + AMX_ROWS - 1) / AMX_ROWS;
    const int8_t *w1 = w + c->first * w_stride, *w2 = w + c->second * w_stride;
    /* the next task's weight rows over this task's steps (without, a decode step took 1.1x the time; the next
     * task's lines of each step alone, or each row's first line, 1.05x) */
    const int64_t tasks = glu_mode ? out_cols / 16 : n / 32;
    next_tiles ahead = next_tiles_of(w, w_stride, task + 1 < tasks ? task + 1 : -1, glu_mode, out_cols, k / 64);
    _tile_zero(0);
    _tile_zero(1);
    if (blocks > 1) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t step = 0; step < k / 64; step++) {
            _tile_loadd(6, w1 + step * 64, w_stride);
            _tile_loadd(7, w2 + step * 64, w_stride);
            _tile_loadd(4, xt + step * 2 * 256, 64);
            _tile_loadd(5, xt + (step * 2 + 1) * 256, 64);
            AMX_DP_WX(0, 6, 4);
            AMX_DP_WX(1, 7, 4);
            AMX_DP_WX(2, 6, 5);
            AMX_DP_WX(3, 7, 5);
            next_tiles_step(&ahead);
        }
    } else {
        for (int64_t step = 0; step < k / 64; step++) {
            _tile_loadd(6, w1 + step * 64, w_stride);
            _tile_loadd(7, w2 + step * 64, w_stride);
            _tile_loadd(4, xt + step * 256, 64);
            AMX_DP_WX(0, 6, 4);
            AMX_DP_WX(1, 7, 4);
            next_tiles_step(&ahead);
        }
    }
}

/* The issued task's sums, [block][tile][weight row][row of x]. */
static inline void amx_few_store(int64_t blocks, int32_t sums[2][2][16][16]) {
    _tile_stored(0, sums[0][0], 64);
    _tile_stored(1, sums[0][1], 64);
    if (blocks > 1) {
        _tile_stored(2, sums[1][0], 64);
        _tile_stored(3, sums[1][1], 64);
    }
}

/* A task's stored sums transposed to [row of x][weight row] and finished as amx_task's (`amx_finish_block`). */
static void amx_few_finish(const amx_columns *c, int32_t sums[2][2][16][16], int64_t m, const float *xs,
                           int glu_mode, const float *bias, int dtype, void *y, const void *residual,
                           int64_t out_cols) {
    for (int64_t b = 0; b < (m + AMX_ROWS - 1) / AMX_ROWS; b++) {
        for (int t = 0; t < 2; t++) {
            __m512i r[16];
            for (int q = 0; q < 16; q++) r[q] = _mm512_load_si512(sums[b][t][q]);
            transpose16(r);
            for (int q = 0; q < 16; q++) _mm512_store_si512(sums[b][t][q], r[q]);
        }
        amx_finish_block(sums[b], MIN(AMX_ROWS, m - b * AMX_ROWS), b * AMX_ROWS, xs, glu_mode, c, bias, dtype, y,
                         residual, out_cols);
    }
}

/* The calling thread's tasks (`next_task`) through amx_few_issue, _store and _finish, each task finished after the
 * next one's products are issued. */
static void amx_few_tasks(task_share *shares, const uint32_t *xt, int64_t m, int64_t k, const int8_t *w,
                          int64_t w_stride, int64_t n, const float *scale, const int32_t *row_sums, const float *xs,
                          int glu_mode, int gelu, const float *bias, void *y, const void *residual, int dtype) {
    const int64_t out_cols = glu_mode ? n / 2 : n, blocks = (m + AMX_ROWS - 1) / AMX_ROWS;
    amx_columns c[2];
    int32_t sums[2][2][2][16][16] __attribute__((aligned(64)));  /* [task in turn][block][tile][...] */
    int done = -1;  /* the stored task's slot, or -1 */
    for (int64_t task; (task = next_task(shares)) >= 0;) {
        const int slot = done == 0 ? 1 : 0;
        amx_columns_of(task, glu_mode, gelu, n, scale, row_sums, bias, dtype, &c[slot]);
        amx_few_issue(xt, m, k, w, w_stride, n, glu_mode, task, &c[slot]);
        if (done >= 0) amx_few_finish(&c[done], sums[done], m, xs, glu_mode, bias, dtype, y, residual, out_cols);
        amx_few_store(blocks, sums[slot]);
        done = slot;
    }
    if (done >= 0) amx_few_finish(&c[done], sums[done], m, xs, glu_mode, bias, dtype, y, residual, out_cols);
}
#endif

int linear_int8(const void *x, int io_dtype, int64_t m, int64_t k, const int8_t *w, int64_t w_stride, int64_t n,
                const float *scale, const int32_t *row_sums, const float *bias, int glu_mode, int gelu, void *y,
                const void *residual, int num_threads) {
    if (m <= 0) return 0;
    const int64_t out_cols = glu_mode ? n / 2 : n, kp = (k + KB - 1) / KB * KB;
    const int64_t blocks = glu_mode ? (out_cols + 1) / 2 : (n + RW - 1) / RW;
    const size_t x_bytes = ((size_t)(m * kp) + 63) / 64 * 64, scale_bytes = ((size_t)m * sizeof(float) + 63) / 64 * 64;
    int64_t block0 = 0;  /* the first block the vector path computes (past what the tiles did) */
    size_t row_bytes = (size_t)k * sizeof(float);  /* each thread's: a row of x in floats, or a task's packing */
    size_t packed_bytes = 0;  /* every AMX task's packed weights, where x goes in passes */
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
    int64_t amx_tasks = 0, pass_rows = m;
    int few = 0;  /* fewer than AMX_INT8_MIN_ROWS rows: amx_few_tasks', x laid out by few_x_quads in `row` */
    if (k % 64 == 0 && m >= AMX_INT8_FEW_ROWS && amx_permitted()) {
        const int64_t amx_cols = glu_mode ? out_cols / 16 * 16 : n / 32 * 32;
        amx_tasks = glu_mode ? amx_cols / 16 : amx_cols / 32;
        block0 = glu_mode ? amx_cols / 2 : amx_cols / RW;
        few = amx_tasks > 0 && m < AMX_INT8_MIN_ROWS;
    }
    if (few) row_bytes = MAX(row_bytes, (size_t)(k / 64) * (size_t)((m + AMX_ROWS - 1) / AMX_ROWS) * 1024);
    /* own: the tiles take every column (no vector blocks), so each thread quantizes all of x for itself (its own
     * copy after the quads' room, then its scales), and no thread waits for another's rows */
    const int own = few && (glu_mode ? out_cols / 16 * 16 : n / 32 * 32) == (glu_mode ? out_cols : n);
    const size_t own_x = ((size_t)(m * kp) + 63) / 64 * 64;
    if (own) row_bytes = (row_bytes + 63) / 64 * 64 + own_x + scale_bytes;
    else if (amx_tasks) {
        row_bytes = (size_t)k * 32;  /* amx_pack_weights' */
        const int64_t passes = (m * k + AMX_PASS_BYTES - 1) / AMX_PASS_BYTES;
        if (passes > 1 && (size_t)amx_tasks * row_bytes <= AMX_PACKED_MAX) {  /* passes of equal rows, whole pairs */
            const int64_t pair = 2 * AMX_ROWS;
            pass_rows = MAX(AMX_PASS_ROWS, ((m + passes - 1) / passes + pair - 1) / pair * pair);
            packed_bytes = (size_t)amx_tasks * row_bytes;
        }
    }
#endif
    uint8_t *xq = thread_scratch(x_bytes + scale_bytes + packed_bytes);
    if (!xq) return 2;
    float *xs = (float *)(xq + x_bytes);
    int failed = 0;
    const int64_t tasks = (blocks - block0 + NB - 1) / NB;
    const int64_t ahead = blocks_ahead(k);  /* a row is k bytes */
    /* rows of x per pass over the weights: as many as keep a pass's x in the L2 cache (X_BYTES), at most MCI */
    const int64_t chunk_rows = MIN(MCI, MAX(RX, X_BYTES / kp / RX * RX));
    task_share shares[num_threads];
    const int team = m * n * k >= 65536 ? num_threads : 1;
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
    if (own) deal(shares, team, amx_tasks);  /* each thread's share before any thread steals from it */
#endif
#pragma omp parallel num_threads(num_threads) if (team > 1)
    {
        float *row = thread_scratch_at(1, row_bytes);
        if (!row) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
        const int by_pass = amx_tasks > 0 && !few;  /* x quantized a pass of rows at a time, just before it is used */
        uint8_t *own_xq = own && row ? (uint8_t *)row + (row_bytes - own_x - scale_bytes) : NULL;
        float *own_xs = own_xq ? (float *)(own_xq + own_x) : NULL;
        if (own && team_size() != team) deal_team(shares, amx_tasks);
        if (own_xq)
            for (int64_t i = 0; i < m; i++)
                own_xs[i] = quantize_x(x, io_dtype, i, k, kp, i + 2 < m, row, own_xq + i * kp);
#else
        const int by_pass = 0, few = 0, own = 0;
        uint8_t *own_xq = NULL;
        float *own_xs = NULL;
#endif
        if (!by_pass && !own) {
            /* the first chunk's tasks (few: the tiles'): the quantizing loop's barrier is deal's */
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
            if (few) deal_own(shares, amx_tasks);
            else
#endif
            if (tasks > 0) deal_own(shares, tasks);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++)
                if (row) xs[i] = quantize_x(x, io_dtype, i, k, kp, i + 2 < m, row, xq + i * kp);
        }
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
        if (few) {
            uint32_t *xt = (uint32_t *)row;  /* the thread's own quads of x (the quantizing's row is done with) */
            if (xt) few_x_quads(own ? own_xq : xq, kp, m, k, xt);
            const int64_t rows2 = m > AMX_ROWS ? m - AMX_ROWS : 0;
            amx_configure_few((int)MIN(AMX_ROWS, m), (int)rows2);
            if (!__atomic_load_n(&failed, __ATOMIC_RELAXED))
                amx_few_tasks(shares, xt, m, k, w, w_stride, n, scale, row_sums, own ? own_xs : xs, glu_mode, gelu,
                              bias, y, residual, io_dtype);
            _tile_release();
            if (tasks > 0) {  /* the vector blocks' deal below reuses the shares */
#pragma omp barrier
            }
        } else if (amx_tasks) {
            int64_t configured = -1;  /* the tiles' configuration (amx_task's key; other code may reconfigure them) */
            uint32_t *packed = (uint32_t *)(xq + x_bytes + scale_bytes);
            const int64_t task_words = (int64_t)row_bytes / 4;
            if (packed_bytes) {  /* every task's weights packed once, then each pass of rows against them all */
                deal_team(shares, amx_tasks);
                for (int64_t task; (task = next_task(shares)) >= 0;) {
                    const int64_t first = glu_mode ? 16 * task : 32 * task;
                    amx_pack_weights(w, w_stride, k, first, glu_mode ? out_cols + first : first + 16,
                                     packed + task * task_words);
                }
            }
            for (int64_t r0 = 0; r0 < m; r0 += pass_rows) {
                /* the pass's rows quantized as it starts, so that they are in the caches when its tasks read them
                 * (the loop's closing barrier: every thread's tasks of the last pass done before the next deal) */
#pragma omp for schedule(static)
                for (int64_t i = r0; i < MIN(m, r0 + pass_rows); i++)
                    if (row) xs[i] = quantize_x(x, io_dtype, i, k, kp, i + 2 < m, row, xq + i * kp);
                if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) continue;
                deal_team(shares, amx_tasks);
                for (int64_t task; (task = next_task(shares)) >= 0;)
                    amx_task(xq, r0, MIN(m, r0 + pass_rows), k, w, w_stride, n, scale, row_sums, xs, glu_mode, gelu,
                             task, bias, y, residual, io_dtype,
                             packed_bytes ? packed + task * task_words : (uint32_t *)row, !packed_bytes, &configured);
            }
            _tile_release();
#pragma omp barrier
        }
#endif
        if (tasks > 0 && !__atomic_load_n(&failed, __ATOMIC_RELAXED))
            for (int64_t i0 = 0; i0 < m; i0 += chunk_rows) {
                const int64_t chunk = MIN(chunk_rows, m - i0), per_block = rows_per_block(chunk, RX);
                int64_t rows_of[(NB + MAX_AHEAD) * RW];  /* a task's (take_task) */
                if (by_pass || few || i0 > 0) deal_team(shares, tasks);
                for (task_blocks t; take_task(shares, block0, blocks, glu_mode, n, out_cols, ahead, rows_of, &t);) {
                    const int8_t *wr[NB + MAX_AHEAD][RW];
                    for (int64_t b = 0; b < t.count + ahead; b++)
                        for (int c = 0; c < RW; c++) wr[b][c] = w + rows_of[b * RW + c] * w_stride;
                    int32_t sums[MCI * NB * RW];
                    for (int64_t b = 0; b < t.count; b++)
                        for (int64_t i = i0; i < i0 + chunk; i += per_block) {
                            const int rows = (int)MIN(per_block, i0 + chunk - i);
                            /* later rows find the block in the cache: its first pass prefetches `ahead` on */
                            const void *const *next = (const void *const *)(i == i0 ? wr[b + ahead] : wr[b]);
                            int32_t *out = sums + (i - i0) * NB * RW + b * RW;
#ifdef DOT
                            BLOCK_FNS[rows - 1](xq + i * kp, kp, k, wr[b], next, out, NB * RW);
#else
                            (void)next;
                            block_plain(xq + i * kp, kp, k, wr[b], rows, out, NB * RW);
#endif
                        }
#ifdef __AVX512F__
                    /* a whole task: 32 consecutive columns, or 16 gate columns and their 16 up, in vectors */
                    if (io_dtype != F16 && t.cols == (glu_mode ? 2 : RW) * NB) {
                        const columns32 c = columns32_of(scale, row_sums, bias, t.first_col,
                                                         glu_mode ? out_cols + t.first_col : t.first_col + 16, gelu);
                        const int64_t item = io_dtype == F32 ? 4 : 2;
                        const int64_t at = (i0 * out_cols + t.first_col) * item;
                        char *out = (char *)y + at;
                        const char *res = residual ? (const char *)residual + at : NULL;
                        if (glu_mode) {
                            /* block b's sums are gate 2b, 2b + 1, up 2b, 2b + 1 */
                            const __m512i gates = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                                                                    28, 29);
                            const __m512i order[2] = {gates, _mm512_add_epi32(gates, _mm512_set1_epi32(2))};
                            finish16_glu_rows(&c, sums, sums + 16, NB * RW, order, xs + i0, chunk, glu_mode, io_dtype,
                                              out, res, out_cols * item);
                        } else {
                            finish32_rows(&c, sums, sums + 16, NB * RW, xs + i0, chunk, io_dtype, out, res,
                                          out_cols * item);
                        }
                        continue;
                    }
#endif
                    float scale_of[NB * RW];  /* finish_sums' (the vector epilogue loads its columns' own) */
                    int32_t offset_of[NB * RW];
                    task_scales(rows_of, t.count, scale, row_sums, OFFSET, scale_of, offset_of);
                    for (int64_t s = 0; s < chunk; s++)
                        finish_sums(sums + s * NB * RW, scale_of, offset_of, t.count, rows_of, xs[i0 + s], glu_mode,
                                    gelu, bias, io_dtype, y, residual, i0 + s, out_cols, t.first_col, t.cols);
                }
                if (i0 + chunk_rows < m) {  /* the next chunk's deal waits for this one's tasks (the last's: the end) */
#pragma omp barrier
                }
            }
    }
    return failed ? 2 : 0;
}
