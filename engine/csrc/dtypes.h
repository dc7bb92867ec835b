/* What the CPU kernels share: the dtypes they read and write, converted to and from float32 in registers; the
 * calling thread's place in its OpenMP team. */
#ifndef VLMCAP_DTYPES_H
#define VLMCAP_DTYPES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define MIN(a, b) ((a) < (b) ? (a) : (b))

#ifdef _OPENMP
static inline int team_size(void) { return omp_get_num_threads(); }
static inline int team_index(void) { return omp_get_thread_num(); }
#else
static inline int team_size(void) { return 1; }
static inline int team_index(void) { return 0; }
#endif

/* `count` values of `src` (from element `offset`, in `dtype`) as float32 into `dst`. */
static inline void load_floats(const void *src, int dtype, int64_t offset, int64_t count, float *dst) {
    if (dtype == F32) {
        memcpy(dst, (const float *)src + offset, (size_t)count * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *from = (const uint16_t *)src + offset;
        int64_t t = 0;
#ifdef VECTOR
        for (; t + 8 <= count; t += 8) {
            __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(from + t)));
            _mm256_storeu_ps(dst + t, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
#endif
        for (; t < count; t++) {
            uint32_t bits = (uint32_t)from[t] << 16;
            memcpy(dst + t, &bits, sizeof(bits));
        }
    } else {
        const _Float16 *from = (const _Float16 *)src + offset;
        for (int64_t t = 0; t < count; t++) dst[t] = (float)from[t];
    }
}

/* Whether a float's bits are a NaN's: by the bits, not a comparison (the builds' -ffast-math assumes no NaN). */
static inline int nan_word(uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }

/* v rounded to bfloat16 (nearest even, as torch rounds) and widened back. */
static inline float rounded_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof(bits));
    bits = nan_word(bits) ? (bits | 0x00400000u) & 0xffff0000u  /* NaN stays NaN */
                          : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &bits, sizeof(bits));
    return v;
}

/* v rounded to `dtype` and widened back (float32: v), as torch rounds a result to its dtype. */
static inline float rounded(float v, int dtype) {
    if (dtype == F32) return v;
    if (dtype == F16) return (float)(_Float16)v;
    return rounded_bf16(v);
}

#ifdef VECTOR
/* e^x to about a float's precision, a vector at a time (P: the intrinsics' prefix, _mm512 or _mm256): 2^n e^r,
 * |r| <= ln 2 / 2, e^r by a polynomial into p (below -87: e^-87); ROUND rounds to the nearest integer. The caller
 * then scales p by 2^n. */
#define EXP_POLYNOMIAL(P, V, ROUND) \
    x = P##_max_ps(x, P##_set1_ps(-87.0f)); \
    const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), \
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693145751953125f), x); \
    r = P##_fnmadd_ps(n, P##_set1_ps(1.428606765330187045e-06f), r); \
    V p = P##_set1_ps(1.9875691500e-4f); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f)); \
    p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));
#endif

#ifdef __AVX512F__
/* a / b, 16 at a time, as IEEE divides (torch's division): -ffast-math makes a vector division a reciprocal
 * estimate and a Newton step (GCC's default -mrecip=vec-div), which rounds differently and gives NaN for an
 * infinite b. */
static inline __attribute__((always_inline)) __m512 div16(__m512 a, __m512 b) {
    __m512 q;
    __asm__("vdivps %2, %1, %0" : "=v"(q) : "v"(a), "v"(b));
    return q;
}

/* e^x, 16 at a time (EXP_POLYNOMIAL). */
static inline __m512 exp16(__m512 x) {
    EXP_POLYNOMIAL(_mm512, __m512, _mm512_roundscale_ps)
    return _mm512_scalef_ps(p, n);
}

/* c[0] + c[1] x + ... + c[degree] x^degree, 16 at a time, by Horner's rule in fused products (the softmax's and
 * GELU's 2^f: each caller's table is fitted for its own precision). */
static inline __attribute__((always_inline)) __m512 polynomial16(__m512 x, const float *c, int degree) {
    __m512 p = _mm512_set1_ps(c[degree]);
    for (int i = degree - 1; i >= 0; i--) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c[i]));
    return p;
}

/* 16 consecutive values from element `at` of `p` (in `dtype`) as float32 (I8: the integers, unscaled). */
static inline __attribute__((always_inline)) __m512 widen16(const void *p, int dtype, int64_t at) {
    if (dtype == I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + at))));
    if (dtype == BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at))), 16));
    if (dtype == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
    return _mm512_loadu_ps((const float *)p + at);
}

