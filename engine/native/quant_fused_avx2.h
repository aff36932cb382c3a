/*
 * AVX2+FMA fused kernels for the 32-value block types (Q8_0, Q4_0, Q4_1) and int8 rows,
 * included by quant_kernels.c on x86 GCC builds. Each block is dequantized straight into
 * four ymm registers (never stored) and multiplied into the accumulators of up to four
 * activation rows, so one decode step streams each weight byte once and does ~0.75
 * instructions per weight; a single row takes the factored loop (fused_row_factored).
 * The AVX2 path's kernels; AVX-512 CPUs take quant_fused_avx512.h. Widening the quant
 * bytes from memory (below) instead of shuffling a loaded register made one-row GEMVs
 * 1.2-1.3x faster on a Zen 4 (benchmarks/cpu_paths/decode_step.py --gemv).
 */
#include <immintrin.h>

#include "quant_block32_avx2.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Whether the fused kernel handles this weight (block-32 types; int8 rows of 32k values). */
static inline int fused_avx2_applies(int type, int64_t k) {
    return type == QTYPE_Q8_0 || type == QTYPE_Q4_0 || type == QTYPE_Q4_1 ||
           (type == QTYPE_INT8 && k % 32 == 0);
}

/* One weight row against one or two activation rows (x1 may equal x0 when there is one):
 * four accumulators per activation row keep the FMA chains independent; all in registers. */
AVX2_TARGET static inline __attribute__((always_inline)) void fused_row(
    const uint8_t *restrict row, int type, int64_t nb, int64_t bb, const float *restrict x0,
    const float *restrict x1, int two, float *y0, float *y1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t b = 0; b < nb; ++b) {
        __m256 wv[4];
        block32_to_ps(type, row + b * bb, wv);
        const float *p = x0 + 32 * b;
        a0 = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(p), a0);
        a1 = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(p + 8), a1);
        a2 = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(p + 16), a2);
        a3 = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(p + 24), a3);
        if (two) {
            const float *q = x1 + 32 * b;
            b0 = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(q), b0);
            b1 = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(q + 8), b1);
            b2 = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(q + 16), b2);
            b3 = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(q + 24), b3);
        }
    }
    *y0 = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    if (two) *y1 = hsum256(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
}

/* The block sums of one activation row for fused_row_factored: pairs[2b..2b+1] =
 * (0, x_b . 1) for Q4_1, (-8 x_b . 1, 0) for Q4_0, x_b the row's 32 values of block b.
 * The pair lines up with the block's (d, m) header converted to two floats, so one
 * multiply-add per block adds its m * sum(x_b) (Q4_0: d * (-8 sum(x_b))). */
AVX2_TARGET static inline void block_sums(float *restrict pairs, const float *restrict x,
                                          int type, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
        const float *p = x + 32 * b;
        const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
        const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24));
        const float sum = hsum256(_mm256_add_ps(lo, hi));
        pairs[2 * b] = type == QTYPE_Q4_1 ? 0.0f : -8.0f * sum;
        pairs[2 * b + 1] = type == QTYPE_Q4_1 ? sum : 0.0f;
    }
}

/* One activation row against one weight row of Q4_0, Q4_1 or Q8_0, through w = d q + m:
 * W . x = sum_b d_b (q_b . x_b) + m_b sum(x_b) (Q4_0: m_b = -8 d_b; Q8_0: m_b = 0). The
 * quants convert straight to floats, d_b scales a block's partial sums once and m_b meets
 * the block's sum (block_sums) in one scalar-lane multiply-add: per block fewer multiplies
 * and broadcasts than scaling every value (fused_row); the whole-step decode of the default
 * model at one row 1.07x on this path (Zen 4). Exact on one-hot rows like the other paths:
 * d q is exact in fp32 and the block's m term is added once. */
AVX2_TARGET static inline __attribute__((always_inline)) float fused_row_factored(
    const uint8_t *restrict row, int type, int64_t nb, int64_t bb, const float *restrict x,
    const float *restrict pairs) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m128 mterm = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + b * bb;
        const float *p = x + 32 * b;
        __m256 q[4];
        block32_quants_avx2(type, blk, q);
        uint32_t header = load_u16(blk); /* d; Q4_1: d and m, the first two halves */
        if (type == QTYPE_Q4_1) memcpy(&header, blk, sizeof header);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)header));
        if (type != QTYPE_Q8_0)
            mterm = _mm_fmadd_ps(
                dm, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(pairs + 2 * b))), mterm);
        /* q . x over the block in two halves: values 0-7 | 8-15 and 16-23 | 24-31 */
        const __m256 t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(p + 8),
                                          _mm256_mul_ps(q[0], _mm256_loadu_ps(p)));
        const __m256 t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(p + 24),
                                          _mm256_mul_ps(q[2], _mm256_loadu_ps(p + 16)));
        const __m256 d = _mm256_broadcastss_ps(dm);
        acc0 = _mm256_fmadd_ps(t0, d, acc0);
        acc1 = _mm256_fmadd_ps(t1, d, acc1);
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) + (mterm[0] + mterm[1]);
}

