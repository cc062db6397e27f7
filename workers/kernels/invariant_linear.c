/* y[M, N] = x[M, K] @ W[N, K]^T on the CPU (nn.Linear's layout, W as stored), bf16 or fp32, batch-invariant
 * by construction, streaming W once per call for small M.
 *
 * Why: a GEMM library picks its kernel, tiling and reduction split by shape, so a row's result can
 * depend on how many rows the call holds; the runner then probes which row counts agree and pads to
 * them, and at one row its prepacked GEMMs read the weights well below the memory's bandwidth. Here
 * every output y[m, n] is one fixed chain over K, whatever M is, whichever rows share a tile,
 * whichever thread computes it and however N is split:
 *
 *   - 16 fp32 lanes; lane l accumulates, k in increasing order, the products x[m, k] * W[n, k] of
 *     the k that map to it (fp32: k = 16 j + l, one fused multiply-add each; bf16 with AVX512-BF16:
 *     k = 32 j + 2 l and 32 j + 2 l + 1, one VDPBF16PS each pair; bf16 otherwise: widened exactly to
 *     fp32, then as fp32). Past K the lanes add zero products.
 *   - The 16 lanes are then summed by one fixed tree: lane l + lane l+8, then +4, +2, +1 (the tree of
 *     rms_norm in invariant_layer.c). fp32 addition is commutative, so every code path that follows
 *     the tree gives the same bits.
 *   - bf16 output is the fp32 sum rounded to nearest even, as torch rounds.
 *
 * Tiles of up to 4 rows of x by 4 rows of W share loads (each weight vector is used by every row of
 * the tile, each x vector by every weight row); a tile of fewer rows runs the same per-element code.
 * W is plain [N, K] or tiled (tile_weights): each tile's 4 rows interleaved 64 bytes at a time, so that the
 * tile's loads, chunk by chunk across its rows, run through memory in address order. The hardware prefetchers
 * follow that one stream; 4 streams a row apart they follow poorly, and plain weights need the kernel's own
 * prefetches (PREFETCH_W), which cost load slots and still read below the bandwidth at one row. The layout
 * changes where a weight is read, not which products are summed in which order: the same bits.
 * N is split across OpenMP threads in whole tiles, claimed a few at a time, so that a thread done with its
 * own share takes over the rest of a preempted one's (team in kernels.h); one thread computes each output
 * entirely.
 * The instructions are picked at compile time (-march=native): AVX512-BF16, AVX-512F, AVX2 with FMA
 * (16 lanes as two registers of 8, in 2 x 2 sub-tiles: AVX2 has 16 registers), else portable C with
 * fmaf. fp32 results are the same bits in every build (each lane one fused multiply-add per k, the same
 * tree); bf16 with AVX512-BF16 pairs k differently. Built with -ffp-contract=off.
 *
 * bf16 without AVX512-BF16 (the AVX2 build): a call of a few rows widens each weight vector as it loads it
 * (the weights are read once anyway), and its rows (from two on) once per call into fp32; a call of more than
 * WIDEN_ROWS rows widens each L1-sized block of weight tiles once into an fp32 buffer and runs every row over
 * that (span_widened), where widening per load would widen every weight again for every pair of rows.
 * Widening is exact and the products and their order are those of the per-load path: a row's bits do not
 * depend on which path its call took.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "kernels.h"

#define MR 4          /* rows of x per tile */
#define NR 4          /* rows of W per tile */
#ifndef NB_BYTES
#define NB_BYTES 24576 /* weight bytes of the tiles a thread sweeps all of x's row tiles over (stay in L1) */
#endif
/* Calls of at most this many rows read tiled weights without software prefetches: on AVX-512 one row tile in
 * bf16, two rows in fp32 (more rows compute longer per weight and fall behind without them); one row elsewhere
 * (AVX2's pairs of rows read half a tile's lines per pass). Measured, docs/benchmarks.md#decode_floor. */
#ifndef TILED_BARE_ROWS
#if defined(__AVX512F__)
#define TILED_BARE_ROWS(bf16) ((bf16) ? MR : 2)
#else
#define TILED_BARE_ROWS(bf16) 1
#endif
#endif
#ifndef PF_TILES
#define PF_TILES 2 /* prefetch the weight rows this many tiles ahead */
#endif

/* A prefetch of the weights: into L1, or (l2) into L2, for weights that stream past the last-level cache each
 * step: a core can have more misses to memory in flight into L2 than into L1, and a line taken into L1 would
 * only be used once anyway (on a Zen 4 host, a step's GEMMs read 12-15% faster than with prefetcht0 or
 * prefetchnta; docs/benchmarks.md#decode_floor). Weights that fit the caches are wanted in L1 (faster there).
 * Constant after inlining. */
