/* y = x W^T (+ bias) on the CPU, reading W [n, k] where transformers keeps it: row-major, in its own dtype, no
 * packed copy (engine/cpu/ calls it; engine/lean_layers.py fuses q/k/v and gate/up into one matrix of
 * views, so one call computes them all).
 *
 * A decode step multiplies a few rows of x by every weight of the model: its cost is reading the weights once.
 * Four weight rows at a time stream through registers against up to RX rows of x (their chunks come from the
 * L1 cache; RX is six with AVX-512's 32 registers, two with AVX2's 16), 4 RX float32 sums kept in named vector
 * registers: each weight is loaded once per RX rows of x, each chunk of x once per four weight rows. The
 * reduction runs along k, so every sum is a vector that is reduced once, at the end of the row. With a few rows of x the loop does enough arithmetic per byte that the loads of
 * the weights no longer run ahead of it by themselves: each block prefetches the weight rows of a block some
 * 32 KB further on (`blocks_ahead`), into the L2 cache.
 * Many rows of x (GEMM_ROWS or more: a prefill chunk, a vision tile) are arithmetic, not reading: they go by tiles
 * of packed panels instead (`gemm`, below).
 * What the build targets decides the inner loop (engine/cpu/ compiles one library per instruction set
 * and picks the best the CPU has):
 *   - AVX-512 BF16 (`vdpbf16ps`): bfloat16 x against bfloat16 weights, 32 products per instruction; or, where
 *     the CPU runs that instruction slower than widening and FMAs (`PRODUCTS_WIDEN`, chosen by
 *     engine/cpu/ from a measurement at start-up), the float32 loop below;
 *   - AVX-512F: 16 lanes of float32 FMAs, weights widened in registers; bfloat16 weights two per 32-bit word:
 *     the even columns by a shift, the odd ones by a mask (one instruction per 16 weights), against x laid out
 *     in the same order (`split_pairs`);
 *   - AVX2 + FMA: 8 lanes, likewise;
 *   - anything else: plain C.
 * `glu` mode computes act(x W_g^T) * (x W_u^T) for W = [W_g; W_u] (n = 2 * half), act SiLU (Llama) or with
 * MODE_GELU GELU's tanh approximation (Gemma), rounded to the output dtype between operators as torch rounds them,
 * so a gated MLP's gate and up projections are one pass.
 */
#include <math.h>
#include <stdlib.h>

#include "dtypes.h"
#include "kernels.h"
#include "linear.h"

/* Tasks [0, count) shared by a team as contiguous runs: each thread starts on a share of its own and goes front
 * to back, one stream through the weights that the prefetchers follow (faster than tasks dealt one at a time,
 * which interleave the threads' reads); a thread done with its share takes the back half of another's, and goes
 * on with it front to back, so a thread that loses its core leaves its work to the others. A share (task_share)
 * is one 64-bit word, next | end << 32, changed by compare-and-swap. `deal` runs once (`deal_team`) before any
 * `next_task`. */
void deal(task_share *shares, int count_of_shares, int64_t count) {
    for (int s = 0; s < count_of_shares; s++) shares[s].word = share_of(s, count_of_shares, count);
}

/* Share `share` less its first task (returned), or, `halve`, less its back half (set in *taken); -1 or 0 when it
 * has no task left. */
