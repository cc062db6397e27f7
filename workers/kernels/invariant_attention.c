/* Batch-invariant causal GQA attention for one engine step, on the CPU, over a paged KV cache.
 *
 * Every query row reads only its own visible keys (0 .. nvis-1 of its request) in one fixed order, and
 * every sum runs in one fixed order: a score adds its head_dim products from d = 0 up, a softmax
 * denominator adds its terms in LANES fixed lanes and then a fixed tree, an output dimension adds
 * its keys from key 0 up, one fused multiply-add each (rounded once: fewer instructions than a multiply and
 * an add, and the same bits whichever instructions compute it). The result for a row is then a function of that row's query, keys and
 * values alone: not of the other rows in the step, how many there are, which cache blocks hold its
 * keys, or how far any key axis is padded. Threads split (tile of rows, kv head) items, whose outputs
 * are independent.
 *
 * Paging: the cache is a pool of blocks of BS positions (BS a multiple of LANES); a request's key j
 * lives in block block_table[j / BS] at offset j % BS. Only the address of a key changes with the
 * blocks a request lands in, never the order of any sum, so a row's result is the same whether its
 * keys are contiguous, scattered, or shared with another request (a prefix-cache hit).
 *
 * Keys are stored transposed, [D, BS] per (block, kv head), so one vector holds LANES keys' partial
 * scores and each lane is its own sequential chain over d: the vector code computes exactly what
 * the scalar code would, and a key's score does not depend on which lane or block it falls in.
 *
 * The cache holds fp32 or bf16 keys and values (kv_bf16); a bf16 one is widened to fp32 as it is loaded,
 * exactly, and every sum is the same fp32 sum in the same order: a bf16 model's keys and values are bf16
 * values already, so its results do not depend on which dtype the cache stores them in.
 *
 * Build: workers/native_attention.py compiles this with -ffp-contract=off and without -ffast-math,
 * so the compiler may vectorize the lane loops but never reassociate a sum or fuse a multiply-add the
 * code does not fuse itself (fma_lanes, __builtin_fmaf).
 */

#include <stddef.h>
#include <stdint.h>

#define LANES 16  /* keys per score block: a multiple of every vector width the compiler may use */
#define MAX_GROUP 16  /* query heads per kv head */
#define MAX_DBLOCKS 16  /* head_dim up to MAX_DBLOCKS * LANES */
#define ROWS 4  /* query rows of one slot (a prompt chunk) that share each key and value load */
#define AHEAD 3  /* blocks of keys or values asked for ahead of their use (best of 1-6 measured) */

#include "kernels.h"
#include "vec_math.h"

/* a * x + y, lane by lane, rounded once (a fused multiply-add): the same bits whichever instructions compute it */
static inline vlanes fma_lanes(float a, vlanes x, vlanes y) {
#if defined(__AVX512F__) && LANES == 16
    return (vlanes)_mm512_fmadd_ps(_mm512_set1_ps(a), (__m512)x, (__m512)y);
#else
    vlanes r;
    for (int l = 0; l < LANES; l++) r[l] = __builtin_fmaf(a, x[l], y[l]);
    return r;
#endif
}

/* Ask for n elements from element offset off of a cache (bf16 if KB) ahead of their use: a request's
 * next block is anywhere in the pool, where the hardware prefetcher, which follows runs of addresses,
 * cannot guess it. A hint only: it changes no value and never faults. */
static inline __attribute__((always_inline)) void prefetch_block(const void *base, int64_t off, int64_t n, const int KB) {
    const char *p = (const char *)base + off * (KB ? 2 : 4);
    const int64_t bytes = n * (KB ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2); /* into L2: measured better than L1 */
}

