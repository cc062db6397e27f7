/* The elementwise and row-wise ops of a decoder layer, fused, on the CPU: residual add + RMSNorm,
 * RoPE + the key/value cache write, and SiLU(gate) * up.
 *
 * Why: built from torch ops these are ~35 small calls per layer, and a one-row decode step then
 * spends about as long dispatching them as streaming every weight through the GEMMs. Here they are
 * three calls per layer.
 *
 * Every output element is a function of its own row alone, computed in one fixed order: the sum of
 * squares of RMSNorm adds its columns in LANES fixed lanes and then a fixed tree, and every other
 * value is elementwise. A row's result does not depend on how many rows the call holds, on the
 * vector width, or on which rows a thread takes. Values are stored in the model's dtype (fp32 or
 * bf16, as uint16 rounded to nearest even, as torch rounds) after each op torch would round after,
 * so results stay close to the torch ops' (not bit-equal: exp differs).
 *
 * Built with invariant_attention.c into one library (workers/native_attention.py), with
 * -ffp-contract=off and without -ffast-math.
 */

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define LANES 16

#include "kernels.h"
#include "vec_math.h"

/* The value x would hold once stored in the model's dtype. */
static inline vlanes round_to(vlanes x, int bf16) { return bf16 ? round_to_bf16(x) : x; }

/* LANES values from p[i ..], or the first n of them (the rest 0) at a row's end. A whole chunk is loaded
 * straight into a register: through a zeroed temporary, as the end's few values are, it costs a store and a
 * reload each. */
static inline vlanes load(const void *p, int64_t i, int n, int bf16) {
    if (n == LANES) return load_kv(p, i, bf16); /* vec_math.h's whole-chunk load, fp32 or bf16 widened */
    if (bf16) {
        vlanes_h h = {0};
        copy_bytes(&h, (const uint16_t *)p + i, (size_t)n * sizeof(uint16_t), sizeof h);
        return from_bf16(h);
    }
    vlanes x = {0};
    copy_bytes(&x, (const float *)p + i, (size_t)n * sizeof(float), sizeof x);
    return x;
}

static inline void store(void *p, int64_t i, vlanes x, int n, int bf16) {
    if (n == LANES) { /* a whole chunk: one vector move */
        if (bf16) {
            const vlanes_h h = to_bf16(x);
            __builtin_memcpy((uint16_t *)p + i, &h, sizeof h);
        } else {
            __builtin_memcpy((float *)p + i, &x, sizeof x);
        }
        return;
    }
    if (bf16) {
        const vlanes_h h = to_bf16(x);
        copy_bytes((uint16_t *)p + i, &h, (size_t)n * sizeof(uint16_t), sizeof h);
    } else {
        copy_bytes((float *)p + i, &x, (size_t)n * sizeof(float), sizeof x);
    }
}

/* exp(x) for x <= 0, flushed to 0 below -87 (where fp32 would go subnormal). */
static inline vlanes exp_nonpos_flushed(vlanes x) {
    return (vlanes)((vlanes_i)exp_nonpos(x) & ~lanes_lt(x, (vlanes){0} - 87.0f));
}

#define CHUNK(n, j) ((n) - (j) < LANES ? (int)((n) - (j)) : LANES)

/* Row t of rms_norm below, reading the residual from h and, when delta is given, storing h + delta into
 * h_out (h itself for rms_norm; NULL: not stored, added again where read). Each output is written once, with
 * its final value. */
static void rms_row(const void *h, void *h_out, const void *delta, const void *w, void *out, int64_t t, int64_t n,
                    float eps, int bf16) {
    const int64_t row = t * n;
    vlanes ss = {0};
    for (int64_t j = 0; j < n; j += LANES) {
        const int c = CHUNK(n, j);
        vlanes x = load(h, row + j, c, bf16);
        if (delta) {
            x = round_to(x + load(delta, row + j, c, bf16), bf16);
            if (h_out) store(h_out, row + j, x, c, bf16);
        }
        ss = ss + x * x;  /* lanes past the row's end add 0 */
    }
    float acc[LANES];
    __builtin_memcpy(acc, &ss, sizeof acc);
    for (int k = LANES / 2; k > 0; k /= 2)
        for (int l = 0; l < k; l++) acc[l] = acc[l] + acc[l + k];
    const float r = 1.0f / sqrtf(acc[0] / (float)n + eps);
    for (int64_t j = 0; j < n; j += LANES) {
        const int c = CHUNK(n, j);
        vlanes x;
        if (!delta)
            x = load(h, row + j, c, bf16);
        else if (h_out)
            x = load(h_out, row + j, c, bf16);
        else
            x = round_to(load(h, row + j, c, bf16) + load(delta, row + j, c, bf16), bf16);
        const vlanes y = round_to(x * r, bf16);
        store(out, row + j, load(w, j, c, bf16) * y, c, bf16);
    }
}

/* h: [T, n]. If delta is given, h += delta first (in place, rounded to the dtype). Then
 * out = w * dtype(h * rsqrt(mean(h^2) + eps)), with mean(h^2) summed in fp32: HF's LlamaRMSNorm. */
int rms_norm(void *h, const void *delta, const void *w, void *out, int64_t T, int64_t n, float eps, int bf16,
             int nthreads) {
    if (T < 0 || n <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T * n >= 65536)
    for (int64_t t = 0; t < T; t++) rms_row(h, h, delta, w, out, t, n, eps, bf16);
    return 0;
}

/* out[r] = the index of row r's largest value, torch.argmax's answer: the first maximal index, or the first
 * NaN's if the row holds one (torch orders NaN above every number); -0.0 equals 0.0. x: [R, V] fp32.
 * Why not torch's: its reduction reads a greedy step's 49,152 logits several times slower. Two passes:
 * the lane-wise maximum (and whether a NaN was seen), then the first index holding it. */
