/* Position-keyed sampling's exponential race (keyed_sample in workers/sampler.py) in one pass over the vocabulary:
 * the uniforms a keyed torch generator draws, an approximate race that names the few entries whose scores come close
 * enough to the best for the exact noise to decide, and that decision.
 *
 * Why native: at a few rows a decode step's sampling was a dozen torch ops over the 49,152-entry vocabulary, each
 * paying for torch's code evicted by the streamed weights, and the generator's draws alone cost several times a
 * vectorized Mersenne twister. And a leading-candidates search for top-k / top-p (process_logits), where torch sorts
 * the whole vocabulary. */

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>

#include "vec_math.h"

#define MT_N 624
#define MT_M 397

static inline uint32_t mt_twist(uint32_t a, uint32_t b, uint32_t c) {
    const uint32_t y = (a & 0x80000000u) | (b & 0x7fffffffu);
    return c ^ (y >> 1) ^ (-(y & 1u) & 0x9908b0dfu);
}

/* u: [V] the numbers torch.Generator("cpu").manual_seed(key) then uniform_() on V float32 gives: torch's CPU generator
 * is MT19937 (Matsumoto & Nishimura 1998) seeded with the key's low 32 bits, and uniform_ maps each 32-bit draw y to
 * (y & (2^24 - 1)) * 2^-24, exactly. tests/test_fidelity.py holds it to torch's for random keys. */
static void mt_uniforms(uint64_t key, float *u, int64_t V) {
    uint32_t s[MT_N];
    s[0] = (uint32_t)key;
    for (int j = 1; j < MT_N; j++) s[j] = 1812433253u * (s[j - 1] ^ (s[j - 1] >> 30)) + (uint32_t)j;
    for (int64_t i = 0; i < V; i += MT_N) {
        int k = 0;
        for (; k < MT_N - MT_M; k++) s[k] = mt_twist(s[k], s[k + 1], s[k + MT_M]);
        for (; k < MT_N - 1; k++) s[k] = mt_twist(s[k], s[k + 1], s[k + MT_M - MT_N]);
        s[MT_N - 1] = mt_twist(s[MT_N - 1], s[0], s[MT_M - 1]);
        const int m = V - i < MT_N ? (int)(V - i) : MT_N;
        for (int j = 0; j < m; j++) {
            uint32_t y = s[j];
            y ^= y >> 11;
            y ^= (y << 7) & 0x9d2c5680u;
            y ^= (y << 15) & 0xefc60000u;
            y ^= y >> 18;
            u[i + j] = (float)(int32_t)(y & 0xffffffu) * (1.0f / 16777216.0f);
        }
    }
}

/* u: [R, V] row r the uniforms of keys[r] (mt_uniforms). */
void keyed_uniforms_rows(const uint64_t *keys, int64_t R, int64_t V, float *u) {
    for (int64_t r = 0; r < R; r++) mt_uniforms(keys[r], u + r * V, V);
}

/* -log(u + 2^-25), the race's Exp(1) noise, within a relative 1e-6 of the definition's (fp64, rounded to float) for
 * every u = k * 2^-24 that uniform_ gives (tests check all 2^24). The argument is formed exactly in float: below 1/2,
 * u + 2^-25 is an odd multiple of 2^-25 under 2^-1; from 1/2 up, -log1p(y) with y = (u - 1) + 2^-25, u - 1 exact
 * (Sterbenz) and y an odd multiple of 2^-25 of magnitude at most 1/2. Both logs are 2 atanh(s) series, |s| <= 1/3. */
