/* RMSNorm as transformers' decoder layers compute it, in one call (engine/cpu/ops.py calls it).
 *
 * transformers' RMSNorm runs some seven small operators on a decode step's few rows (widen, square, mean, add,
 * rsqrt, multiply, narrow, then the weight); on a small CPU each costs more in dispatch than in work, and a model
 * calls it two to four times a layer. Same arithmetic here, in float32, scale = 1 / sqrt(mean(x^2) + eps), then by
 * the norm's `flavor` (kernels.h's `norm_weights`):
 *   - NORM_LLAMA (Llama, Qwen2, Mistral): x * scale rounded to the input's dtype, times the weight, rounded again
 *     (what `weight * h.to(dtype)` does in torch);
 *   - NORM_GEMMA (Gemma 3): x * scale * w rounded once, w the float32 `1 + weight` the caller made once (what
 *     Gemma's `(h * (1 + weight.float())).type_as(x)` does).
 * `add_rms_norm` first adds a layer's output to the residual stream in place (rounded as torch's add rounds; with
 * a `delta_norm`, the output normalised first, as Gemma's sandwich norms do), then normalises the sum: the
 * residual add and the next norm of a decoder layer in one pass.
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"
#include "kernels.h"

/* fewer rows than this run on the calling thread: a row of SmolVLM-256M's 576 takes about 1 us, a team's start and
 * end about as long; a decode step's 8 rows took 8-9 us a call on one thread, 6 on two */
#define PARALLEL_ROWS 4
#define MAX(a, b) ((a) > (b) ? (a) : (b))

/* The sums and products below are torch's, operation for operation, so that a float32 norm's bits are torch's too
 * (a ulp's difference anywhere before an int8 layer can round one of its activations the other way: int8 weights
 * need the norm exact, not close). Each result passes through KEEP8 / OPAQUE, so that -ffast-math neither fuses a
 * square into the sum (FMA), nor reorders the sums, nor multiplies by x * (scale * w) instead of (x * scale) * w,
 * nor takes 1 / sqrt from the approximate rsqrt. v8f: GCC's 8-float vectors (AVX registers where the build has
 * them, two SSE halves or plain floats elsewhere). */
typedef float v8f __attribute__((vector_size(32)));
#ifdef __AVX__
#define KEEP8(v) __asm__ volatile("" : "+x"(v))
#else
#define KEEP8(v) __asm__ volatile("" : "+m"(v))
#endif

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof(v));
    return v;
}
static inline v8f add8(v8f a, v8f b) {
    v8f sum = a + b;
    KEEP8(sum);
    return sum;
}
static inline float add1(float a, float b) {
    float sum = a + b;
    OPAQUE(sum);
    return sum;
}
/* x[8 v, 8 v + 8) squared (torch's x.pow(2): each square rounded). */
static inline v8f squares8(const float *x, int64_t v) {
    v8f q = load8(x + 8 * v);
    q = q * q;
    KEEP8(q);
    return q;
}
static inline float square1(float x) {
    float q = x * x;
    OPAQUE(q);
    return q;
}

static int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1)); }

/* The sum of the squares of x[0, 8 size) as ATen's row_sum<Vectorized<float>> adds them (SumKernel.cpp): the row
 * as [size / 4, 4] vectors, four running sums summed in cascades of level_step (multi_row_sum), the vectors past
 * the last whole four into the first sum, then the four sums in order. */
static v8f row_sum8(const float *x, int64_t size) {
    const int64_t rows = size / 4, levels = 4;
    const int64_t power = MAX(4, ceil_log2(rows) / levels), step = (int64_t)1 << power, mask = step - 1;
    const v8f zero = {0};
    v8f acc[4][4];
    for (int j = 0; j < levels; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = zero;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; k++) acc[0][k] = add8(acc[0][k], squares8(x, 4 * i + k));
        for (int64_t j = 1; j < levels; ++j) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = add8(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = zero;
            }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < rows; ++i)
        for (int k = 0; k < 4; k++) acc[0][k] = add8(acc[0][k], squares8(x, 4 * i + k));
    for (int j = 1; j < levels; ++j)
        for (int k = 0; k < 4; k++) acc[0][k] = add8(acc[0][k], acc[j][k]);
    v8f sum = acc[0][0];
    for (int64_t v = rows * 4; v < size; v++) sum = add8(sum, squares8(x, v));
    for (int k = 1; k < 4; k++) sum = add8(sum, acc[0][k]);
    return sum;
}