void argmax_rows(const float *x, int64_t R, int64_t V, int64_t *out) {
    enum { BLK = 4 * LANES }; /* four independent chains: a compare-and-select's latency, not its throughput */
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * V;
        const int64_t vend = V - V % BLK;
        vlanes m[4];
        for (int c = 0; c < 4; c++) m[c] = (vlanes){0} + row[0];
        vlanes_i nan = {0};
        for (int64_t j = 0; j < vend; j += BLK)
            for (int c = 0; c < 4; c++) {
                const vlanes v = load_lanes(row + j + c * LANES);
                nan |= lanes_ne(v, v);
                m[c] = select_lanes(lanes_gt(v, m[c]), v, m[c]);
            }
        float best = row[0];
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < LANES; l++) best = m[c][l] > best ? m[c][l] : best;
        int has_nan = any_lane(nan);
        for (int64_t j = vend; j < V; j++) {
            has_nan |= row[j] != row[j];
            best = row[j] > best ? row[j] : best;
        }
        int64_t at = -1, j = 0;
        if (has_nan) {
            for (; j < V && at < 0; j++)
                if (row[j] != row[j]) at = j;
        } else {
            const vlanes b = (vlanes){0} + best;
            for (; j < vend; j += BLK) {
                const vlanes_i eq = lanes_eq(load_lanes(row + j), b) | lanes_eq(load_lanes(row + j + LANES), b) |
                                    lanes_eq(load_lanes(row + j + 2 * LANES), b) |
                                    lanes_eq(load_lanes(row + j + 3 * LANES), b);
                if (any_lane(eq)) break;
            }
            for (; j < V && at < 0; j++)
                if (row[j] == best) at = j;
        }
        out[r] = at;
    }
}

/* Every position inside the tables and every cache index inside the pool (0), else -1. */
static int rope_check(const int64_t *pos, const int64_t *kv_index, int64_t T, int64_t Hkv, int64_t D, int64_t BS,
                      int64_t num_blocks, int64_t max_len) {
    if (D % 2 || D > 1024 || Hkv <= 0 || BS <= 0) return -1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_len || kv_index[t] < 0 || kv_index[t] >= num_blocks * BS) return -1;
    return 0;
}

/* Head hh of row t (a query head if hh < H, else key head hh - H) rotated: into q_out, or into the cache. */
static inline void rope_head(const void *qkv, int64_t row, const float *c, const float *s, float *q_out, void *kt,
                             int64_t t, int64_t hh, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t blk,
                             int64_t off, int bf16, int kv_bf16) {
    const int64_t half = D / 2;
    float x[1024], y[1024];
    for (int64_t d = 0; d < D; d += LANES) {
        const int n = CHUNK(D, d);
        store(x, d, load(qkv, row + hh * D + d, n, bf16), n, 0);
    }
    for (int64_t d = 0; d < D; d += LANES) {
        const int n = CHUNK(D, d);
        vlanes rot;
        if (half % LANES == 0) /* whole vectors from one half: -x[d + half ..] or x[d - half ..] */
            rot = d < half ? -load_lanes(x + d + half) : load_lanes(x + d - half);
        else
            for (int l = 0; l < LANES; l++) {
                const int64_t e = d + l < D ? d + l : 0;
                rot[l] = e < half ? -x[e + half] : x[e - half];
            }
        const vlanes a = round_to(load(x, d, n, 0) * load(c, d, n, 0), bf16);
        const vlanes b = round_to(rot * load(s, d, n, 0), bf16);
        store(y, d, round_to(a + b, bf16), n, 0);
    }
    if (hh < H) {
        __builtin_memcpy(q_out + (t * H + hh) * D, y, (size_t)D * sizeof(float));
    } else {
        const int64_t k0 = ((blk * Hkv + (hh - H)) * D) * BS + off;  /* key d at k0 + d * BS */
        if (kv_bf16) {
            uint16_t kh[1024];
            for (int64_t d = 0; d < D; d += LANES) store(kh, d, load(y, d, CHUNK(D, d), 0), CHUNK(D, d), 1);
            for (int64_t d = 0; d < D; d++) ((uint16_t *)kt)[k0 + d * BS] = kh[d];
        } else {
            for (int64_t d = 0; d < D; d++) ((float *)kt)[k0 + d * BS] = y[d];
        }
    }
}

/* Row t of rope_kv below, its arguments checked, for query heads [q0, q1) and kv heads [g0, g1) only
 * (every head is computed on its own: any split of the heads gives the same values). */
static void rope_heads(const void *qkv, int64_t qkv_stride, const int64_t *pos, const int64_t *kv_index,
                       const void *cos, const void *sin, float *q_out, void *kt, void *v, int64_t t, int64_t H,
                       int64_t Hkv, int64_t D, int64_t BS, int bf16, int kv_bf16, int64_t q0, int64_t q1, int64_t g0,
                       int64_t g1) {
    const int64_t p = pos[t], row = t * qkv_stride, blk = kv_index[t] / BS, off = kv_index[t] % BS;
    float c[1024], s[1024];
    for (int64_t d = 0; d < D; d += LANES) {
        const int n = CHUNK(D, d);
        store(c, d, load(cos, p * D + d, n, bf16), n, 0);
        store(s, d, load(sin, p * D + d, n, bf16), n, 0);
    }
    for (int64_t hh = q0; hh < q1; hh++)
        rope_head(qkv, row, c, s, q_out, kt, t, hh, H, Hkv, D, BS, blk, off, bf16, kv_bf16);
    for (int64_t hh = H + g0; hh < H + g1; hh++)
        rope_head(qkv, row, c, s, q_out, kt, t, hh, H, Hkv, D, BS, blk, off, bf16, kv_bf16);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t v0 = ((blk * Hkv + g) * BS + off) * D;
        for (int64_t d = 0; d < D; d += LANES) {
            const int n = CHUNK(D, d);
            store(v, v0 + d, load(qkv, row + (H + Hkv + g) * D + d, n, bf16), n, kv_bf16);
        }
    }
}