static int64_t take(uint64_t *share, int halve, uint64_t *taken) {
    uint64_t seen = __atomic_load_n(share, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint64_t next = seen & 0xffffffffu, end = seen >> 32;
        if (next >= end) return halve ? 0 : -1;
        const uint64_t mid = end - ((end - next + 1) / 2);
        const uint64_t left = halve ? next | mid << 32 : seen + 1;
        if (__atomic_compare_exchange_n(share, &seen, left, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            if (!halve) return (int64_t)next;
            *taken = mid | end << 32;
            return 1;
        }
    }
}

/* The calling thread's next task: its own share's first, else the first of the back half it takes from another
 * share; -1 when no share has a task left. */
int64_t next_task(task_share *shares) {
    const int count_of_shares = team_size(), own = team_index();
    for (;;) {
        const int64_t task = take(&shares[own].word, 0, NULL);
        if (task >= 0) return task;
        uint64_t taken = 0;
        int other = 1;
        while (other < count_of_shares && !take(&shares[(own + other) % count_of_shares].word, 1, &taken)) other++;
        if (other == count_of_shares) return -1;
        __atomic_store_n(&shares[own].word, taken, __ATOMIC_RELEASE);
    }
}

#define MC 48  /* rows of x per pass over the weights */

#if defined(__AVX512F__)
typedef __m512 vf;
typedef __m512i vi;
#define VW 16
#define RX 6   /* rows of x per block: 24 sums, 4 weights and x in 32 registers */
#define MR 12  /* rows of x per tile (gemm): 24 sums */
#ifndef GEMM_ROWS
#define GEMM_ROWS 64  /* rows of x from which tiles of packed panels beat the blocks (a scratch timing, 2 threads) */
#endif
#define V_(op) _mm512_##op            /* an intrinsic on vf or vi: V_(fmadd_ps) */
#define VI_(op) _mm512_##op##_si512   /* one on the whole of a vi: VI_(loadu) */
static inline __attribute__((always_inline)) vf vload(const void *p, int dtype, int64_t at) {
    return widen16(p, dtype, at);
}
static inline vf as_floats(vi d) { return _mm512_castsi512_ps(d); }
static inline vi gather_words(vi at, const void *base) { return _mm512_i32gather_epi32(at, base, 4); }
/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 reduce4(vf a, vf b, vf c, vf d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#elif defined(VECTOR)
typedef __m256 vf;
typedef __m256i vi;
#define VW 8
#define RX 2   /* rows of x per block: 8 sums, 4 weights, x and the odd columns' mask in 16 registers (with 3 rows,
                  the compiler spills sums to the stack: 1.45x slower at 8 rows, a scratch timing on one core) */
#define MR 6   /* rows of x per tile (gemm): 12 sums */
#ifndef GEMM_ROWS
#define GEMM_ROWS 32
#endif
#define V_(op) _mm256_##op
#define VI_(op) _mm256_##op##_si256
static inline __attribute__((always_inline)) vf vload(const void *p, int dtype, int64_t at) {
    return widen8(p, dtype, at);
}
static inline vf as_floats(vi d) { return _mm256_castsi256_ps(d); }
static inline vi gather_words(vi at, const void *base) { return _mm256_i32gather_epi32((const int *)base, at, 4); }
static inline __m128 reduce4(vf a, vf b, vf c, vf d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#else
#define RX 6
#endif

#ifdef VW  /* the same for both widths */
static inline vf vzero(void) { return V_(setzero_ps)(); }
static inline vf vfma(vf a, vf b, vf c) { return V_(fmadd_ps)(a, b, c); }
#define XLOAD(p) V_(loadu_ps)(p)
static inline vf vset1(float v) { return V_(set1_ps)(v); }
static inline void vstore(float *p, vf v) { V_(storeu_ps)(p, v); }
static inline vi wload(const uint16_t *p) { return VI_(loadu)((const vi *)p); }
static inline vi lanes_of(const int32_t *p) { return VI_(loadu)((const vi *)p); }
static inline vf even_of(vi d) { return as_floats(V_(slli_epi32)(d, 16)); }
static inline vf odd_of(vi d) { return as_floats(VI_(and)(d, V_(set1_epi32)((int)0xffff0000u))); }
#endif

/* One weight value as float32. */
static inline float wvalue(const void *w, int dtype, int64_t at) {
    float v;
    load_floats(w, dtype, at, 1, &v);
    return v;
}

/* out[i * stride + r] += dot(W row w[r], x row i) over k from `from` (the scalar tail, or everything). */
static void tail(const float *x, int64_t k, int64_t from, const void *const w[RW], int dtype, int rows,
                 float *out, int64_t stride) {
    for (int r = 0; r < RW; r++)
        for (int i = 0; i < rows; i++) {
            float sum = 0.0f;
            for (int64_t t = from; t < k; t++) sum += wvalue(w[r], dtype, t) * x[i * k + t];
            out[i * stride + r] += sum;
        }
}

#ifdef VW
#define A(r, i) a##r##i
#define DECL(i) vf A(0, i) = vzero(), A(1, i) = A(0, i), A(2, i) = A(0, i), A(3, i) = A(0, i);
#define FMA_ROW(i) \
    if (rows > i) { \
        const vf xv = XLOAD(x + i * k + t); \
        A(0, i) = vfma(w0, xv, A(0, i)), A(1, i) = vfma(w1, xv, A(1, i)); \
        A(2, i) = vfma(w2, xv, A(2, i)), A(3, i) = vfma(w3, xv, A(3, i)); \
    }
#define STORE_ROW(i) \
    if (rows > i) _mm_storeu_ps(out + i * stride, reduce4(A(0, i), A(1, i), A(2, i), A(3, i)));
#if RX == 6
#define EACH_ROW(M) M(0) M(1) M(2) M(3) M(4) M(5)
#else
#define EACH_ROW(M) M(0) M(1)
#endif
/* Float32 x (rows 0..R-1, each k long) against weight rows w[0..3] of dtype D, the four sums of x row i into
 * out[i * stride ..], the rows `next` prefetched meanwhile: one function per D and R. */
#define BLOCK(D, R) \
    static void block_##D##_##R(const float *x, int64_t k, const void *const w[RW], const void *const next[RW], \
                                float *out, int64_t stride) { \
        const int rows = R; \
        EACH_ROW(DECL) \
        const void *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3]; \
        int64_t t = 0; \
        for (; t + VW <= k; t += VW) { \
            if (t % 32 == 0) prefetch_rows(next, t * ((D) == F32 ? 4 : 2)); \
            const vf w0 = vload(p0, D, t), w1 = vload(p1, D, t), w2 = vload(p2, D, t), w3 = vload(p3, D, t); \
            EACH_ROW(FMA_ROW) \
        } \
        EACH_ROW(STORE_ROW) \
        if (t < k) tail(x, k, t, w, D, rows, out, stride); \
    }
/* The same for bfloat16 weights, 2 VW columns at a time: each 32-bit word of weights holds an even and an odd
 * column; x comes laid out by `split_pairs` (each 2 VW's even columns, then its odd ones). */
#define PAIR_ROW(i, half) \
    if (rows > i) { \
        const vf xv = XLOAD(x + i * k + t + (half)); \
        A(0, i) = vfma(w0, xv, A(0, i)), A(1, i) = vfma(w1, xv, A(1, i)); \
        A(2, i) = vfma(w2, xv, A(2, i)), A(3, i) = vfma(w3, xv, A(3, i)); \
    }
#define PAIR_EVEN(i) PAIR_ROW(i, 0)
#define PAIR_ODD(i) PAIR_ROW(i, VW)
#define PAIR_BLOCK(R) \
    static void block_BF16_##R(const float *x, int64_t k, const void *const w[RW], const void *const next[RW], \
                               float *out, int64_t stride) { \
        const int rows = R; \
        EACH_ROW(DECL) \
        const uint16_t *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3]; \
        int64_t t = 0; \
        for (; t + 2 * VW <= k; t += 2 * VW) { \
            if (t % 32 == 0) prefetch_rows(next, 2 * t); \
            { \
                const vf w0 = even_of(wload(p0 + t)), w1 = even_of(wload(p1 + t)); \
                const vf w2 = even_of(wload(p2 + t)), w3 = even_of(wload(p3 + t)); \
                EACH_ROW(PAIR_EVEN) \
            } \
            const vf w0 = odd_of(wload(p0 + t)), w1 = odd_of(wload(p1 + t)); \
            const vf w2 = odd_of(wload(p2 + t)), w3 = odd_of(wload(p3 + t)); \
            EACH_ROW(PAIR_ODD) \
        } \
        EACH_ROW(STORE_ROW) \
        if (t < k) tail(x, k, t, w, BF16, rows, out, stride); \
    }