#define PREFETCH_W(p, l2)                                                                                        \
    do {                                                                                                         \
        if (l2)                                                                                                  \
            __builtin_prefetch((p), 0, 2);                                                                       \
        else                                                                                                     \
            __builtin_prefetch((p), 0, 3);                                                                       \
    } while (0)

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays quiet */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Where element k of a weight row lies, from the row's first chunk: wm = 1 for plain rows ([N, K]); wm = NR
 * for tiled weights, whose rows' chunks of ck elements (64 bytes) are interleaved by tile (tile_weights). */
static inline __attribute__((always_inline)) int64_t woff(int64_t k, const int wm, const int ck) {
    return wm == 1 ? k : (k & ~(int64_t)(ck - 1)) * wm + (k & (ck - 1));
}

/* The fixed tree over one accumulator's 16 lanes (the portable form of reduce16 below). */
static inline float tree16(const float *a) {
    float t[16];
    memcpy(t, a, sizeof t);
    for (int h = 8; h > 0; h /= 2)
        for (int l = 0; l < h; l++) t[l] = t[l] + t[l + h];
    return t[0];
}

#if defined(__AVX512F__)

typedef __m512 acc_t;

/* acc[0..15] -> lane 4 e + j holds the tree sum of acc[e + 4 j]: four levels of pairwise sums, each
 * pairing lanes l and l + h within an accumulator (h = 8, 4, 2, 1), as tree16. */
static inline __m512 reduce16(const __m512 *a) {
    __m512 u[8], z[4], y[2];
    for (int i = 0; i < 8; i++) /* lanes l + l+8: [a_2i (8 lanes), a_2i+1 (8 lanes)] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* + l+4: four lanes each of [a_4i, a_4i+1, a_4i+2, a_4i+3] ... */
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    /* z[i] block e: four lanes of a_{4 i + e} */
    for (int i = 0; i < 2; i++) /* + l+2: block e: 2 lanes of a_{8 i + e}, 2 of a_{8 i + 4 + e} */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xee));
    /* + l+1: block e: a_e, a_{4 + e}, a_{8 + e}, a_{12 + e} */
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
}

/* Where reduce16 leaves the sum of accumulator s. */
#define LANE_OF(s) (4 * ((s) % 4) + (s) / 4)

/* reduce16 for a one-row tile, whose accumulators are acc[0], acc[4], acc[8] and acc[12] (SLOT(0, c)): the same
 * tree for each, in a third of the instructions (the other twelve are zeros that reduce16 would add). Lane
 * LANE_OF(4 c) = c holds the sum of acc[4 c]; the other lanes are not read. */
static inline __m512 reduce4_row0(const __m512 *a) {
    /* + l+8: [a_0 (8 lanes), a_4 (8 lanes)], [a_8, a_12] */
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[4], 0x44), _mm512_shuffle_f32x4(a[0], a[4], 0xee));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[8], a[12], 0x44), _mm512_shuffle_f32x4(a[8], a[12], 0xee));
    /* + l+4: block c holds four lanes of a_{4 c} */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xdd));
    /* + l+2, then + l+1, within each block: its lane 0 holds the sum */
    const __m512 y = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0x4e));
    const __m512 w = _mm512_add_ps(y, _mm512_shuffle_ps(y, y, 0xb1));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w);
}

#else

typedef struct {
    float v[16];
} acc_t;

#define LANE_OF(s) (s)

#endif

/* Accumulator slot of tile entry (row r, weight row c): r + 4 c, so reduce16 leaves row r's four
 * weight rows in lanes 4 r .. 4 r + 3. */
#define SLOT(r, c) ((r) + 4 * (c))

#if defined(__AVX512F__)
/* One K step of a tile: 32 bf16 (or 16 fp32) of each row; `full` (a constant after inlining) loads
 * without a mask, else the lanes of m only (the rest read as 0). */
static inline __attribute__((always_inline)) void step_bf16(__m512 *acc, const uint16_t *const *xr,
                                                            const uint16_t *const *wr, int64_t k, int64_t kw, int mr,
                                                            int full, __mmask32 m) {
#if defined(__AVX512BF16__)
    __m512bh xv[MR], wv[NR];
    for (int r = 0; r < mr; r++)
        xv[r] = (__m512bh)(full ? _mm512_loadu_si512(xr[r] + k) : _mm512_maskz_loadu_epi16(m, xr[r] + k));
    for (int c = 0; c < NR; c++)
        wv[c] = (__m512bh)(full ? _mm512_loadu_si512(wr[c] + kw) : _mm512_maskz_loadu_epi16(m, wr[c] + kw));
    for (int c = 0; c < NR; c++)
        for (int r = 0; r < mr; r++) acc[SLOT(r, c)] = _mm512_dpbf16_ps(acc[SLOT(r, c)], xv[r], wv[c]);
#else
    /* Widen 16 bf16 at a time (exact) and fuse multiply-add: lane l takes k + l, then k + 16 + l. */
    for (int h = 0; h < 2; h++) {
        const __mmask16 mh = full ? (__mmask16)0xffff : (__mmask16)(m >> (16 * h));
        __m512 xv[MR], wv[NR];
        for (int r = 0; r < mr; r++)
            xv[r] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mh, xr[r] + k + 16 * h)), 16));
        for (int c = 0; c < NR; c++)
            wv[c] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mh, wr[c] + kw + 16 * h)), 16));
        for (int c = 0; c < NR; c++)
            for (int r = 0; r < mr; r++) acc[SLOT(r, c)] = _mm512_fmadd_ps(xv[r], wv[c], acc[SLOT(r, c)]);
    }
