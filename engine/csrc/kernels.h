/* The kernels other kernels call (engine/csrc/decode_layers.c), declared once: each defining file includes this
 * too, so a definition that drifts from its declaration does not compile. Their contracts are at the
 * definitions. */
#ifndef VLMCAP_KERNELS_H
#define VLMCAP_KERNELS_H

#include <stdint.h>

#define MODE_GLU 1        /* `mode` bits of linear(): act(x W_g^T) * (x W_u^T), act SiLU */
#define PRODUCTS_WIDEN 2  /* bfloat16 products by float32 FMAs even where the build has vdpbf16ps */
#define MODE_GELU 4       /* with MODE_GLU: act is GELU's tanh approximation (Gemma's MLP) */

enum { NORM_LLAMA = 0, NORM_GEMMA = 1 }; /* how an RMSNorm applies its weight (rms_norm.c) */

/* One RMSNorm's weight [dim] (in `dtype`; NORM_GEMMA: float32 1 + weight), flavor and epsilon; engine/cpu_kernel.py's
 * `NormArgs` mirrors it. A NULL weight: no norm. */
typedef struct {
    const void *weight;
    int dtype, flavor;
    float eps;
} norm_weights;

int linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int w_dtype, int64_t w_stride,
           int64_t n, const float *bias, int mode, void *y, int num_threads);
/* out = norm(h += delta_norm(delta)); delta and delta_norm may be NULL. */
int add_rms_norm(void *h, const void *delta, const norm_weights *delta_norm, int io_dtype, int64_t rows,
                 int64_t dim, const norm_weights *norm, void *out, int num_threads);
/* row [dim] (float32) normalised in place, rounded to `dtype` as the norm's flavor rounds; w [dim] float32. */
void normalize_row(float *row, int64_t dim, const float *w, float eps, int flavor, int dtype);
int rope_store(void *qkv, int dtype, int64_t tokens, int64_t width, int64_t nq, int64_t nkv, int64_t d,
               const norm_weights *q_norm, const norm_weights *k_norm, const void *cos, const void *sin,
               const int64_t *slots, void *key_cache, void *value_cache, int cache_dtype, int num_threads);
int paged_decode_attention(const void *q, int q_dtype, int64_t q_head_stride, int64_t q_token_stride,
                           const int64_t *query_index, const void *key_cache, const void *value_cache, int dtype,
                           const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs,
                           int64_t kv_heads, int64_t groups, int64_t d, int64_t block_size, int64_t table_width,
                           float scale, int64_t window, void *out, int num_threads);
int full_attention(const void *q, const void *k, const void *v, int dtype, int64_t batch, int64_t heads, int64_t n,
                   int64_t d, int64_t batch_stride, int64_t head_stride, int64_t row_stride, float scale, void *out,
                   int num_threads);

#endif