#if RX == 6
#define BLOCKS(D) BLOCK(D, 1) BLOCK(D, 2) BLOCK(D, 3) BLOCK(D, 4) BLOCK(D, 5) BLOCK(D, 6)
#define PAIR_BLOCKS PAIR_BLOCK(1) PAIR_BLOCK(2) PAIR_BLOCK(3) PAIR_BLOCK(4) PAIR_BLOCK(5) PAIR_BLOCK(6)
#define FNS(D) {block_##D##_1, block_##D##_2, block_##D##_3, block_##D##_4, block_##D##_5, block_##D##_6}
#else
#define BLOCKS(D) BLOCK(D, 1) BLOCK(D, 2)
#define PAIR_BLOCKS PAIR_BLOCK(1) PAIR_BLOCK(2)
#define FNS(D) {block_##D##_1, block_##D##_2}
#endif
BLOCKS(F32)
PAIR_BLOCKS
BLOCKS(F16)
typedef void (*block_fn)(const float *, int64_t, const void *const[RW], const void *const[RW], float *, int64_t);
static const block_fn BLOCK_FNS[3][RX] = {FNS(F32), FNS(BF16), FNS(F16)};

/* Each row of x [m, k] (float32, in place) with every 2 VW columns reordered as the bfloat16 blocks read them:
 * the even columns, then the odd ones (the columns past the last whole 2 VW stay where they are). */
static void split_pairs(float *x, int64_t m, int64_t k) {
    float even[VW], odd[VW];
    for (int64_t i = 0; i < m; i++)
        for (int64_t t = 0; t + 2 * VW <= k; t += 2 * VW) {
            float *at = x + i * k + t;
            for (int c = 0; c < VW; c++) even[c] = at[2 * c], odd[c] = at[2 * c + 1];
            memcpy(at, even, sizeof(even));
            memcpy(at + VW, odd, sizeof(odd));
        }
}
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
    static void dp_block_##R(const uint16_t *xb, int64_t k, const void *const w[RW], const void *const next[RW], \
                             float *out, int64_t stride) { \
        const int rows = R; \
        EACH_ROW(DECL) \
        const uint16_t *p0 = w[0], *p1 = w[1], *p2 = w[2], *p3 = w[3]; \
        for (int64_t t = 0; t < k; t += 32) { \
            prefetch_rows(next, 2 * t); \
            const __mmask32 mask = k - t >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - t)) - 1u); \
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p0 + t); \
            const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p1 + t); \
            const __m512bh w2 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p2 + t); \
            const __m512bh w3 = (__m512bh)_mm512_maskz_loadu_epi16(mask, p3 + t); \
            EACH_ROW(DP_ROW) \
        } \
        EACH_ROW(STORE_ROW) \
    }
DP_BLOCK(1) DP_BLOCK(2) DP_BLOCK(3) DP_BLOCK(4) DP_BLOCK(5) DP_BLOCK(6)
typedef void (*dp_fn)(const uint16_t *, int64_t, const void *const[RW], const void *const[RW], float *, int64_t);
static const dp_fn DP_FNS[RX] = {dp_block_1, dp_block_2, dp_block_3, dp_block_4, dp_block_5, dp_block_6};
#endif

/* The instruction set this build's inner loop uses (engine/cpu/ reports it). */
const char *linear_isa(void) {
#if defined(__AMX_BF16__)
    return "amx_bf16";
#elif defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(VECTOR)
    return "avx2";
#else
    return "generic";
#endif
}

/* v rounded to bfloat16 or float16 and widened back, as torch rounds (nearest even); float32: v. Plain loops
 * over arrays, so that the compiler vectorises them. */
static inline void round_to(float *v, int64_t count, int dtype) {
    if (dtype == BF16) {
        for (int64_t c = 0; c < count; c++) {
            uint32_t bits;
            memcpy(&bits, v + c, sizeof(bits));
            bits = nan_word(bits) ? (bits | 0x00400000u) & 0xffff0000u : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
            memcpy(v + c, &bits, sizeof(bits));
        }
    } else if (dtype == F16) {
        for (int64_t c = 0; c < count; c++) v[c] = (float)(_Float16)v[c];
    }
}

/* The denominator of act(gate) in float32: SiLU, gate / (1 + e^-gate); or GELU's tanh approximation,
 * 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3). */
static inline float activation_denominator(float gate, int glu_mode) {
    if (glu_mode == GLU_GELU)
        return 1.0f + expf(-2.0f * 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate));
    return 1.0f + expf(-gate);
}

/* v[c] /= d[c] as IEEE divides (div16): an infinite d (e^-gate past float's range) gives 0, not NaN. */
static void divide(float *v, const float *d, int64_t count) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= count; c += 16) _mm512_storeu_ps(v + c, div16(_mm512_loadu_ps(v + c), _mm512_loadu_ps(d + c)));
#elif defined(VECTOR)
    for (; c + 8 <= count; c += 8) _mm256_storeu_ps(v + c, div8(_mm256_loadu_ps(v + c), _mm256_loadu_ps(d + c)));
#endif
    for (; c < count; c++) {
        float by = d[c];
        OPAQUE(by);  /* one at a time: a vectorised loop would divide by reciprocals */
        v[c] /= by;
    }
}

/* The sums of one task's columns for one row of x, finished: bias, then (glu) act(gate) * up with each
 * operator's result rounded to the output dtype as torch's `act(gate) * up` rounds it. gate_up holds per block
 * [gate j, gate j+1, up j, up j+1]. */
void finish_row(float *sums, int64_t blocks, int glu_mode, const float *bias, const int64_t *rows_of,
                       int dtype, float *out) {
    if (!glu_mode) {  /* loops the compiler vectorises: `out` written as whole vectors, which the store reads */
        const int64_t count = blocks * RW;
        if (!bias) {
            for (int64_t c = 0; c < count; c++) out[c] = sums[c];
        } else if (rows_of[count - 1] == rows_of[0] + count - 1) {  /* consecutive: all but a last partial task */
            const float *b = bias + rows_of[0];
            for (int64_t c = 0; c < count; c++) out[c] = sums[c] + b[c];
        } else {
            for (int64_t c = 0; c < count; c++) out[c] = sums[c] + bias[rows_of[c]];
        }
        return;
    }
    float gate[2 * NB], up[2 * NB];
    const int64_t count = 2 * blocks;
    for (int64_t b = 0; b < blocks; b++)
        for (int c = 0; c < 2; c++) {
            gate[2 * b + c] = sums[b * RW + c] + (bias ? bias[rows_of[b * RW + c]] : 0.0f);
            up[2 * b + c] = sums[b * RW + 2 + c] + (bias ? bias[rows_of[b * RW + 2 + c]] : 0.0f);
        }
    glu_tail(gate, up, count, glu_mode, dtype, out);
}

