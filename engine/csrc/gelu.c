/* GELU with the tanh approximation (transformers' "gelu_pytorch_tanh"), in place (engine/cpu/ops.py
 * calls it).
 *
 * torch's bfloat16 GELU runs at about a nanosecond a value on a small CPU, as long as the matrix product before
 * it (a SigLIP tower's first MLP layer: 1,024 x 3,072 values a tile and layer), and oneDNN's GELU post-op costs
 * as much. Here: in float32, gelu(x) = 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3),
 * rounded to the tensor's dtype once; with AVX-512 as 2^t by a polynomial and vscalefps (gelu16), else e^x from a
 * polynomial the compiler vectorizes for the build's instruction set. Blocks of `BLOCK` values are widened into a
 * thread's scratch buffer, transformed and narrowed back.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"
#include "kernels.h"
#include "linear.h"

#define BLOCK 4096
#define PARALLEL_VALUES 65536 /* fewer values than this run on the calling thread */

#ifdef __AVX512F__
/* gelu of 16 values as v / (1 + 2^t), t = -2 sqrt(2/pi) log2(e) (v + 0.044715 v^3), 2^t = 2^floor(t) 2^f: f = t -
 * floor(t) in [0, 1) by vreduceps (exact), 2^f by a degree-5 polynomial fitted for relative error (9e-8: a float's
 * precision, as the float32 GELU must be), 2^floor(t) by vscalefps, which floors its exponent itself; t held in
 * [-126, 100] so that 2^t stays a normal float (a denormal costs the core an assist; 1 + 2^-126 is 1) and 1 + 2^t's
 * reciprocal too (an infinite 2^t made the Newton step's 2 - d r a NaN; v / (1 + 2^100) is v's GELU to a float's
 * precision, about 0, there). About eighteen operations where e^(-2u) by exp_poly (its clamps, its two-part
 * reduction and its exponent's shift and add), as the compiler vectorizes the loop below, took some twenty-six: GELU
 * was a quarter of a SigLIP fc1 product's time with int8 weights. */
static inline __m512 gelu16(__m512 v) {
    const __m512 a = _mm512_set1_ps(-2.0f * 0.7978845608028654f * 1.44269504088896341f);
    const __m512 b = _mm512_set1_ps(-2.0f * 0.7978845608028654f * 1.44269504088896341f * 0.044715f);
    const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, _mm512_fmadd_ps(_mm512_mul_ps(v, v), b, a)),
                                                 _mm512_set1_ps(-126.0f)), _mm512_set1_ps(100.0f));
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  /* t - floor(t), exact */
    static const float c[6] = {0.9999999403953552f, 0.6931530833244324f, 0.24015361070632935f, 0.05582631751894951f,
                               0.008989340625703335f, 0.0018775766948238015f};
    const __m512 d = _mm512_add_ps(_mm512_scalef_ps(polynomial16(f, c, 5), t), _mm512_set1_ps(1.0f));  /* 1 + 2^t */
    const __m512 r = _mm512_rcp14_ps(d);  /* one Newton step: 1 / d to about 2^-28 */
    return _mm512_mul_ps(v, _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))));
}
#else
/* e^x to about a float's precision for x in [-87, 88]: 2^n e^r with |r| <= ln 2 / 2. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}
#endif

/* values[count], count a multiple of GELU_STEP, replaced by gelu(values): gelu16's vectors with AVX-512, else the
 * loop the compiler vectorizes. */
static inline void gelu_steps(float *values, int64_t count) {
#ifdef __AVX512F__
    for (int64_t i = 0; i < count; i += 16) _mm512_storeu_ps(values + i, gelu16(_mm512_loadu_ps(values + i)));
#else
    for (int64_t i = 0; i < count; i++) {
        const float v = values[i];
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        values[i] = v / (1.0f + exp_poly(-2.0f * u));
    }
#endif
}

#define GELU_STEP 16  /* values a vector step of the loop above takes, at most */

/* values[count] (float32) replaced by gelu(values): gelu_tanh's steps, and linear()'s for a product's GELU
 * (MODE_GELU without MODE_GLU), one compiled copy. The last count % GELU_STEP values go through the vector loop
 * too, padded: the fast-math build's scalar loop rounds some values a float32 ulp apart from the vector one, and
 * a value's GELU would then depend on where it lies in the call. */
void gelu_floats(float *values, int64_t count) {
    const int64_t whole = count / GELU_STEP * GELU_STEP;
    gelu_steps(values, whole);
    if (whole < count) {
        float padded[GELU_STEP] = {0};
        memcpy(padded, values + whole, (size_t)(count - whole) * sizeof(float));
        gelu_steps(padded, GELU_STEP);
        memcpy(values + whole, padded, (size_t)(count - whole) * sizeof(float));
    }
}

/* x [count] in `dtype`, replaced by gelu(x). Returns 2 where memory runs out. */
int gelu_tanh(void *x, int dtype, int64_t count, int num_threads) {
    int failed = 0;
    const int64_t blocks = (count + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(num_threads) if (count >= PARALLEL_VALUES)
    {
        float *values = thread_scratch(BLOCK * sizeof(float));
        if (!values) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!values) continue;
            const int64_t start = b * BLOCK, n = MIN(BLOCK, count - start);
            load_floats(x, dtype, start, n, values);
            gelu_floats(values, n);
            store_floats(values, n, x, dtype, start);
        }
    }
    return failed;
}
