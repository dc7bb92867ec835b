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

#define PARALLEL_ROWS 32 /* fewer rows than this run on the calling thread */

void normalize_row(float *row, int64_t dim, const float *w, float eps, int flavor, int dtype) {
    float sum = 0.0f;
    for (int64_t j = 0; j < dim; j++) sum += row[j] * row[j];
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    if (flavor == NORM_GEMMA) {
        for (int64_t j = 0; j < dim; j++) row[j] = rounded(row[j] * scale * w[j], dtype);
    } else {
        for (int64_t j = 0; j < dim; j++) row[j] = rounded(rounded(row[j] * scale, dtype) * w[j], dtype);
    }
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