/* The lanes of v that hold a NaN: nan_word's test, 16 at a time. */
static inline __attribute__((always_inline)) __mmask16 nan_lanes16(__m512 v) {
    return _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)),
                                   _mm512_set1_epi32(0x7f800000));
}

/* 16 floats rounded to bfloat16 as store_floats rounds them (nearest even, NaN kept a NaN), in the upper halves
 * of their words, by integer arithmetic. */
static inline __attribute__((always_inline)) __m512i bf16_high_words16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __mmask16 nan = nan_lanes16(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
    return _mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet), _mm512_set1_epi32((int)0xffff0000u));
}

/* 16 floats as bfloat16 words, rounded as store_floats rounds them. With AVX-512 BF16 by vcvtneps2bf16 (one
 * instruction for some eleven): it rounds to nearest even and quiets a NaN as store_floats does, but flushes a
 * denormal float to zero, so lanes holding one (a value below 2^-126: rare) take the integer way. */
static inline __attribute__((always_inline)) __m256i bf16_words16(__m512 v) {
#ifdef __AVX512BF16__
    const __m256i words = (__m256i)_mm512_cvtneps_pbh(v);
    const __mmask16 denormal = _mm512_fpclass_ps_mask(v, 0x20);
    if (__builtin_expect(denormal == 0, 1)) return words;
    return _mm256_mask_mov_epi16(words, denormal, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high_words16(v), 16)));
#else
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high_words16(v), 16));
#endif
}

/* 16 floats rounded to bfloat16 as store_floats rounds them, widened back. */
static inline __attribute__((always_inline)) __m512 rounded_bf16_16(__m512 v) {
#ifdef __AVX512BF16__
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_words16(v)), 16));
#else
    return _mm512_castsi512_ps(bf16_high_words16(v));
#endif
}
#endif

/* `count` float32 values into `dst` (from element `offset`) in `dtype`, rounded to nearest even as torch does. */
static inline void store_floats(const float *src, int64_t count, void *dst, int dtype, int64_t offset) {
    if (dtype == BF16) {
        uint16_t *out = (uint16_t *)dst + offset;
        int64_t t = 0;
#ifdef __AVX512BF16__
        for (; t + 16 <= count; t += 16) _mm256_storeu_si256((__m256i *)(out + t), bf16_words16(_mm512_loadu_ps(src + t)));
#endif
        for (; t < count; t++) {  /* one expression, so that the compiler vectorises the loop */
            uint32_t bits;
            memcpy(&bits, src + t, sizeof(bits));
            out[t] = (uint16_t)(nan_word(bits) ? (bits >> 16) | 0x40u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        }
    } else if (dtype == F16) {
        _Float16 *out = (_Float16 *)dst + offset;
        for (int64_t t = 0; t < count; t++) out[t] = (_Float16)src[t];
    } else {
        memcpy((float *)dst + offset, src, (size_t)count * sizeof(float));
    }
}

#ifdef VECTOR
/* a / b, 8 at a time, as IEEE divides (div16). */
static inline __attribute__((always_inline)) __m256 div8(__m256 a, __m256 b) {
    __m256 q;
    __asm__("vdivps %2, %1, %0" : "=x"(q) : "x"(a), "x"(b));
    return q;
}
#endif

#if defined(VECTOR) && !defined(__AVX512F__)
/* e^x, 8 at a time (EXP_POLYNOMIAL; 2^n built in the exponent bits: n stays within [-126, 0] for x <= 0, the
 * softmax's range). */
static inline __m256 exp8(__m256 x) {
    EXP_POLYNOMIAL(_mm256, __m256, _mm256_round_ps)
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* 8 consecutive values from element `at` of `p` (in `dtype`) as float32 (I8: the integers, unscaled). */
static inline __attribute__((always_inline)) __m256 widen8(const void *p, int dtype, int64_t at) {
    if (dtype == I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + at))));
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at))), 16));
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
    return _mm256_loadu_ps((const float *)p + at);
}
#endif