static void rope_row(const void *qkv, int64_t qkv_stride, const int64_t *pos, const int64_t *kv_index, const void *cos,
                     const void *sin, float *q_out, void *kt, void *v, int64_t t, int64_t H, int64_t Hkv, int64_t D,
                     int64_t BS, int bf16, int kv_bf16) {
    rope_heads(qkv, qkv_stride, pos, kv_index, cos, sin, q_out, kt, v, t, H, Hkv, D, BS, bf16, kv_bf16, 0, H, 0, Hkv);
}

/* RoPE on the query and key heads of a fused qkv projection, as HF's rotate_half form:
 * y = x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype.
 * qkv: [T, (H + 2 Hkv) * D] with row stride qkv_stride. pos: [T] (for RoPE). cos, sin: [max_len, D].
 * kv_index: [T] where the row's key and value go in the paged cache: block * BS + offset.
 * Returns -1 (nothing written) if a position lies outside the tables or an index outside the pool.
 * Writes q_out [T, H, D] (fp32), keys into kt [num_blocks, Hkv, D, BS] (transposed) and values into
 * v [num_blocks, Hkv, BS, D] at (block, head, offset), in fp32 or (kv_bf16) bf16. A bf16 model's keys
 * and values are bf16 values already, so storing them as bf16 loses nothing. */
int rope_kv(const void *qkv, int64_t qkv_stride, const int64_t *pos, const int64_t *kv_index, const void *cos,
            const void *sin, float *q_out, void *kt, void *v, int64_t T, int64_t H, int64_t Hkv, int64_t D,
            int64_t BS, int64_t num_blocks, int64_t max_len, int bf16, int kv_bf16, int nthreads) {
    if (rope_check(pos, kv_index, T, Hkv, D, BS, num_blocks, max_len)) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T >= 64)
    for (int64_t t = 0; t < T; t++)
        rope_row(qkv, qkv_stride, pos, kv_index, cos, sin, q_out, kt, v, t, H, Hkv, D, BS, bf16, kv_bf16);
    return 0;
}

/* gu: [T, 2 I] (gate then up, as the fused gate_up projection writes them). out: [T, I] =
 * dtype(dtype(silu(gate)) * up), silu(x) = x / (1 + exp(-x)) computed from exp(-|x|), which never
 * overflows. */
/* Chunks [c0, c1) of LANES values of silu_mul below, chunk c = row c / cpr at column (c % cpr) LANES, cpr the
 * chunks of a row: elementwise, so any split of the chunks gives the same values. */
static void silu_span(const void *gu, void *out, int64_t I, int bf16, int64_t c0, int64_t c1) {
    const int64_t cpr = (I + LANES - 1) / LANES;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t t = c / cpr, j = (c % cpr) * LANES;
        const int n = CHUNK(I, j);
        const vlanes g = load(gu, t * 2 * I + j, n, bf16);
        const vlanes u = load(gu, t * 2 * I + I + j, n, bf16);
        const vlanes e = exp_nonpos_flushed((vlanes)((vlanes_u)g | 0x80000000u));  /* exp(-|g|) */
        const vlanes num = select_lanes(lanes_ge(g, (vlanes){0}), g, g * e);
        const vlanes sg = round_to(num / (1.0f + e), bf16);
        store(out, t * I + j, sg * u, n, bf16);
    }
}

int silu_mul(const void *gu, void *out, int64_t T, int64_t I, int bf16, int nthreads) {
    if (T < 0 || I <= 0) return -1;
    const int64_t cpr = (I + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T * I >= 65536)
    for (int64_t t = 0; t < T; t++) silu_span(gu, out, I, bf16, t * cpr, (t + 1) * cpr);
    return 0;
}

/* Where the fused forward adds each phase's seconds (thread 0's clock from phase end to phase end, so a
 * phase's share includes waiting for its last units), or NULL: benchmarks/engine/step_split.py reads it. */
static double *phase_acc;

void layers_profile(double *acc) { phase_acc = acc; }

/* One layer's intermediates in the fused forward: where each phase writes (see invariant_layers). */
typedef struct {
    /* the row-wise phases' outputs: with fewer rows than threads, each thread's own copy */
    void *h_attn;  /* [T, hidden] the residual after the layer's attention input (h + the last layer's output) */
    void *x;       /* [T, hidden] the input norm's output */
    void *h_mlp;   /* [T, hidden] the residual after the attention block */
    void *x_mlp;   /* [T, hidden] the post-attention norm's output */
    void *act;     /* [T, I] SiLU(gate) * up */
    /* the GEMMs' and attention's outputs, shared */
    void *qkv;     /* [T, (H + 2 Hkv) D] */
    float *q;      /* [T, H D] fp32, the rotated queries */
    float *o32;    /* [T, H D] fp32, attention's output */
    void *o;       /* [T, H D] the model's dtype: the o projection's input (o32 itself in fp32) */
    void *d_attn;  /* [T, hidden] the o projection's output */
    void *gu;      /* [T, 2 I] */
    void *d_mlp;   /* [T, hidden] the down projection's output */
} layer_bufs;

#ifndef KV_AHEAD_BYTES
#define KV_AHEAD_BYTES (64 << 10) /* a thread's keys and values fetched a layer ahead, at most (a burst of prefetches) */
#endif

#ifndef RING_LAYERS
#define RING_LAYERS 8 /* layers whose intermediates the workspace holds at once: the ring stays in L2 */
#endif

/* Carves one ring slot of layer intermediates out of base (64-byte aligned pieces), with `copies` copies of
 * the row-wise outputs, and points b at copy `id`'s; returns the slot's bytes. With base NULL, only counts. */
