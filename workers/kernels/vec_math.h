/* Vector arithmetic shared by the native kernels: LANES floats as one value and an exp built from it.
 * Included by invariant_attention.c and invariant_layer.c (one library, workers/native_attention.py). */

#ifndef SPECSERVE_VEC_MATH_H
#define SPECSERVE_VEC_MATH_H

#include <stdint.h>
#if defined(__AVX512F__)
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

static inline vlanes_h to_bf16(vlanes x) {
    const vlanes_u u = (vlanes_u)x;
    const vlanes_u nan = (vlanes_u)((u & 0x7fffffffu) > 0x7f800000u);
    const vlanes_u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & r), vlanes_h);
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
    const vlanes_i below = x < lo;
    x = (vlanes)(((vlanes_i)lo & below) | ((vlanes_i)x & ~below));
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