#endif
}

static inline __attribute__((always_inline)) void step_f32(__m512 *acc, const float *const *xr,
                                                           const float *const *wr, int64_t k, int64_t kw, int mr,
                                                           int full, __mmask16 m) {
    __m512 xv[MR], wv[NR];
    for (int r = 0; r < mr; r++) xv[r] = full ? _mm512_loadu_ps(xr[r] + k) : _mm512_maskz_loadu_ps(m, xr[r] + k);
    for (int c = 0; c < NR; c++) {
        wv[c] = full ? _mm512_loadu_ps(wr[c] + kw) : _mm512_maskz_loadu_ps(m, wr[c] + kw);
        __asm__("" : "+v"(wv[c])); /* one load per weight vector, not one folded into each row's FMA */
    }
    for (int r = 0; r < mr; r++) __asm__("" : "+v"(xv[r]));
    for (int c = 0; c < NR; c++)
        for (int r = 0; r < mr; r++) acc[SLOT(r, c)] = _mm512_fmadd_ps(xv[r], wv[c], acc[SLOT(r, c)]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* 8 values at p[i ..] as fp32: fp32, or bf16 widened (exactly). */
static inline __attribute__((always_inline)) __m256 ld8(const void *p, int64_t i, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* One K step of 16 of an rn x cn sub-tile (rows xr, weight rows wr; xb, wb: bf16, else fp32). */
static inline __attribute__((always_inline)) void avx2_step(__m256 lo[2][4], __m256 hi[2][4], const void *const *xr,
                                                            const void *const *wr, int64_t k, const int rn,
                                                            const int cn, const int xb, const int wb, const int wm) {
    __m256 xl[2], xh[2];
    for (int i = 0; i < rn; i++) {
        xl[i] = ld8(xr[i], k, xb), xh[i] = ld8(xr[i], k + 8, xb);
        __asm__("" : "+x"(xl[i]), "+x"(xh[i])); /* one load per vector, not one folded into each FMA */
    }
    for (int j = 0; j < cn; j++) {
        __m256 wl = ld8(wr[j], woff(k, wm, wb ? 32 : 16), wb), wh = ld8(wr[j], woff(k + 8, wm, wb ? 32 : 16), wb);
        if (rn > 1) __asm__("" : "+x"(wl), "+x"(wh));
        for (int i = 0; i < rn; i++) {
            lo[i][j] = _mm256_fmadd_ps(xl[i], wl, lo[i][j]);
            hi[i][j] = _mm256_fmadd_ps(xh[i], wh, hi[i][j]);
        }
    }
}

/* A sub-tile of rn rows (xr) by cn weight rows (wr: tile rows c0 ..), all K, into sums[LANE_OF(SLOT(r0 + i,
 * c0 + j))]. The 16 lanes are two halves of 8 (lane l: k + l of every 16 k). Its 2 rn cn accumulators stay
 * in registers (AVX2 has 16): 1 x 4 for a single row, whose 8 independent chains keep both FMA pipes busy,
 * else 2 x 2, where each load serves two FMAs. rn, cn, bf16 and l2 are constants after inlining, and the
 * prefetch is decided outside the K loop: a test per K step costs as much as the step. pf: the tile
 * PF_TILES ahead, of which this sub-tile prefetches lines c0 .. c0 + cn - 1 of every NR (NULL: none). */
static inline __attribute__((always_inline)) void avx2_sub(const void *const *xr, const void *const *wr, int64_t K,
                                                           const int rn, const int cn, const int xb, const int wb,
                                                           const int wm, const char *pf, const int l2, int r0, int c0,
                                                           float *sums) {
    __m256 lo[2][4], hi[2][4];
    for (int i = 0; i < rn; i++)
        for (int j = 0; j < cn; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    if (pf && wb) /* NR lines of the tile ahead per 32 k */
        for (; k + 32 <= K; k += 32) {
            for (int j = 0; j < cn; j++) PREFETCH_W(pf + 8 * k + 64 * (c0 + j), l2);
            avx2_step(lo, hi, xr, wr, k, rn, cn, xb, wb, wm);
            avx2_step(lo, hi, xr, wr, k + 16, rn, cn, xb, wb, wm);
        }
    else if (pf) /* NR lines per 16 k */
        for (; k + 16 <= K; k += 16) {
            for (int j = 0; j < cn; j++) PREFETCH_W(pf + 16 * k + 64 * (c0 + j), l2);
            avx2_step(lo, hi, xr, wr, k, rn, cn, xb, wb, wm);
        }
    for (; k + 16 <= K; k += 16) avx2_step(lo, hi, xr, wr, k, rn, cn, xb, wb, wm);
    if (k < K) { /* the tail, zero-padded to 16 (tiled weights have none) */
        uint32_t buf[6][16];
        memset(buf, 0, sizeof buf);
        const size_t xs = xb ? 2 : 4, ws = wb ? 2 : 4;
        const void *xt[2] = {buf[0], buf[1]}, *wt[4] = {buf[2], buf[3], buf[4], buf[5]};
        for (int i = 0; i < rn; i++) memcpy(buf[i], (const char *)xr[i] + (size_t)k * xs, (size_t)(K - k) * xs);
        for (int j = 0; j < cn; j++) memcpy(buf[2 + j], (const char *)wr[j] + (size_t)k * ws, (size_t)(K - k) * ws);
        avx2_step(lo, hi, xt, wt, 0, rn, cn, xb, wb, 1);
    }
    for (int i = 0; i < rn; i++)
        for (int j = 0; j < cn; j++) {
            const __m256 v = _mm256_add_ps(lo[i][j], hi[i][j]);                                /* l + l+8 */
            const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* + l+4 */
            const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                               /* + l+2 */
            const __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));                            /* + l+1 */
            sums[LANE_OF(SLOT(r0 + i, c0 + j))] = _mm_cvtss_f32(c);
        }
}

/* tile() on AVX2 with bf16 a constant, the first row prefetching: fp32 a row at a time in 1 x 4 (the weights
 * come from L1, the rows from L2), bf16 rows in pairs in 2 x 2, where each weight vector widened serves two
 * rows (a last single row 1 x 4). */
static inline __attribute__((always_inline)) void avx2_tile(const void *x, int64_t ldx, const void *const *w,
                                                            int64_t K, int mr, const int xb, const int wb, const int wm,
                                                            const void *const *pf, const int l2, float *sums) {
    const size_t es = xb ? 2 : 4;
    const int pair = wb ? 2 : 1;
    for (int r0 = 0; r0 < mr; r0 += pair) {
        const int rn = mr - r0 < pair ? mr - r0 : pair;
        const void *xr[2] = {(const char *)x + (size_t)(r0 * ldx) * es, (const char *)x + (size_t)((r0 + 1) * ldx) * es};
        const char *p = pf && r0 == 0 ? (const char *)pf[0] : NULL;
        if (rn == 1)
            avx2_sub(xr, w, K, 1, NR, xb, wb, wm, p, l2, r0, 0, sums);
        else
            for (int c0 = 0; c0 < NR; c0 += 2) avx2_sub(xr, w + c0, K, 2, 2, xb, wb, wm, p, l2, r0, c0, sums);
    }
}
#endif


/* One tile: rows x[0..mr) (row stride ldx) against weight rows w[0..NR) (row stride K), all K.
 * sums[LANE_OF(SLOT(r, c))] receives y[r, c] in fp32. Always inlined with a constant mr, so the
 * accumulators stay in registers. pf[0]: the first weight row PF_TILES tiles ahead, or pf NULL: a tile's
 * rows are contiguous, and each K step prefetches the next NR cache lines of that tile in address order
 * (one stream: faster than NR streams a row apart, docs/benchmarks.md#gemm_ab); l2: how (PREFETCH_W). */
static inline __attribute__((always_inline)) void tile(const void *x, int64_t ldx, const void *const *w, int64_t K,
                                                       int mr, int bf16, int wb, int wm, const void *const *pf,
                                                       int l2, float *sums) {
#if defined(__AVX512F__) /* wb is bf16 in every call outside the AVX2 build (span_widened) */
    (void)wb;
    acc_t acc[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm512_setzero_ps();
    if (bf16) {
        const uint16_t *xr[MR], *wr[NR];
        for (int r = 0; r < mr; r++) xr[r] = (const uint16_t *)x + r * ldx;
        for (int c = 0; c < NR; c++) wr[c] = (const uint16_t *)w[c];
        int64_t k = 0;
        if (pf)
            for (; k + 32 <= K; k += 32) {
                for (int c = 0; c < NR; c++) PREFETCH_W((const char *)pf[0] + 8 * k + 64 * c, l2);
                step_bf16(acc, xr, wr, k, k * wm, mr, 1, 0);
            }
        else
            for (; k + 32 <= K; k += 32) step_bf16(acc, xr, wr, k, k * wm, mr, 1, 0);
        if (k < K) step_bf16(acc, xr, wr, k, k * wm, mr, 0, (__mmask32)((1u << (K - k)) - 1u));
    } else {
        const float *xr[MR], *wr[NR];
        for (int r = 0; r < mr; r++) xr[r] = (const float *)x + r * ldx;
        for (int c = 0; c < NR; c++) wr[c] = (const float *)w[c];
        int64_t k = 0;
        if (pf)
            for (; k + 16 <= K; k += 16) {
                for (int c = 0; c < NR; c++) PREFETCH_W((const char *)pf[0] + 16 * k + 64 * c, l2);
                step_f32(acc, xr, wr, k, k * wm, mr, 1, 0);
            }
        else
            for (; k + 16 <= K; k += 16) step_f32(acc, xr, wr, k, k * wm, mr, 1, 0);
        if (k < K) step_f32(acc, xr, wr, k, k * wm, mr, 0, (__mmask16)((1u << (K - k)) - 1u));
    }
    _mm512_storeu_ps(sums, mr == 1 ? reduce4_row0(acc) : reduce16(acc));
#elif defined(__AVX2__) && defined(__FMA__)
    if (bf16 && wb)
        avx2_tile(x, ldx, w, K, mr, 1, 1, wm, pf, l2, sums);
    else if (bf16)
        avx2_tile(x, ldx, w, K, mr, 1, 0, wm, pf, l2, sums);
    else if (wb) /* x widened to fp32 once per call (linear_part) */
        avx2_tile(x, ldx, w, K, mr, 0, 1, wm, pf, l2, sums);
    else
        avx2_tile(x, ldx, w, K, mr, 0, 0, wm, pf, l2, sums);
#else
    (void)pf;
    (void)l2;
    (void)wb;
    const int ck = bf16 ? 32 : 16;
    acc_t acc[16];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k += 16) {
        const int n = K - k < 16 ? (int)(K - k) : 16;
        float xv[MR][16], wv[NR][16];
        for (int r = 0; r < mr; r++)
            for (int l = 0; l < 16; l++)
                xv[r][l] = l >= n ? 0.0f
                           : bf16    ? bf16_widen(((const uint16_t *)x)[r * ldx + k + l])
                                     : ((const float *)x)[r * ldx + k + l];
        for (int c = 0; c < NR; c++)
            for (int l = 0; l < 16; l++)
                wv[c][l] = l >= n  ? 0.0f
                           : bf16 ? bf16_widen(((const uint16_t *)w[c])[woff(k + l, wm, ck)])
                                  : ((const float *)w[c])[woff(k + l, wm, ck)];
        for (int c = 0; c < NR; c++)
            for (int r = 0; r < mr; r++)
                for (int l = 0; l < 16; l++)
                    acc[SLOT(r, c)].v[l] = __builtin_fmaf(xv[r][l], wv[c][l], acc[SLOT(r, c)].v[l]);
    }
    for (int s = 0; s < 16; s++) sums[LANE_OF(s)] = tree16(acc[s].v);
#endif
}

/* One row tile of mr rows (a compile-time constant after inlining) against the weight tiles
 * [t0, t1), writing y. W holds weight rows from row w0 on, bf16 if wb (x and y: bf16 if bf16, but x fp32 if xw:
 * the AVX2 build's bf16 rows, widened once per call). */
static inline __attribute__((always_inline)) void row_tile(const void *x, int64_t m0, int mr, const void *W, void *y,
                                                           int64_t N, int64_t K, int64_t t0, int64_t t1, int64_t tend,
                                                           int bf16, int prefetch, int l2, int wb, int64_t w0, int xw,
                                                           int wm) {
    const size_t es = bf16 && !xw ? 2 : 4, wes = wb ? 2 : 4;
    const char *xb = (const char *)x + (size_t)(m0 * K) * es;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n0 = t * NR;
        const void *w[NR], *pf[NR];
        for (int c = 0; c < NR; c++) /* past N: repeat the last row (its sums are not stored); tiled: N % NR == 0 */
            w[c] = wm == 1 ? (const char *)W + (size_t)(((n0 + c < N ? n0 + c : N - 1) - w0) * K) * wes
                           : (const char *)W + (size_t)((n0 - w0) * K) * wes + (size_t)c * 64;
        const int ahead = PF_TILES > 0 && prefetch && t + PF_TILES < tend;
        for (int c = 0; c < NR; c++) {
            const int64_t n = n0 + PF_TILES * NR + c;
            pf[c] = (const char *)W + (size_t)(((n < N ? n : N - 1) - w0) * K) * wes;
        }
        float sums[16];
        tile(xb, K, w, K, mr, bf16 && !xw, wb, wm, ahead ? pf : NULL, l2, sums);
        const size_t nc = N - n0 < NR ? (size_t)(N - n0) : NR;
#if defined(__AVX512F__)
        /* row r's NR sums sit in lanes NR r ..: one copy per row */
        if (bf16) {
            uint16_t h[16];
            const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(sums));
            const __m512i rne = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
                16);
            const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_loadu_ps(sums), _mm512_loadu_ps(sums), _CMP_UNORD_Q);
            const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)); /* NaN stays quiet */
            _mm256_storeu_si256((__m256i *)h, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rne, q)));
            /* copy_bytes: a whole tile's copy inlines; a call per tile costs as much as streaming a short GEMM */
            for (int r = 0; r < mr; r++) copy_bytes((uint16_t *)y + (m0 + r) * N + n0, h + NR * r, nc * 2, NR * 2);
        } else {
            for (int r = 0; r < mr; r++) copy_bytes((float *)y + (m0 + r) * N + n0, sums + NR * r, nc * 4, NR * 4);
        }
