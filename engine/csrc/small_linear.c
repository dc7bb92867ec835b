/* y = x W^T (+ bias) on the CPU, from weights packed once into panels (engine/cpu_kernel.py packs and calls).
 *
 * A decode step multiplies a handful of rows by every weight matrix of the model; a vision tower, a thousand
 * rows by a few small ones. torch's general GEMMs here reach a fraction of the memory's bandwidth for the first
 * and, in bfloat16 without hardware support, a fraction of the arithmetic for the second. This kernel reads the
 * weights in their own dtype (float32, bfloat16 or float16, widened in registers) from a layout made for it:
 *
 *   panels[p][t][c] = W[16 p + c][t]   (n rounded up to 16 with zero rows; [ceil(n / 16), k, 16])
 *
 * so that one step t of the reduction is 16 consecutive weights: two vector loads that feed up to six rows of x
 * (each broadcast once), twelve multiply-adds with every sum in a register. A thread streams its run of panels
 * front to back, which is what the hardware prefetcher follows best; rows of x come in blocks that stay in the
 * cache while every panel passes by.
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"

#define NR 16  /* weight rows (output columns) in a panel */
#define MR 6   /* rows of x in one block of sums */
#define MC 48  /* rows of x per pass over the weights: 48 x k floats stay in the L2 cache */

#ifdef VECTOR
/* 8 consecutive weights of a panel as float32. `dtype` is a constant at each inlined call site. */
static inline __attribute__((always_inline)) __m256 widen8(const void *p, int dtype, int64_t at) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at))), 16));
#ifdef __F16C__
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
#endif
    return _mm256_loadu_ps((const float *)p + at);
}

/* Sums for R rows of x against one panel into out[r * 16 + c]; one function per dtype and R (1..MR). The sums
 * are named variables, not an array: GCC keeps an array of vectors on the stack, storing it every step. */
#define ROW(r)                                                                                               \
    if (rows > r) {                                                                                          \
        const __m256 xv = _mm256_broadcast_ss(x + r * k + t);                                                \
        a##r = _mm256_fmadd_ps(xv, w0, a##r), b##r = _mm256_fmadd_ps(xv, w1, b##r);                          \
    }
#define OUT(r) \
    if (rows > r) _mm256_storeu_ps(out + r * NR, a##r), _mm256_storeu_ps(out + r * NR + 8, b##r);
#define BLOCK(D, R)                                                                                          \
    static void block_##D##_##R(const float *x, int64_t k, const void *panel, float *out) {                 \
        const int rows = R;                                                                                  \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;                       \
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;                                         \
        for (int64_t t = 0; t < k; t++) {                                                                    \
            const __m256 w0 = widen8(panel, D, t * NR), w1 = widen8(panel, D, t * NR + 8);                   \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)                                                        \
        }                                                                                                    \
        OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)                                                            \
    }
#define BLOCKS(D) BLOCK(D, 1) BLOCK(D, 2) BLOCK(D, 3) BLOCK(D, 4) BLOCK(D, 5) BLOCK(D, 6)
BLOCKS(F32)
BLOCKS(BF16)
BLOCKS(F16)

/* One panel against `rows` (1..MR) rows of x. */
static void panel_rows(const float *x, int64_t k, const void *panel, int dtype, int rows, float *out) {
#define ROWS(D)                                                                                              \
    static void (*const D##_blocks[MR])(const float *, int64_t, const void *, float *) = {                   \
        block_##D##_1, block_##D##_2, block_##D##_3, block_##D##_4, block_##D##_5, block_##D##_6};
    ROWS(F32)
    ROWS(BF16)
    ROWS(F16)
#undef ROWS
    (dtype == BF16 ? BF16_blocks : dtype == F16 ? F16_blocks : F32_blocks)[rows - 1](x, k, panel, out);
}
#endif

/* y[i, j0 + c] for c < cols (<= 16) from 16 float32 sums `v`, plus the bias, in `io_dtype`. */
static inline void store_row(const float *v, int64_t cols, const float *bias, int64_t j0, void *y, int io_dtype,
                             int64_t at) {
    float sums[NR];
    for (int64_t c = 0; c < cols; c++) sums[c] = v[c] + (bias ? bias[j0 + c] : 0.0f);
    store_floats(sums, cols, y, io_dtype, at);
}

/* The bytes of one packed weight. */
static inline int64_t item_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* panels (see the top) from w [n, k] in `dtype`: one pass, the caller's buffer of ceil(n / 16) * k * 16. */
void pack_panels(const void *w, int dtype, int64_t n, int64_t k, void *panels) {
    const int64_t item = item_size(dtype), count = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++) {
        char *out = (char *)panels + p * k * NR * item;
        for (int64_t c = 0; c < NR; c++) {
            const int64_t j = p * NR + c;
            const char *row = (const char *)w + j * k * item;
            for (int64_t t = 0; t < k; t++) {
                char *dst = out + (t * NR + c) * item;
                if (j < n) memcpy(dst, row + t * item, (size_t)item);
                else memset(dst, 0, (size_t)item);
            }
        }
    }
}

/* A growable buffer per calling thread (the engine's, a test's), kept across calls: no allocation per step. */
static float *scratch(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t held = 0;
    if (floats > held) {
        free(buffer);
        buffer = malloc((size_t)floats * sizeof(float));
        held = buffer ? floats : 0;
    }
    return buffer;
}

/* x [m, k] and y [m, n] in `io_dtype`; panels of w [n, k] in `dtype`; bias (n floats) or NULL. */
int small_linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *panels, int dtype, int64_t n,
                 const float *bias, void *y, int num_threads) {
    const float *xf = (const float *)x;
    if (io_dtype != F32) {
        float *converted = scratch(m * k);
        if (!converted) return 2;
        load_floats(x, io_dtype, 0, m * k, converted);
        xf = converted;
    }
    const int64_t count = (n + NR - 1) / NR, item = item_size(dtype);
#pragma omp parallel num_threads(num_threads)
    for (int64_t i0 = 0; i0 < m; i0 += MC) {
        const int64_t chunk = MIN(MC, m - i0);
#pragma omp for schedule(dynamic, 4)  /* a thread that loses its core to another process leaves its work */
        for (int64_t p = 0; p < count; p++) {
            const char *panel = (const char *)panels + p * k * NR * item;
            const int64_t j0 = p * NR, cols = MIN(NR, n - j0);
            for (int64_t i = i0; i < i0 + chunk; i += MR) {
                const int rows = (int)MIN(MR, i0 + chunk - i);
#ifdef VECTOR
                float sums[MR * NR];
                panel_rows(xf + i * k, k, panel, dtype, rows, sums);
                for (int r = 0; r < rows; r++) store_row(sums + r * NR, cols, bias, j0, y, io_dtype, (i + r) * n + j0);
#else
                for (int r = 0; r < rows; r++) {
                    float v[NR] = {0};
                    for (int64_t t = 0; t < k; t++) {
                        const float xv = xf[(i + r) * k + t];
                        float w[NR];
                        load_floats(panel, dtype, t * NR, NR, w);
                        for (int c = 0; c < NR; c++) v[c] += xv * w[c];
                    }
                    store_row(v, cols, bias, j0, y, io_dtype, (i + r) * n + j0);
                }
#endif
            }
        }
    }
    return 0;
}