static int64_t carve_slot(char *base, layer_bufs *b, int64_t T, int64_t hidden, int64_t nqkv, int64_t HD, int64_t I,
                          int bf16, int copies, int id) {
    const int64_t es = bf16 ? 2 : 4;
    const int64_t rows[5] = {T * hidden * es, T * hidden * es, T * hidden * es, T * hidden * es, T * I * es};
    const int64_t shared[7] = {T * nqkv * es, T * HD * 4, T * HD * 4, bf16 ? T * HD * 2 : 0, T * hidden * es,
                               T * 2 * I * es, T * hidden * es};
    void *at[12] = {0};
    int64_t off = 0;
    for (int c = 0; c < copies; c++)
        for (int i = 0; i < 5; i++) {
            if (c == id) at[i] = base ? base + off : NULL;
            off += (rows[i] + 63) / 64 * 64;
        }
    for (int i = 0; i < 7; i++) {
        at[5 + i] = base ? base + off : NULL;
        off += (shared[i] + 63) / 64 * 64;
    }
    if (b) {
        b->h_attn = at[0], b->x = at[1], b->h_mlp = at[2], b->x_mlp = at[3], b->act = at[4];
        b->qkv = at[5], b->q = (float *)at[6], b->o32 = (float *)at[7], b->o = bf16 ? at[8] : at[7];
        b->d_attn = at[9], b->gu = at[10], b->d_mlp = at[11];
    }
    return off;
}

static int ring_slots(int64_t L) { return L < RING_LAYERS ? (int)L : RING_LAYERS; }

/* The bytes of the workspace in which invariant_layers gives the layers their own intermediates, for
 * nthreads threads. */
int64_t layers_workspace_bytes(int64_t L, int64_t T, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t I,
                               int bf16, int nthreads) {
    const int copies = nthreads > 1 && T < nthreads ? nthreads : 1;
    return 64 + ring_slots(L) * carve_slot(NULL, NULL, T, hidden, (H + 2 * Hkv) * D, H * D, I, bf16, copies, 0);
}

#define WIDEN_CHUNK 4096 /* logits widened per unit of the head's widening phase */
#define ARGMAX_CHUNK 4096 /* logits per unit of the head's argmax, when it has fewer rows than threads */

/* The head's arguments (see invariant_layers), checked before anything is written: 0, or -1. */
static int head_check(const int64_t *rows, int64_t M, int64_t T, int64_t hidden, int64_t V, int bf16, int tiled) {
    if (M < 0 || hidden <= 0 || V <= 0 || M > (int64_t)SHARE_MASK || (V + 3) / 4 > (int64_t)SHARE_MASK ||
        (M * V + WIDEN_CHUNK - 1) / WIDEN_CHUNK > (int64_t)SHARE_MASK || (tiled && !tiled_shape_ok(V, hidden, bf16)))
        return -1;
    for (int64_t m = 0; m < M; m++)
        if (rows[m] < 0 || rows[m] >= T) return -1;
    return 0;
}