/* One weight row against NR (1..4) activation rows: each block dequantized once into
 * registers and multiplied into every row's two accumulators (8 + 4 ymm at NR = 4, inside
 * AVX2's 16). NR is a literal at every call, so each count compiles to its own loop. */
AVX2_TARGET static inline __attribute__((always_inline)) void fused_rows(
    const uint8_t *restrict row, int type, int64_t nb, int64_t bb, const float *restrict x,
    int64_t x_stride, const int nr, float *y) {
    __m256 acc[4][2];
    for (int j = 0; j < nr; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256 wv[4];
        block32_to_ps(type, row + b * bb, wv);
        for (int j = 0; j < nr; ++j) {
            const float *p = x + j * x_stride + 32 * b;
            acc[j][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(p), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(p + 8), acc[j][1]);
            acc[j][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(p + 16), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(p + 24), acc[j][1]);
        }
    }
    for (int j = 0; j < nr; ++j) y[j] = hsum256(_mm256_add_ps(acc[j][0], acc[j][1]));
}

/* linear_rows_fused_avx2's work for one block type, `type` a literal at every call. One
 * row: fused_row_factored (int8: fused_row), with the row's block sums in `pairs` (the
 * caller's scratch of k floats); two rows: four accumulators per row (fused_row); more:
 * four rows at a time (fused_rows), so an 8-row decode step dequantizes each block twice
 * instead of four times. */
AVX2_TARGET static inline __attribute__((always_inline)) void fused_avx2_body(
    float *restrict out, int64_t out_stride, const float *restrict x, int64_t x_stride,
    int64_t rows, const uint8_t *restrict w, int64_t row_bytes, const float *restrict scales,
    int type, int64_t n0, int64_t n1, int64_t k, float *restrict pairs) {
    const int64_t nb = k / 32, bb = type == QTYPE_INT8 ? 32 : block_bytes(type);
    if (rows == 1 && type != QTYPE_INT8) {
        if (type != QTYPE_Q8_0) block_sums(pairs, x, type, nb);
        for (int64_t n = n0; n < n1; ++n)
            out[n] = (scales ? scales[n] : 1.0f) *
                     fused_row_factored(w + n * row_bytes, type, nb, bb, x, pairs);
        return;
    }
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        const float s = scales ? scales[n] : 1.0f;
        int64_t r = 0;
        float y[4];
        for (; rows > 2 && r + 4 <= rows; r += 4) {
            fused_rows(row, type, nb, bb, x + r * x_stride, x_stride, 4, y);
            for (int j = 0; j < 4; ++j) out[(r + j) * out_stride + n] = s * y[j];
        }
        if (rows - r == 3) {
            fused_rows(row, type, nb, bb, x + r * x_stride, x_stride, 3, y);
            for (int j = 0; j < 3; ++j) out[(r + j) * out_stride + n] = s * y[j];
            continue;
        }
        for (; r < rows; r += 2) {
            const int two = r + 1 < rows;
            float y0, y1 = 0.0f;
            if (two)
                fused_row(row, type, nb, bb, x + r * x_stride, x + (r + 1) * x_stride, 1, &y0, &y1);
            else
                fused_row(row, type, nb, bb, x + r * x_stride, x + r * x_stride, 0, &y0, &y1);
            out[r * out_stride + n] = s * y0;
            if (two) out[(r + 1) * out_stride + n] = s * y1;
        }
    }
}

/* Compiles `call` once per type the fused kernels take, with `T` that type as a constant, so
 * no type test is left inside the copies' loops (one- and two-row GEMVs 2-10 % faster on a
 * Zen 4 than with the type a run-time value). Shared with quant_fused_avx512.h. */
#define DISPATCH_FUSED_TYPE(call, type)  \
    switch (type) {                      \
        case QTYPE_Q4_1: {               \
            const int T = QTYPE_Q4_1;    \
            call;                        \
            break;                       \
        }                                \
        case QTYPE_Q4_0: {               \
            const int T = QTYPE_Q4_0;    \
            call;                        \
            break;                       \
        }                                \
        case QTYPE_Q8_0: {               \
            const int T = QTYPE_Q8_0;    \
            call;                        \
            break;                       \
        }                                \
        default: {                       \
            const int T = QTYPE_INT8;    \
            call;                        \
        }                                \
    }

/* Same contract as linear_rows_*: out[r, n] for n in [n0, n1) and every row r. */
AVX2_TARGET static void linear_rows_fused_avx2(float *restrict out, int64_t out_stride,
                                               const float *restrict x, int64_t x_stride,
                                               int64_t rows, const uint8_t *restrict w,
                                               int64_t row_bytes, const float *restrict scales,
                                               int type, int64_t n0, int64_t n1, int64_t k,
                                               float *restrict wbuf) {
    DISPATCH_FUSED_TYPE(fused_avx2_body(out, out_stride, x, x_stride, rows, w, row_bytes,
                                        scales, T, n0, n1, k, wbuf),
                        type)
}
