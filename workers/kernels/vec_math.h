/* Vector arithmetic shared by the native kernels: LANES floats as one value and an exp built from it.
 * Included by invariant_attention.c and invariant_layer.c (one library, workers/native_attention.py). */

#ifndef SPECSERVE_VEC_MATH_H
#define SPECSERVE_VEC_MATH_H

#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef LANES
#define LANES 16  /* a multiple of every vector width the compiler may use */
#endif

/* LANES floats as one value: the compiler maps it onto whatever vector registers the CPU has (one
 * AVX-512 register, two AVX2 ones, ...). Its arithmetic is lane by lane, so the width never changes
 * a result; it keeps the accumulators in registers where plain arrays would go through memory. */
typedef float vlanes __attribute__((vector_size(LANES * sizeof(float))));

static inline vlanes load_lanes(const float *p) {
    vlanes x;
    __builtin_memcpy(&x, p, sizeof x);
    return x;
}

typedef int32_t vlanes_i __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vlanes_u __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vlanes_h __attribute__((vector_size(LANES * sizeof(uint16_t))));

/* Lane-wise comparisons, as masks (every bit set where true; false where either side is NaN, as C's vector
 * comparisons). On AVX2 a comparison of 16 floats is wider than the machine's vectors, and GCC lowers it lane
 * by lane through scalar code: here it is split into the two 8-lane halves instead. */
#if defined(__AVX2__) && !defined(__AVX512F__) && LANES == 16
#define VEC_CMP_HALVES(a, b, cmp)                                                                                \
    do {                                                                                                         \
        __m256 a0_, a1_, b0_, b1_;                                                                               \
        __builtin_memcpy(&a0_, &(a), 32), __builtin_memcpy(&a1_, (const char *)&(a) + 32, 32);                   \
        __builtin_memcpy(&b0_, &(b), 32), __builtin_memcpy(&b1_, (const char *)&(b) + 32, 32);                   \
        const __m256 r_[2] = {cmp(a0_, b0_), cmp(a1_, b1_)};                                                     \
        vlanes_i m_;                                                                                             \
        __builtin_memcpy(&m_, r_, sizeof m_);                                                                    \
        return m_;                                                                                               \
    } while (0)
#define CMP_LT_(x, y) _mm256_cmp_ps(x, y, _CMP_LT_OQ)
#define CMP_GT_(x, y) _mm256_cmp_ps(x, y, _CMP_GT_OQ)
#define CMP_GE_(x, y) _mm256_cmp_ps(x, y, _CMP_GE_OQ)
#define CMP_EQ_(x, y) _mm256_cmp_ps(x, y, _CMP_EQ_OQ)
#define CMP_NE_(x, y) _mm256_cmp_ps(x, y, _CMP_NEQ_UQ)
#define CMP_GTI_(x, y) _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_castps_si256(x), _mm256_castps_si256(y)))
static inline vlanes_i lanes_lt(vlanes a, vlanes b) { VEC_CMP_HALVES(a, b, CMP_LT_); }
static inline vlanes_i lanes_gt(vlanes a, vlanes b) { VEC_CMP_HALVES(a, b, CMP_GT_); }
static inline vlanes_i lanes_ge(vlanes a, vlanes b) { VEC_CMP_HALVES(a, b, CMP_GE_); }
static inline vlanes_i lanes_eq(vlanes a, vlanes b) { VEC_CMP_HALVES(a, b, CMP_EQ_); }
static inline vlanes_i lanes_ne(vlanes a, vlanes b) { VEC_CMP_HALVES(a, b, CMP_NE_); } /* true where NaN */
static inline vlanes_i lanes_gt_i(vlanes_i a, vlanes_i b) { VEC_CMP_HALVES(a, b, CMP_GTI_); }
#else
static inline vlanes_i lanes_lt(vlanes a, vlanes b) { return a < b; }
static inline vlanes_i lanes_gt(vlanes a, vlanes b) { return a > b; }
static inline vlanes_i lanes_ge(vlanes a, vlanes b) { return a >= b; }
static inline vlanes_i lanes_eq(vlanes a, vlanes b) { return a == b; }
static inline vlanes_i lanes_ne(vlanes a, vlanes b) { return a != b; } /* true where NaN */
static inline vlanes_i lanes_gt_i(vlanes_i a, vlanes_i b) { return a > b; }
#endif