static inline vlanes race_noise_lanes(vlanes u) {
    const vlanes half = (vlanes){0} + 0.5f, two = (vlanes){0} + 2.0f;
    const vlanes_i low = lanes_lt(u, half);
    /* below 1/2: x = m * 2^e, m in [sqrt(1/2), sqrt(2)), log x = e ln2 + 2 atanh((m - 1) / (m + 1)) */
    const vlanes x = u + 0x1p-25f;
    vlanes_i bits = (vlanes_i)x;
    vlanes_i e = ((bits >> 23) & 0xff) - 127;
    vlanes m = (vlanes)((bits & 0x007fffff) | 0x3f800000); /* [1, 2) */
    const vlanes_i big = lanes_gt(m, (vlanes){0} + 1.41421356f);
    m = select_lanes(big, m * 0.5f, m);
    e = e + (big & 1);
    /* from 1/2 up: 1 + y = (1 + s) / (1 - s) with s = y / (2 + y) */
    const vlanes y = (u - 1.0f) + 0x1p-25f;
    const vlanes num = select_lanes(low, m - 1.0f, y), den = select_lanes(low, m + 1.0f, two + y);
    const vlanes s = num / den, s2 = s * s;
    vlanes poly = (vlanes){0} + 1.0f / 17.0f;
    poly = poly * s2 + 1.0f / 15.0f;
    poly = poly * s2 + 1.0f / 13.0f;
    poly = poly * s2 + 1.0f / 11.0f;
    poly = poly * s2 + 1.0f / 9.0f;
    poly = poly * s2 + 1.0f / 7.0f;
    poly = poly * s2 + 1.0f / 5.0f;
    poly = poly * s2 + 1.0f / 3.0f;
    poly = poly * s2 + 1.0f;
    const vlanes log_m = 2.0f * s * poly;
    const vlanes ef = __builtin_convertvector(e, vlanes);
    const vlanes log_x = select_lanes(low, ef * 0.693147180559945f + log_m, log_m);
    return -log_x;
}

/* out: [n] race_noise_lanes of u [n] (tests measure its error against the definition). */
void race_noise(const float *u, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vlanes e = race_noise_lanes(load_lanes(u + i));
        __builtin_memcpy(out + i, &e, sizeof e);
    }
    if (i < n) {
        float tail[LANES];
        for (int l = 0; l < LANES; l++) tail[l] = i + l < n ? u[i + l] : 0.5f;
        const vlanes e = race_noise_lanes(load_lanes(tail));
        for (int l = 0; i + l < n; l++) out[i + l] = e[l];
    }
}

/* The definition's noise for one uniform: (float)-log((double)u + 2^-25), as torch computes it in fp64 and rounds
 * (_exponentials_of in workers/sampler.py). Returns it, or -1 where -log lies within 4 double ulps of a point where
 * the rounding to float flips, so that a log a few ulps off (torch's is within 1) could round elsewhere: there the
 * caller asks torch. For every uniform uniform_ can draw it is the definition's number, and none is that close:
 * tests check all 2^24. */
static float exact_noise(float u) {
    const double d = -log((double)u + 0x1p-25);
    const float f = (float)d;
    const double up = (double)nextafterf(f, __builtin_inff()) - (double)f, down = (double)f - (double)nextafterf(f, 0.0f);
    const double slack = 4 * (nextafter(d, __builtin_inf()) - d);
    return ((double)f + up / 2) - d < slack || d - ((double)f - down / 2) < slack ? -1.0f : f;
}

/* out: [n] exact_noise of u [n] (tests compare it with the definition's). */
void race_exact_noise(const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = exact_noise(u[i]);
}

/* One row of keyed_race: its winner, or -1. u_scratch: [V], c and sc: [cap]. */
static int64_t race_row(const float *row, uint64_t key, int64_t V, float margin, int64_t cap, float *u_scratch,
                        int64_t *c, float *sc) {
    mt_uniforms(key, u_scratch, V);
    float best = 0.0f, thr = 0.0f;
    int64_t n = 0;
    int bad = 0;
    vlanes_i odd = {0}, positive = {0}; /* odd: a NaN, an infinity or a negative p */
    for (int64_t i = 0; i < V && !bad; i += LANES) {
        vlanes pv, uv;
        if (i + LANES <= V) {
            pv = load_lanes(row + i), uv = load_lanes(u_scratch + i);
        } else { /* the row's end: p = 0 past it, never a candidate */
            float pt[LANES], ut[LANES];
            for (int l = 0; l < LANES; l++)
                pt[l] = i + l < V ? row[i + l] : 0.0f, ut[l] = i + l < V ? u_scratch[i + l] : 0.5f;
            pv = load_lanes(pt), uv = load_lanes(ut);
        }
        odd |= lanes_ne(pv - pv, (vlanes){0}) | lanes_lt(pv, (vlanes){0});
        positive |= lanes_gt(pv, (vlanes){0});
        /* p >= thr * E' (a hair lower): every lane whose score p / E' reaches thr, without a division */
        const vlanes e = race_noise_lanes(uv);
        if (!any_lane(lanes_ge(pv, e * (thr * (1.0f - 0x1p-20f))) & lanes_gt(pv, (vlanes){0}))) continue;
        const vlanes s = pv / e;
        for (int l = 0; l < LANES && i + l < V; l++) {
            if (!(s[l] >= thr && s[l] > 0.0f)) continue;
            if (s[l] > best) { /* a new best: drop the candidates it leaves behind */
                best = s[l], thr = best * (1.0f - margin);
                int64_t k = 0;
                for (int64_t j = 0; j < n; j++)
                    if (sc[j] >= thr) c[k] = c[j], sc[k] = sc[j], k++;
                n = k;
            }
            if (n == cap) {
                bad = 1;
                break;
            }
            c[n] = i + l, sc[n] = s[l], n++;
        }
    }
    int64_t token = -1;
    if (!bad && !any_lane(odd) && !any_lane(positive)) { /* every p is 0: so is every score; argmax's first */
        token = 0;
    } else if (!bad && !any_lane(odd) && best >= 0x1p-100f && best <= FLT_MAX) {
        float top = -1.0f;
        for (int64_t j = 0; j < n; j++) {
            const float e = exact_noise(u_scratch[c[j]]);
            if (e < 0.0f) {
                token = -1;
                break;
            }
            const float score = row[c[j]] / e;
            if (score > top) top = score, token = c[j]; /* ascending: the first maximal one, as argmax */
        }
    }
    return token;
}