#else
        for (int r = 0; r < mr; r++) {
            const int64_t o = (m0 + r) * N + n0;
            if (bf16)
                for (size_t c = 0; c < nc; c++) ((uint16_t *)y)[o + c] = bf16_round(sums[LANE_OF(SLOT(r, c))]);
            else
                for (size_t c = 0; c < nc; c++) ((float *)y)[o + c] = sums[LANE_OF(SLOT(r, c))];
        }
#endif
    }
}

/* Weight tiles [a, z) against every row of x, in blocks of nb tiles that all of x's row tiles sweep while the
 * block sits in cache; the weights are prefetched up to tile tend, with PREFETCH_W(l2). */
static inline __attribute__((always_inline)) void span(const void *x, const void *W, void *y, int64_t M, int64_t N,
                                                       int64_t K, int bf16, int64_t a, int64_t z, int64_t nb,
                                                       int64_t tend, int prefetch, int l2, int xw, int wm) {
    /* Tiled weights read by a call of at most TILED_BARE_ROWS rows go through memory in address order at its
     * pace, which the hardware prefetchers follow on their own (prefetches would only take load slots); a call
     * of more rows computes longer per weight, and its first row tile prefetches ahead as for plain weights. */
    const int pf_first = wm == 1 || M > TILED_BARE_ROWS(bf16);
    for (int64_t b0 = a; b0 < z; b0 += nb) {
        const int64_t b1 = b0 + nb < z ? b0 + nb : z;
        int64_t m0 = 0;
        /* the block's first row tile reads the weights from memory: prefetch them there */
        for (; m0 + MR <= M; m0 += MR) row_tile(x, m0, MR, W, y, N, K, b0, b1, tend, bf16, (m0 == 0 && pf_first) || prefetch, l2, bf16, 0, xw, wm);
        switch (M - m0) {
        case 1: row_tile(x, m0, 1, W, y, N, K, b0, b1, tend, bf16, (m0 == 0 && pf_first) || prefetch, l2, bf16, 0, xw, wm); break;
        case 2: row_tile(x, m0, 2, W, y, N, K, b0, b1, tend, bf16, (m0 == 0 && pf_first) || prefetch, l2, bf16, 0, xw, wm); break;
        case 3: row_tile(x, m0, 3, W, y, N, K, b0, b1, tend, bf16, (m0 == 0 && pf_first) || prefetch, l2, bf16, 0, xw, wm); break;
        default: break;
        }
    }
}

