/* What linear.c shares with linear_int8.c (not part of the engine's interface, kernels.h): the blocks of weight
 * rows and tasks of blocks both split a product into, the dealing of tasks to a team's threads, the epilogue of
 * a task's sums (bias, glu, rounding to the output dtype) and, in AMX builds, the tiles' set-up. Their contracts
 * are at the definitions, in linear.c. */
#ifndef VLMCAP_LINEAR_H
#define VLMCAP_LINEAR_H

#include <stdint.h>

#include "dtypes.h"  /* MIN, team_size, team_index */

#define RW 4   /* weight rows per block */
#define NB 8   /* blocks per task: 32 output columns (16 in glu mode), finished together */

/* The cache line `offset` bytes into each of a block's weight rows, fetched ahead of its use into the L2 cache
 * (prefetcht1), not the L1: a block's few rows of x keep the L1 busy, and into the L1 the lines in flight are
 * bounded by its few miss buffers, so the reading stalled on them (8 rows of x against a 49280 x 576 weight, 2
 * threads, Zen 4: 3.1 ms into the L1 a block ahead, 1.7 ms into the L2 `blocks_ahead` blocks ahead). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *const rows[RW], int64_t offset) {
    for (int r = 0; r < RW; r++) __builtin_prefetch((const char *)rows[r] + offset, 0, 2);
}

#ifndef AHEAD_BYTES
#define AHEAD_BYTES 32768  /* how far ahead of its use a block of weight rows is fetched, in bytes of weights */
#endif
#define MAX_AHEAD 8  /* blocks */

/* The blocks between a block and the one its reading prefetches (`prefetch_rows`): AHEAD_BYTES of weights
 * (`row_bytes` a row), at least the next block. Far enough ahead that a line arrives before its block starts
 * whatever the block's length (a 576-wide row of bfloat16 is 1,152 bytes, a block of them 72 cache lines). */
static inline int64_t blocks_ahead(int64_t row_bytes) {
    const int64_t ahead = (AHEAD_BYTES + RW * row_bytes - 1) / (RW * row_bytes);
    return ahead < 1 ? 1 : ahead > MAX_AHEAD ? MAX_AHEAD : ahead;
}