/* Each row's exponential race: tokens[r] = argmax_v p[r, v] / E_v, the first maximal index, E the definition's noise
 * for keys[r] (keyed_sample in workers/sampler.py), p [R, V] processed probabilities (float32). An approximate race
 * first names the entries whose score p / race_noise(u) is within `margin` (relative) of the row's best; the exact
 * scores p / exact_noise(u) of those decide. The winner is always among them: every approximate score is within a
 * relative 1e-6 + 3 ulps of the exact one, and margin is far wider. tokens[r] = -1 where the race cannot say (a NaN,
 * an infinity or a negative p, a best score too small for relative errors to hold, more than cap candidates, a
 * candidate's noise near a rounding flip): the definition decides that row. Rows are split over nthreads threads
 * (each row is one thread's, whatever the split). Returns 0, or -1 if a buffer could not be allocated. */
int keyed_race(const float *p, const uint64_t *keys, int64_t R, int64_t V, float margin, int64_t cap, int nthreads,
               int64_t *tokens) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (nthreads > 1 && R > 1) reduction(| : failed)
    {
        float *const u = malloc((size_t)V * sizeof(float));   /* the row's uniforms */
        int64_t *const c = malloc((size_t)cap * sizeof(int64_t)); /* its candidates, ascending */
        float *const sc = malloc((size_t)cap * sizeof(float));    /* their approximate scores */
        if (u && c && sc) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) tokens[r] = race_row(p + r * V, keys[r], V, margin, cap, u, c, sc);
        } else {
            failed = 1;
        }
        free(u), free(c), free(sc);
    }
    return failed ? -1 : 0;
}

/* y = x / t over a row of V, as torch divides (into y unless NULL), and its maximum *m. Returns -1 where the row holds
 * a NaN or a +inf, or no finite value: the definition decides such a row. */
static int scaled_max(const float *x, float t, int64_t V, float *y, float *m) {
    const vlanes tv = (vlanes){0} + t;
    vlanes mv = (vlanes){0} - __builtin_inff();
    vlanes_i odd = {0};
    int64_t i = 0;
    for (; i + LANES <= V; i += LANES) {
        const vlanes yv = load_lanes(x + i) / tv;
        odd |= lanes_ne(yv, yv) | lanes_gt(yv, (vlanes){0} + FLT_MAX);
        mv = select_lanes(lanes_gt(yv, mv), yv, mv);
        if (y) __builtin_memcpy(y + i, &yv, sizeof yv);
    }
    float best = -__builtin_inff();
    for (int l = 0; l < LANES; l++) best = mv[l] > best ? mv[l] : best;
    for (; i < V; i++) {
        const float v = x[i] / t;
        if (v != v || v > FLT_MAX) return -1;
        best = v > best ? v : best;
        if (y) y[i] = v;
    }
    *m = best;
    return any_lane(odd) || !(best > -__builtin_inff()) ? -1 : 0;
}