/* span with the prefetch hint and the weights' layout constants: the hot loops carry no branch on them */
#define SPAN_FN(name, l2, wm)                                                                                    \
    static void name(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int64_t a, \
                     int64_t z, int64_t nb, int64_t tend, int prefetch, int xw) {                                \
        span(x, W, y, M, N, K, bf16, a, z, nb, tend, prefetch, l2, xw, wm);                                      \
    }
SPAN_FN(span_t0, 0, 1)
SPAN_FN(span_l2, 1, 1)
SPAN_FN(span_tiled_t0, 0, NR)
SPAN_FN(span_tiled_l2, 1, NR)
#undef SPAN_FN

/* The first min(PF_TILES, z - a) weight tiles from tile a, which no earlier tile prefetched (a span that does
 * not continue where the thread's last one ended), bounded by W's N rows. */
static void prefetch_weights(const void *W, int64_t N, int64_t K, int bf16, int64_t a, int64_t z, int l2) {
    const int64_t t1 = a + PF_TILES < z ? a + PF_TILES : z;
    const int64_t r0 = a * NR, r1 = t1 * NR < N ? t1 * NR : N;
    if (r1 <= r0) return;
    const char *p = (const char *)W + (size_t)(r0 * K) * (bf16 ? 2 : 4);
    const size_t bytes = (size_t)((r1 - r0) * K) * (bf16 ? 2 : 4);
    for (size_t b = 0; b < bytes; b += 64) PREFETCH_W(p + b, l2);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#ifndef WIDEN_ROWS
#define WIDEN_ROWS 8 /* bf16 calls of more rows widen each weight block once (span_widened) */
#endif

/* A bf16 call of more than WIDEN_ROWS rows on AVX2, weight tiles [a, z): each block of tiles is widened once
 * into fp32 (exactly), then every row runs over it, where otherwise every pair of rows widens every weight
 * again. The same products, summed in the same order: the same bits. 0 (nothing done) where a block of one
 * tile would not fit the stack buffer. */
static int span_widened(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int64_t a,
                        int64_t z, int l2, int xw, int tiled) {
    int64_t nb = NB_BYTES / (NR * K * (int64_t)sizeof(float));
    if (nb < 1) nb = 1;
    const size_t cap = (size_t)(nb * NR * K) * sizeof(float);
    if (cap > (256u << 10)) return 0;
    float *wf = __builtin_alloca(cap);
    const uint16_t *const end = (const uint16_t *)W + N * K;
    for (int64_t b0 = a; b0 < z; b0 += nb) {
        const int64_t b1 = b0 + nb < z ? b0 + nb : z, r0 = b0 * NR, r1 = b1 * NR < N ? b1 * NR : N;
        const uint16_t *src = (const uint16_t *)W + r0 * K;
        const int64_t n = (r1 - r0) * K, ahead = PF_TILES * NR * K; /* prefetch PF_TILES tiles ahead */
        int64_t i = 0;
        if (tiled) /* the block's chunks back into rows: chunk i / 32 is row c of tile t, elements 32 j .. */
            for (; i < n; i += 32) {
                const int64_t t = i / (NR * K), j = i / (NR * 32) % (K / 32), c = i / 32 % NR;
                for (int h = 0; h < 32; h += 8) _mm256_storeu_ps(wf + (t * NR + c) * K + 32 * j + h, ld8(src, i + h, 1));
            }
        for (; i + 32 <= n; i += 32) {
            if (src + i + ahead < end) PREFETCH_W(src + i + ahead, l2);
            for (int h = 0; h < 32; h += 8) _mm256_storeu_ps(wf + i + h, ld8(src, i + h, 1));
        }
        for (; i < n; i++) wf[i] = bf16_widen(src[i]);
        int64_t m0 = 0;
        for (; m0 + MR <= M; m0 += MR) row_tile(x, m0, MR, wf, y, N, K, b0, b1, b1, 1, 0, l2, 0, r0, xw, 1);
        switch (M - m0) {
        case 1: row_tile(x, m0, 1, wf, y, N, K, b0, b1, b1, 1, 0, l2, 0, r0, xw, 1); break;
        case 2: row_tile(x, m0, 2, wf, y, N, K, b0, b1, b1, 1, 0, l2, 0, r0, xw, 1); break;
        case 3: row_tile(x, m0, 3, wf, y, N, K, b0, b1, b1, 1, 0, l2, 0, r0, xw, 1); break;
        default: break;
        }
    }
    return 1;
}
#endif

uint64_t team_takeover_count;
struct team_stall_spec team_stall;

uint64_t team_takeovers(void) { return __atomic_load_n(&team_takeover_count, __ATOMIC_RELAXED); }

/* Makes thread id sleep `seconds` while it holds its first claim of phase `phase` of every team call (0: no
 * stall). For tests only: it is what a preemption at that point looks like. */
void team_stall_at(int id, unsigned phase, double seconds) {
    team_stall.id = id;
    team_stall.phase = phase;
    team_stall.seconds = seconds;
}

#ifndef CLAIM_TILES
#define CLAIM_TILES 8 /* weight tiles per claim when streaming W: what a preempted thread can hold back */
#endif

/* The team's phase y = x @ W^T (see team in kernels.h): units of whole weight tiles, so one thread computes
 * each output. Shapes as invariant_linear, already checked, with (N + 3) / 4 <= SHARE_MASK. stream: W is
 * larger than the last-level cache, so its prefetches go to L2 (PREFETCH_W). */
void linear_part(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int stream,
                 int tiled, team *t) {
    const int64_t tiles = (N + NR - 1) / NR;
    const int64_t es = bf16 ? 2 : 4;
    int64_t nb = NB_BYTES / (NR * K * es);
    if (nb < 1) nb = 1;
    const int prefetch = M <= 2 * MR; /* streaming W: the next tiles are not in cache yet */
    /* tiled weights streamed by a few rows are read in address order, without prefetches (span) */
    const int pf = prefetch && !(tiled && M <= TILED_BARE_ROWS(bf16));
    /* the owner's claims run on through its share: prefetch up to its end */
    const int64_t own_end = tiles * (t->id + 1) / t->nt;
    /* a claim: a few tiles, more as the phase has more (a claim's compare-and-swap costs about as much as
     * streaming a tile), in whole blocks */
    int64_t claim = tiles / (8 * t->nt);
    claim = claim < CLAIM_TILES ? CLAIM_TILES : claim > 4 * CLAIM_TILES ? 4 * CLAIM_TILES : claim;
    if (!prefetch) claim = (claim + nb - 1) / nb * nb;
    int64_t next = -1; /* where this thread's last span ended: the tiles from there on are prefetched */
    int xw = 0;        /* x widened to fp32 here, once, for every tile (AVX2's bf16) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (bf16 && M > 1 && (size_t)(M * K) * sizeof(float) <= (64u << 10)) { /* one row: no gain measured */
        float *xf = __builtin_alloca((size_t)(M * K) * sizeof(float));
        const int64_t n = M * K;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(xf + i, ld8(x, i, 1));
        for (; i < n; i++) xf[i] = bf16_widen(((const uint16_t *)x)[i]);
        x = xf, xw = 1;
    }
#endif
    /* claims of many rows stay whole blocks (each block's weights are read once for every row) */
    PHASE_UNITS_MIN(t, tiles, claim, prefetch ? 1 : nb, a, z, {
        int done = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        done = bf16 && M > WIDEN_ROWS && span_widened(x, W, y, M, N, K, a, z, stream, xw, tiled);
#endif
        if (!done) {
            const int64_t tend = t->victim == 0 ? own_end : z;
            if (pf && a != next) prefetch_weights(W, N, K, bf16, a, z, stream);
            (tiled ? (stream ? span_tiled_l2 : span_tiled_t0) : (stream ? span_l2 : span_t0))(
                x, W, y, M, N, K, bf16, a, z, nb, tend, pf, xw);
        }
        next = z;
    });
}

