/* y = x W^T (+ bias) on the CPU, reading W [n, k] where transformers keeps it: row-major, in its own dtype, no
 * packed copy (engine/cpu_kernel.py calls it; engine/lean_layers.py fuses q/k/v and gate/up into one matrix of
 * views, so one call computes them all).
 *
 * A decode step multiplies a few rows of x by every weight of the model: its cost is reading the weights once.
 * Four weight rows at a time stream through registers against up to six rows of x (their chunks come from the
 * L1 cache), 24 float32 sums kept in named vector registers: each weight is loaded once per six rows of x, each
 * chunk of x once per four weight rows. The reduction runs along k, so every sum is a vector that is reduced
 * once, at the end of the row. What the build targets decides the inner loop (engine/cpu_kernel.py compiles one
 * library per instruction set and picks the best the CPU has):
 *   - AVX-512 BF16 (`vdpbf16ps`): bfloat16 x against bfloat16 weights, 32 products per instruction;
 *   - AVX-512F: 16 lanes, weights widened from bfloat16/float16 in registers;
 *   - AVX2 + FMA: 8 lanes, likewise;
 *   - anything else: plain C.
 * `glu` mode computes act(x W_g^T) * (x W_u^T) for W = [W_g; W_u] (n = 2 * half), SiLU, rounded to the output
 * dtype between operators as torch rounds them, so a Llama MLP's gate and up projections are one pass.
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"

#define RW 4   /* weight rows per block */
#define RX 6   /* rows of x per block */
#define MC 48  /* rows of x per pass over the weights */

#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline __attribute__((always_inline)) vf vload(const void *p, int dtype, int64_t at) {
    if (dtype == BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at))), 16));
    if (dtype == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
    return _mm512_loadu_ps((const float *)p + at);
}
#elif defined(VECTOR)
typedef __m256 vf;
#define VW 8
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline __attribute__((always_inline)) vf vload(const void *p, int dtype, int64_t at) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at))), 16));
#ifdef __F16C__
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
#endif
    return _mm256_loadu_ps((const float *)p + at);
}
#endif

/* One weight value as float32. */
static inline float wvalue(const void *w, int dtype, int64_t at) {
    float v;
    load_floats(w, dtype, at, 1, &v);
    return v;
}

/* sums[r * RX + i] = dot(W row w[r], x row i) for r < RW, i < rows: the scalar tail of k (from `from`) added to
 * what the vector loop left. */
static void tail(const float *x, int64_t k, int64_t from, const void *const w[RW], int dtype, int rows,
                 float *sums) {
    for (int r = 0; r < RW; r++)
        for (int i = 0; i < rows; i++)
            for (int64_t t = from; t < k; t++) sums[r * RX + i] += wvalue(w[r], dtype, t) * x[i * k + t];
}

#ifdef VW
#define A(r, i) a##r##i
#define DECL(r) vf A(r, 0) = vzero(), A(r, 1) = A(r, 0), A(r, 2) = A(r, 0), A(r, 3) = A(r, 0), A(r, 4) = A(r, 0), \
                   A(r, 5) = A(r, 0);
#define FMA_ROW(i) \
    if (rows > i) { \
        const vf xv = _mm_loadx(x + i * k + t); \
        A(0, i) = vfma(w0, xv, A(0, i)), A(1, i) = vfma(w1, xv, A(1, i)); \
        A(2, i) = vfma(w2, xv, A(2, i)), A(3, i) = vfma(w3, xv, A(3, i)); \
    }
#define SUM_ROW(i) \
    if (rows > i) sums[0 * RX + i] = vsum(A(0, i)), sums[1 * RX + i] = vsum(A(1, i)), \
                  sums[2 * RX + i] = vsum(A(2, i)), sums[3 * RX + i] = vsum(A(3, i));
