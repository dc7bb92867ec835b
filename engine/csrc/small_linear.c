/* y = x W^T (+ bias) for a few rows of x, for the CPU (engine/cpu_kernel.py builds and calls it).
 *
 * A decode step multiplies a handful of rows by every weight matrix of the model, so its cost is reading the
 * weights once: a general GEMM (MKL, oneDNN) packs the weights first and, on CPUs it was not tuned for or in
 * bfloat16 without hardware support, reaches a fraction of the memory's bandwidth. Here each weight row is
 * read once, straight from where the model holds it (float32, bfloat16 or float16, converted in registers),
 * and multiplied by every row of x, which stays in the cache; threads take disjoint runs of weight rows.
 * Three weight rows and four rows of x at a time: each load feeds three or four multiply-adds.
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"

#define TILE 3

#ifdef VECTOR
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef VECTOR
/* 8 weights from `w` (element t of a row) as float32: bfloat16 widened in registers, float32 loaded. */
static inline __m256 load8(const void *w, int dtype, int64_t t) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + t))), 16));
    return _mm256_loadu_ps((const float *)w + t);
}

/* Weight rows j0..j0+TILE-1 (w: the first of them, in `dtype`; bfloat16 or float32) against rows i..i+3 of x.
 * Twelve running sums stay in registers (locals, not the output array), so each load feeds three or four
 * multiply-adds; `dtype` is a constant at each call, so the widening is chosen once, not per load. */
static inline __attribute__((always_inline)) void block4(const float *x, int64_t i, int64_t k, const void *w,
                                                         const int dtype, __m256 out[4][TILE]) {
    const float *x0 = x + i * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
    __m256 s00 = _mm256_setzero_ps(), s01 = s00, s02 = s00, s10 = s00, s11 = s00, s12 = s00;
    __m256 s20 = s00, s21 = s00, s22 = s00, s30 = s00, s31 = s00, s32 = s00;
    for (int64_t t = 0; t + 8 <= k; t += 8) {
        const __m256 w0 = load8(w, dtype, t), w1 = load8(w, dtype, k + t), w2 = load8(w, dtype, 2 * k + t);
        __m256 xv = _mm256_loadu_ps(x0 + t);
        s00 = _mm256_fmadd_ps(xv, w0, s00), s01 = _mm256_fmadd_ps(xv, w1, s01), s02 = _mm256_fmadd_ps(xv, w2, s02);
        xv = _mm256_loadu_ps(x1 + t);
        s10 = _mm256_fmadd_ps(xv, w0, s10), s11 = _mm256_fmadd_ps(xv, w1, s11), s12 = _mm256_fmadd_ps(xv, w2, s12);
        xv = _mm256_loadu_ps(x2 + t);
        s20 = _mm256_fmadd_ps(xv, w0, s20), s21 = _mm256_fmadd_ps(xv, w1, s21), s22 = _mm256_fmadd_ps(xv, w2, s22);
        xv = _mm256_loadu_ps(x3 + t);
        s30 = _mm256_fmadd_ps(xv, w0, s30), s31 = _mm256_fmadd_ps(xv, w1, s31), s32 = _mm256_fmadd_ps(xv, w2, s32);
    }
    out[0][0] = s00, out[0][1] = s01, out[0][2] = s02, out[1][0] = s10, out[1][1] = s11, out[1][2] = s12;
    out[2][0] = s20, out[2][1] = s21, out[2][2] = s22, out[3][0] = s30, out[3][1] = s31, out[3][2] = s32;
}
#endif

/* y[:, j0:j0+rows] for all m rows of x. Four rows of x at a time read the weights where they are stored when
 * the tile is whole (TILE rows of whole 8-wide vectors, float32 or bfloat16); anything else reads them from
 * `rows_f32` (TILE * k floats), converted once, as do the rows of x left over. */
static inline void tile(const float *x, int64_t m, int64_t k, const void *w, int dtype, int64_t rows, float *y,
                        int64_t n, int64_t j0, const float *bias, float *rows_f32) {
    int64_t i = 0;
    int converted = 0;
#ifdef VECTOR
    const int direct = rows == TILE && k % 8 == 0 && dtype != F16;
    if (!direct && m >= 4) {
        load_floats(w, dtype, j0 * k, rows * k, rows_f32);
        for (int64_t r = rows; r < TILE; r++) memset(rows_f32 + r * k, 0, (size_t)k * sizeof(float));
        converted = 1;
    }
    const int64_t whole = k / 8 * 8;
    const void *wj = dtype == BF16 ? (const void *)((const uint16_t *)w + j0 * k) : (const void *)((const float *)w + j0 * k);
    for (; i + 4 <= m; i += 4) {
        __m256 s[4][TILE];
        if (direct && dtype == BF16) block4(x, i, k, wj, BF16, s);
        else if (direct) block4(x, i, k, wj, F32, s);
        else block4(x, i, k, rows_f32, F32, s);
        for (int a = 0; a < 4; a++) {
            const float *xa = x + (i + a) * k;
            for (int64_t r = 0; r < rows; r++) {
                float sum = hsum(s[a][r]);
                for (int64_t u = whole; u < k; u++) sum += xa[u] * rows_f32[r * k + u];
                y[(i + a) * n + j0 + r] = sum + (bias ? bias[j0 + r] : 0.0f);
            }
        }
    }
#endif
    if (i < m && !converted) load_floats(w, dtype, j0 * k, rows * k, rows_f32);
    for (; i < m; i++) {  /* the rows left over, one at a time */
        const float *xi = x + i * k;
        for (int64_t r = 0; r < rows; r++) {
            float sum = 0.0f;
            for (int64_t u = 0; u < k; u++) sum += xi[u] * rows_f32[r * k + u];
            y[i * n + j0 + r] = sum + (bias ? bias[j0 + r] : 0.0f);
        }
    }
}

/* x [m, k] and y [m, n] in `io_dtype`, w [n, k] in `dtype`; bias (n floats) or NULL. */
int small_linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int dtype, int64_t n,
                 const float *bias, void *y, int num_threads) {
    float *xf = malloc((size_t)(m * k) * sizeof(float));
    float *yf = io_dtype == F32 ? (float *)y : malloc((size_t)(m * n) * sizeof(float));
    float *scratch = malloc((size_t)(num_threads * TILE * k) * sizeof(float));
    if (!xf || !yf || !scratch) {
        free(xf), free(scratch);
        if (yf != y) free(yf);
        return 2;
    }
    load_floats(x, io_dtype, 0, m * k, xf);
    const int64_t item = dtype == F32 ? 4 : 2;  /* bytes of one weight */
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        float *rows = scratch + (int64_t)omp_get_thread_num() * TILE * k;
#else
        float *rows = scratch;
#endif
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j += TILE) {
            if (j + 2 * TILE <= n) {  /* the tile after next, on its way from memory while these are used */
                const char *ahead = (const char *)w + (j + TILE) * k * item;
                for (int64_t b = 0; b < TILE * k * item; b += 64) __builtin_prefetch(ahead + b);
            }
            tile(xf, m, k, w, dtype, n - j < TILE ? n - j : TILE, yf, n, j, bias, rows);
        }
    }
    if (io_dtype != F32) {
        store_floats(yf, m * n, y, io_dtype, 0);
        free(yf);
    }
    free(xf);
    free(scratch);
    return 0;
}