int tiled_shape_ok(int64_t N, int64_t K, int bf16) { return N % NR == 0 && K % (bf16 ? 32 : 16) == 0; }

/* Whether this build's GEMMs read tiled weights faster than plain ones, over the row counts a server runs
 * (docs/benchmarks.md#decode_floor): with AVX-512, yes; on AVX2, fp32 only: its bf16 calls of a few rows
 * widen weight pairs in two passes over each tile, which read half the tile's lines each when it is tiled,
 * and lost more at 2-5 rows than one row gained. */
int tiled_layout_wins(int bf16) {
#if defined(__AVX512F__)
    (void)bf16;
    return 1;
#else
    return !bf16;
#endif
}

/* Weights [N, K] (fp32, or bf16 as uint16) into the tiled layout the GEMMs read in address order: tile t (rows
 * NR t .. NR t + NR - 1) is one contiguous run of K / ck chunks of NR rows' ck elements (64 bytes each), chunk
 * j holding elements ck j .. ck j + ck - 1 of each row in turn: element (n, k) lies at
 * ((n / NR * (K / ck) + k / ck) * NR + n % NR) * ck + k % ck, ck = 64 bytes / element. A one-row GEMM reads
 * the rows of a tile side by side, chunk by chunk; tiled, that is one stream in address order, which the
 * hardware prefetchers follow, where NR rows a row apart are NR streams. Needs tiled_shape_ok. */