/* act(gate) * up for `count` outputs (gate and up with their bias; count at most GLU_MOST), each operator's result
 * rounded to `dtype` as torch's `act(gate) * up` rounds it, into `out`: finish_row's, and the int8 kernel's
 * vector epilogue's (many rows' at once there), so that a task's outputs are finished by the same code either
 * way. */
void glu_tail(float *gate, float *up, int64_t count, int glu_mode, int dtype, float *out) {
    round_to(gate, count, dtype);
    round_to(up, count, dtype);
    float denominator[GLU_MOST];
    for (int64_t c = 0; c < count; c++) denominator[c] = activation_denominator(gate[c], glu_mode), out[c] = gate[c];
    divide(out, denominator, count);
    round_to(out, count, dtype);
    for (int64_t c = 0; c < count; c++) out[c] *= up[c];
}

#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>

/* AMX tiles (bfloat16 x and weights, k a multiple of 32): the product is computed transposed, C^T = W x^T, so
 * that the weight's rows load into tiles straight from where the model holds them: two 16-row tiles of W
 * (A, 64 bytes of k each) against two tiles of x^T (B: two blocks of 16 rows of x, packed once per call in pairs
 * of k, as TDPBF16PS reads them) into four 16 x (up to 16 rows of x) sums, so that each tile loaded is multiplied
 * twice (one block of x a pass took mostly 1.1-1.3x as long from 17 rows up, `python -m bench.linear_ab`: the
 * loads, not the products, bound the loop); in glu mode the two weight tiles are 16 gate rows and the same 16 up
 * rows. Each pass's sums are finished after the next pass's products are issued (the tiles multiply while the
 * vectors finish: a decode step 0.98x). Columns past the last whole tile pair go through the vector blocks. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_MIN_ROWS 4  /* fewer rows of x go through the dot-product blocks, faster there */

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether the kernel lets this process use the tiles (asked once). */
int amx_permitted(void) {
    static int state = 0;
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* Tiles 0-7 configured (palette 1): tile t `rows[t]` rows of `colsb[t]` bytes (0: unused). */
void amx_load_config(const uint8_t rows[8], const uint16_t colsb[8]) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = rows[t], config.colsb[t] = colsb[t];
    /* ldtilecfg by hand: GCC 12 took `_tile_loadconfig(&config)` for a read of fewer bytes and dropped the
     * stores of the tiles' shapes (the instruction then faulted); the "m" operand is the whole struct. */
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

/* Tiles 0-1: sums (16 weight rows x `cols` rows of x, float32) of the first block of x rows, 2-3 of the second
 * (`cols2` rows; 0: none); 4-5: weight rows; 6-7: the two blocks' x^T pairs. */
static void amx_configure(int cols, int cols2) {
    const uint8_t r2 = cols2 ? 16 : 0;
    const uint16_t c = (uint16_t)(4 * cols), c2 = (uint16_t)(4 * cols2);
    const uint8_t rows[8] = {16, 16, r2, r2, 16, 16, 16, r2};
    const uint16_t colsb[8] = {c, c, c2, c2, 64, 64, c, c2};
    amx_load_config(rows, colsb);
}

/* bfloat16 of 16 floats (nearest even, as torch rounds), widened back. */
static inline __m512 bf16_round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* One task's sums ([tile][weight row][row of x]) into y rows row0.. (bfloat16): plain, the 32 columns from
 * `first` (the second tile's 16 follow the first's); glu, act(gate) * up for the 16 outputs from `first`, each
 * operator rounded as torch rounds it (`activation_denominator`, 16 at a time). */
static void amx_finish(float sums[2][16][16], int64_t rows, int64_t first, int64_t second, int glu_mode,
                       const float *bias, void *y, int64_t out_cols, int64_t row0) {
    __m512i across[2][16];  /* [tile][row of x]: the 16 weight rows' sums */
    for (int t = 0; t < 2; t++) {
        for (int n = 0; n < 16; n++) across[t][n] = _mm512_load_si512(sums[t][n]);
        transpose16(across[t]);
    }
    const __m512 bias_a = bias ? _mm512_loadu_ps(bias + first) : _mm512_setzero_ps();
    const __m512 bias_b = bias ? _mm512_loadu_ps(bias + second) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 a = _mm512_add_ps(_mm512_castsi512_ps(across[0][r]), bias_a);
        const __m512 b = _mm512_add_ps(_mm512_castsi512_ps(across[1][r]), bias_b);
        uint16_t *out = (uint16_t *)y + (row0 + r) * out_cols + first;
        if (glu_mode) {
            const __m512 gate = bf16_round16(a);
            const __m512 one = _mm512_set1_ps(1.0f);
            __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), gate);  /* SiLU: e^-gate */
            if (glu_mode == GLU_GELU) {  /* e^(-2u), u = sqrt(2 / pi) (g + 0.044715 g^3) */
                const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gate, gate), gate);
                minus = _mm512_mul_ps(_mm512_set1_ps(-2.0f * 0.7978845608028654f),
                                      _mm512_fmadd_ps(cube, _mm512_set1_ps(0.044715f), gate));
            }
            const __m512 act = bf16_round16(div16(gate, _mm512_add_ps(one, exp16(minus))));
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, bf16_round16(b))));
        } else {
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(a));
            _mm256_storeu_si256((__m256i *)(out + 16), (__m256i)_mm512_cvtneps_pbh(b));
        }
    }
}

/* Columns [0, amx_cols) of y (or of the glu output) through the tiles; x packed into `packed`
 * ([row blocks][k / 2][16][2] bfloat16). */
