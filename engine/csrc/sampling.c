/* Sampling a token from each of a step's sampled rows (engine/sampling.py states the rule): a row's weights
 * w = e^((logit - the row's maximum) / temperature), cut to those of at least a threshold weight that top_k and
 * top_p set, and one draw u in [0, 1) by the inverse of their cumulative sum in token order: the first token whose
 * running sum exceeds u times their total. A weight of 0 (a logit of -inf, or more than 87 below the maximum after
 * the temperature) is never drawn.
 *
 * The threshold is found without sorting the vocabulary: a radix selection over the weights' float bits (a
 * non-negative float's bits order as its value), 13 bits a level, then 10, then 9, each level a histogram of
 * counts and masses walked from the top; only the bin that holds the boundary goes on to the next level. top_k keeps
 * every weight of which fewer than k are larger (ties with the k-th are kept, as transformers' TopKLogitsWarper
 * keeps them); top_p, among those, every weight the mass of the larger ones stays under top_p times their total
 * (the smallest prefix of the weights largest first whose mass reaches top_p, tied weights kept together).
 * Before the histograms, two shortcuts: a top_k up to SMALL_TOP_K keeps its candidates in a buffer as the row is
 * read (the tokens at or above the k-th largest weight so far; top_p then walks them sorted), and top_p alone
 * histograms only the weights above (1 - top_p) / 2 of the mean, which it cannot keep. */
#include "dtypes.h"
#include "kernels.h"

#define LEVEL1_SHIFT 19      /* level 1 bins a weight's bits >> 19: its exponent and 4 bits of its mantissa */
#define LEVEL1_BINS 4096     /* (bits & 0x7fffffff) >> 19 */
#define DRAW_BLOCK 64        /* the draw over a whole row sums blocks of this many weights, then walks one */
#define EXP_FLOOR -87.0f     /* below, a weight is 0 (e^-87 is about float32's least normal number) */
#define SMALL_TOP_K 256      /* a top_k up to this keeps its candidates in a buffer as the row is read */
#define SCAN_AHEAD 2048      /* bytes of a row asked for ahead of row_max's pass (scan_columns) */

typedef struct {
    uint32_t key;
    float w;
    int32_t id;
} item;

/* A weight's bits as an unsigned integer that orders as the weight does (w >= 0; a NaN's sign bit dropped). */
static inline uint32_t key_of(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof(bits));
    return bits & 0x7fffffffu;
}

/* Logit i of `logits` (float32 or bfloat16, widened exactly as torch's float() widens it). */
static inline float logit_at(const void *logits, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)logits)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)logits)[i] << 16;
    float v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

/* w[i] = e^((logits[at + i] - top) * inv_t) (float32 or bfloat16 logits), 0 below EXP_FLOOR; returns their sum. The
 * vector builds' last partial vector masked. */
