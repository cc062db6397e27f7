/* What the native kernels' sources share: the thread-share entry points a fused forward calls from inside
 * one parallel region (invariant_layer.c), beside the standalone calls that open their own. */

#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <sched.h>
#include <time.h>
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
void prefetch_items(const attn_plan *p, const void *kt, const void *v, int id, int nt, int64_t bytes);
void attention_part(const attn_plan *p, const float *q, int64_t q_row_stride, const void *kt, const void *v,
                    float *out, uint16_t *out_bf16, int id, int nt);
int invariant_attention(const float *q, int64_t q_row_stride, const void *kt, const void *v, int kv_bf16,
                        const int64_t *block_table, int64_t bt_stride, const int64_t *req, const int64_t *nvis,
                        float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t num_blocks,
                        float scale, float *scratch, int64_t n_pad, int nthreads, uint16_t *out_bf16);

/* A team's way through a forward's phases without barriers. Each phase is n units of work (weight tiles, rows,
 * attention items, SiLU chunks) on what the phase before wrote. Each thread owns a static share of the units
 * and claims them a few at a time from its front; a thread that has spent its own takes the others' from their
 * back; and a thread moves on once no unit of the phase is left unclaimed or being computed, not once every
 * thread has arrived.
 *
 * Why: the serving processes share these cores, and the OS preempts a thread of the team for hundreds of
 * microseconds at a time. With a barrier per phase the other thread then waits that long; here it finishes
 * the preempted thread's share, and (with takeover) computes again the units the preempted thread holds once
 * they have been held too long, and goes on alone through the following phases. The preempted thread, once it
 * runs again, finishes its unit (its writes are the same bits, into buffers no later phase writes: the caller
 * guarantees that when it allows takeover), finds its phases done, and catches up.
 *
 * Every unit's outputs are the same whoever computes them (one fixed order per output), so who takes which
 * units changes no bit.
 *
 * team_slot, each alone on a cache line so that a thread's own words stay in its core until another looks:
 *   - share: a thread's units not yet claimed in a phase, phase number (16 bits) | front (24) | back (24).
 *     Phase numbers only grow within a call: a share of a later phase than a thread's own is spent for it.
 *   - busy: what a thread is computing, phase | first | end; or phase | CLAIMING (set before it claims, so
 *     that a share spent is never seen before its units are seen held); or 0. Only the thread itself writes
 *     it, but for a waiter that took its units over and clears it (one compare-and-swap).
 *   - stage: where a thread is, for callers that reuse buffers (team_at). */
typedef struct {
    uint64_t word;
    char pad[56];
} team_slot;

#define SHARE_BITS 24
#define SHARE_MASK ((1ull << SHARE_BITS) - 1)
#define TEAM_MAX_PHASES 65535u /* phase numbers per call: 16 bits, numbered from 1 */
#define SHARE_WORD(gen, f, b) (((uint64_t)(gen) << (2 * SHARE_BITS)) | ((uint64_t)(f) << SHARE_BITS) | (uint64_t)(b))
#define WORD_GEN(w) ((w) >> (2 * SHARE_BITS))
#define WORD_FRONT(w) ((int64_t)(((w) >> SHARE_BITS) & SHARE_MASK))
#define WORD_BACK(w) ((int64_t)((w)&SHARE_MASK))
#define CLAIMING(gen) SHARE_WORD(gen, SHARE_MASK, 0)
#ifndef TAKEOVER_S
#define TAKEOVER_S 50e-6 /* how long units may stay held, beyond a few of the waiter's own, before it takes them */
#endif

/* Diagnostics (invariant_linear.c): how many times a waiting thread has taken held units over, and a stall
 * that makes thread `id` sleep while it holds its first claim of phase `phase` (as if preempted there), for
 * tests of the takeover. */
extern uint64_t team_takeover_count;
extern struct team_stall_spec {
    int id;
    unsigned phase;
    double seconds;
} team_stall;

typedef struct {
    team_slot *share, *busy, *stage; /* [nt] each, shared by the team */
    int id, nt;
    int takeover;             /* whether a waiter may compute held units again (see above) */
    unsigned phase;           /* this thread's current phase */
    int64_t n, claim;         /* the phase's units and how many a claim takes */
    int64_t claim_min;        /* the fewest a claim takes as a share runs out (see claim_units) */
    int victim;               /* whose share it claims from: 0 its own, then the others' in turn */
    int held_by;              /* whose held units it computes again (takeover), or -1 */
    uint64_t held;            /* their busy word then */
    int64_t claims;           /* how many claims this thread computed in this phase */
    double t_begin;           /* when it began the phase (with takeover) */
} team;