static void amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t w_stride, int64_t n,
                       const float *bias, int glu_mode, int64_t amx_cols, void *y, int io_dtype, uint32_t *packed,
                       int num_threads) {
    const int64_t out_cols = glu_mode ? n / 2 : n, pairs = k / 2, row_blocks = (m + AMX_ROWS - 1) / AMX_ROWS;
    for (int64_t rb = 0; rb < row_blocks; rb++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t r = 0; r < AMX_ROWS; r++) {
                const int64_t row = rb * AMX_ROWS + r;
                uint32_t pair = 0;
                if (row < m) memcpy(&pair, x + row * k + 2 * p, sizeof(pair));
                packed[(rb * pairs + p) * AMX_ROWS + r] = pair;
            }
    const int64_t tasks = glu_mode ? amx_cols / 16 : amx_cols / 32;
    task_share shares[num_threads];
#pragma omp parallel num_threads(num_threads)
    {
        /* each pass's sums are finished after the next pass's products are issued, so that the tiles multiply
         * while the vectors finish the pass before: [pass in turn][block][tile][weight row][row of x] */
        float sums[2][2][2][16][16] __attribute__((aligned(64)));
        int64_t done_first[2], done_second[2], done_rows[2][2], done_row0[2];
        int done = -1;  /* the stored pass's slot, or -1 */
        int64_t configured = -1;  /* the row counts the tiles are configured for (other code may reconfigure them) */
        deal_team(shares, tasks);
#define FINISH_DONE()                                                                                              \
        for (int b = 0; b < (done_rows[done][1] ? 2 : 1); b++)                                                    \
            amx_finish(sums[done][b], done_rows[done][b], done_first[done], done_second[done], glu_mode, bias, y,  \
                       out_cols, done_row0[done] + b * AMX_ROWS);
        for (int64_t task; (task = next_task(shares)) >= 0;) {
            const int64_t first = glu_mode ? 16 * task : 32 * task;  /* first weight row of each tile */
            const int64_t second = glu_mode ? out_cols + first : first + 16;
            const uint16_t *w1 = w + first * w_stride, *w2 = w + second * w_stride;
            /* where a task is one pass (a decode step's rows), the next task's weight rows over its steps, as the
             * int8 tiles' (a decode step 0.95x); with more passes the first brings the weights in for the others,
             * and the prefetches only cost (512 rows: 1.06x) */
            next_tiles ahead = next_tiles_of(w, w_stride * 2, row_blocks <= 2 && task + 1 < tasks ? task + 1 : -1,
                                             glu_mode, out_cols, k / 32);
            for (int64_t rb = 0; rb < row_blocks; rb += 2) {  /* two blocks of x a pass: each weight tile twice */
                const int64_t rows = MIN(AMX_ROWS, m - rb * AMX_ROWS);
                const int64_t rows2 = rb + 1 < row_blocks ? MIN(AMX_ROWS, m - (rb + 1) * AMX_ROWS) : 0;
                if (rows * 32 + rows2 != configured)
                    amx_configure((int)rows, (int)rows2), configured = rows * 32 + rows2;
                const uint32_t *x1 = packed + rb * pairs * AMX_ROWS, *x2 = x1 + pairs * AMX_ROWS;
                _tile_zero(0);
                _tile_zero(1);
                if (rows2) {
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t c = 0; c < k; c += 32) {
                        _tile_loadd(4, w1 + c, w_stride * 2);
                        _tile_loadd(5, w2 + c, w_stride * 2);
                        _tile_loadd(6, x1 + c / 2 * AMX_ROWS, 4 * AMX_ROWS);
                        _tile_loadd(7, x2 + c / 2 * AMX_ROWS, 4 * AMX_ROWS);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 5, 6);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                        next_tiles_step(&ahead);
                    }
                } else {
                    for (int64_t c = 0; c < k; c += 32) {
                        _tile_loadd(4, w1 + c, w_stride * 2);
                        _tile_loadd(5, w2 + c, w_stride * 2);
                        _tile_loadd(6, x1 + c / 2 * AMX_ROWS, 4 * AMX_ROWS);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 5, 6);
                        next_tiles_step(&ahead);
                    }
                }
                if (done >= 0) {
                    FINISH_DONE()
                }
                const int slot = done == 0 ? 1 : 0;
                _tile_stored(0, sums[slot][0][0], 64);
                _tile_stored(1, sums[slot][0][1], 64);
                if (rows2) {
                    _tile_stored(2, sums[slot][1][0], 64);
                    _tile_stored(3, sums[slot][1][1], 64);
                }
                done_first[slot] = first, done_second[slot] = second, done_row0[slot] = rb * AMX_ROWS;
                done_rows[slot][0] = rows, done_rows[slot][1] = rows2;
                done = slot;
            }
        }
        if (done >= 0) {
            FINISH_DONE()
        }
#undef FINISH_DONE
        _tile_release();
    }
}
#endif

/* The weight rows of block `block` (past the last one: the last real row, repeated): four consecutive ones, or
 * in glu mode two of the gate's and the same two of the up's. */
void block_rows(int64_t block, int glu_mode, int64_t n, int64_t out_cols, int64_t r[RW]) {
    if (glu_mode) {
        const int64_t j = MIN(2 * block, out_cols - 1), j1 = MIN(j + 1, out_cols - 1);
        r[0] = j, r[1] = j1, r[2] = out_cols + j, r[3] = out_cols + j1;
    } else {
        for (int c = 0; c < RW; c++) r[c] = MIN(RW * block + c, n - 1);
    }
}

#ifdef VW
/* Many rows of x (a prefill chunk, a vision tile's patches: GEMM_ROWS or more) multiply each weight by many rows,
 * and the arithmetic is what counts, not the reading. There the sums run the other way: a tile of MR rows of x by
 * NR output columns, 2 MR vector sums along the columns, each step along k one FMA per sum (no widening, no
 * reduction at the end). Both sides are packed once per call in k-major order: x by groups of MR rows
 * (`pack_rows`, each value then one broadcast), the weights one panel of NR columns at a time as float32
 * (`pack_panel`, in each thread's own buffer: no copy of the whole weight). A panel is PANEL_BLOCKS blocks of
 * `block_rows`, so finish_row finishes its tiles as it does the blocks. A scratch timing of a vision tile's
 * products (1,024 rows, 2 AVX-512 cores): 255-300 GFLOP/s by tiles, 185-250 by the blocks. */