static double weights(const void *logits, int dtype, int64_t at, int64_t vocab, float top, float inv_t, float *w) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 t = _mm512_set1_ps(top), s = _mm512_set1_ps(inv_t), floor = _mm512_set1_ps(EXP_FLOOR);
    __m512d sum = _mm512_setzero_pd();  /* in float64: top_p's bound is a fraction of it */
    for (; i < vocab; i += 16) {
        const __mmask16 lanes = vocab - i >= 16 ? 0xffff : (__mmask16)((1u << (vocab - i)) - 1);
        const __m512 v = dtype == F32 ? _mm512_maskz_loadu_ps(lanes, (const float *)logits + at + i)
                                      : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)logits + at + i)), 16));
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(v, t), s);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ) & lanes, exp16(x));
        _mm512_mask_storeu_ps(w + i, lanes, e);
        sum = _mm512_add_pd(sum, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        sum = _mm512_add_pd(sum, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    return _mm512_reduce_add_pd(sum);
#elif defined(VECTOR)
    const __m256 t = _mm256_set1_ps(top), s = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(EXP_FLOOR);
    __m256d sum = _mm256_setzero_pd();  /* in float64: top_p's bound is a fraction of it */
    for (; i < vocab; i += 8) {
        const int64_t n = MIN(8, vocab - i);
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 v;
        if (n == 8) {
            v = widen8(logits, dtype, at + i);
        } else {  /* the last partial vector's logits as float32, zeros past them */
            float tail[8] = {0};
            load_floats(logits, dtype, at + i, n, tail);
            v = _mm256_loadu_ps(tail);
        }
        const __m256 x = _mm256_mul_ps(_mm256_sub_ps(v, t), s);
        const __m256 e = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(x, floor, _CMP_GE_OQ), _mm256_castsi256_ps(lanes)),
                                       exp8(x));
        _mm256_maskstore_ps(w + i, lanes, e);
        sum = _mm256_add_pd(sum, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        sum = _mm256_add_pd(sum, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double lanes_sum[4];
    _mm256_storeu_pd(lanes_sum, sum);
    return (lanes_sum[0] + lanes_sum[1]) + (lanes_sum[2] + lanes_sum[3]);
#else
    double total = 0.0;
    for (; i < vocab; i++) {
        const float x = (logit_at(logits, dtype, at + i) - top) * inv_t;
        w[i] = x >= EXP_FLOOR ? expf(x) : 0.0f;
        total += w[i];
    }
    return total;
#endif
}

/* The mask of the 16 (AVX-512) or 8 (AVX2) weights from w + i whose key is at least `least`; GROUP: how many. */
#ifdef __AVX512F__
#define GROUP 16
static inline uint32_t at_least(const float *w, int64_t i, uint32_t least) {
    const __m512i keys = _mm512_and_si512(_mm512_loadu_si512(w + i), _mm512_set1_epi32(0x7fffffff));
    return _mm512_cmpge_epu32_mask(keys, _mm512_set1_epi32((int)least));
}
#elif defined(VECTOR)
#define GROUP 8
static inline uint32_t at_least(const float *w, int64_t i, uint32_t least) {  /* keys < 2^31: a signed compare */
    const __m256i keys = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + i)), _mm256_set1_epi32(0x7fffffff));
    const __m256i below = _mm256_set1_epi32((int)least - 1);
    return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, below)));
}
#else
#define GROUP 1
static inline uint32_t at_least(const float *w, int64_t i, uint32_t least) { return key_of(w[i]) >= least; }
#endif

/* items = the tokens whose key is at least `least`, in token order; returns their count. */
static int64_t gather(const float *w, int64_t vocab, uint32_t least, item *items) {
    int64_t m = 0, i = 0;
    for (; i + GROUP <= vocab; i += GROUP)
        for (uint32_t hit = at_least(w, i, least); hit; hit &= hit - 1) {
            const int64_t t = i + __builtin_ctz(hit);
            items[m++] = (item){key_of(w[t]), w[t], (int32_t)t};
        }
    for (; i < vocab; i++)
        if (key_of(w[i]) >= least) items[m++] = (item){key_of(w[i]), w[i], (int32_t)i};
    return m;
}

