/* What the native kernels' sources share: the thread-share entry points a fused forward calls from inside
 * one parallel region (invariant_layer.c), beside the standalone calls that open their own. */

#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* This thread's place in the enclosing parallel region: its id and the team's size (0 and 1 outside one, or
 * without OpenMP). Every thread-share function below takes the pair. */
static inline void team_place(int *id, int *nt) {
#ifdef _OPENMP
    *id = omp_get_thread_num();
    *nt = omp_get_num_threads();
#else
    *id = 0;
    *nt = 1;
#endif
}

/* n bytes from src to dst, where n is usually `whole`, a constant at the call site: a copy of a constant size
 * compiles to vector moves, one of a variable size to a call into libc (a chunk's or a tile's worth of work). */
static inline __attribute__((always_inline)) void copy_bytes(void *dst, const void *src, size_t n, size_t whole) {
    if (n == whole)
        __builtin_memcpy(dst, src, whole);
    else
        __builtin_memcpy(dst, src, n);
}

/* One step's attention work, the same for every layer (attention_plan in invariant_attention.c). */
typedef struct {
    const int64_t *block_table, *req, *nvis, *first; /* first: [tiles + 1] each tile's first query row */
    int64_t bt_stride, tiles, work, H, Hkv, D, BS;
    float scale;
    float *scratch; /* nthreads * ROWS * (H / Hkv) * n_pad floats */
    int64_t n_pad;
    int kv_bf16;
} attn_plan;

int attention_plan(attn_plan *p, const int64_t *block_table, int64_t bt_stride, const int64_t *req,
                   const int64_t *nvis, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                   float scale, float *scratch, int64_t n_pad, int kv_bf16, int64_t *first);
void attention_item(const attn_plan *p, const float *q, int64_t q_row_stride, const void *kt, const void *v,
                    float *out, uint16_t *out_bf16, int64_t it, int64_t next, int id);
void attention_part(const attn_plan *p, const float *q, int64_t q_row_stride, const void *kt, const void *v,
                    float *out, uint16_t *out_bf16, int id, int nt);
int invariant_attention(const float *q, int64_t q_row_stride, const void *kt, const void *v, int kv_bf16,
                        const int64_t *block_table, int64_t bt_stride, const int64_t *req, const int64_t *nvis,
                        float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                        float scale, float *scratch, int64_t n_pad, int nthreads, uint16_t *out_bf16);

void linear_part(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int id, int nt);
int invariant_linear(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int nthreads);

#endif