#define NR (2 * VW)  /* output columns (weight rows) per panel: 32, 16 */
#define PANEL_BLOCKS (NR / RW)

/* Whether rows[0..NR) of a weight, `words` 32-bit words apart, can be gathered (each row's first word within
 * 2^31 words), and then each VW of them as a vector of word offsets. */
static int gather_lanes(const int64_t rows[NR], int64_t words, vi lanes[NR / VW]) {
    int32_t at[NR];
    for (int q = 0; q < NR; q++) {
        if (rows[q] * words > INT32_MAX) return 0;
        at[q] = (int32_t)(rows[q] * words);
    }
    for (int h = 0; h < NR / VW; h++) lanes[h] = lanes_of(at + h * VW);
    return 1;
}

/* Weight rows rows[0..NR) (each k long) as float32, k-major: wp[t * NR + q] = w[rows[q]][t]. bfloat16 (rows an
 * even number of elements apart) and float32 by gathers, VW rows at a time (a bfloat16 gather takes two k). */
static void pack_panel(const void *w, int dtype, int64_t w_stride, const int64_t rows[NR], int64_t k, float *wp) {
    vi lanes_by_half[NR / VW];
    if (!(dtype == F32 || (dtype == BF16 && w_stride % 2 == 0)) ||
        !gather_lanes(rows, dtype == F32 ? w_stride : w_stride / 2, lanes_by_half)) {
        for (int64_t t = 0; t < k; t++)
            for (int q = 0; q < NR; q++) wp[t * NR + q] = wvalue(w, dtype, rows[q] * w_stride + t);
        return;
    }
    for (int h = 0; h < NR / VW; h++) {
        const vi lanes = lanes_by_half[h];
        float *out = wp + h * VW;
        int64_t t = 0;
        if (dtype == F32) {
            for (; t < k; t++) vstore(out + t * NR, (vf)gather_words(lanes, (const float *)w + t));
            continue;
        }
        for (; t + 2 <= k; t += 2) {
            const vi pairs = gather_words(lanes, (const uint16_t *)w + t);
            vstore(out + t * NR, even_of(pairs));
            vstore(out + (t + 1) * NR, odd_of(pairs));
        }
        for (; t < k; t++)
            for (int l = 0; l < VW; l++) out[t * NR + l] = wvalue(w, dtype, rows[h * VW + l] * w_stride + t);
    }
}

/* Rows [i, i + MR) of x [m, k] (io_dtype) as float32, k-major: xp[t * MR + r] = x[i + r][t] (rows past m repeat
 * the last one; the caller drops their sums). */
static void pack_rows(const void *x, int io_dtype, int64_t m, int64_t k, int64_t i, float *xp) {
    enum { SPAN = 64 };
    float rows[MR][SPAN];
    for (int64_t t0 = 0; t0 < k; t0 += SPAN) {
        const int64_t span = MIN(SPAN, k - t0);
        for (int r = 0; r < MR; r++) load_floats(x, io_dtype, MIN(i + r, m - 1) * k + t0, span, rows[r]);
        for (int64_t t = 0; t < span; t++)
            for (int r = 0; r < MR; r++) xp[(t0 + t) * MR + r] = rows[r][t];
    }
}

/* tile [MR][NR] = packed rows xp times the packed panel wp. */
static void panel_tile(const float *xp, int64_t k, const float *wp, float *tile) {
    vf sums[MR][2];
    for (int r = 0; r < MR; r++) sums[r][0] = sums[r][1] = vzero();
    for (int64_t t = 0; t < k; t++) {
        const vf w0 = XLOAD(wp + t * NR), w1 = XLOAD(wp + t * NR + VW);
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            const vf xv = vset1(xp[t * MR + r]);
            sums[r][0] = vfma(xv, w0, sums[r][0]), sums[r][1] = vfma(xv, w1, sums[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) vstore(tile + r * NR, sums[r][0]), vstore(tile + r * NR + VW, sums[r][1]);
}

#ifdef __AVX512BF16__
/* The same tiles by the dot products (bfloat16 x and weights, `dot`): k in pairs, each pair one 32-bit word as
 * vdpbf16ps reads it (the even element in the low half; an odd k's last pair ends in zero). The panel is its rows'
 * words as gathered, [k / 2][NR] (no widening); x's rows likewise, [k / 2][MR], each word broadcast. */
static inline uint32_t pair_at(const uint16_t *row, int64_t t, int64_t k) {
    return (uint32_t)row[t] | (t + 1 < k ? (uint32_t)row[t + 1] << 16 : 0u);
}

static void pack_pair_panel(const uint16_t *w, int64_t w_stride, const int64_t rows[NR], int64_t k, uint32_t *wp) {
    const int64_t pairs = (k + 1) / 2, whole = k / 2;
    vi lanes_by_half[NR / VW];
    const int gathers = w_stride % 2 == 0 && gather_lanes(rows, w_stride / 2, lanes_by_half);
    for (int h = 0; h < NR / VW; h++) {
        uint32_t *out = wp + h * VW;
        int64_t p = 0;
        if (gathers)
            for (; p < whole; p++)
                _mm512_storeu_si512((void *)(out + p * NR), gather_words(lanes_by_half[h], w + 2 * p));
        for (; p < pairs; p++)
            for (int l = 0; l < VW; l++) out[p * NR + l] = pair_at(w + rows[h * VW + l] * w_stride, 2 * p, k);
    }
}

static void pack_row_pairs(const uint16_t *x, int64_t m, int64_t k, int64_t i, uint32_t *xp) {
    const int64_t pairs = (k + 1) / 2;
    for (int r = 0; r < MR; r++) {
        const uint16_t *row = x + MIN(i + r, m - 1) * k;
        for (int64_t p = 0; p < pairs; p++) xp[p * MR + r] = pair_at(row, 2 * p, k);
    }
}

static void pair_tile(const uint32_t *xp, int64_t pairs, const uint32_t *wp, float *tile) {
    vf sums[MR][2];
    for (int r = 0; r < MR; r++) sums[r][0] = sums[r][1] = vzero();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wp + p * NR));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wp + p * NR + VW));
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[p * MR + r]);
            sums[r][0] = _mm512_dpbf16_ps(sums[r][0], w0, xv), sums[r][1] = _mm512_dpbf16_ps(sums[r][1], w1, xv);
        }
    }
    for (int r = 0; r < MR; r++) vstore(tile + r * NR, sums[r][0]), vstore(tile + r * NR + VW, sums[r][1]);
}
#endif