/* The k-th largest of keys[0..n) (1 <= k <= n), keys reordered: a quickselect. */
static uint32_t kth_largest(uint32_t *keys, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const uint32_t pivot = keys[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (keys[i] > pivot) i++;
            while (keys[j] < pivot) j--;
            if (i <= j) {
                const uint32_t swap = keys[i];
                keys[i++] = keys[j];
                keys[j--] = swap;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return keys[want];
    }
    return keys[want];
}

/* Keeps the items whose key is at least that of the k-th largest (ties kept), in their order; returns their count
 * and that key in *least. */
static int64_t keep_top(item *items, int64_t m, int64_t k, uint32_t *keys, uint32_t *least) {
    for (int64_t j = 0; j < m; j++) keys[j] = items[j].key;
    *least = kth_largest(keys, m, k);
    int64_t kept = 0;
    for (int64_t j = 0; j < m; j++)
        if (items[j].key >= *least) items[kept++] = items[j];
    return kept;
}

/* A small top_k's candidates as the row is read: the tokens at or above the k-th largest key so far (a buffer of
 * `capacity`, cut back to them when full), then the final cut. Returns how many remain (ties with the k-th
 * included), with the k-th's key in *least; -1 where ties keep the buffer too full to go on (the caller then
 * selects by histograms). */
static int64_t top_candidates(const float *w, int64_t vocab, int64_t k, item *items, int64_t capacity,
                              uint32_t *keys, uint32_t *least) {
    int64_t m = 0;  /* m + GROUP <= capacity at each group's start */
    *least = 0;
    for (int64_t i = 0; i < vocab; i += GROUP) {
        const int64_t end = MIN(i + GROUP, vocab);
        uint32_t hit = 0;
        if (end - i == GROUP) hit = at_least(w, i, *least);
        else
            for (int64_t t = i; t < end; t++) hit |= (uint32_t)(key_of(w[t]) >= *least) << (t - i);
        for (; hit; hit &= hit - 1) {
            const int64_t t = i + __builtin_ctz(hit);
            items[m++] = (item){key_of(w[t]), w[t], (int32_t)t};
        }
        if (m + GROUP > capacity) {
            m = keep_top(items, m, k, keys, least);
            if (m > capacity / 2) return -1;
        }
    }
    return m < k ? m : keep_top(items, m, k, keys, least);
}

static int by_key_descending(const void *a, const void *b) {
    const uint32_t x = ((const item *)a)->key, y = ((const item *)b)->key;
    return (x < y) - (x > y);
}

static int by_id(const void *a, const void *b) {
    const int32_t x = ((const item *)a)->id, y = ((const item *)b)->id;
    return (x > y) - (x < y);
}

/* Counts and masses by bin. */
typedef struct {
    int64_t count[LEVEL1_BINS];
    double mass[LEVEL1_BINS];
} bins;

/* The bin of `b`'s first `n` (walked from the highest) where what lies above it (count, or mass where by_mass)
 * plus its own first reaches `bound`, with what lies above it in *above (added to); the lowest non-empty bin where
 * the sums fall short (rounding: a level's masses summed in another order than the level before it). -1: no bin
 * is non-empty. */
static int64_t boundary_bin(const bins *b, int64_t n, int by_mass, double bound, double *above) {
    int64_t lowest = -1;
    double lowest_above = *above, sum = *above;
    for (int64_t i = n - 1; i >= 0; i--) {
        if (!b->count[i]) continue;
        const double here = by_mass ? b->mass[i] : (double)b->count[i];
        if (sum + here >= bound) {
            *above = sum;
            return i;
        }
        lowest = i;
        lowest_above = sum;
        sum += here;
    }
    *above = lowest_above;
    return lowest;
}

/* The least key kept among `items` where a key is kept if the weights with larger keys total (by count, or by mass
 * where by_mass) less than `bound`: the key of the group at the boundary, by levels (the file's comment);
 * `fallback` where the items never reach the bound. `level1` holds the items' level-1 histogram; `sub` and
 * `picked` are scratch. */
static uint32_t select_key(const item *items, int64_t m, const bins *level1, int by_mass, double bound,
                           uint32_t fallback, item *picked, bins *sub) {
    double above = 0.0, sum = 0.0;
    for (int64_t i = 0; i < LEVEL1_BINS; i++) sum += by_mass ? level1->mass[i] : (double)level1->count[i];
    if (sum < bound) return fallback;
    const int64_t top = boundary_bin(level1, LEVEL1_BINS, by_mass, bound, &above);
    if (top < 0) return fallback;
    int64_t n = 0;
    for (int64_t j = 0; j < m; j++)
        if ((items[j].key >> LEVEL1_SHIFT) == (uint32_t)top) picked[n++] = items[j];
    uint32_t key = (uint32_t)top << LEVEL1_SHIFT;
    static const int shifts[2] = {9, 0}, widths[2] = {10, 9};
    for (int level = 0; level < 2; level++) {
        const int shift = shifts[level];
        const uint32_t mask = (1u << widths[level]) - 1;
        const int64_t bins_here = (int64_t)mask + 1;
        memset(sub->count, 0, (size_t)bins_here * sizeof(sub->count[0]));
        memset(sub->mass, 0, (size_t)bins_here * sizeof(sub->mass[0]));
        for (int64_t j = 0; j < n; j++) {
            const uint32_t s = (picked[j].key >> shift) & mask;
            sub->count[s]++;
            sub->mass[s] += picked[j].w;
        }
        const int64_t s = boundary_bin(sub, bins_here, by_mass, bound, &above);
        if (s < 0) break;  /* cannot happen: the bin picked is not empty */
        int64_t kept = 0;
        for (int64_t j = 0; j < n; j++)
            if (((picked[j].key >> shift) & mask) == (uint32_t)s) picked[kept++] = picked[j];
        n = kept;
        key |= (uint32_t)s << shift;
    }
    return key;
}

/* The token drawn at u among a whole row's weights (the file's comment): the blocks' sums, then a walk in the
 * block where the running sum passes u times the total. Where rounding leaves it short, the last token of
 * positive weight in that block, or in the row. */
static int64_t draw_row(const float *w, int64_t vocab, double u, float *sums) {
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * DRAW_BLOCK, end = MIN(start + DRAW_BLOCK, vocab);
        float s = 0.0f;
        for (int64_t i = start; i < end; i++) s += w[i];
        sums[b] = s;
        total += s;
    }
    const double target = u * total;
    double before = 0.0, chosen_before = 0.0;
    int64_t chosen = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (sums[b] > 0.0f || before + sums[b] > target) {  /* the block drawn, or the last of positive sum */
            chosen = b;
            chosen_before = before;
            if (before + sums[b] > target) break;
        }
        before += sums[b];
    }
    before = chosen_before;
    const int64_t start = chosen * DRAW_BLOCK, end = MIN(start + DRAW_BLOCK, vocab);
    int64_t last = start;
    for (int64_t i = start; i < end; i++) {
        if (w[i] <= 0.0f) continue;
        before += w[i];
        last = i;
        if (before > target) return i;
    }
    return last;
}