/* Whether any lane of a comparison's result is set. */
static inline int any_lane(vlanes_i m) {
    uint64_t w[sizeof m / 8], o = 0;
    __builtin_memcpy(w, &m, sizeof m);
    for (size_t i = 0; i < sizeof m / 8; i++) o |= w[i];
    return o != 0;
}

/* Lane by lane, a where mask is set, else b. */
static inline vlanes select_lanes(vlanes_i mask, vlanes a, vlanes b) {
    return (vlanes)((mask & (vlanes_i)a) | (~mask & (vlanes_i)b));
}

/* bf16 <-> fp32, round to nearest even, NaN kept quiet: the rounding torch's BFloat16 does. Widening is
 * exact, so a bf16 value read back is the fp32 value it was rounded to. */
static inline vlanes from_bf16(vlanes_h h) {
#if defined(__AVX512BW__) && LANES == 16
    /* one zero-extension of all 16 and a shift: the generic form compiles to two halves and an insert */
    return (vlanes)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#else
    return (vlanes)(__builtin_convertvector(h, vlanes_u) << 16);
#endif
}

/* The bf16 bits of x, in the low 16 of each 32-bit lane: round to nearest even, a NaN kept quiet. The
 * comparison is signed: a value with its sign bit cleared is below 2^31. */
static inline vlanes_u bf16_bits(vlanes x) {
    const vlanes_u u = (vlanes_u)x;
    const vlanes_u nan = (vlanes_u)lanes_gt_i((vlanes_i)(u & 0x7fffffffu), (vlanes_i){0} + 0x7f800000);
    return (nan & ((u >> 16) | 0x40u)) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
}

static inline vlanes_h to_bf16(vlanes x) {
    const vlanes_u r = bf16_bits(x);
#if defined(__AVX2__) && !defined(__AVX512BW__) && LANES == 16
    /* AVX2 has no 32 -> 16-bit narrowing (the generic convert is done lane by lane): pack the two halves
     * (every value fits 16 bits, so nothing saturates), then undo the pack's interleave of 128-bit lanes */
    __m256i lo, hi;
    __builtin_memcpy(&lo, &r, sizeof lo);
    __builtin_memcpy(&hi, (const char *)&r + sizeof lo, sizeof hi);
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    vlanes_h h;
    __builtin_memcpy(&h, &p, sizeof h);
    return h;
#else
    return __builtin_convertvector(r, vlanes_h);
#endif
}

/* from_bf16(to_bf16(x)), the value x holds once stored as bf16, without narrowing to 16 bits and back. */
static inline vlanes round_to_bf16(vlanes x) {
    return (vlanes)(bf16_bits(x) << 16);
}

/* LANES values of a KV cache at p[i ..]: fp32, or bf16 (bf16 != 0) widened to fp32. */
static inline vlanes load_kv(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        vlanes_h h;
        __builtin_memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return from_bf16(h);
    }
    return load_lanes((const float *)p + i);
}

/* One value of a KV cache, as load_kv reads it. */
static inline float load_kv1(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float x;
        __builtin_memcpy(&x, &u, sizeof x);
        return x;
    }
    return ((const float *)p)[i];
}

/* exp(x) for x <= 0, lane by lane (Cody-Waite reduction, Cephes' degree-6 polynomial), in vector
 * arithmetic only: every lane computes the same function, so a key's weight never depends on the
 * lane it falls in. Lanes past a row's keys compute garbage that is never read. */
static inline vlanes exp_nonpos(vlanes x) {
    const vlanes lo = (vlanes){0} - 87.0f;
    x = select_lanes(lanes_lt(x, lo), lo, x);
    const vlanes_i ki = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vlanes_i);  /* nearest, x <= 0 */
    const vlanes kf = __builtin_convertvector(ki, vlanes);
    vlanes r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    vlanes p = (vlanes){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (vlanes)((ki + 127) << 23);
}

#endif