/* Panels a task packs and then runs together, each x group once for them all (x comes from the L3 cache, the
 * panels stay in L2): as many as fit in PANELS_BYTES, at most MAX_SPAN. */
#define MAX_SPAN 4
#define PANELS_BYTES (1 << 20)
static inline int64_t panel_span(int64_t k) {
    const int64_t fit = PANELS_BYTES / (k * NR * 4);
    return fit < 1 ? 1 : MIN(MAX_SPAN, fit);
}

/* Blocks [block0, blocks) of y (see linear), `panel_span` panels a task, from x packed by MR rows into `xp`
 * (k * MR floats a group of rows); `panels` holds a task's panels for each thread, and a cache line more. */
static void gemm(const void *x, int64_t m, int64_t k, const void *w, int w_dtype, int64_t w_stride, int64_t n,
                 const float *bias, int glu_mode, int64_t block0, int64_t blocks, void *y, int io_dtype, int dot,
                 float *xp, float *panels, int num_threads) {
    const int64_t out_cols = glu_mode ? n / 2 : n, span = panel_span(k);
    const int64_t panel_count = (blocks - block0 + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    const int64_t tasks = (panel_count + span - 1) / span, groups = (m + MR - 1) / MR;
#ifndef __AVX512BF16__
    (void)dot;
#endif
    task_share shares[num_threads];
#pragma omp parallel num_threads(num_threads)
    {
        float *wp = (float *)(((uintptr_t)(panels + team_index() * (span * k * NR + 16)) + 63) & ~(uintptr_t)63);
#pragma omp for
        for (int64_t g = 0; g < groups; g++) {
#ifdef __AVX512BF16__
            if (dot) {
                pack_row_pairs(x, m, k, g * MR, (uint32_t *)xp + g * k * MR);
                continue;
            }
#endif
            pack_rows(x, io_dtype, m, k, g * MR, xp + g * k * MR);
        }
        deal_team(shares, tasks);
        for (int64_t task; (task = next_task(shares)) >= 0;) {
            const int64_t here = MIN(span, panel_count - task * span);
            int64_t rows_of[MAX_SPAN][NR], count[MAX_SPAN], first_col[MAX_SPAN], cols[MAX_SPAN];
            for (int64_t j = 0; j < here; j++) {
                const int64_t first_block = block0 + (task * span + j) * PANEL_BLOCKS;
                for (int b = 0; b < PANEL_BLOCKS; b++)
                    block_rows(first_block + b, glu_mode, n, out_cols, rows_of[j] + b * RW);
#ifdef __AVX512BF16__
                if (dot) pack_pair_panel(w, w_stride, rows_of[j], k, (uint32_t *)wp + j * k * NR);
                else
#endif
                    pack_panel(w, w_dtype, w_stride, rows_of[j], k, wp + j * k * NR);
                count[j] = MIN(PANEL_BLOCKS, blocks - first_block);
                first_col[j] = glu_mode ? 2 * first_block : RW * first_block;
                cols[j] = MIN(glu_mode ? 2 * count[j] : RW * count[j], out_cols - first_col[j]);
            }
            for (int64_t g = 0; g < groups; g++)
                for (int64_t j = 0; j < here; j++) {
                    float tile[MR * NR], done[NR];
#ifdef __AVX512BF16__
                    if (dot)
                        pair_tile((const uint32_t *)xp + g * k * MR, (k + 1) / 2, (const uint32_t *)wp + j * k * NR, tile);
                    else
#endif
                        panel_tile(xp + g * k * MR, k, wp + j * k * NR, tile);
                    for (int64_t s = 0; s < MIN(MR, m - g * MR); s++) {
                        finish_row(tile + s * NR, count[j], glu_mode, bias, rows_of[j], io_dtype, done);
                        store_floats(done, cols[j], y, io_dtype, (g * MR + s) * out_cols + first_col[j]);
                    }
                }
        }
    }
}
#endif

void add_residual(void *y, const void *residual, int dtype, int64_t offset, int64_t count) {
    float sum[256], other[256];
    for (int64_t at = offset; at < offset + count; at += 256) {
        const int64_t part = MIN(256, offset + count - at);
        load_floats(y, dtype, at, part, sum);
        load_floats(residual, dtype, at, part, other);
        for (int64_t i = 0; i < part; i++) sum[i] += other[i];
        store_floats(sum, part, y, dtype, at);
    }
}

static int float_linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int w_dtype,
                        int64_t w_stride, int64_t n, const float *bias, int mode, int glu_mode, void *y,
                        int num_threads);

/* x [m, k] in io_dtype, w [n, k] in w_dtype (rows `w_stride` elements apart), bias n floats or NULL; y [m, n]
 * (or [m, n / 2] with MODE_GLU) in io_dtype; `mode`: MODE_GLU | MODE_GELU | PRODUCTS_WIDEN bits. An I8 weight
 * comes with its float32 scales and int32 row sums [n] (linear_int8.c; NULL for float weights); `residual` (y's
 * shape and dtype, or NULL) is added as kernels.h says. Returns 2 where memory runs out. */
int linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int w_dtype, int64_t w_stride,
           int64_t n, const float *bias, const float *scale, const int32_t *row_sums, int mode, void *y,
           const void *residual, int num_threads) {
    const int glu_mode = !(mode & MODE_GLU) ? 0 : (mode & MODE_GELU) ? GLU_GELU : GLU_SILU;
    const int gelu = !glu_mode && (mode & MODE_GELU);  /* y's own GELU */
    if (w_dtype == I8)  /* the GELU and the residual in its epilogue */
        return linear_int8(x, io_dtype, m, k, w, w_stride, n, scale, row_sums, bias, glu_mode, gelu, y, residual,
                           num_threads);
    int failed = float_linear(x, io_dtype, m, k, w, w_dtype, w_stride, n, bias, mode, glu_mode, y, num_threads);
    if (!failed && gelu) failed = gelu_tanh(y, io_dtype, m * n, num_threads);  /* a pass over y after the products */
    if (failed || !residual) return failed;
    const int64_t out_cols = glu_mode ? n / 2 : n;  /* a pass over y after the products */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * out_cols >= 65536)
    for (int64_t i = 0; i < m; i++) add_residual(y, residual, io_dtype, i * out_cols, out_cols);
    return 0;
}

/* The float weights' products (bfloat16, float16, float32): `linear` less the residual. */
static int float_linear(const void *x, int io_dtype, int64_t m, int64_t k, const void *w, int w_dtype,
                        int64_t w_stride, int64_t n, const float *bias, int mode, int glu_mode, void *y,
                        int num_threads) {
    const int64_t item = w_dtype == F32 ? 4 : 2, out_cols = glu_mode ? n / 2 : n;
    const int64_t blocks = glu_mode ? (out_cols + 1) / 2 : (n + RW - 1) / RW;
    int64_t block0 = 0;  /* the first block the vector path computes (past what the tiles did) */
#ifdef __AMX_BF16__
    if (io_dtype == BF16 && w_dtype == BF16 && k % 32 == 0 && m >= AMX_MIN_ROWS && amx_permitted()) {
        const int64_t amx_cols = glu_mode ? out_cols / 16 * 16 : n / 32 * 32;
        if (amx_cols > 0) {
            uint32_t *packed = thread_scratch((size_t)((m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * (k / 2)) * 4);
            if (!packed) return 2;
            amx_linear(x, m, k, w, w_stride, n, bias, glu_mode, amx_cols, y, io_dtype, packed, num_threads);
            block0 = glu_mode ? amx_cols / 2 : amx_cols / RW;
            if (block0 >= blocks) return 0;
        }
    }
#endif
    const int64_t tasks = (blocks - block0 + NB - 1) / NB;
#ifdef __AVX512BF16__
    const int dot = io_dtype == BF16 && w_dtype == BF16 && !(mode & PRODUCTS_WIDEN);
#else
    const int dot = 0;
#endif
#ifdef VW
    const int many = m >= GEMM_ROWS;  /* by tiles (gemm) */
    const int split = !dot && !many && w_dtype == BF16;  /* x reordered for the bfloat16 blocks */
#else
    const int many = 0, split = 0;
#endif
#ifdef VW
    if (many) {  /* x packed by groups of rows, and a task's panels' buffer per thread */
        float *xp = thread_scratch((size_t)((m + MR - 1) / MR * MR * k) * sizeof(float));
        float *panels = thread_scratch_at(1, (size_t)(num_threads * (panel_span(k) * k * NR + 16)) * sizeof(float));
        if (!xp || !panels) return 2;
        gemm(x, m, k, w, w_dtype, w_stride, n, bias, glu_mode, block0, blocks, y, io_dtype, dot, xp, panels,
             num_threads);
        return 0;
    }
#else
    (void)many;
#endif
    const float *xf = (const float *)x;
    if (!dot && (io_dtype != F32 || split)) {
        float *converted = thread_scratch((size_t)(m * k) * sizeof(float));
        if (!converted) return 2;
        load_floats(x, io_dtype, 0, m * k, converted);
#ifdef VW
        if (split) split_pairs(converted, m, k);
#endif
        xf = converted;
    }
    task_share shares[num_threads];
    const int64_t ahead = blocks_ahead(k * item);
#pragma omp parallel num_threads(num_threads) if (m * n * k >= 65536)
    for (int64_t i0 = 0; i0 < m; i0 += MC) {
        const int64_t chunk = MIN(MC, m - i0), per_block = rows_per_block(chunk, RX);
        int64_t rows_of[(NB + MAX_AHEAD) * RW];  /* a task's (take_task) */
        deal_team(shares, tasks);
        for (task_blocks t; take_task(shares, block0, blocks, glu_mode, n, out_cols, ahead, rows_of, &t);) {
            float sums[MC * NB * RW];
            memset(sums, 0, sizeof(float) * (size_t)(chunk * NB * RW));
            for (int64_t b = 0; b < t.count; b++) {
                const void *wr[RW], *wn[RW];
                for (int c = 0; c < RW; c++) {
                    wr[c] = (const char *)w + rows_of[b * RW + c] * w_stride * item;
                    wn[c] = (const char *)w + rows_of[(b + ahead) * RW + c] * w_stride * item;
                }
                for (int64_t i = i0; i < i0 + chunk; i += per_block) {
                    const int rows = (int)MIN(per_block, i0 + chunk - i);
                    const void *const *next = i == i0 ? wn : wr;  /* later passes find the block in the cache */
                    float *out = sums + (i - i0) * NB * RW + b * RW;
#ifdef __AVX512BF16__
                    if (dot) {
                        DP_FNS[rows - 1]((const uint16_t *)x + i * k, k, wr, next, out, NB * RW);
                        continue;
                    }
#endif
#ifdef VW
                    BLOCK_FNS[w_dtype][rows - 1](xf + i * k, k, wr, next, out, NB * RW);
#else
                    (void)next;
                    tail(xf + i * k, k, 0, wr, w_dtype, rows, out, NB * RW);
#endif
                }
            }
            for (int64_t s = 0; s < chunk; s++) {
                float done[NB * RW];
                finish_row(sums + s * NB * RW, t.count, glu_mode, bias, rows_of, io_dtype, done);
                store_floats(done, t.cols, y, io_dtype, (i0 + s) * out_cols + t.first_col);
            }
        }
        if (i0 + MC < m) {  /* the next chunk's deal waits for this one's tasks (the last's: the region's end) */
#pragma omp barrier
        }
    }
    return 0;
}