/* The race among the entries ids [n] of a row x [V] at temperature t (row maximum of x / t: m), on the uniforms u:
 * each scored exp(x / t - m) / E in double (x / t - m rounded in float as torch rounds it, E the definition's noise).
 * Returns the winner where it leads every other by a relative `guard`, far more than the few ulps torch's softmax
 * and its two roundings may move a score; else -1 (a near tie: the definition decides). */
static int64_t clear_winner(const int64_t *ids, int64_t n, const float *x, float t, float m, const float *u,
                            double guard) {
    int64_t token = -1;
    double top = -1.0, second = -1.0;
    for (int64_t j = 0; j < n; j++) {
        const float d = x[ids[j]] / t - m;
        const double score = exp((double)d) / (double)(float)-log((double)u[ids[j]] + 0x1p-25);
        if (score > top) {
            second = top, top = score, token = ids[j];
        } else if (score > second) {
            second = score;
        }
    }
    return token >= 0 && second * (1.0 + guard) < top ? token : -1;
}

/* One row of scaled_race: its winner, or -1. u_scratch: [V], c and sc: [cap]. */
int64_t scaled_race_row(const float *x, float t, uint64_t key, int64_t V, float margin, double guard, int64_t cap,
                        float *u_scratch, int64_t *c, float *sc) {
    float m;
    if (scaled_max(x, t, V, NULL, &m)) return -1;
    const vlanes tv = (vlanes){0} + t;
    int64_t i;
    mt_uniforms(key, u_scratch, V);
    /* the approximate race on exp(y - m) / E': softmax's common 1 / sum cannot change which entries come close */
    float best = 0.0f, thr = 0.0f;
    int64_t n = 0;
    const vlanes mvec = (vlanes){0} + m;
    for (i = 0; i < V; i += LANES) {
        vlanes yv, uv;
        if (i + LANES <= V) {
            yv = load_lanes(x + i) / tv, uv = load_lanes(u_scratch + i);
        } else { /* the row's end: -inf past it, never a candidate */
            float yt[LANES], ut[LANES];
            for (int l = 0; l < LANES; l++)
                yt[l] = i + l < V ? x[i + l] / t : -__builtin_inff(), ut[l] = i + l < V ? u_scratch[i + l] : 0.5f;
            yv = load_lanes(yt), uv = load_lanes(ut);
        }
        const vlanes pv = exp_nonpos(yv - mvec);
        const vlanes e = race_noise_lanes(uv);
        if (!any_lane(lanes_ge(pv, e * (thr * (1.0f - 0x1p-20f))) & lanes_gt(yv, (vlanes){0} - __builtin_inff())))
            continue;
        const vlanes s = pv / e;
        for (int l = 0; l < LANES && i + l < V; l++) {
            if (!(s[l] >= thr && yv[l] > -__builtin_inff())) continue;
            if (s[l] > best) {
                best = s[l], thr = best * (1.0f - margin);
                int64_t k = 0;
                for (int64_t j = 0; j < n; j++)
                    if (sc[j] >= thr) c[k] = c[j], sc[k] = sc[j], k++;
                n = k;
            }
            if (n == cap) return -1;
            c[n] = i + l, sc[n] = s[l], n++;
        }
    }
    return clear_winner(c, n, x, t, m, u_scratch, guard);
}

/* Each listed row's exponential race on softmax(x / t) straight from its logits: tokens[r] is what keyed_race gives on
 * torch's softmax(x[rows[r]] / temps[r]) with keys[r] (keyed_sample of process_logits with top-k and top-p off),
 * without forming the probabilities. The approximate race names the entries within `margin` of the best; their
 * scores exp(y - max) / E in double decide, and the winner must beat every other by a relative `guard`, else -1
 * (a near tie, a NaN or +inf logit, a row of -inf, more than cap candidates): the definition decides that row. x:
 * [*, V] float32, rows: [R] indices into it. Rows split over nthreads threads. Returns 0, or -1 if a buffer could not
 * be allocated. */
int scaled_race(const float *x, const int64_t *rows, const float *temps, const uint64_t *keys, int64_t R, int64_t V,
                float margin, double guard, int64_t cap, int nthreads, int64_t *tokens) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (nthreads > 1 && R > 1) reduction(| : failed)
    {
        float *const u = malloc((size_t)V * sizeof(float));
        int64_t *const c = malloc((size_t)cap * sizeof(int64_t));
        float *const sc = malloc((size_t)cap * sizeof(float));
        if (u && c && sc) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++)
                tokens[r] = scaled_race_row(x + rows[r] * V, temps[r], keys[r], V, margin, guard, cap, u, c, sc);
        } else {
            failed = 1;
        }
        free(u), free(c), free(sc);
    }
    return failed ? -1 : 0;
}