/* A tile: R query rows of one request (R = 1, or ROWS for rows of a prompt chunk, which share their
 * keys) times the G query heads of one kv head, against the request's first n[r] keys each.
 * q[r * G + g]: [D]. bt: the request's block table. kt: the pool's keys at this kv head, block b's
 * [D, BS] at kt + b * kv_stride (keys transposed). v: likewise, block b's [BS, D] at v + b * kv_stride.
 * s: [R * G, n_pad] scratch.
 * out[r * G + g]: [D]. KB: the cache is bf16 (else fp32); kv_stride and every offset count elements.
 * Inlined with R, G, DB (LANES-wide blocks of head_dim) and KB as constants (attend_tile), so the
 * accumulators stay in registers.
 *
 * Every number is computed as it would be for that row alone: a score is a chain over d from 0, a
 * row's softmax covers its own n[r] keys, and P @ V adds key by key from key 0. Keys a row does not
 * see (up to the tile's longest row) get weight exactly 0, and adding 0 * v (a signed zero, v finite)
 * to an accumulator that started at +0 never changes it. */
static inline __attribute__((always_inline)) void attend_tile_g(
        const float *const *q, const int R, const int G, const int DB, const int KB, const int *n, const int64_t *bt,
        const void *restrict kt, const void *restrict v, int64_t BS, int64_t kv_stride, int D, float scale,
        float *restrict s, int64_t n_pad, float *const *out) {
    int n_max = 0;
    for (int r = 0; r < R; r++) n_max = n[r] > n_max ? n[r] : n_max;
    const int nb = (n_max + LANES - 1) / LANES * LANES;
    /* scores: LANES keys x R*G query heads held in registers; d innermost */
    for (int j0 = 0; j0 < nb; j0 += LANES) {
        vlanes acc[ROWS * MAX_GROUP];
        for (int i = 0; i < R * G; i++) acc[i] = (vlanes){0};
        const int64_t kb = bt[j0 / BS] * kv_stride + j0 % BS;  /* LANES keys, never across blocks */
        if (j0 % BS == 0)  /* the next blocks lie anywhere in the pool: fetch them ahead */
            for (int64_t b = j0 == 0 ? 1 : AHEAD; b <= AHEAD && j0 + b * BS < nb; b++)
                prefetch_block(kt, bt[j0 / BS + b] * kv_stride, (int64_t)D * BS, KB);
        for (int d = 0; d < D; d++) {
            const vlanes k = load_kv(kt, kb + (int64_t)d * BS, KB);
            for (int i = 0; i < R * G; i++) acc[i] = acc[i] + q[i][d] * k;
        }
        for (int i = 0; i < R * G; i++) {
            const vlanes sc = acc[i] * scale;
            __builtin_memcpy(s + i * n_pad + j0, &sc, sizeof sc);
        }
    }
    for (int i = 0; i < R * G; i++) {
        float *sg = s + i * n_pad;
        const int ni = n[i / G];
        /* the row's largest score, lane-wise then across lanes: a maximum is exact in any order (only the sign
         * of a zero maximum may differ, and exp(s - m) does not see it) */
        float m = sg[0];
        int jm = 0;
        if (ni >= LANES) {
            vlanes mv = load_lanes(sg);
            for (jm = LANES; jm + LANES <= ni; jm += LANES) {
                const vlanes x = load_lanes(sg + jm);
                mv = select_lanes(lanes_gt(x, mv), x, mv);
            }
            for (int l = 0; l < LANES; l++) m = mv[l] > m ? mv[l] : m;
        }
        for (; jm < ni; jm++) m = sg[jm] > m ? sg[jm] : m;
        for (int j0 = 0; j0 < nb; j0 += LANES) {
            const vlanes e = exp_nonpos(load_lanes(sg + j0) - m);
            __builtin_memcpy(sg + j0, &e, sizeof e);
        }
        float acc[LANES];
        for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
        int j = 0;
        for (; j + LANES <= ni; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] = acc[l] + sg[j + l];
        for (int l = 0; j < ni; j++, l++) acc[l] = acc[l] + sg[j];
        for (int w = LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
        for (j = ni; j < n_max; j++) sg[j] = 0.0f;  /* keys this row does not see */
        sg[n_pad - 1] = 1.0f / acc[0];  /* n_pad > nb: the scratch row's last slot holds the normalizer */
    }
    /* P @ V: one pass over v, key by key from key 0; rows in pairs so the accumulators fit registers */
    for (int r0 = 0; r0 < R; r0 += 2) {
        const int rr = R - r0 < 2 ? R - r0 : 2;
        vlanes acc[2 * MAX_GROUP][MAX_DBLOCKS];
        for (int i = 0; i < rr * G; i++)
            for (int b = 0; b < DB; b++) acc[i][b] = (vlanes){0};
        const float *sp = s + (int64_t)r0 * G * n_pad;
        for (int j0 = 0; j0 < n_max; j0 += (int)BS) {  /* block by block, key by key within: key 0 up */
            const int64_t vb = bt[j0 / BS] * kv_stride;
            for (int64_t b = j0 == 0 ? 1 : AHEAD; b <= AHEAD && j0 + b * BS < n_max; b++)
                prefetch_block(v, bt[j0 / BS + b] * kv_stride, (int64_t)D * BS, KB);
            const int jn = n_max - j0 < BS ? n_max - j0 : (int)BS;
            for (int jj = 0; jj < jn; jj++) {
                const int64_t vj = vb + (int64_t)jj * D;
                for (int b = 0; b < DB; b++) {
                    const vlanes x = load_kv(v, vj + b * LANES, KB);
                    for (int i = 0; i < rr * G; i++) acc[i][b] = fma_lanes(sp[i * n_pad + j0 + jj], x, acc[i][b]);
                }
            }
        }
        for (int i = 0; i < rr * G; i++)
            for (int b = 0; b < DB; b++) {
                const vlanes o = acc[i][b] * sp[i * n_pad + n_pad - 1];
                __builtin_memcpy(out[r0 * G + i] + b * LANES, &o, sizeof o);
            }
    }
    for (int d0 = DB * LANES; d0 < D; d0++) {  /* head_dim not a multiple of LANES: the same chains */
        for (int i = 0; i < R * G; i++) {
            float a = 0.0f;
            for (int j = 0; j < n_max; j++)
                a = __builtin_fmaf(s[i * n_pad + j], load_kv1(v, bt[j / BS] * kv_stride + (j % BS) * D + d0, KB), a);
            out[i][d0] = a * s[i * n_pad + n_pad - 1];
        }
    }
}

static void attend_tile(const float *const *q, int R, int G, int kb, const int *n, const int64_t *bt, const void *kt,
                        const void *v, int64_t BS, int64_t kv_stride, int D, float scale, float *s, int64_t n_pad,
                        float *const *out) {
    const int DB = D / LANES;
#define ATTEND(RC, GC, DBC) \
    (kb ? attend_tile_g(q, RC, GC, DBC, 1, n, bt, kt, v, BS, kv_stride, D, scale, s, n_pad, out) \
        : attend_tile_g(q, RC, GC, DBC, 0, n, bt, kt, v, BS, kv_stride, D, scale, s, n_pad, out))
#define SHAPES(RC)                                                      \
    if (G == 3 && DB == 4) ATTEND(RC, 3, 4);      /* e.g. SmolLM2 */    \
    else if (G == 1 && DB == 4) ATTEND(RC, 1, 4);                       \
    else if (G == 4 && DB == 8) ATTEND(RC, 4, 8); /* e.g. Llama 3 8B */ \
    else if (G == 8 && DB == 8) ATTEND(RC, 8, 8); /* e.g. Llama 3 70B */ \
    else ATTEND(RC, G, DB);
    /* the common shapes with constant sizes; any other runs the same code with run-time sizes */
    if (R == 1) { SHAPES(1) } else if (R == ROWS) { SHAPES(ROWS) } else { ATTEND(R, G, DB); }
#undef SHAPES
#undef ATTEND
}

/* bf16 copies of n floats (rounded as torch rounds): a bf16 model's o projection input. */
static void round_bf16(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vlanes_h h = to_bf16(load_lanes(x + i));
        __builtin_memcpy(out + i, &h, sizeof h);
    }
    for (; i < n; i++) {
        vlanes x1 = {0};
        x1[0] = x[i];
        out[i] = to_bf16(x1)[0];
    }
}