/* The token drawn at u among the items (in token order) whose key is at least `least`. */
static int64_t draw_items(const item *items, int64_t m, uint32_t least, double u) {
    double total = 0.0;
    for (int64_t j = 0; j < m; j++) total += items[j].key >= least ? items[j].w : 0.0f;
    const double target = u * total;
    double before = 0.0;
    int64_t last = m ? items[0].id : 0;
    for (int64_t j = 0; j < m; j++) {
        if (items[j].key < least || items[j].w <= 0.0f) continue;
        before += items[j].w;
        last = items[j].id;
        if (before > target) return last;
    }
    return last;
}

/* Each thread's buffers for rows of `vocab`. */
typedef struct {
    float *w, *sums;
    bins *level1, *sub;
    item *items, *picked;
    uint32_t *keys;
} buffers;

/* The least key top_p keeps among items[0..m) sorted largest first (all kept so far): that of the last whose
 * larger ones' mass is under top_p times their total. */
static uint32_t top_p_key(const item *items, int64_t m, float top_p) {
    double total = 0.0;
    for (int64_t j = 0; j < m; j++) total += items[j].w;
    const double bound = (double)top_p * total;
    double before = 0.0;
    int64_t last = 0;
    for (int64_t j = 0; j < m && before < bound; j++) {
        last = j;
        before += items[j].w;
    }
    return items[last].key;
}

/* One row's token (the file's comment); 0 where its maximum `top` is not finite (the caller fails that row). */
static int64_t sample_row(const void *logits, int dtype, int64_t at, int64_t vocab, float top, float inv_t,
                          int64_t top_k, float top_p, double u, const buffers *b) {
    uint32_t bits;
    memcpy(&bits, &top, sizeof(bits));
    if ((bits & 0x7f800000u) == 0x7f800000u) return -1;  /* a NaN or an infinity: bits, since -ffast-math */
    const double total = weights(logits, dtype, at, vocab, top, inv_t, b->w);
    const int by_count = top_k > 0 && top_k < vocab, by_mass = top_p < 1.0f;
    if (!by_count && !by_mass) return draw_row(b->w, vocab, u, b->sums);
    uint32_t least = 0;
    if (by_count && top_k <= SMALL_TOP_K) {  /* the candidates in a buffer, sorted: top_p walks them */
        const int64_t m = top_candidates(b->w, vocab, top_k, b->items, 4 * top_k + 4 * GROUP, b->keys, &least);
        if (m >= 0) {
            if (by_mass) {
                qsort(b->items, (size_t)m, sizeof(item), by_key_descending);
                const uint32_t key = top_p_key(b->items, m, top_p);
                least = key > least ? key : least;
                qsort(b->items, (size_t)m, sizeof(item), by_id);
            }
            return draw_items(b->items, m, least, u);
        }
    }
    /* Histograms. top_p alone skips the weights at or below (1 - top_p) / 2 of the mean: the least weight it keeps
     * is above (1 - top_p) times the mean (the weights it drops, each below that least one, hold more than
     * 1 - top_p of the mass). */
    const uint32_t floor = by_count ? 0 : key_of((float)(0.5 * (1.0 - top_p) * total / (double)vocab));
    const int64_t m = gather(b->w, vocab, floor, b->items);
    memset(b->level1, 0, sizeof(*b->level1));
    for (int64_t j = 0; j < m; j++) {
        const uint32_t bin = b->items[j].key >> LEVEL1_SHIFT;
        b->level1->count[bin]++;
        b->level1->mass[bin] += b->items[j].w;
    }
    double kept = total;
    least = floor;
    if (by_count) {
        least = select_key(b->items, m, b->level1, 0, (double)top_k, 0, b->picked, b->sub);
        kept = 0.0;
        for (int64_t j = 0; j < m; j++) kept += b->items[j].key >= least ? b->items[j].w : 0.0f;
    }
    if (by_mass) {
        const uint32_t key = select_key(b->items, m, b->level1, 1, (double)top_p * kept, floor, b->picked, b->sub);
        least = key > least ? key : least;
    }
    return draw_items(b->items, m, least, u);
}