/* The slots for a team of up to nt threads, on the caller's stack (every call's own: two concurrent callers
 * never meet), zeroed: no phase opened, nothing held, nothing started. */
#define TEAM_SLOTS(name, nt)                                                                                    \
    team_slot *name = (team_slot *)(((uintptr_t)__builtin_alloca((3 * (size_t)(nt) + 1) * sizeof(team_slot)) + \
                                     63) &                                                                      \
                                    ~(uintptr_t)63);                                                            \
    __builtin_memset(name, 0, 3 * (size_t)(nt) * sizeof(team_slot))

static inline double team_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void team_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* This thread's member of the team, inside the parallel region (slots from TEAM_SLOTS, for nt >= the team). */
static inline team team_join(team_slot *slots, int nt_max, int takeover) {
    team t;
    __builtin_memset(&t, 0, sizeof t);
    t.share = slots, t.busy = slots + nt_max, t.stage = slots + 2 * nt_max;
    t.takeover = takeover, t.held_by = -1;
    team_place(&t.id, &t.nt);
    return t;
}

/* Opens the next phase: n units (n <= SHARE_MASK), claimed `claim` at a time, down to claim_min at a share's
 * end. */
static inline void phase_begin(team *t, int64_t n, int64_t claim, int64_t claim_min) {
    t->phase++;
    t->n = n;
    t->claim = claim < 1 ? 1 : claim;
    t->claim_min = claim_min < 1 ? 1 : claim_min > t->claim ? t->claim : claim_min;
    t->victim = 0;
    t->claims = 0;
    if (t->takeover) t->t_begin = team_clock();
}

/* Claims units of thread o's share for this phase: from the front (its owner) or the back (another thread).
 * Returns 0 when the share is spent, else sets [*a, *z). A claim takes half of what is left of the share once
 * that is less than two claims (not below claim_min): the threads then run out of units within a small claim
 * of each other, where whole claims left one waiting up to a whole claim's time at every phase's end. */
