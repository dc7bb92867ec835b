/* What linear.c shares with linear_int8.c (not part of the engine's interface, kernels.h): the blocks of weight
 * rows and tasks of blocks both split a product into, the dealing of tasks to a team's threads, the epilogue of
 * a task's sums (bias, glu, rounding to the output dtype) and, in AMX builds, the tiles' set-up. Their contracts
 * are at the definitions, in linear.c. */
#ifndef VLMCAP_LINEAR_H
#define VLMCAP_LINEAR_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef _OPENMP
static inline int team_size(void) { return omp_get_num_threads(); }
static inline int team_index(void) { return omp_get_thread_num(); }
#else
static inline int team_size(void) { return 1; }
static inline int team_index(void) { return 0; }
#endif

#define RW 4   /* weight rows per block */
#define NB 8   /* blocks per task: 32 output columns (16 in glu mode), finished together */

/* The cache line `offset` bytes into each of a block's weight rows, fetched ahead of its use. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *const rows[RW], int64_t offset) {
    for (int r = 0; r < RW; r++) __builtin_prefetch((const char *)rows[r] + offset, 0, 3);
}

enum { GLU_SILU = 1, GLU_GELU = 2 }; /* `glu_mode`: which act, or 0 (no glu) */

void deal(uint64_t *shares, int count_of_shares, int64_t count);
int64_t next_task(uint64_t *shares);
void block_rows(int64_t block, int glu_mode, int64_t n, int64_t out_cols, int64_t r[RW]);
void finish_row(float *sums, int64_t blocks, int glu_mode, const float *bias, const int64_t *rows_of, int dtype,
                float *out);

/* y = x W^T for int8 weights (linear_int8.c; linear() passes it every I8 weight). */
int linear_int8(const void *x, int io_dtype, int64_t m, int64_t k, const int8_t *w, int64_t w_stride, int64_t n,
                const float *scale, const int32_t *row_sums, const float *bias, int glu_mode, void *y,
                int num_threads);

#ifdef __AMX_BF16__
#define AMX_ROWS 16
int amx_permitted(void);
void amx_configure(int cols);
#endif

#endif