/* A step's attention work, checked once and the same for every layer: tiles of query rows (runs of
 * consecutive rows of one request, cut into ROWS rows and single rows at a run's end) times kv heads.
 * first: [T + 1] caller's storage, first[i] the first row of tile i and first[tiles] = T. Returns 0, or -1
 * if the shapes are outside what the kernel handles or a block id a row would read is outside the pool. */
int attention_plan(attn_plan *p, const int64_t *block_table, int64_t bt_stride, const int64_t *req,
                   const int64_t *nvis, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                   float scale, float *scratch, int64_t n_pad, int kv_bf16, int64_t *first) {
    if (Hkv <= 0 || H % Hkv || H / Hkv > MAX_GROUP || D / LANES > MAX_DBLOCKS || BS <= 0 || BS % LANES) return -1;
    int64_t work = 0;
    for (int64_t t = 0; t < T; t++) {
        if (nvis[t] < 1 || nvis[t] > bt_stride * BS || nvis[t] + LANES >= n_pad || req[t] < 0) return -1;
        const int64_t *bt = block_table + req[t] * bt_stride;
        for (int64_t b = 0; b * BS < nvis[t]; b++)
            if (bt[b] < 0 || bt[b] >= num_blocks) return -1;
        work += nvis[t];
    }
    int64_t tiles = 0;
    for (int64_t t = 0; t < T;) {
        int64_t end = t + 1;
        while (end < T && req[end] == req[t] && end - t < ROWS) end++;
        if (end - t < ROWS) end = t + 1;
        first[tiles++] = t;
        t = end;
    }
    first[tiles] = T;
    *p = (attn_plan){.block_table = block_table, .req = req, .nvis = nvis, .first = first, .bt_stride = bt_stride,
                     .tiles = tiles, .work = work, .H = H, .Hkv = Hkv, .D = D, .BS = BS, .scale = scale,
                     .scratch = scratch, .n_pad = n_pad, .kv_bf16 = kv_bf16};
    return 0;
}