/* An int8 KV cache (engine/kv_cache.py's `quantize_kv` states the rule): per token and KV head, t = max|x| / 127,
 * s = the least power of two >= t within 2^-24..2^120 (2^9 for a float16 model; 1 where the max is 0 or t is not
 * finite), q = x / s rounded half to even and clamped to [-127, 127]; read back as (float)q * s rounded to the
 * model's dtype, which that scale makes exact: a reader may apply s after a dot product or fold it into a weight
 * and get the same bits. t's division is an IEEE one, as torch divides (which power of two follows depends on its
 * last bit): OPAQUE hides the divisor from -ffast-math, which would otherwise multiply by its rounded reciprocal;
 * x / s is exact, a product by 1 / s. */
#if defined(__x86_64__) || defined(__i386__)
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))
#else
#define OPAQUE(v) do { volatile __typeof__(v) opaque_ = (v); (v) = opaque_; } while (0)
#endif
#define INT8_LIMIT 127.0f

/* The power of two `quantize_row` scales by, for the largest magnitude `top` of a row of a `dtype` model. */
static inline float kv_scale(float top, int dtype) {
    if (top == 0.0f) return 1.0f;
    float limit = INT8_LIMIT;
    OPAQUE(limit);
    const float t = top / limit;
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    const int32_t field = (int32_t)(bits >> 23) & 0xff;
    if (field == 0xff) return 1.0f;  /* t infinite or NaN (torch's frexp: exponent 0) */
    int32_t exponent = field == 0 ? -126 : field - 127 + ((bits & 0x7fffff) != 0);  /* 2^exponent >= t, least */
    const int32_t highest = dtype == F16 ? 9 : 120;
    exponent = exponent < -24 ? -24 : exponent > highest ? highest : exponent;
    const uint32_t power = (uint32_t)(exponent + 127) << 23;
    float scale;
    memcpy(&scale, &power, sizeof scale);
    return scale;
}

/* x [count] (float32 values of the `dtype` model's) into q; returns its scale. */
static inline float quantize_row(const float *x, int64_t count, int8_t *q, int dtype) {
    float top = 0.0f;
    for (int64_t j = 0; j < count; j++) top = fabsf(x[j]) > top ? fabsf(x[j]) : top;
    const float scale = kv_scale(top, dtype), inverse = 1.0f / scale;  /* both powers of two: exact */
    for (int64_t j = 0; j < count; j++) {
        const float r = rintf(x[j] * inverse);
        q[j] = (int8_t)(r > INT8_LIMIT ? INT8_LIMIT : r < -INT8_LIMIT ? -INT8_LIMIT : r);
    }
    return scale;
}

/* `count` int8 values from element `offset` of `src` times their row's `scale`, into dst: the values they stand for,
 * exact in float32 and in the model's dtype (kv_scale's powers of two). */
static inline void load_dequantized(const void *src, int64_t offset, int64_t count, float scale, float *dst) {
    const int8_t *from = (const int8_t *)src + offset;
    for (int64_t t = 0; t < count; t++) dst[t] = (float)from[t] * scale;
}

/* Growable buffers of the calling thread (SCRATCH_SLOTS of them, one set per source file), kept across calls: no
 * allocation per call. release_scratch (scratch.c) frees those of the calling thread and its OpenMP team in every
 * file: the engine calls it once start-up's timings, which ran the largest shapes, are done, so that a buffer keeps
 * only what steps need. */
#define SCRATCH_SLOTS 2
/* A buffer's start, a page: malloc's 16 bytes would leave every 64-byte row a kernel reads from it (x's quantized
 * rows, an AMX tile's packed weights) across two cache lines, at a place varying with the heap's state. */
#define SCRATCH_ALIGN 4096
static __thread void *scratch_buffer[SCRATCH_SLOTS];
static __thread size_t scratch_held[SCRATCH_SLOTS];
static inline void *thread_scratch_at(int slot, size_t bytes) {
    if (bytes > scratch_held[slot]) {
        free(scratch_buffer[slot]);
        if (posix_memalign(&scratch_buffer[slot], SCRATCH_ALIGN, bytes)) scratch_buffer[slot] = NULL;
        scratch_held[slot] = scratch_buffer[slot] ? bytes : 0;
    }
    return scratch_buffer[slot];
}
static void release_file_scratch(void) {
    for (int slot = 0; slot < SCRATCH_SLOTS; slot++) {
        free(scratch_buffer[slot]);
        scratch_buffer[slot] = NULL;
        scratch_held[slot] = 0;
    }
}
void register_scratch(void (*release)(void));  /* scratch.c */
__attribute__((constructor)) static void register_file_scratch(void) { register_scratch(release_file_scratch); }
static inline void *thread_scratch(size_t bytes) { return thread_scratch_at(0, bytes); }

#endif