int64_t leading_candidates(const float *x, int64_t V, int64_t c, float *heap, int64_t *ids, int64_t cap, int *every,
                           const float *mass, double top_p, int64_t *keep);

/* One truncated row (top-k and / or top-p) of process_logits, raced from its logits: the token keyed_sample gives on
 * process_logits' row, or -1 where this cannot be sure of it. y: [V] scratch (x / t), u: [V], heap: [V], ids: [V].
 * The candidates and top-k are exact (leading_candidates on y, as the definition orders them). The masses top-p sums
 * are exp(y - max) / sum in double where torch's are float32 softmax values summed in double: they differ by a few
 * parts in a million (a test bounds it), so a prefix sum within `mass_guard` of top_p at the nucleus's edge hands
 * the row over. The kept tokens' race is scaled_race_row's: exp(y - max) / E in double, the winner ahead of every
 * other kept token by a relative `guard`. */
int64_t truncated_race_row(const float *x, float t, int64_t k, double top_p, uint64_t key, int64_t V, double guard,
                           double mass_guard, float *y, float *u, float *heap, int64_t *ids) {
    float m;
    if (scaled_max(x, t, V, y, &m)) return -1;
    const int64_t kk = k > 0 && k < V ? k : V;
    if (kk == V && !(top_p < 1.0)) return -1; /* not truncated: scaled_race_row's row */
    double total = 0.0;                      /* top-k off: the whole vocabulary's sum of exp(y - max) */
    if (kk == V) {
        int64_t i = 0;
        const vlanes mv = (vlanes){0} + m;
        for (; i + LANES <= V; i += LANES) {
            const vlanes e = exp_nonpos(load_lanes(y + i) - mv);
            float part = 0.0f;
            for (int l = 0; l < LANES; l++) part += e[l];
            total += part;
        }
        for (; i < V; i++) total += exp((double)(y[i] - m));
    }
    int64_t c = kk < V ? kk : 64, keep = -1;
    for (;;) {
        int every = 0;
        int64_t n = leading_candidates(y, V, c, heap, ids, V, &every, NULL, 0.0, NULL);
        if (n < 1) return -1;
        if (kk < V) n = n < kk ? n : kk;
        if (!(top_p < 1.0)) {
            keep = n;
            break;
        }
        double sum = total;
        if (kk < V) { /* the masses under the top-k set's own softmax */
            sum = 0.0;
            for (int64_t j = 0; j < n; j++) sum += exp((double)(y[ids[j]] - m));
        }
        double before = 0.0;
        for (int64_t j = 0; j < n && keep < 0; j++) {
            if (j > 0) {
                if (fabs(before - top_p) < mass_guard) return -1;
                if (before >= top_p) keep = j;
            }
            if (keep < 0) before += exp((double)(y[ids[j]] - m)) / sum;
        }
        if (keep >= 0) break;
        if (kk < V || every || before >= top_p) {
            if (!(kk < V || every) && fabs(before - top_p) < mass_guard) return -1;
            keep = n;
            break;
        }
        if (c >= V) return -1;
        c = 4 * c < V ? 4 * c : V;
    }
    mt_uniforms(key, u, V);
    return clear_winner(ids, keep, y, 1.0f, m, u, guard); /* y / 1 is y: the same scores */
}

/* Each listed row's truncated race (truncated_race_row) with its own top-k (0: off) and top-p (1: off). Rows split
 * over nthreads threads. Returns 0, or -1 if a buffer could not be allocated. */
int truncated_race(const float *x, const int64_t *rows, const float *temps, const int64_t *top_k, const double *top_p,
                   const uint64_t *keys, int64_t R, int64_t V, double guard, double mass_guard, int nthreads,
                   int64_t *tokens) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (nthreads > 1 && R > 1) reduction(| : failed)
    {
        float *const y = malloc((size_t)V * 3 * sizeof(float)); /* y, u, heap */
        int64_t *const ids = malloc((size_t)V * sizeof(int64_t));
        if (y && ids) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++)
                tokens[r] = truncated_race_row(x + rows[r] * V, temps[r], top_k[r], top_p[r], keys[r], V, guard,
                                               mass_guard, y, y + V, y + 2 * V, ids);
        } else {
            failed = 1;
        }
        free(y), free(ids);
    }
    return failed ? -1 : 0;
}