/* The first blocks (at most max_blocks) of keys and values item `it` of plan p reads, into L2; returns how many. */
static int64_t prefetch_item(const attn_plan *p, const void *kt, const void *v, int64_t it, int64_t max_blocks) {
    const int64_t D = p->D, BS = p->BS, kv_stride = p->Hkv * D * BS, esize = p->kv_bf16 ? 2 : 4;
    const int64_t t = p->first[it / p->Hkv], g = it % p->Hkv;
    const int64_t *bt = p->block_table + p->req[t] * p->bt_stride;
    int64_t b = 0;
    for (; b < max_blocks && b * BS < p->nvis[t]; b++) {
        prefetch_block((const char *)kt + g * D * BS * esize, bt[b] * kv_stride, D * BS, p->kv_bf16);
        prefetch_block((const char *)v + g * BS * D * esize, bt[b] * kv_stride, D * BS, p->kv_bf16);
    }
    return b;
}

/* One (tile, kv head) item `it` of a layer's attention under plan p, in thread id's scratch; `next`: the
 * item this thread computes after it (its first blocks are fetched while this one computes), or -1. q, kt,
 * v, out, out_bf16 as invariant_attention. */
void attention_item(const attn_plan *p, const float *q, int64_t q_row_stride, const void *kt, const void *v,
                    float *out, uint16_t *out_bf16, int64_t it, int64_t next, int id) {
    const int64_t H = p->H, Hkv = p->Hkv, D = p->D, BS = p->BS, G = H / Hkv, bt_stride = p->bt_stride;
    const int64_t *first = p->first, *req = p->req, *nvis = p->nvis, *block_table = p->block_table;
    const int64_t kv_stride = Hkv * D * BS, esize = p->kv_bf16 ? 2 : 4;
    if (next >= 0) prefetch_item(p, kt, v, next, AHEAD);
    const int64_t t0 = first[it / Hkv], R = first[it / Hkv + 1] - t0, g = it % Hkv;
    const float *qs[ROWS * MAX_GROUP];
    float *os[ROWS * MAX_GROUP];
    int n[ROWS];
    for (int64_t r = 0; r < R; r++) {
        n[r] = (int)nvis[t0 + r];
        for (int64_t i = 0; i < G; i++) {
            qs[r * G + i] = q + (t0 + r) * q_row_stride + (g * G + i) * D;
            os[r * G + i] = out + ((t0 + r) * H + g * G + i) * D;
        }
    }
    attend_tile(qs, (int)R, (int)G, p->kv_bf16, n, block_table + req[t0] * bt_stride,
                (const char *)kt + g * D * BS * esize, (const char *)v + g * BS * D * esize, BS, kv_stride, (int)D,
                p->scale, p->scratch + (int64_t)id * ROWS * G * p->n_pad, p->n_pad, os);
    if (out_bf16) /* the o projection's input in a bf16 model: this item's outputs rounded as torch rounds */
        for (int64_t r = 0; r < R; r++) {
            const int64_t o = ((t0 + r) * H + g * G) * D;
            round_bf16(out + o, out_bf16 + o, G * D);
        }
}

