/*
 * KV-cache element types for the attention kernels of cpu_kernels.c (included there, after
 * its vector types `vfloat`/`vint` and `vload`/`vsum_lanes`).
 *
 * The cache holds keys and values in fp32 (the model dtype on CPU) or, with
 * `kv_cache_dtype`, in bf16 or fp16: half the memory, and half the bytes a decode step's
 * attention streams. Keys/values are rounded once, when written (round to nearest even, as
 * torch's `.to()`), and widened when read, so every score, softmax and weighted sum is still
 * computed in fp32. The kernels take the type as a code (KV_F32 / KV_BF16 / KV_F16, the same
 * numbers as engine/native/attention.py's KV_DTYPE_CODES) and dispatch on it once per call
 * (DISPATCH_KV_DTYPE), so each inner loop is compiled for one element type.
 *
 *   bf16 -> fp32: the 16 bits are the top half of the fp32 pattern (a shift, any CPU).
 *   fp16 -> fp32: F16C's vcvtph2ps where the build target has it (-march=native: chosen for
 *                 the machine the library is built on), else a portable bit conversion.
 *   fp32 -> fp16: F16C's vcvtps2ph with round-to-nearest-even, else the portable rounding.
 */
#ifndef PAGEDSERVE_KV_DTYPE_H
#define PAGEDSERVE_KV_DTYPE_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* Bytes per cache element. */
INLINE int64_t kv_elem_bytes(int kv) { return kv == KV_F32 ? 4 : 2; }

/* Element `index` of a cache of type `kv`. */
INLINE const void *kv_at(const void *base, int64_t index, int kv) {
    return (const char *)base + index * kv_elem_bytes(kv);
}

/* ---- scalar conversions ---------------------------------------------------------------- */

INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even on the 16 dropped bits; a NaN stays a (quiet) NaN. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The portable fp16 conversions (IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits),
 * used where the build target has no F16C. */
INLINE float f16_to_f32_portable(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent == 0) {                       /* zero, subnormal: mantissa * 2^-24 */
        const float f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint16_t f32_to_f16_portable(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu); /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to inf (ties to even) */
    if (a < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
        float magnitude;
        memcpy(&magnitude, &a, sizeof magnitude);
        /* In units of 2^-24 (exact), rounded to nearest even by rintf's default mode. */
        return sign | (uint16_t)rintf(magnitude * 16777216.0f);
    }
    /* Rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
     * carry out of the mantissa correctly bumps the exponent. */
    const uint32_t rounded = a - 0x38000000u + 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)(rounded >> 13);
}

INLINE float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_to_f32_portable(h);
#endif
}

INLINE uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return f32_to_f16_portable(f);
#endif
}

/* Element `i` of a cache row of type `kv`, as fp32. */
INLINE float kv_load1(const void *p, int64_t i, int kv) {
    if (kv == KV_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (kv == KV_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* ---- vector loads: LANES elements widened to a vfloat ----------------------------------- */

typedef uint16_t vu16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(LANES * sizeof(uint32_t))));

INLINE vfloat vload_bf16(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    const vu32 bits = __builtin_convertvector(h, vu32) << 16;
    return (vfloat)bits;
}

INLINE vfloat vload_f16(const uint16_t *p) {
    vfloat out;
#if defined(__AVX512F__) && LANES == 16
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&out, &v, sizeof out);
#elif defined(__F16C__) && LANES % 8 == 0
    for (int l = 0; l < LANES; l += 8) {
        const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + l)));
        memcpy((char *)&out + l * sizeof(float), &v, sizeof v);
    }
#else
    for (int l = 0; l < LANES; ++l) out[l] = f16_to_f32_portable(p[l]);
#endif
    return out;
}

/* Elements i .. i + LANES of a cache row of type `kv`, as fp32. */
INLINE vfloat kv_loadv(const void *p, int64_t i, int kv) {
    if (kv == KV_BF16) return vload_bf16((const uint16_t *)p + i);
    if (kv == KV_F16) return vload_f16((const uint16_t *)p + i);
    return vload((const float *)p + i);
}

/* ---- the decode kernels' dot product and axpy over a cache row --------------------------- */

/* q . k over n elements, k a cache row of type `kv` (fp32: cpu_kernels.c's `dot`). */
INLINE float dot_kv(const float *restrict q, const void *k, int64_t n, int kv) {
    if (kv == KV_F32) return dot(q, (const float *)k, n);
    if (n % LANES == 0) {
        vfloat acc = (vfloat){0};
        for (int64_t i = 0; i < n; i += LANES) acc += vload(q + i) * kv_loadv(k, i, kv);
        return vsum_lanes(acc);
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += q[i] * kv_load1(k, i, kv);
    return sum;
}

/* y += alpha * x over n elements, x a cache row of type `kv`. */
INLINE void axpy_kv(float *restrict y, float alpha, const void *x, int64_t n, int kv) {
    if (kv == KV_F32) {
        axpy(y, alpha, (const float *)x, n);
        return;
    }
    int64_t i = 0;
    if (n % LANES == 0)
        for (; i < n; i += LANES) vstore(y + i, vload(y + i) + alpha * kv_loadv(x, i, kv));
    for (; i < n; ++i) y[i] += alpha * kv_load1(x, i, kv);
}

/* ---- the KV write: one row of fp32 rounded into the cache's type -------------------------- */

INLINE void kv_store_row(void *dst, const float *restrict src, int64_t n, int kv) {
    if (kv == KV_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else if (kv == KV_F16) {
        uint16_t *d = dst;
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; ++i) d[i] = f32_to_f16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Compiles `call` once per cache type with `KV` a constant, so the type tests above fold
 * away inside each copy. */
#define DISPATCH_KV_DTYPE(call, kv_dtype) \
    switch (kv_dtype) {                   \
        case KV_BF16: {                   \
            const int KV = KV_BF16;       \
            call;                         \
            break;                        \
        }                                 \
        case KV_F16: {                    \
            const int KV = KV_F16;        \
            call;                         \
            break;                        \
        }                                 \
        default: {                        \
            const int KV = KV_F32;        \
            call;                         \
        }                                 \
    }

#endif