static inline int claim_units(team *t, int o, int front, int64_t *a, int64_t *z) {
    uint64_t *const w = &t->share[o].word;
    const uint64_t gen = t->phase;
    uint64_t cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint64_t g = WORD_GEN(cur);
        if (g > gen) return 0; /* the team has moved past this phase: every unit of it is done */
        if (g < gen) {         /* still a former phase's (spent): open it for this one */
            const uint64_t fresh = SHARE_WORD(gen, t->n * o / t->nt, t->n * (o + 1) / t->nt);
            if (!__atomic_compare_exchange_n(w, &cur, fresh, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
            cur = fresh;
        }
        const int64_t f = WORD_FRONT(cur), b = WORD_BACK(cur);
        if (f >= b) return 0;
        int64_t take = (b - f + 1) / 2;
        take = take > t->claim ? t->claim : take < t->claim_min ? t->claim_min : take;
        const int64_t nf = front ? (f + take < b ? f + take : b) : f;
        const int64_t nb = front ? b : (b - take > f ? b - take : f);
        if (__atomic_compare_exchange_n(w, &cur, SHARE_WORD(gen, nf, nb), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *a = front ? f : nb;
            *z = front ? nf : b;
            return 1;
        }
    }
}

/* How much longer than TAKEOVER_S units may stay held: four of this thread's own claims in the phase (an
 * attention item at a long context is slow, not preempted), at most TAKEOVER_MAX_S (a waiter that was itself
 * preempted during its claims would otherwise wait out any preemption of the holder). */
#ifndef TAKEOVER_MAX_S
#define TAKEOVER_MAX_S 2e-3
#endif
static inline double takeover_slack(const team *t, double since) {
    const double slack = 4.0 * (since - t->t_begin) / (double)(t->claims + 1);
    return slack < TAKEOVER_MAX_S ? slack : TAKEOVER_MAX_S;
}

/* Waits until no other thread holds units of this phase (returns 0: they are done, their outputs visible to
 * this thread), or (with takeover) until one has held the same units too long: returns 1 with them in
 * [*a, *z), to compute again. Every share of the phase is spent when it is called. */
static inline int phase_wait(team *t, int64_t *a, int64_t *z) {
    uint64_t seen = 0; /* the held units it watches, and since when */
    double since = 0.0;
    for (unsigned spins = 0;; spins++) {
        int held_by = -1;
        uint64_t b = 0;
        for (int v = 1; v < t->nt && held_by < 0; v++) {
            const int o = (t->id + v) % t->nt;
            b = __atomic_load_n(&t->busy[o].word, __ATOMIC_ACQUIRE);
            if (WORD_GEN(b) == t->phase) held_by = o;
        }
        if (held_by < 0) return 0;
        if (t->takeover && WORD_BACK(b) > WORD_FRONT(b) && (spins & 31) == 31) {
            const double now = team_clock();
            if (b != seen) {
                seen = b, since = now;
            } else if (now - since > TAKEOVER_S + takeover_slack(t, since)) {
                t->held_by = held_by, t->held = b;
                *a = WORD_FRONT(b), *z = WORD_BACK(b);
                __atomic_fetch_add(&team_takeover_count, 1, __ATOMIC_RELAXED);
                return 1;
            }
        }
        team_pause();
        if (spins >= 4096 && !t->takeover) sched_yield(); /* the holder waits for a core: give this one up */
    }
}

/* The next units this thread computes in this phase, [*a, *z): its claims, then held units it takes over;
 * 0 once the phase is done. The caller reports each with phase_did once their outputs are written. */
static inline int phase_next(team *t, int64_t *a, int64_t *z) {
    uint64_t *const busy = &t->busy[t->id].word;
    for (; t->victim < t->nt; t->victim++) {
        __atomic_store_n(busy, CLAIMING(t->phase), __ATOMIC_RELEASE); /* seen before the share it claims from */
        if (claim_units(t, (t->id + t->victim) % t->nt, t->victim == 0, a, z)) {
            __atomic_store_n(busy, SHARE_WORD(t->phase, *a, *z), __ATOMIC_RELEASE);
            if (__builtin_expect(team_stall.seconds > 0.0, 0) && t->id == team_stall.id &&
                t->phase == team_stall.phase && t->claims == 0) {
                const struct timespec ts = {(time_t)team_stall.seconds,
                                            (long)((team_stall.seconds - (double)(time_t)team_stall.seconds) * 1e9)};
                nanosleep(&ts, NULL);
            }
            t->claims++;
            return 1;
        }
    }
    __atomic_store_n(busy, 0, __ATOMIC_RELEASE);
    return phase_wait(t, a, z);
}

/* Units [a, z) are done, their outputs written. The thread's own units stay marked held until its next
 * claim or its wait clears them; units it took over are cleared from their holder's mark, unless the holder
 * has cleared it first. */
static inline void phase_did(team *t, int64_t a, int64_t z) {
    (void)a, (void)z;
    if (t->held_by >= 0) {
        uint64_t expect = t->held;
        __atomic_compare_exchange_n(&t->busy[t->held_by].word, &expect, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        t->held_by = -1;
    }
}

/* Stages, for a caller that reuses buffers (a ring of layers' intermediates): a thread says where it is, and
 * waits before overwriting what a thread behind may still read. Stage 0: not started. */
static inline void team_at(team *t, uint64_t stage) {
    __atomic_store_n(&t->stage[t->id].word, stage, __ATOMIC_RELEASE);
}

static inline void team_wait_stage(const team *t, uint64_t stage) {
    for (unsigned spins = 0;; spins++) {
        int behind = 0;
        for (int i = 0; i < t->nt; i++) behind |= __atomic_load_n(&t->stage[i].word, __ATOMIC_ACQUIRE) < stage;
        if (!behind) return;
        team_pause();
        if (spins >= 4096) sched_yield();
    }
}

/* One thread's part of a phase of n units: `...` computes units [a, z). */
#define PHASE_UNITS(t, n, claim, a, z, ...) PHASE_UNITS_MIN(t, n, claim, 1, a, z, __VA_ARGS__)
/* The same, with claims of no fewer than claim_min units (blocks a unit's computation wants whole). */
#define PHASE_UNITS_MIN(t, n, claim, claim_min, a, z, ...) \
    do {                                     \
        phase_begin(t, n, claim, claim_min); \
        int64_t a, z;                        \
        while (phase_next(t, &a, &z)) {      \
            __VA_ARGS__;                     \
            phase_did(t, a, z);              \
        }                                    \
    } while (0)

void linear_part(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int stream,
                 int tiled, team *t);
int tiled_shape_ok(int64_t N, int64_t K, int bf16);

/* keyed_race.c: one row's exponential race on softmax(x / t) with its key's noise (-1: the definition decides), the
 * key of an output position, and the race of a row truncated by top-k / top-p. */
int64_t scaled_race_row(const float *x, float t, uint64_t key, int64_t V, float margin, double guard, int64_t cap,
                        float *u_scratch, int64_t *c, float *sc);
uint64_t position_key(uint64_t seed, uint64_t position);
int64_t truncated_race_row(const float *x, float t, int64_t k, double top_p, uint64_t key, int64_t V, double guard,
                           double mass_guard, float *y, float *u, float *heap, int64_t *ids);
int tiled_layout_wins(int bf16);
int invariant_linear(const void *x, const void *W, void *y, int64_t M, int64_t N, int64_t K, int bf16, int stream,
                     int tiled, int nthreads);

#endif