/* splitmix64 (Steele et al. 2014), as workers/sampler.py's _splitmix64. */
static inline uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The noise key of output position `position` of a request seeded `seed` (position_key in workers/sampler.py). */
uint64_t position_key(uint64_t seed, uint64_t position) { return splitmix64(seed ^ splitmix64(position)); }

/* qsort's order for leading_candidates: logit descending, then id ascending (a total order: ids are distinct). */
static __thread const float *lead_x;
static int lead_cmp(const void *a, const void *b) {
    const int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    const float xi = lead_x[i], xj = lead_x[j];
    return xi > xj ? -1 : xi < xj ? 1 : (i > j) - (i < j);
}

static void heap_down(float *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t m = i, l = 2 * i + 1, r = l + 1;
        if (l < n && h[l] < h[m]) m = l;
        if (r < n && h[r] < h[m]) m = r;
        if (m == i) return;
        const float t = h[i];
        h[i] = h[m], h[m] = t, i = m;
    }
}

/* A truncated row's leading candidates (process_logits in workers/sampler.py): ids [n] every token whose logit in
 * x [V] is finite and at least the c-th largest finite one (ties included), ordered by logit descending then id; or,
 * where the row has at most c finite logits (or c is V), every finite one (*every = 1). Returns n, or -1 if more than cap tokens
 * qualify (ids then unset). heap: [c] floats. With mass ([V] each token's probability, or NULL), *keep is how many of
 * the ids top-p keeps: those before which the mass of the ones before them, summed in double in order, is below
 * top_p; or -1 where all n are kept and the mass is still below top_p while more candidates exist (the caller asks
 * for more). Why not torch's topk then nonzero: each reads the vocabulary several times; here one pass keeps the c
 * largest in a heap (past the first few hundred, a vector compare rejects all 16 lanes at once), and a second
 * collects the ids. */
int64_t leading_candidates(const float *x, int64_t V, int64_t c, float *heap, int64_t *ids, int64_t cap, int *every,
                           const float *mass, double top_p, int64_t *keep) {
    int64_t n = 0;
    if (c < 1) return -1;
    for (int64_t i = 0; i < V; i += LANES) {
        if (n == c && i + LANES <= V && !any_lane(lanes_gt(load_lanes(x + i), (vlanes){0} + heap[0]))) continue;
        for (int64_t j = i; j < i + LANES && j < V; j++) {
            const float v = x[j];
            if (!(v > -__builtin_inff())) continue; /* -inf and NaN are never candidates */
            if (n < c) { /* filling: sift the new value up */
                int64_t k = n++;
                heap[k] = v;
                while (k > 0 && heap[(k - 1) / 2] > heap[k]) {
                    const float t = heap[k];
                    heap[k] = heap[(k - 1) / 2], heap[(k - 1) / 2] = t, k = (k - 1) / 2;
                }
            } else if (v > heap[0]) {
                heap[0] = v;
                heap_down(heap, c, 0);
            }
        }
    }
    *every = n < c || c >= V; /* fewer finite logits than c, or c the whole vocabulary */
    const float t = n == c ? heap[0] : -__builtin_inff(); /* the c-th largest, or every finite logit */
    int64_t m = 0;
    for (int64_t i = 0; i < V; i += LANES) {
        if (i + LANES <= V && !any_lane(lanes_ge(load_lanes(x + i), (vlanes){0} + t))) continue;
        for (int64_t j = i; j < i + LANES && j < V; j++)
            if (x[j] >= t && x[j] > -__builtin_inff()) {
                if (m == cap) return -1;
                ids[m++] = j;
            }
    }
    lead_x = x;
    qsort(ids, (size_t)m, sizeof(int64_t), lead_cmp);
    if (mass) {
        double before = 0.0;
        *keep = m;
        for (int64_t j = 0; j < m; j++) {
            if (j > 0 && !(before < top_p)) {
                *keep = j;
                break;
            }
            before += (double)mass[ids[j]];
        }
        if (*keep == m && !*every && before < top_p) *keep = -1;
    }
    return m;
}
