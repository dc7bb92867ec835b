/* The kernels' C interface, declared once: every function the engine calls (engine/cpu/abi.py types them,
 * tests/engine/test_cpu_abi.py checks that file against this one), the structs it passes, the dtype codes and
 * mode bits. Each defining file includes this, so a definition that drifts from its declaration does not compile.
 * Their contracts are at the definitions. */
#ifndef VLMCAP_KERNELS_H
#define VLMCAP_KERNELS_H

#include <stdint.h>

#define MODE_GLU 1        /* `mode` bits of linear(): act(x W_g^T) * (x W_u^T), act SiLU */
#define PRODUCTS_WIDEN 2  /* bfloat16 products by float32 FMAs even where the build has vdpbf16ps */
#define MODE_GELU 4       /* with MODE_GLU: act is GELU's tanh approximation (Gemma's MLP); without: y's GELU */
#define PRODUCTS_TILES 8  /* attention's bfloat16 products by AMX tiles, where the build has them (full_attention.c) */

enum { F32 = 0, BF16 = 1, F16 = 2, I8 = 3 }; /* the tensors' dtypes (I8: linear()'s int8 weights, an int8 KV cache) */
enum { NORM_LLAMA = 0, NORM_GEMMA = 1 }; /* how an RMSNorm applies its weight (rms_norm.c) */

/* One RMSNorm's weight [dim] (in `dtype`; NORM_GEMMA: float32 1 + weight), flavor and epsilon (`NormArgs`). A
 * NULL weight: no norm. */
typedef struct {
    const void *weight;
    int dtype, flavor;
    float eps;
} norm_weights;

/* One projection: weight [n, k] (rows `stride` elements apart, `dtype`), float32 bias or NULL; an I8 weight's
 * float32 scales and int32 row sums [n] (NULL for float weights). */
typedef struct {
    const void *weight;
    int64_t n, k, stride;
    const float *bias;
    int dtype;
    const float *scale;
    const int32_t *row_sums;
} projection;

/* One layer's weights and cache (`LeanLayerArgs`). */
typedef struct {
    norm_weights input_norm, mlp_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm;
    projection qkv, o, gate_up, down;
    void *key_cache, *value_cache;
    float *key_scales, *value_scales;  /* an I8 cache's scales [slots, kv_heads] (engine/kv_cache.py); else NULL */
    float scaling;
    int64_t window;  /* keys more than this behind a query are hidden (0: none) */
    int act;         /* linear()'s glu mode bits: MODE_GLU (SiLU) or MODE_GLU | MODE_GELU */
    int local_rope;  /* 1: the step's local rotary tables */
} lean_layer;

/* What a step's call reads and writes besides the layers (`DecodeStepArgs`). */
typedef struct {
    void *h, *normed, *qkv, *attended, *o, *gate_up, *down;  /* [tokens, width] buffers, io_dtype */
    const void *cos, *sin, *local_cos, *local_sin;           /* [tokens, head_dim], io_dtype */
    const int64_t *positions;  /* NULL, or the rotary tables' rows [tokens]: cos ... are then tables of rope_rows */
    const int64_t *ids;        /* NULL, or the step's token ids [tokens]: h is first their rows of `embedding` */
    const void *embedding;     /* [embedding_rows, hidden], io_dtype */
    const int64_t *slots, *query_index, *block_tables, *context_lens;
    norm_weights final_norm;
    int64_t tokens, hidden, heads, kv_heads, head_dim, num_seqs, block_size, table_width, rope_rows, embedding_rows;
    int io_dtype, cache_dtype, mode, num_threads;  /* an I8 cache is read back in io_dtype */
} decode_step;

/* y = x W^T (+ bias) [+ residual]: `residual` (NULL: none) is y's shape and dtype, added to the product rounded
 * to that dtype and the sum rounded again, as torch's `residual + linear(x)` rounds. MODE_GELU without MODE_GLU:
 * y = gelu_tanh(x W^T + b) (the product rounded to y's dtype, then gelu_tanh's own steps), before any residual. */
int linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int w_dtype, int64_t w_stride,
           int64_t n, const float *bias, const float *scale, const int32_t *row_sums, int mode, void *y,
           const void *residual, int num_threads);
/* out = norm(h += delta_norm(delta)); delta and delta_norm may be NULL. */
int add_rms_norm(void *h, const void *delta, const norm_weights *delta_norm, int io_dtype, int64_t rows,
                 int64_t dim, const norm_weights *norm, void *out, int num_threads);
/* row [dim] (float32) normalised in place, rounded to `dtype` as the norm's flavor rounds; w [dim] float32. */
void normalize_row(float *row, int64_t dim, const float *w, float eps, int flavor, int dtype);
int rope_store(void *qkv, int dtype, int64_t tokens, int64_t width, int64_t nq, int64_t nkv, int64_t d,
               const norm_weights *q_norm, const norm_weights *k_norm, const void *cos, const void *sin,
               const int64_t *positions, int64_t table_rows, const int64_t *slots, void *key_cache,
               void *value_cache, float *key_scales, float *value_scales, int cache_dtype, int num_threads);
int paged_decode_attention(const void *q, int q_dtype, int64_t q_head_stride, int64_t q_token_stride,
                           const int64_t *query_index, const void *key_cache, const void *value_cache,
                           const float *key_scales, const float *value_scales, int dtype,
                           const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs,
                           int64_t kv_heads, int64_t groups, int64_t d, int64_t block_size, int64_t table_width,
                           float scale, int64_t window, void *out, int mode, int num_threads);
int full_attention(const void *q, const void *k, const void *v, int dtype, int64_t batch, int64_t heads, int64_t n,
                   int64_t d, int64_t batch_stride, int64_t head_stride, int64_t row_stride, float scale, void *out,
                   int64_t out_batch_stride, int64_t out_row_stride, int mode, int num_threads);
int chunk_attention(const void *q, int dtype, int64_t q_head_stride, int64_t q_row_stride, int64_t query_start,
                    int64_t n, int64_t start, const void *key_cache, const void *value_cache, const float *key_scales,
                    const float *value_scales, int cache_dtype, const int64_t *block_table, int64_t block_size,
                    int64_t kv_heads, int64_t groups, int64_t d, float scale, int64_t window, void *out, int mode,
                    int num_threads);
int rms_norm(const void *x, int io_dtype, int64_t rows, int64_t dim, const void *weight, int w_dtype, float eps,
             void *out, int num_threads);
int gelu_tanh(void *x, int dtype, int64_t count, int num_threads);
int sample_rows(const void *logits, int dtype, int64_t vocab, int64_t logit_rows, const int64_t *index, int64_t rows,
                const float *top, const float *inv_temperature, const int64_t *top_k, const float *top_p,
                const double *u, int64_t *tokens, int num_threads);
int row_max(const void *logits, int dtype, int64_t rows, int64_t vocab, float *top, int64_t *at, int num_threads);
int decode_layers(const decode_step *s, const lean_layer *layers, int64_t count);
const char *linear_isa(void);
int release_scratch(int num_threads);

#endif
