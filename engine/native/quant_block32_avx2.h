/*
 * The quants of one 32-value block as four vectors of 8 floats, unscaled: q[0..3] hold
 * values 0-7, 8-15, 16-23, 24-31. Q8_0 and int8: the signed bytes (Q8_0's after its fp16
 * scale; int8 rows have no header); Q4_0 / Q4_1: the nibbles 0..15, low nibbles values
 * 0-15, high nibbles 16-31. The bytes are widened to 32-bit lanes straight from memory
 * (vpmovzxbd / vpmovsxbd with a memory operand: no shuffles of a loaded register), a 4-bit
 * block's nibbles then split with an AND and a shift per vector. Shared by the AVX2 row
 * kernels (quant_fused_avx2.h) and the GEMM's AVX2 panel fill (quant_gemm_x86.h), which
 * scale them each their own way.
 */
#ifndef PAGEDSERVE_QUANT_BLOCK32_AVX2_H
#define PAGEDSERVE_QUANT_BLOCK32_AVX2_H

#include <immintrin.h>
#include <stdint.h>

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

#endif