#if VW == 16
#define _mm_loadx(p) _mm512_loadu_ps(p)
#else
#define _mm_loadx(p) _mm256_loadu_ps(p)
#endif
/* Float32 x (rows 0..R-1, each k long) against weight rows w[0..3] of dtype D: one function per D and R. */
#define BLOCK(D, R) \
    static void block_##D##_##R(const float *x, int64_t k, const void *const w[RW], float *sums) { \
        const int rows = R; \
        DECL(0) DECL(1) DECL(2) DECL(3) \
        const void *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3]; \
        int64_t t = 0; \
        for (; t + VW <= k; t += VW) { \
            const vf w0 = vload(p0, D, t), w1 = vload(p1, D, t), w2 = vload(p2, D, t), w3 = vload(p3, D, t); \
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5) \
        } \
        SUM_ROW(0) SUM_ROW(1) SUM_ROW(2) SUM_ROW(3) SUM_ROW(4) SUM_ROW(5) \
        tail(x, k, t, w, D, rows, sums); \
    }
#define BLOCKS(D) BLOCK(D, 1) BLOCK(D, 2) BLOCK(D, 3) BLOCK(D, 4) BLOCK(D, 5) BLOCK(D, 6)
BLOCKS(F32)
BLOCKS(BF16)
BLOCKS(F16)
typedef void (*block_fn)(const float *, int64_t, const void *const[RW], float *);
static const block_fn BLOCK_FNS[3][RX] = {
    {block_F32_1, block_F32_2, block_F32_3, block_F32_4, block_F32_5, block_F32_6},
    {block_BF16_1, block_BF16_2, block_BF16_3, block_BF16_4, block_BF16_5, block_BF16_6},
    {block_F16_1, block_F16_2, block_F16_3, block_F16_4, block_F16_5, block_F16_6},
};
#endif

#ifdef __AVX512BF16__
/* bfloat16 x rows (k long) against bfloat16 weight rows: pairs of products summed in float32 by vdpbf16ps. */
#define DP_ROW(i) \
    if (rows > i) { \
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + i * k + t); \
        A(0, i) = _mm512_dpbf16_ps(A(0, i), w0, xv), A(1, i) = _mm512_dpbf16_ps(A(1, i), w1, xv); \
        A(2, i) = _mm512_dpbf16_ps(A(2, i), w2, xv), A(3, i) = _mm512_dpbf16_ps(A(3, i), w3, xv); \
    }
#define DP_BLOCK(R) \
    static void dp_block_##R(const uint16_t *xb, int64_t k, const void *const w[RW], float *sums) { \
        const int rows = R; \
        DECL(0) DECL(1) DECL(2) DECL(3) \
        const uint16_t *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3]; \
        for (int64_t t = 0; t < k; t += 32) { \
            const __mmask32 mask = k - t >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - t)) - 1u); \
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p0 + t); \
            const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p1 + t); \
            const __m512bh w2 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p2 + t); \
            const __m512bh w3 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p3 + t); \
            DP_ROW(0) DP_ROW(1) DP_ROW(2) DP_ROW(3) DP_ROW(4) DP_ROW(5) \
        } \
        SUM_ROW(0) SUM_ROW(1) SUM_ROW(2) SUM_ROW(3) SUM_ROW(4) SUM_ROW(5) \
    }
DP_BLOCK(1) DP_BLOCK(2) DP_BLOCK(3) DP_BLOCK(4) DP_BLOCK(5) DP_BLOCK(6)
typedef void (*dp_fn)(const uint16_t *, int64_t, const void *const[RW], float *);
static const dp_fn DP_FNS[RX] = {dp_block_1, dp_block_2, dp_block_3, dp_block_4, dp_block_5, dp_block_6};
#endif

/* The instruction set this build's inner loop uses (engine/cpu_kernel.py reports it). */
const char *linear_isa(void) {
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(VECTOR)
    return "avx2";
#else
    return "generic";
#endif
}

/* A growable buffer per calling thread, kept across calls: no allocation per step. */
static void *scratch(size_t bytes) {
    static __thread void *buffer = NULL;
    static __thread size_t held = 0;
    if (bytes > held) {
        free(buffer);
        buffer = malloc(bytes);
        held = buffer ? bytes : 0;
    }
    return buffer;
}