/* Into L2, the keys and values that thread id's first items of plan p will read (its static share of nt, as
 * the team first splits them), up to `bytes`: called a phase or two before the attention that reads them, so that
 * the items, which at one row a request are too short for prefetches of their own to run ahead, find them
 * there. A hint only. */
void prefetch_items(const attn_plan *p, const void *kt, const void *v, int id, int nt, int64_t bytes) {
    const int64_t items = p->tiles * p->Hkv, lo = items * id / nt, hi = items * (id + 1) / nt;
    const int64_t block_bytes = 2 * p->D * p->BS * (p->kv_bf16 ? 2 : 4); /* a block's keys and values */
    for (int64_t it = lo; it < hi && bytes > 0; it++)
        bytes -= prefetch_item(p, kt, v, it, (bytes + block_bytes - 1) / block_bytes) * block_bytes;
}

/* Thread id's share (of nt threads, each calling this once) of one layer's attention under plan p: whole
 * (tile, kv head) items, in a static split, so one thread computes each output. q, kt, v, out, out_bf16 as
 * invariant_attention. */
void attention_part(const attn_plan *p, const float *q, int64_t q_row_stride, const void *kt, const void *v,
                    float *out, uint16_t *out_bf16, int id, int nt) {
    const int64_t items = p->tiles * p->Hkv, lo = items * id / nt, hi = items * (id + 1) / nt;
    for (int64_t it = lo; it < hi; it++)
        attention_item(p, q, q_row_stride, kt, v, out, out_bf16, it, it + 1 < hi ? it + 1 : -1, id);
}

/* q: [T, H, D] at q + t * q_row_stride + h * D. kt: [num_blocks, Hkv, D, BS] (keys transposed) and
 * v: [num_blocks, Hkv, BS, D], contiguous, fp32 or (kv_bf16) bf16, BS a multiple of LANES. block_table: [num_reqs, bt_stride]
 * block ids; req, nvis: [T] (the row's request and its visible keys, 1 .. bt_stride * BS).
 * out: [T, H, D] contiguous; out_bf16: NULL, or [T, H, D] where out is also written rounded to bf16. scratch: nthreads * ROWS * G * n_pad floats, n_pad = max(nvis) rounded
 * up to LANES plus LANES. Returns 0, or -1 if the shapes are outside what the kernel handles or a
 * block id a row would read is outside the pool (nothing is read then). */
int invariant_attention(const float *q, int64_t q_row_stride, const void *kt, const void *v, int kv_bf16,
                        const int64_t *block_table, int64_t bt_stride, const int64_t *req, const int64_t *nvis,
                        float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                        float scale, float *scratch, int64_t n_pad, int nthreads, uint16_t *out_bf16) {
    int64_t *first = (int64_t *)__builtin_alloca((size_t)(T + 1) * sizeof(int64_t));
    attn_plan p;
    if (attention_plan(&p, block_table, bt_stride, req, nvis, T, H, Hkv, D, BS, num_blocks, scale, scratch, n_pad,
                       kv_bf16, first))
        return -1;
    const int nt = nthreads > 1 && p.work * H * D > 200000 ? nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int id, n;
        team_place(&id, &n);
        attention_part(&p, q, q_row_stride, kt, v, out, out_bf16, id, n);
    }
    return 0;
}