/* tokens[r] for the rows index[r] of logits [logit_rows, vocab] (`dtype`: float32 or bfloat16; rows vocab apart),
 * r < rows: each row's maximum top[r], 1 / its temperature inv_temperature[r], top_k[r] (0: none), top_p[r] (1: none)
 * and draw u[r] in [0, 1); -1 for a row whose maximum is not finite. The rows split among the threads. Returns 3
 * where an index lies outside the logits (nothing drawn), 2 where memory runs out. */
int sample_rows(const void *logits, int dtype, int64_t vocab, int64_t logit_rows, const int64_t *index, int64_t rows,
                const float *top, const float *inv_temperature, const int64_t *top_k, const float *top_p,
                const double *u, int64_t *tokens, int num_threads) {
    for (int64_t r = 0; r < rows; r++)
        if (index[r] < 0 || index[r] >= logit_rows) return 3;
    int failed = 0;
    const int64_t blocks = (vocab + DRAW_BLOCK - 1) / DRAW_BLOCK;
    const size_t bins_bytes = 2 * sizeof(bins), items_bytes = (size_t)vocab * sizeof(item);
    const size_t w_bytes = (size_t)(vocab + 16) * sizeof(float), sums_bytes = (size_t)blocks * sizeof(float);
    const size_t keys_bytes = (size_t)(4 * SMALL_TOP_K + 4 * GROUP) * sizeof(uint32_t);
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        char *scratch = thread_scratch(bins_bytes + 2 * items_bytes + w_bytes + sums_bytes + keys_bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 2;
        }
        buffers b = {0};
        if (scratch) {
            b.level1 = (bins *)scratch;
            b.sub = b.level1 + 1;
            b.items = (item *)(scratch + bins_bytes);
            b.picked = b.items + vocab;
            b.w = (float *)(b.picked + vocab);
            b.sums = b.w + vocab + 16;
            b.keys = (uint32_t *)(b.sums + blocks);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (!scratch) continue;
            tokens[r] = sample_row(logits, dtype, index[r] * vocab, vocab, top[r], inv_temperature[r], top_k[r],
                                   top_p[r], u[r], &b);
        }
    }
    return failed;
}

/* Columns [begin, end) of the row at `row` (`dtype` float32 or bfloat16): their largest value into *best_out and the
 * index of its first occurrence into *first_out, torch's max(dim=-1) rule: the first of equal maxima, a NaN the
 * largest (the first NaN: *nan_out, else -1). One pass for the maximum (a NaN ends it), one for its first index. */