static inline float rounded(float v, int dtype) {
    if (dtype == F32) return v;
    uint16_t half;
    float back;
    store_floats(&v, 1, &half, dtype, 0);
    load_floats(&half, dtype, 0, 1, &back);
    return back;
}

/* SiLU(g) * u as torch computes `act(gate) * up` in `dtype`: each operator's result rounded to it. */
static inline float glu(float g, float u, int dtype) {
    g = rounded(g, dtype);
    const float act = rounded(g / (1.0f + expf(-g)), dtype);
    return rounded(act * rounded(u, dtype), dtype);
}

/* x [m, k] in io_dtype, w [n, k] in w_dtype (rows `w_stride` elements apart), bias n floats or NULL; y [m, n]
 * (or [m, n / 2] with `glu`) in io_dtype. Returns 2 where memory runs out. */
int linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int w_dtype, int64_t w_stride,
           int64_t n, const float *bias, int glu_mode, void *y, int num_threads) {
    const int64_t item = w_dtype == F32 ? 4 : 2, out_cols = glu_mode ? n / 2 : n;
    const int64_t blocks = glu_mode ? (out_cols + 1) / 2 : (n + RW - 1) / RW;
#ifdef __AVX512BF16__
    const int dot = io_dtype == BF16 && w_dtype == BF16;
#else
    const int dot = 0;
#endif
    const float *xf = (const float *)x;
    if (!dot && io_dtype != F32) {
        float *converted = scratch((size_t)(m * k) * sizeof(float));
        if (!converted) return 2;
        load_floats(x, io_dtype, 0, m * k, converted);
        xf = converted;
    }
    /* A block's weight rows: four consecutive ones, or two of the gate's and the same two of the up's; a row
     * past the end repeats the last real one (its sums are not stored). */
#pragma omp parallel num_threads(num_threads) if (m * n * k >= 65536)
    for (int64_t i0 = 0; i0 < m; i0 += MC) {
        const int64_t chunk = MIN(MC, m - i0);
#pragma omp for schedule(dynamic, 8)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t rows_of[RW];
            if (glu_mode) {
                const int64_t j = 2 * b, j1 = MIN(j + 1, out_cols - 1);
                rows_of[0] = j, rows_of[1] = j1, rows_of[2] = out_cols + j, rows_of[3] = out_cols + j1;
            } else {
                for (int r = 0; r < RW; r++) rows_of[r] = MIN(RW * b + r, n - 1);
            }
            const void *wr[RW];
            for (int r = 0; r < RW; r++) wr[r] = (const char *)w + rows_of[r] * w_stride * item;
            for (int64_t i = i0; i < i0 + chunk; i += RX) {
                const int rows = (int)MIN(RX, i0 + chunk - i);
                float sums[RW * RX] = {0};
#ifdef __AVX512BF16__
                if (dot) DP_FNS[rows - 1]((const uint16_t *)x + i * k, k, wr, sums);
                else
#endif
#ifdef VW
                    BLOCK_FNS[w_dtype][rows - 1](xf + i * k, k, wr, sums);
#else
                    tail(xf + i * k, k, 0, wr, w_dtype, rows, sums);
#endif
                for (int r = 0; r < RW; r++)
                    if (bias)
                        for (int s = 0; s < rows; s++) sums[r * RX + s] += bias[rows_of[r]];
                for (int s = 0; s < rows; s++) {
                    float out[RW];
                    int count = 0;
                    int64_t first;
                    if (glu_mode) {
                        first = 2 * b;
                        count = (int)MIN(2, out_cols - first);
                        for (int c = 0; c < count; c++) out[c] = glu(sums[c * RX + s], sums[(c + 2) * RX + s], io_dtype);
                    } else {
                        first = RW * b;
                        count = (int)MIN(RW, n - first);
                        for (int c = 0; c < count; c++) out[c] = sums[c * RX + s];
                    }
                    store_floats(out, count, y, io_dtype, (i + s) * out_cols + first);
                }
            }
        }
    }
    return 0;
}