/* The chunks of a row that the argmax's units take when the head has fewer rows than threads. */
static int64_t argmax_chunks(int64_t M, int64_t V, int nt) {
    return M >= nt ? 1 : (V + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK;
}

/* argmax_rows' answer for one row from its chunks' (first maximal or first NaN) indices, in chunk order: the
 * first chunk holding a NaN gives the first NaN, else the first chunk holding the maximum its first index. */
static int64_t argmax_of_chunks(const float *row, const int64_t *at, int64_t nch) {
    for (int64_t c = 0; c < nch; c++)
        if (row[at[c]] != row[at[c]]) return at[c];
    int64_t best = at[0];
    for (int64_t c = 1; c < nch; c++)
        if (row[at[c]] > row[best]) best = at[c];
    return best;
}

/* The model's head as team phases: for each of the M rows `rows` of the residual stream, the final RMSNorm of
 * h + delta into hs, then logits = hs @ W^T, then (logits_f32 not NULL) the bf16 logits widened to fp32: the same
 * row computations as rms_norm on those rows and invariant_linear, so the same bits. Then (argmax not NULL) each
 * row's argmax_rows into argmax, or, with fewer rows than threads, each chunk's into chunk_at [M, argmax_chunks]
 * for the caller to combine (argmax_of_chunks) after the region. h and delta are only read, and every unit
 * rewrites the same values: held units may be computed again. acc (thread 0's, or NULL): adds the norm's seconds
 * to acc[9] and the rest's (GEMM, widening, argmax) to acc[10], from *t_phase on. */
static void head_phases(team *t, const void *h, const void *delta, const int64_t *rows, int64_t M, const void *norm_w,
                        const void *W, void *hs, void *logits, int64_t hidden, int64_t V, float eps, int bf16,
                        int stream, int tiled, float *logits_f32, int64_t *argmax, int64_t *chunk_at, double *acc,
                        double t_phase) {
    const size_t row_bytes = (size_t)hidden * (bf16 ? 2 : 4);
    PHASE_UNITS(t, M, 1, a, z, for (int64_t m = a; m < z; m++) {
        const size_t at = (size_t)rows[m] * row_bytes;
        rms_row((const char *)h + at, NULL, (const char *)delta + at, norm_w, (char *)hs + (size_t)m * row_bytes, 0,
                hidden, eps, bf16);
    });
    const double t_norm = acc ? team_clock() : 0.0;
    linear_part(hs, W, logits, M, V, hidden, bf16, stream, tiled, t);
    if (logits_f32) { /* exact: what torch's .float() gives */
        const int64_t n = M * V, chunks = (n + WIDEN_CHUNK - 1) / WIDEN_CHUNK;
        PHASE_UNITS(t, chunks, 1, a, z, {
            const int64_t i1 = z * WIDEN_CHUNK < n ? z * WIDEN_CHUNK : n;
            for (int64_t i = a * WIDEN_CHUNK; i < i1; i++) {
                const uint32_t u = (uint32_t)((const uint16_t *)logits)[i] << 16;
                __builtin_memcpy(logits_f32 + i, &u, sizeof u);
            }
        });
    }
    if (argmax) { /* each row's largest logit, read while the logits are in cache: a unit a row, or a row's chunk */
        const float *const f = logits_f32 ? logits_f32 : (const float *)logits;
        const int64_t nch = argmax_chunks(M, V, t->nt);
        PHASE_UNITS(t, M * nch, 1, a, z, for (int64_t u = a; u < z; u++) {
            const int64_t m = u / nch, c0 = (u % nch) * ARGMAX_CHUNK;
            const int64_t n = nch == 1 ? V : (V - c0 < ARGMAX_CHUNK ? V - c0 : ARGMAX_CHUNK);
            int64_t j; /* stored once: a unit computed again (a takeover) writes the same value */
            argmax_rows(f + m * V + c0, 1, n, &j);
            *(nch == 1 ? argmax + m : chunk_at + u) = j + c0;
        });
    }
    if (acc) {
        acc[9] += t_norm - t_phase;
        acc[10] += team_clock() - t_norm;
    }
}

/* Every decoder layer of one forward in one call, when every GEMM is invariant_linear: the same per-row
 * and per-output computations, in the same order, as the calls the runner would make one by one from
 * Python, so the result is bit-identical to that path.
 *
 * Why one parallel region: at one row a layer is nine short phases, and opening a parallel region for
 * each (or running the row-wise ones on one thread while the other waits to be woken) costs about as
 * long as the shorter GEMMs stream. Here the threads stay in one region for the whole forward and go
 * through its phases as a team (team in kernels.h): each phase's units (whole weight tiles, whole
 * attention items, whole rows, whole LANES chunks) are claimed a few at a time, and a phase starts once
 * the one before is done.
 *
 * With a workspace (ws, of layers_workspace_bytes: a decode step's few rows), the layers write their
 * intermediates into a ring of RING_LAYERS slots there, and a thread reuses a slot only once every thread
 * has left the layers that read it. So no unit rewrites what a later phase reads, and a thread waiting on
 * units a preempted thread holds may compute them again (the team's takeover). With fewer rows than
 * threads, each thread also computes every row-wise phase (the norms, SiLU * up) in its own copy: the
 * same values, without a phase and its wait. The last layer's residual and down projection are copied to h
 * and delta at the end. Without a workspace (a prefill chunk's many rows), the layers share the buffers
 * below, h is updated in place, and held units are only waited for.
 *
 * w: [L * 6] per layer in_norm [hidden], qkv [(H + 2 Hkv) D, hidden], o [hidden, H D], post_norm [hidden],
 * gate_up [2 I, hidden], down [hidden, I]. kt, v: [L] the layers' caches (see rope_kv). h: [T, hidden], the
 * residual stream, updated; on return delta holds the last layer's down projection (h + delta is the output,
 * added by the caller as torch adds). Buffers without a workspace: x [T, hidden], qkv [T, (H + 2 Hkv) D],
 * q and o32 [T, H D] fp32, o [T, H D] (the model's dtype; unused for fp32), delta [T, hidden], gu [T, 2 I],
 * act [T, I]. stream: the weights are larger than the last-level cache (see linear_part); tiled: the four GEMM
 * weights of every layer are in tile_weights' layout (invariant_linear.c). ids: NULL, or [T] token ids, when h
 * is first set to their rows of embed ([vocab, hidden], the model's dtype): the gather torch's index_select
 * would make, here without a torch op of its own. rows: NULL, or [M] rows of the stream (0..T-1) whose logits the
 * step needs: the head (head_phases) then runs in the same region, after the last layer, without a second
 * call, its parallel region and the Python between them; norm_w [hidden] the final norm, W_head [V, hidden] (in
 * the layers' layout), hs [M, hidden] and logits [M, V] in the model's dtype, logits_f32: NULL, or (bf16) [M, V]
 * where the logits are also written widened to fp32, the sampler's input, so that Python makes no conversion;
 * argmax: NULL, or [M] each row's argmax_rows (a greedy row's token), found while its logits are still in cache.
 * Returns 0, or -1 if an index lies outside the tables or the pool, a token id outside the vocabulary, a row
 * outside 0..T-1, a shape outside the kernels, or the workspace is too small (checked before anything is
 * written). */
int invariant_layers(void *h, const void *const *w, void *const *kt, void *const *v, int64_t L,
                     const int64_t *pos, const int64_t *kv_index, const void *cos, const void *sin, int64_t max_len,
                     const int64_t *block_table, int64_t bt_stride, const int64_t *req, const int64_t *nvis,
                     float scale, float *scratch, int64_t n_pad, void *x, void *qkv, float *q, float *o32, void *o,
                     void *delta, void *gu, void *act, int64_t T, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                     int64_t I, int64_t BS, int64_t num_blocks, float eps, int bf16, int kv_bf16, int nthreads,
                     void *ws, int64_t ws_bytes, int stream, int tiled, const void *embed, const int64_t *ids,
                     int64_t vocab, const int64_t *rows, int64_t M, const void *norm_w, const void *W_head, void *hs,
                     void *logits, int64_t V, float *logits_f32, int64_t *argmax) {
    if (T <= 0 || hidden <= 0 || I <= 0 || L <= 0) return -1;
    if (rope_check(pos, kv_index, T, Hkv, D, BS, num_blocks, max_len)) return -1;
    if (ids)
        for (int64_t r = 0; r < T; r++)
            if (ids[r] < 0 || ids[r] >= vocab) return -1;
    if (rows && head_check(rows, M, T, hidden, V, bf16, tiled)) return -1;
    const int nmax = nthreads > 0 ? nthreads : 1;
    if (ws && ws_bytes < layers_workspace_bytes(L, T, hidden, H, Hkv, D, I, bf16, nmax)) return -1;
    int64_t *first = (int64_t *)__builtin_alloca((size_t)(T + 1) * sizeof(int64_t));
    attn_plan plan;
    if (attention_plan(&plan, block_table, bt_stride, req, nvis, T, H, Hkv, D, BS, num_blocks, scale, scratch, n_pad,
                       kv_bf16, first))
        return -1;
    const int64_t nqkv = (H + 2 * Hkv) * D, cpr = (I + LANES - 1) / LANES;
    /* SiLU's units: chunks of LANES values, grouped so that a phase's units fit a share word */
    const int64_t silu_group = (T * cpr + (int64_t)SHARE_MASK - 1) / (int64_t)SHARE_MASK;
    const int64_t silu_units = (T * cpr + silu_group - 1) / silu_group;
    if ((uint64_t)(9 * L + 4) >= TEAM_MAX_PHASES || T > (int64_t)SHARE_MASK ||
        plan.tiles * Hkv > (int64_t)SHARE_MASK || (2 * I + 3) / 4 > (int64_t)SHARE_MASK ||
        (nqkv + 3) / 4 > (int64_t)SHARE_MASK ||
        (tiled && !(tiled_shape_ok(nqkv, hidden, bf16) && tiled_shape_ok(hidden, H * D, bf16) &&
                    tiled_shape_ok(2 * I, hidden, bf16) && tiled_shape_ok(hidden, I, bf16))))
        return -1;
    if (ids) { /* the residual stream starts as the tokens' embedding rows: one copy each, before any phase */
        const size_t row_bytes = (size_t)hidden * (bf16 ? 2 : 4);
        for (int64_t r = 0; r < T; r++)
            __builtin_memcpy((char *)h + (size_t)r * row_bytes, (const char *)embed + (size_t)ids[r] * row_bytes,
                             row_bytes);
    }
    int one_row_each = 1; /* each request has one row (rows of a request are consecutive, requests in order) */
    for (int64_t t = 1; t < T; t++) one_row_each &= req[t] > req[t - 1];
    char *const ws_base = ws ? (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63) : NULL;
    const int own_rows = ws != NULL && nmax > 1 && T < nmax; /* each thread computes the row-wise phases itself */
    /* claims of a few per thread and phase: a claim's compare-and-swap costs about as much as a row's norm */
    const int64_t row_claim = (T + 4 * nmax - 1) / (4 * nmax), silu_claim = (silu_units + 4 * nmax - 1) / (4 * nmax);
    const int copies = own_rows ? nmax : 1, slots = ring_slots(L);
    const int64_t slot_bytes = carve_slot(NULL, NULL, T, hidden, nqkv, H * D, I, bf16, copies, 0);
    const layer_bufs shared = {h, x, h, x, act, qkv, q, o32, bf16 ? o : (void *)o32, delta, gu, delta};
    /* the argmax's chunk answers, per row, when the head has fewer rows than threads (a few) */
    const int64_t nch = rows && argmax ? argmax_chunks(M, V, nmax) : 1;
    int64_t *const chunk_at = nch > 1 ? (int64_t *)__builtin_alloca((size_t)(M * nch) * sizeof(int64_t)) : NULL;
    TEAM_SLOTS(team_slots, nmax);
#pragma omp parallel num_threads(nmax) if (nmax > 1)
    {
        team tm = team_join(team_slots, nmax, ws != NULL);
        team *const t = &tm;
        /* the end of this thread's own attention items: while it claims its own, the next is likely its next */
        const int64_t own_items = plan.tiles * Hkv * (t->id + 1) / t->nt;
        double *const acc = t->id == 0 ? phase_acc : NULL;
        double t_phase = acc ? team_clock() : 0.0;
#define PHASE(i)                                   \
    if (acc) {                                     \
        const double t_now = team_clock();         \
        acc[i] += t_now - t_phase;                 \
        t_phase = t_now;                           \
    }
/* a row-wise phase: the rows [0, T) each thread computes itself, or a phase of the team's */
#define ROWS(r, n, claim, ...)                                      \
    if (own_rows) {                                                  \
        for (int64_t r = 0; r < (n); r++) {                          \
            __VA_ARGS__;                                             \
        }                                                            \
    } else                                                           \
        PHASE_UNITS(t, n, claim, r##_a, r##_z, for (int64_t r = r##_a; r < r##_z; r++) { __VA_ARGS__; })
        layer_bufs prev = shared, b = shared;
        for (int64_t l = 0; l < L; l++) {
            const void *const *wl = w + 6 * l;
            if (ws_base) {
                /* this layer reads its slot and the last layer's: stage l + 1. Its slot last held layer
                 * l - slots, read up to layer l - slots + 1: wait until no thread is there */
                team_at(t, (uint64_t)l + 1);
                if (slots < L && l - slots + 3 > 0) team_wait_stage(t, (uint64_t)(l - slots + 3));
                carve_slot(ws_base + (l % slots) * slot_bytes, &b, T, hidden, nqkv, H * D, I, bf16, copies,
                           own_rows ? t->id : 0);
            }
            /* the residual entering the layer, and after its first add (none in layer 0) */
            const void *const h_in = l ? prev.h_mlp : h, *const d_in = l ? prev.d_mlp : NULL;
            void *const h_attn = l ? b.h_attn : (void *)h;
            uint16_t *const o_bf16 = bf16 ? (uint16_t *)b.o : NULL;
            ROWS(r, T, row_claim, rms_row(h_in, h_attn, d_in, wl[0], b.x, r, hidden, eps, bf16));
            PHASE(0);
            linear_part(b.x, wl[1], b.qkv, T, nqkv, hidden, bf16, stream, tiled, t);
            PHASE(1);
            if (one_row_each) {
                /* a decode step: an item reads only its own row's new key and value, so it ropes its own
                 * heads first and the phase between them is gone (rope_kv's clock reads 0) */
                PHASE_UNITS(t, plan.tiles * Hkv, 1, a, z, for (int64_t it = a; it < z; it++) {
                    const int64_t r = plan.first[it / Hkv], g = it % Hkv;
                    rope_heads(b.qkv, nqkv, pos, kv_index, cos, sin, b.q, kt[l], v[l], r, H, Hkv, D, BS, bf16,
                               kv_bf16, g * (H / Hkv), (g + 1) * (H / Hkv), g, g + 1);
                    attention_item(&plan, b.q, H * D, kt[l], v[l], b.o32, o_bf16, it, it + 1 < own_items ? it + 1 : -1,
                                   t->id);
                });
            } else {
                PHASE_UNITS(t, T, 1, a, z,
                            for (int64_t r = a; r < z; r++)
                                rope_row(b.qkv, nqkv, pos, kv_index, cos, sin, b.q, kt[l], v[l], r, H, Hkv, D, BS, bf16,
                                         kv_bf16));
                PHASE(2);
                PHASE_UNITS(t, plan.tiles * Hkv, 1, a, z, for (int64_t it = a; it < z; it++) {
                    attention_item(&plan, b.q, H * D, kt[l], v[l], b.o32, o_bf16, it, it + 1 < own_items ? it + 1 : -1,
                                   t->id);
                });
            }
            PHASE(3);
            linear_part(b.o, wl[2], b.d_attn, T, hidden, H * D, bf16, stream, tiled, t);
            PHASE(4);
            ROWS(r, T, row_claim, rms_row(h_attn, b.h_mlp, b.d_attn, wl[3], b.x_mlp, r, hidden, eps, bf16));
            PHASE(5);
            linear_part(b.x_mlp, wl[4], b.gu, T, 2 * I, hidden, bf16, stream, tiled, t);
            PHASE(6);
            ROWS(u, silu_units, silu_claim, {
                const int64_t c1 = (u + 1) * silu_group < T * cpr ? (u + 1) * silu_group : T * cpr;
                silu_span(b.gu, b.act, I, bf16, u * silu_group, c1);
            });
            PHASE(7);
            /* a decode step: the next layer's keys and values, which its attention reads from memory at the
             * latency of a few items' loads, fetched while this GEMM streams */
            if (one_row_each && l + 1 < L) prefetch_items(&plan, kt[l + 1], v[l + 1], t->id, t->nt, KV_AHEAD_BYTES);
            linear_part(b.act, wl[5], b.d_mlp, T, hidden, I, bf16, stream, tiled, t);
            PHASE(8);
            prev = b;
        }
        if (ws_base && t->id == 0) { /* the last layer's residual and output, where the caller reads them */
            const size_t bytes = (size_t)(T * hidden) * (bf16 ? 2 : 4);
            __builtin_memcpy(h, prev.h_mlp, bytes);
            __builtin_memcpy(delta, prev.d_mlp, bytes);
        }
        if (rows && M > 0) /* the head on the last layer's output, in the same region */
            head_phases(t, prev.h_mlp, prev.d_mlp, rows, M, norm_w, W_head, hs, logits, hidden, V, eps, bf16, stream,
                        tiled, logits_f32, argmax, chunk_at, acc, t_phase);
    }
#undef ROWS
#undef PHASE
    if (chunk_at) {
        const float *const f = logits_f32 ? logits_f32 : (const float *)logits;
        for (int64_t m = 0; m < M; m++) argmax[m] = argmax_of_chunks(f + m * V, chunk_at + m * nch, nch);
    }
    return 0;
}

/* invariant_layers' parameters in one block, in their order. Why: a caller that keeps a block per shape sets the
 * few that change from step to step, where a foreign-function call converted some fifty arguments each time. */
typedef struct {
    void *h;
    const void *const *w;
    void *const *kt, *const *v;
    int64_t L;
    const int64_t *pos, *kv_index;
    const void *cos, *sin;
    int64_t max_len;
    const int64_t *block_table;
    int64_t bt_stride;
    const int64_t *req, *nvis;
    float scale;
    float *scratch;
    int64_t n_pad;
    void *x, *qkv;
    float *q, *o32;
    void *o, *delta, *gu, *act;
    int64_t T, hidden, H, Hkv, D, I, BS, num_blocks;
    float eps;
    int bf16, kv_bf16, nthreads;
    void *ws;
    int64_t ws_bytes;
    int stream, tiled;
    const void *embed;
    const int64_t *ids;
    int64_t vocab;
    const int64_t *rows;
    int64_t M;
    const void *norm_w, *W_head;
    void *hs, *logits;
    int64_t V;
    float *logits_f32;
    int64_t *argmax;
} layers_args;

int64_t layers_args_bytes(void) { return (int64_t)sizeof(layers_args); }

int invariant_layers_packed(const layers_args *a) {
    return invariant_layers(a->h, a->w, a->kt, a->v, a->L, a->pos, a->kv_index, a->cos, a->sin, a->max_len,
                            a->block_table, a->bt_stride, a->req, a->nvis, a->scale, a->scratch, a->n_pad, a->x,
                            a->qkv, a->q, a->o32, a->o, a->delta, a->gu, a->act, a->T, a->hidden, a->H, a->Hkv, a->D,
                            a->I, a->BS, a->num_blocks, a->eps, a->bf16, a->kv_bf16, a->nthreads, a->ws, a->ws_bytes,
                            a->stream, a->tiled, a->embed, a->ids, a->vocab, a->rows, a->M, a->norm_w, a->W_head,
                            a->hs, a->logits, a->V, a->logits_f32, a->argmax);
}

/* The next decode step of a's (see invariant_layers_steps): each row's token tokens[r] at its next position and cache
 * slot (read from its request's block table). Returns 0, or -1 (nothing changed) where a row's next position lies
 * past its table (bt_stride blocks). */
int invariant_layers_advance(layers_args *a, const int64_t *tokens) {
    int64_t *const ids = (int64_t *)a->ids, *const pos = (int64_t *)a->pos, *const kv = (int64_t *)a->kv_index;
    int64_t *const nvis = (int64_t *)a->nvis;
    if (!ids || a->BS <= 0) return -1;
    for (int64_t r = 0; r < a->T; r++)
        if ((pos[r] + 1) / a->BS >= a->bt_stride) return -1;
    for (int64_t r = 0; r < a->T; r++) {
        const int64_t p = pos[r] + 1;
        ids[r] = tokens[r], pos[r] = p, nvis[r] += 1;
        kv[r] = a->block_table[a->req[r] * a->bt_stride + p / a->BS] * a->BS + p % a->BS;
    }
    return 0;
}

/* n greedy decode steps in one call: the fused forward of a's step, then each row's argmax fed back as that row's
 * next token, n times, with no return to the caller between them. Step s's argmaxes go to tokens[s * M ..]. Each
 * step is the computation a call of invariant_layers_packed makes on the same inputs, so every token is the one a
 * greedy step at a time would pick; what a call saves is the caller's work between steps (its scheduling, its
 * output handling). The step a has set up must be a decode step whose logits rows are its rows in order (M == T,
 * rows[m] == m, one row per request), with an argmax; a's index vectors (ids, pos, kv_index, nvis) are advanced in
 * place (invariant_layers_advance), which the attention scratch must cover too. Returns how many steps ran: n, or
 * fewer if a check refused one (none: -1); the tokens of the steps that ran are set. */
static int steps_shape_ok(const layers_args *a, int64_t n) {
    if (n < 1 || !a->rows || !a->argmax || !a->ids || a->M != a->T || a->BS <= 0) return 0;
    for (int64_t m = 0; m < a->M; m++)
        if (a->rows[m] != m || (m > 0 && a->req[m] <= a->req[m - 1])) return 0;
    return 1;
}

int64_t invariant_layers_steps(layers_args *a, int64_t n, int64_t *tokens) {
    if (!steps_shape_ok(a, n)) return -1;
    for (int64_t s = 0; s < n; s++) {
        if (s > 0 && invariant_layers_advance(a, a->argmax)) return s; /* the next position of every row */
        if (invariant_layers_packed(a)) return s ? s : -1;
        __builtin_memcpy(tokens + s * a->M, a->argmax, (size_t)a->M * sizeof(int64_t));
    }
    return n;
}

/* invariant_layers_steps for rows that sample: row r with temps[r] > 0 takes, at step s, the exponential race on
 * softmax(logits / temps[r]) truncated by its top_k[r] (0: off) and top_p[r] (1: off), keyed by output position
 * first_pos[r] + s of a request seeded seeds[r] (scaled_race_row, truncated_race_row: the token the sampler's
 * definition gives), the others their argmax. logits: [M, V] float32, the head's output the forward writes. Where a
 * row's race cannot decide (a near tie, a nucleus edge), the call stops after that step's forward with *pending = 1:
 * its logits are in place for the caller to pick that step's tokens by the definition.
 * Returns the steps whose tokens are set (as invariant_layers_steps), or -1 if a buffer could not be allocated. */
int64_t invariant_layers_steps_sampled(layers_args *a, int64_t n, const float *logits, const float *temps,
                                       const int64_t *top_k, const double *top_p, const uint64_t *seeds,
                                       const int64_t *first_pos, float margin, double guard, double mass_guard,
                                       int64_t cap, int64_t *tokens, int *pending) {
    *pending = 0;
    if (!steps_shape_ok(a, n) || !logits || cap < 1) return -1;
    const int64_t M = a->M, V = a->V;
    int64_t sampled = 0;
    for (int64_t m = 0; m < M; m++) sampled += temps[m] > 0.0f;
    const int nt = a->nthreads > 1 && sampled > 1 ? a->nthreads : 1;
    int truncating = 0; /* a row with top-k or top-p: its race needs the scaled row, a heap and the candidates */
    for (int64_t m = 0; m < M; m++) truncating |= temps[m] > 0.0f && ((top_k[m] > 0 && top_k[m] < V) || top_p[m] < 1.0);
    /* each thread's race candidates [cap] (and, truncating, the row's candidate ids [V]), their scores [cap], the
     * row's uniforms [V] (and, truncating, its scaled logits [V] and a heap [V]): the int64 arrays first, each
     * thread's block at a 64-byte boundary */
    const size_t ids_bytes = truncating ? (size_t)V * sizeof(int64_t) : 0;
    const size_t per = ((size_t)cap * (sizeof(int64_t) + sizeof(float)) + ids_bytes +
                        (size_t)V * sizeof(float) * (truncating ? 3 : 1) + 63) & ~(size_t)63;
    char *const scratch = aligned_alloc(64, per * (size_t)nt);
    if (!scratch) return -1;
    int64_t s = 0;
    for (; s < n; s++) {
        if (s > 0 && invariant_layers_advance(a, tokens + (s - 1) * M)) break;
        if (invariant_layers_packed(a)) {
            if (!s) s = -1;
            break;
        }
        int64_t *const out = tokens + s * M;
        int undecided = 0;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static) reduction(| : undecided)
        for (int64_t m = 0; m < M; m++) {
            if (!(temps[m] > 0.0f)) {
                out[m] = a->argmax[m];
                continue;
            }
            char *const mine = scratch + per * (size_t)(nt > 1 ? omp_get_thread_num() : 0);
            int64_t *const c = (int64_t *)mine, *const ids = c + cap;
            float *const sc = (float *)(mine + (size_t)cap * sizeof(int64_t) + ids_bytes), *const u = sc + cap;
            const uint64_t key = position_key(seeds[m], (uint64_t)(first_pos[m] + s));
            if ((top_k[m] > 0 && top_k[m] < V) || top_p[m] < 1.0) {
                float *const y = u + V, *const heap = y + V;
                out[m] = truncated_race_row(logits + m * V, temps[m], top_k[m], top_p[m], key, V, guard, mass_guard,
                                            y, u, heap, ids);
            } else {
                out[m] = scaled_race_row(logits + m * V, temps[m], key, V, margin, guard, cap, u, c, sc);
            }
            undecided |= out[m] < 0;
        }
        if (undecided) {
            *pending = 1;
            break;
        }
    }
    free(scratch);
    return s;
}
