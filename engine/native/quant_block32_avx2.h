/*
 * The quants of one 32-value block as four vectors of 8 floats, unscaled: q[0..3] hold
 * values 0-7, 8-15, 16-23, 24-31. Q8_0 and int8: the signed bytes (Q8_0's after its fp16
 * scale; int8 rows have no header); Q4_0 / Q4_1: the nibbles 0..15, low nibbles values
 * 0-15, high nibbles 16-31. The bytes are widened to 32-bit lanes straight from memory
 * (vpmovzxbd / vpmovsxbd with a memory operand: no shuffles of a loaded register), a 4-bit
 * block's nibbles then split with an AND and a shift per vector. Shared by the AVX2 row
 * kernels (quant_fused_avx2.h, the factored one-row loop scaling them its own way) and,
 * through block32_to_ps, by those kernels' other loops and the GEMM's AVX2 panel fill
 * (quant_gemm_x86.h).
 */
#ifndef PAGEDSERVE_QUANT_BLOCK32_AVX2_H
#define PAGEDSERVE_QUANT_BLOCK32_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_types.h"

__attribute__((target("avx2"))) static inline __attribute__((always_inline)) void
block32_quants_avx2(int type, const uint8_t *b, __m256 q[4]) {
    if (type == QTYPE_INT8 || type == QTYPE_Q8_0) {
        const uint8_t *qs = type == QTYPE_INT8 ? b : b + 2;
        for (int j = 0; j < 4; ++j)
            q[j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j))));
        return;
    }
    const uint8_t *qs = b + (type == QTYPE_Q4_1 ? 4 : 2);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i nibble = _mm256_set1_epi32(15);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

/* The 32 values of one block as fp32 in w[0..3] (values 0-7, 8-15, 16-23, 24-31): the
 * quants (block32_quants_avx2) times the block's scale; one conversion gives Q4_1's two
 * fp16 scales. Int8 rows stay unscaled (their row scale is applied to the sums). */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) void
block32_to_ps(int type, const uint8_t *b, __m256 w[4]) {
    block32_quants_avx2(type, b, w);
    if (type == QTYPE_INT8) return; /* unscaled: the row scale is applied later */
    if (type == QTYPE_Q4_1) {
        uint32_t dm_bits; /* d and m: the block's first two halves */
        memcpy(&dm_bits, b, sizeof dm_bits);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));
        const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(d, w[j], m);
        return;
    }
    uint16_t d_bits;
    memcpy(&d_bits, b, sizeof d_bits);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(d_bits));
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int j = 0; j < 4; ++j) /* Q4_0: d * (q - 8), q - 8 exact in fp32; Q8_0: d * q */
        w[j] = _mm256_mul_ps(d, type == QTYPE_Q4_0 ? _mm256_sub_ps(w[j], eight) : w[j]);
}

#endif