#ifdef __AVX512F__
/* r[16] (16 rows of 16 words) transposed in place: four 4x4 transposes inside the 128-bit lanes, then the lanes. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    __m512i s[4][4];  /* s[g][j], lane L: column 4L + j of rows 4g..4g+3 */
    for (int g = 0; g < 4; g++) {
        s[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        s[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        s[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        s[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i a = _mm512_shuffle_i32x4(s[0][j], s[1][j], 0x44);  /* lanes 0-1 of rows 0-3, of 4-7 */
        const __m512i b = _mm512_shuffle_i32x4(s[0][j], s[1][j], 0xee);  /* lanes 2-3 */
        const __m512i c = _mm512_shuffle_i32x4(s[2][j], s[3][j], 0x44);  /* the same of rows 8-15 */
        const __m512i d = _mm512_shuffle_i32x4(s[2][j], s[3][j], 0xee);
        r[j] = _mm512_shuffle_i32x4(a, c, 0x88), r[4 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);
        r[8 + j] = _mm512_shuffle_i32x4(b, d, 0x88), r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}
#endif

enum { GLU_SILU = 1, GLU_GELU = 2 }; /* `glu_mode`: which act, or 0 (no glu) */

/* A thread's share of a team's tasks (`deal`), next | end << 32, alone on its cache line: each task taken is a
 * compare-and-swap on it, which on a line the other threads' shares shared moved the line between the cores at
 * every task (next_task was 4% of a decode step's int8 products' time). */
typedef struct {
    uint64_t word;
} __attribute__((aligned(64))) task_share;

/* Share s of `of` of tasks [0, count): tasks count * s / of up to count * (s + 1) / of (`deal`'s). */
static inline uint64_t share_of(int s, int of, int64_t count) {
    return (uint64_t)(count * s / of) | (uint64_t)(count * (s + 1) / of) << 32;
}
void deal(task_share *shares, int count_of_shares, int64_t count);
int64_t next_task(task_share *shares);
void block_rows(int64_t block, int glu_mode, int64_t n, int64_t out_cols, int64_t r[RW]);
void finish_row(float *sums, int64_t blocks, int glu_mode, const float *bias, const int64_t *rows_of, int dtype,
                float *out);
#define GLU_MOST (16 * 16)  /* glu_tail's most outputs a call: 16 rows of a task's 16 */
void glu_tail(float *gate, float *up, int64_t count, int glu_mode, int dtype, float *out);
void gelu_floats(float *values, int64_t count);  /* gelu.c: gelu_tanh's steps on float32 values, in place */

/* `deal` of `count` tasks to the calling team: one thread deals while the others wait (omp single), so every
 * thread of the team calls it, before any `next_task`. */
static inline __attribute__((always_inline)) void deal_team(task_share *shares, int64_t count) {
#pragma omp single
    deal(shares, team_size(), count);
}

/* The calling thread's own share of `deal`'s: where every thread of the team deals its own, a barrier the team
 * meets anyway (a loop's) stands for deal_team's, before any `next_task`. */
static inline __attribute__((always_inline)) void deal_own(task_share *shares, int64_t count) {
    shares[team_index()].word = share_of(team_index(), team_size(), count);
}

/* Rows of x per block when a chunk of `chunk` rows goes in blocks of at most `most` rows, all of about the same
 * size (8 rows, at most 6: 4 + 4, not 6 + 2). */
static inline __attribute__((always_inline)) int64_t rows_per_block(int64_t chunk, int64_t most) {
    const int64_t count = (chunk + most - 1) / most;
    return (chunk + count - 1) / count;
}

/* A task of the loops over blocks of weight rows (`take_task`): NB blocks (fewer in the last task). */
typedef struct {
    int64_t count;            /* its blocks */
    int64_t first_col, cols;  /* the output columns they finish */
} task_blocks;

/* The calling thread's next task (`next_task`) of the blocks from block0 on (`blocks` in all) into *t, and the
 * weight rows of its blocks, and of the `ahead` blocks after them (to prefetch: block b's reading prefetches
 * block b + ahead's rows), into rows_of; 0 when none is left. */
static inline __attribute__((always_inline)) int take_task(task_share *shares, int64_t block0, int64_t blocks,
                                                           int glu_mode, int64_t n, int64_t out_cols, int64_t ahead,
                                                           int64_t rows_of[(NB + MAX_AHEAD) * RW], task_blocks *t) {
    const int64_t task = next_task(shares);
    if (task < 0) return 0;
    const int64_t first_block = block0 + task * NB;
    t->count = MIN(NB, blocks - first_block);
    t->first_col = glu_mode ? 2 * first_block : RW * first_block;
    t->cols = MIN(glu_mode ? 2 * t->count : RW * t->count, out_cols - t->first_col);
    for (int64_t b = 0; b < t->count + ahead; b++) block_rows(first_block + b, glu_mode, n, out_cols, rows_of + b * RW);
    return 1;
}

/* y = x W^T for int8 weights (linear_int8.c; linear() passes it every I8 weight). */
int linear_int8(const void *x, int io_dtype, int64_t m, int64_t k, const int8_t *w, int64_t w_stride, int64_t n,
                const float *scale, const int32_t *row_sums, const float *bias, int glu_mode, int gelu, void *y,
                const void *residual, int num_threads);
/* y[offset + i] = round(y[offset + i] + residual[offset + i]) for `count` values of `dtype` (linear()'s residual). */
void add_residual(void *y, const void *residual, int dtype, int64_t offset, int64_t count);

#ifdef __AMX_BF16__
#define AMX_ROWS 16
int amx_permitted(void);
void amx_load_config(const uint8_t rows[8], const uint16_t colsb[8]);

/* The next task's weight rows (task `next` of the tiles' tasks: 32 consecutive rows, or in glu mode 16 gate rows
 * and their 16 up rows; each tile's 16 rows lie together, 16 * row_bytes), asked for into the L2 cache a few lines
 * at a time over the `steps` steps of the task before (`next_tiles_step` once a step): a tile's 16 rows are streams
 * too short for the hardware's prefetching. next < 0: none. */
typedef struct {
    const char *first, *second;
    int64_t span, per_step, line;
} next_tiles;

static inline __attribute__((always_inline)) next_tiles next_tiles_of(const void *w, int64_t row_bytes, int64_t next,
                                                                      int glu_mode, int64_t out_cols, int64_t steps) {
    const int64_t first = glu_mode ? 16 * next : 32 * next, second = glu_mode ? out_cols + first : first + 16;
    const int64_t span = 16 * row_bytes;
    next_tiles t = {next < 0 ? NULL : (const char *)w + first * row_bytes,
                    next < 0 ? NULL : (const char *)w + second * row_bytes, span, (span / 64 + steps - 1) / steps, 0};
    return t;
}

static inline __attribute__((always_inline)) void next_tiles_step(next_tiles *t) {
    for (int64_t e = 0; t->first && e < t->per_step && t->line < t->span; e++, t->line += 64)
        __builtin_prefetch(t->first + t->line, 0, 2), __builtin_prefetch(t->second + t->line, 0, 2);
}
#endif

#endif
