/* RMSNorm as Llama's decoder layers compute it, in one call (engine/cpu_kernel.py builds and calls it).
 *
 * transformers' LlamaRMSNorm runs seven small operators on a decode step's few rows (widen, square, mean,
 * add, rsqrt, multiply, narrow, then the weight); on a small CPU each costs more in dispatch than in work, and
 * a model calls it twice a layer. Same arithmetic here: in float32, h = x / sqrt(mean(x^2) + eps), rounded to
 * the input's dtype, then times the weight and rounded again (what `weight * h.to(dtype)` does in torch).
 * `add_rms_norm` first adds a layer's output to the residual stream in place (rounded as torch's add rounds),
 * then normalises the sum: the residual add and the next norm of a decoder layer in one pass.
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"
#include "kernels.h"

#define PARALLEL_ROWS 32 /* fewer rows than this run on the calling thread */

/* h and out [rows, dim] in `io_dtype`, delta the same or NULL, weight [dim] in `w_dtype`. With delta, h becomes
 * h + delta first. Returns 2 where memory runs out. */
int add_rms_norm(void *h, const void *delta, int io_dtype, int64_t rows, int64_t dim, const void *weight,
                 int w_dtype, float eps, void *out, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    {
        float *row = thread_scratch((size_t)(3 * dim) * sizeof(float)), *w = row ? row + dim : NULL;
        float *add = w ? w + dim : NULL;
        if (!row) {
#pragma omp atomic write
            failed = 2;
        } else {
            load_floats(weight, w_dtype, 0, dim, w);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            if (!row) continue;
            load_floats(h, io_dtype, i * dim, dim, row);
            if (delta) {
                load_floats(delta, io_dtype, i * dim, dim, add);
                for (int64_t j = 0; j < dim; j++) row[j] = rounded(row[j] + add[j], io_dtype);
                store_floats(row, dim, h, io_dtype, i * dim);
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < dim; j++) sum += row[j] * row[j];
            const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
            for (int64_t j = 0; j < dim; j++) row[j] = rounded(rounded(row[j] * scale, io_dtype) * w[j], io_dtype);
            store_floats(row, dim, out, io_dtype, i * dim);
        }
    }
    return failed;
}

/* x and out [rows, dim] in `io_dtype`, weight [dim] in `w_dtype`. Returns 2 where memory runs out. */
int rms_norm(const void *x, int io_dtype, int64_t rows, int64_t dim, const void *weight, int w_dtype, float eps,
             void *out, int num_threads) {
    return add_rms_norm((void *)x, NULL, io_dtype, rows, dim, weight, w_dtype, eps, out, num_threads);
}