static void scan_columns(const void *logits, int dtype, int64_t row, int64_t begin, int64_t end, float *best_out,
                         int64_t *first_out, int64_t *nan_out) {
    float best = -INFINITY;
    int64_t j = begin, nan_at = -1;
#ifdef __AVX512F__
    /* the lines SCAN_AHEAD bytes on asked for into the L2 as the pass goes (the first SCAN_AHEAD at its start): the
     * logits are seldom in this core's L1 or L2 (the head's product streamed its weights past them); a decode step's
     * first pass over its 8 rows took 159-163 us without these requests, 119-144 with them */
    const int64_t item = dtype == F32 ? 4 : 2;
    const char *bytes = (const char *)logits + (row + begin) * item, *stop = (const char *)logits + (row + end) * item;
    for (const char *line = bytes; line < bytes + SCAN_AHEAD && line < stop; line += 64) __builtin_prefetch(line, 0, 2);
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= end; j += 16) {
        const char *ahead = (const char *)logits + (row + j) * item + SCAN_AHEAD;
        if (ahead < stop) __builtin_prefetch(ahead, 0, 2);
        const __m512 v = widen16(logits, dtype, row + j);
        const __mmask16 nan = nan_lanes16(v);
        if (nan) {
            nan_at = j + __builtin_ctz(nan);
            break;
        }
        most = _mm512_max_ps(most, v);
    }
    if (nan_at < 0) best = _mm512_reduce_max_ps(most);
#endif
    for (; nan_at < 0 && j < end; j++) {
        const float v = logit_at(logits, dtype, row + j);
        uint32_t bits;
        memcpy(&bits, &v, sizeof(bits));
        if (nan_word(bits)) nan_at = j;
        else best = v > best ? v : best;
    }
    *nan_out = nan_at;
    if (nan_at >= 0) {
        *best_out = logit_at(logits, dtype, row + nan_at), *first_out = nan_at;
        return;
    }
    int64_t first = begin;
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(best);
    for (; first + 16 <= end; first += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(widen16(logits, dtype, row + first), target, _CMP_EQ_OQ);
        if (hit) {
            first += __builtin_ctz(hit);
            break;
        }
    }
#endif
    while (first < end && logit_at(logits, dtype, row + first) != best) first++;
    *best_out = best, *first_out = first < end ? first : begin;
}

/* Each row of logits [rows, vocab] (`dtype` float32 or bfloat16, rows vocab apart): its largest value into top[r]
 * and the index of its first occurrence into at[r], torch's max(dim=-1) rule: the first of equal maxima, a NaN the
 * largest (the first NaN). torch's `max` took 0.25 ms of a decode step for 8 rows of a 49,280-token vocabulary on 2
 * AMX cores.
 * The threads split the columns, not the rows: thread t of T scans columns [vocab t / T, vocab (t + 1) / T) of every
 * row (`scan_columns`), the columns that thread t of the lm head's product wrote (its tasks are contiguous shares
 * of the columns, linear.c's `deal`), on its own core's side; by rows, each thread read half of each row from the
 * other core's (a decode step's 8 rows: 156-169 us after the head, 30 us over rows in its own caches). The
 * threads' parts of a row are then taken in column order: the first with a NaN, else the first with the largest. */
int row_max(const void *logits, int dtype, int64_t rows, int64_t vocab, float *top, int64_t *at, int num_threads) {
    const int parts = rows * vocab >= 32768 && vocab >= 64 * num_threads ? num_threads : 1;
    float best_stack[64];
    int64_t index_stack[128];
    const int many = rows * parts > 64;
    float *best = many ? malloc(sizeof(float) * (size_t)(rows * parts)) : best_stack;
    int64_t *first = many ? malloc(sizeof(int64_t) * (size_t)(2 * rows * parts)) : index_stack;
    if (!best || !first) {
        if (many) free(best), free(first);
        return 2;
    }
    int64_t *nan_at = first + rows * parts;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
        const int t = team_index(), of = team_size();
        /* a team smaller than asked for: each thread takes the parts t, t + of, ... */
        for (int p = t; p < parts; p += of) {
            const int64_t begin = vocab * p / parts, end = vocab * (p + 1) / parts;
            for (int64_t r = 0; r < rows; r++)
                scan_columns(logits, dtype, r * vocab, begin, end, best + r * parts + p, first + r * parts + p,
                             nan_at + r * parts + p);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int chosen = 0;
        for (int p = 0; p < parts; p++) {
            const int64_t i = r * parts + p;
            if (nan_at[i] >= 0) {
                chosen = p;
                break;
            }
            if (best[i] > best[r * parts + chosen]) chosen = p;
        }
        top[r] = best[r * parts + chosen], at[r] = first[r * parts + chosen];
    }
    if (many) free(best), free(first);
    return 0;
}