/* sum(x^2) as torch's x.pow(2).sum(-1) (and so .mean(-1)) computes it on a contiguous float32 row: ATen's
 * vectorized_inner_sum, whose vectors are 8 floats on every CPU torch runs here (the AVX2 kernel even where its
 * capability is AVX-512: the sum has no AVX-512 one), the elements past the last whole vector, then the vector's
 * lanes in order; under 8 elements ATen's scalar row_sum (four running sums). tests/engine/test_cpu_kernels.py
 * checks it against torch bit for bit. */
static float sum_of_squares(const float *x, int64_t n) {
    if (n < 8) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t whole = n / 4 * 4;
        for (int64_t k = 0; k < whole; k++) part[k] = square1(x[k]);
        for (int64_t k = whole; k < n; k++) part[0] = add1(part[0], square1(x[k]));
        for (int k = 1; k < 4; k++) part[0] = add1(part[0], part[k]);
        return part[0];
    }
    const int64_t vectors = n / 8;
    const v8f lanes = row_sum8(x, vectors);
    float total = 0.0f;
    for (int64_t k = vectors * 8; k < n; k++) total = add1(total, square1(x[k]));
    for (int l = 0; l < 8; l++) total = add1(total, lanes[l]);
    return total;
}

/* row[j] *= (w ? w[j] : s), each product as written. */
static void multiply(float *row, int64_t dim, const float *w, float s) {
    int64_t j = 0;
    const v8f splat = (v8f){0} + s;
    for (; j + 8 <= dim; j += 8) {
        v8f v = load8(row + j) * (w ? load8(w + j) : splat);
        KEEP8(v);
        memcpy(row + j, &v, sizeof(v));
    }
    for (; j < dim; j++) {
        float v = row[j] * (w ? w[j] : s);
        OPAQUE(v);
        row[j] = v;
    }
}

void normalize_row(float *row, int64_t dim, const float *w, float eps, int flavor, int dtype) {
    float count = (float)dim;
    OPAQUE(count);  /* a division, as torch's mean divides its sum (not a product by 1 / dim) */
    float root = sqrtf(sum_of_squares(row, dim) / count + eps);
    OPAQUE(root);
    float scale = 1.0f / root;  /* torch.rsqrt: 1 / sqrt, both correctly rounded */
    OPAQUE(scale);
    multiply(row, dim, NULL, scale);
    if (flavor != NORM_GEMMA)  /* Llama: x * scale in the input's dtype, then times the weight */
        for (int64_t j = 0; j < dim; j++) row[j] = rounded(row[j], dtype);
    multiply(row, dim, w, 0.0f);
    for (int64_t j = 0; j < dim; j++) row[j] = rounded(row[j], dtype);
}

int add_rms_norm(void *h, const void *delta, const norm_weights *delta_norm, int io_dtype, int64_t rows,
                 int64_t dim, const norm_weights *norm, void *out, int num_threads) {
    int failed = 0;
    const int normed_delta = delta && delta_norm && delta_norm->weight;
#pragma omp parallel num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    {
        float *row = thread_scratch((size_t)(4 * dim) * sizeof(float)), *w = row ? row + dim : NULL;
        float *add = w ? w + dim : NULL, *delta_w = add ? add + dim : NULL;
        if (!row) {
#pragma omp atomic write
            failed = 2;
        } else {
            load_floats(norm->weight, norm->dtype, 0, dim, w);
            if (normed_delta) load_floats(delta_norm->weight, delta_norm->dtype, 0, dim, delta_w);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            if (!row) continue;
            load_floats(h, io_dtype, i * dim, dim, row);
            if (delta) {
                load_floats(delta, io_dtype, i * dim, dim, add);
                if (normed_delta) normalize_row(add, dim, delta_w, delta_norm->eps, delta_norm->flavor, io_dtype);
                for (int64_t j = 0; j < dim; j++) row[j] = rounded(row[j] + add[j], io_dtype);
                store_floats(row, dim, h, io_dtype, i * dim);
            }
            normalize_row(row, dim, w, norm->eps, norm->flavor, io_dtype);
            store_floats(row, dim, out, io_dtype, i * dim);
        }
    }
    return failed;
}

/* x and out [rows, dim] in `io_dtype`, weight [dim] in `w_dtype`, Llama's flavor. Returns 2 where memory runs
 * out. */
int rms_norm(const void *x, int io_dtype, int64_t rows, int64_t dim, const void *weight, int w_dtype, float eps,
             void *out, int num_threads) {
    const norm_weights norm = {weight, w_dtype, NORM_LLAMA, eps};
    return add_rms_norm((void *)x, NULL, NULL, io_dtype, rows, dim, &norm, out, num_threads);
}