int tile_weights(const void *W, void *out, int64_t N, int64_t K, int bf16) {
    if (N <= 0 || K <= 0 || !tiled_shape_ok(N, K, bf16)) return -1;
    const size_t es = bf16 ? 2 : 4, ck = 64 / es;
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < K / (int64_t)ck; j++)
            memcpy((char *)out + ((size_t)((n / NR * (K / (int64_t)ck) + j) * NR + n % NR) * ck) * es,
                   (const char *)W + (size_t)(n * K + j * (int64_t)ck) * es, 64);
    return 0;
}

/* x: [M, K], W: [N, K] (or tiled: tile_weights' layout), y: [M, N], all contiguous; fp32, or bf16 (bf16 != 0)
 * as uint16. stream: see linear_part (a speed hint: every bit of y is the same either way); tiled: the layout
 * (the same bits either way). */
int invariant_linear(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int stream,
                     int tiled, int nthreads) {
    if (M < 0 || N <= 0 || K <= 0 || (tiled && !tiled_shape_ok(N, K, bf16))) return -1;
    if (M == 0) return 0;
    const int64_t tiles = (N + NR - 1) / NR;
    int nt = nthreads < 1 ? 1 : nthreads;
    if ((double)M * N * K < 262144.0) nt = 1; /* a tiny call costs less than waking the threads */
    if (nt > tiles) nt = (int)tiles;
    if (tiles > (int64_t)SHARE_MASK) return -1;
    TEAM_SLOTS(slots, nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        team t = team_join(slots, nt, 1); /* x is only read, y only written: held tiles may be computed again */
        linear_part(x, W, y, M, N, K, bf16, stream, tiled, &t);
    }
    return 0;
}
