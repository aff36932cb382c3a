/*
 * AVX-512 fused kernels for the 32-value block types (Q8_0, Q4_0, Q4_1) and int8 rows,
 * included by quant_kernels.c on x86 GCC builds after quant_fused_avx2.h, whose contract
 * (linear_rows_*) they share. A block is two zmm registers of 16 values.
 *
 * The 4-bit types decode through a table instead of converting every value: the 16
 * values a nibble can stand for, T[j] = d * j + m (Q4_1) or d * (j - 8) (Q4_0), are one
 * zmm computed with one FMA per block, and vpermps picks each value's entry by its nibble
 * (it reads only an index's low four bits, so the high nibbles need a shift and no mask).
 * T[j] is computed exactly as the per-value formula computes it (the same FMA or product on
 * the same operands), so the weights are bit for bit those of the other paths. Per block:
 * one widening of the 16 quant bytes, two permutes and the FMAs, where the AVX2 kernel
 * widens, converts and scales four registers: ~1.3x per one-row GEMV on a Zen 4 core
 * (benchmarks/cpu_paths/decode_step.py --gemv).
 */
#include <immintrin.h>

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* The values one 4-bit block can take, T[j] for j = 0..15 (see the file comment). */
AVX512_TARGET static inline __m512 nibble_table(int type, const uint8_t *b) {
    if (type == QTYPE_Q4_1) { /* d and m are the block's first two halves: one conversion */
        uint32_t dm_bits;
        memcpy(&dm_bits, b, sizeof dm_bits);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        return _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), iota,
                               _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    }
    const __m512 centred = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(load_u16(b))), centred);
}

/* The 32 values of one block as fp32: w[0] values 0-15, w[1] values 16-31. */
AVX512_TARGET static inline __attribute__((always_inline)) void block32_to_ps512(
    int type, const uint8_t *b, __m512 w[2]) {
    if (type == QTYPE_Q4_0 || type == QTYPE_Q4_1) {
        const __m512 table = nibble_table(type, b);
        const __m512i q = /* byte j of the 16 in lane j: low nibble value j, high j + 16 */
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == QTYPE_Q4_1 ? 4 : 2))));
        w[0] = _mm512_permutexvar_ps(q, table);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        return;
    }
    const uint8_t *qs = type == QTYPE_INT8 ? b : b + 2; /* int8: unscaled (row scale later) */
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    const __m512 q1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
    if (type == QTYPE_INT8) {
        w[0] = q0;
        w[1] = q1;
        return;
    }
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b))); /* Q8_0 */
    w[0] = _mm512_mul_ps(d, q0);
    w[1] = _mm512_mul_ps(d, q1);
}

/* One weight row against NR (1..8) activation rows: each block decoded once and multiplied
 * into every row's two accumulators (16 + 2 zmm at NR = 8, inside AVX-512's 32). NR is a
 * literal at every call, so each count compiles to its own loop. */
AVX512_TARGET static inline __attribute__((always_inline)) void fused_rows512(
    const uint8_t *restrict row, int type, int64_t nb, int64_t bb, const float *restrict x,
    int64_t x_stride, const int nr, float *y) {
    __m512 acc[8][2];
    for (int j = 0; j < nr; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 wv[2];
        block32_to_ps512(type, row + b * bb, wv);
        for (int j = 0; j < nr; ++j) {
            const float *p = x + j * x_stride + 32 * b;
            acc[j][0] = _mm512_fmadd_ps(wv[0], _mm512_loadu_ps(p), acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(wv[1], _mm512_loadu_ps(p + 16), acc[j][1]);
        }
    }
    for (int j = 0; j < nr; ++j) y[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]));
}

/* Up to eight activation rows per pass over a weight row; `type` is a literal at every call
 * (linear_rows_fused_avx512), so the block decoding has no type tests in the loop. */
AVX512_TARGET static inline __attribute__((always_inline)) void fused_avx512_body(
    float *restrict out, int64_t out_stride, const float *restrict x, int64_t x_stride,
    int64_t rows, const uint8_t *restrict w, int64_t row_bytes, const float *restrict scales,
    int type, int64_t n0, int64_t n1, int64_t k) {
    const int64_t nb = k / 32, bb = type == QTYPE_INT8 ? 32 : block_bytes(type);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        const float s = scales ? scales[n] : 1.0f;
        for (int64_t r = 0; r < rows; r += 8) {
            const float *xr = x + r * x_stride;
            const int64_t nr = rows - r < 8 ? rows - r : 8;
            float y[8];
            switch (nr) { /* a literal per case: one specialised loop each */
            case 1: fused_rows512(row, type, nb, bb, xr, x_stride, 1, y); break;
            case 2: fused_rows512(row, type, nb, bb, xr, x_stride, 2, y); break;
            case 3: fused_rows512(row, type, nb, bb, xr, x_stride, 3, y); break;
            case 4: fused_rows512(row, type, nb, bb, xr, x_stride, 4, y); break;
            case 5: fused_rows512(row, type, nb, bb, xr, x_stride, 5, y); break;
            case 6: fused_rows512(row, type, nb, bb, xr, x_stride, 6, y); break;
            case 7: fused_rows512(row, type, nb, bb, xr, x_stride, 7, y); break;
            default: fused_rows512(row, type, nb, bb, xr, x_stride, 8, y); break;
            }
            for (int64_t j = 0; j < nr; ++j) out[(r + j) * out_stride + n] = s * y[j];
        }
    }
}

/* Same contract as linear_rows_fused_avx2 (and the types fused_avx2_applies admits). */
AVX512_TARGET static void linear_rows_fused_avx512(float *restrict out, int64_t out_stride,
                                                   const float *restrict x, int64_t x_stride,
                                                   int64_t rows, const uint8_t *restrict w,
                                                   int64_t row_bytes, const float *restrict scales,
                                                   int type, int64_t n0, int64_t n1, int64_t k,
                                                   float *restrict unused) {
    (void)unused;
    DISPATCH_FUSED_TYPE(
        fused_avx512_body(out, out_stride, x, x_stride, rows, w, row_bytes, scales, T, n0, n1, k),
        type)
}
