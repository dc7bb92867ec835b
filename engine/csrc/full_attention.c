/* Attention of every token to every token of the same input, no mask (a vision tower's layer), on the CPU
 * (engine/lean_vision.py calls it through engine/cpu/).
 *
 * q, k and v [batch, heads, n, d] are views of one packed projection (rows `row_stride` elements apart, heads
 * `head_stride`, inputs `batch_stride`), in `dtype`; out [batch, n, heads, d] contiguous, in `dtype`. A task is
 * one input's head: its keys are packed once as float32, transposed ([d][n], each d-th value of NR keys a
 * vector), and its values as float32 rows; then each tile of MR query rows takes all its scores at once
 * (MR x NR outer products, one FMA per score and step along d), their softmax in float32, and their sum of
 * values (RO rows at a time, d in vectors). torch's flash attention for bfloat16 on the CPU runs a 512 px
 * SigLIP tile's attention (1,024 patches, 12 heads of 64) at about 130 GFLOP/s on 2 AVX-512 cores: half the
 * tower's time. The vectors are GCC's, as wide as the build's instruction set.
 */
#include <math.h>
#include <stdlib.h>

#include "dtypes.h"
#include "kernels.h"

#if defined(__AVX512F__)
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

/* o[r][0..d) = sum over j < n of p[r][j] * v[j][..] / total[r] for `rows` (<= RO) rows, 4 vectors of d at a time,
 * into out rows (dtype), `out_stride` elements apart. */
static void weighted_values(const float *p, int64_t rows, int64_t n, int64_t n_pad, const float *vrows, int64_t d,
                            const float *total, void *out, int dtype, int64_t out_offset, int64_t out_stride) {
    float done[RO][256] __attribute__((aligned(64)));
    for (int64_t c = 0; c < d; c += 4 * FW) {
        const int span = (int)MIN(4, (d - c) / FW);
        fv o[RO][4];
        for (int r = 0; r < RO; r++)
            for (int b = 0; b < 4; b++) o[r][b] = (fv){0};
        for (int64_t j = 0; j < n; j++) {
            fv value[4];
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++)
                if (b < span) value[b] = *(const fv *)(vrows + j * d + c + b * FW);
#pragma GCC unroll 6
            for (int r = 0; r < RO; r++) {
                if (r >= rows) break;
                const fv weight = SPLAT(p[r * n_pad + j]);
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++)
                    if (b < span) o[r][b] += weight * value[b];
            }
        }
        for (int r = 0; r < RO; r++)
            for (int b = 0; b < 4; b++)
                if (r < rows && b < span) *(fv *)(done[r] + c + b * FW) = o[r][b] * (1.0f / total[r]);
    }
    for (int64_t r = 0; r < rows; r++) store_floats(done[r], d, out, dtype, out_offset + r * out_stride);
}

/* Returns 0; 1 where d is not a multiple of the vector width (or above 256); 2 where memory runs out. */
int full_attention(const void *q, const void *k, const void *v, int dtype, int64_t batch, int64_t heads, int64_t n,
                   int64_t d, int64_t batch_stride, int64_t head_stride, int64_t row_stride, float scale, void *out,
                   int num_threads) {
    if (d % FW || d > 256 || n < 1) return 1;
    const int64_t n_pad = (n + NR - 1) / NR * NR, tiles = (n + MR - 1) / MR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* a task's keys [d][n_pad], values [n][d], a tile's queries [d][MR] and scores [MR][n_pad] */
        float *kt = thread_scratch((size_t)(d * n_pad + n * d + d * MR + MR * n_pad + MR) * sizeof(float));
        float *vrows = kt ? kt + d * n_pad : NULL, *qp = vrows ? vrows + n * d : NULL, *s = qp ? qp + d * MR : NULL;
        float *total = s ? s + MR * n_pad : NULL, row[256], block[FW][256];
        if (!kt) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * heads; task++) {
            if (!kt) continue;
            const int64_t b = task / heads, h = task % heads, base = b * batch_stride + h * head_stride;
            for (int64_t j0 = 0; j0 < n_pad; j0 += FW) {  /* FW keys at a time, so that kt is written by vectors */
                for (int64_t j = j0; j < j0 + FW; j++) {
                    if (j < n) load_floats(k, dtype, base + j * row_stride, d, block[j - j0]);
                    else memset(block[j - j0], 0, (size_t)d * sizeof(float));
                }
                for (int64_t t = 0; t < d; t++)
                    for (int j = 0; j < FW; j++) kt[t * n_pad + j0 + j] = block[j][t];
            }
            for (int64_t j = 0; j < n; j++) load_floats(v, dtype, base + j * row_stride, d, vrows + j * d);
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t first = tile * MR, rows = MIN(MR, n - first);
                for (int64_t r = 0; r < MR; r++) {  /* rows past n repeat the last one; their results are dropped */
                    load_floats(q, dtype, base + MIN(first + r, n - 1) * row_stride, d, row);
                    for (int64_t t = 0; t < d; t++) qp[t * MR + r] = row[t] * scale;
                }
                scores(qp, kt, d, n_pad, s);
                softmax_rows(s, rows, n, n_pad, total);
                for (int64_t r0 = 0; r0 < rows; r0 += RO)
                    weighted_values(s + r0 * n_pad, MIN(RO, rows - r0), n, n_pad, vrows, d, total + r0, out, dtype,
                                    ((b * n + first + r0) * heads + h) * d, heads * d);
            }
        }
    }
    return failed;
}
