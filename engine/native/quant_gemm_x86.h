/*
 * The AVX2 and AVX-512 parts of quant_gemm.c (included by it on x86 GCC builds): the
 * micro-kernels, the activation packing and the output stores, and panel fills that
 * dequantize whole blocks into vectors (an F16C conversion per fp16 scale).
 */
#include <immintrin.h>

#include "quant_block32_avx2.h"

#define AVX2_TARGET __attribute__((target("avx2,fma")))
#define AVX2_F16C_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* ---- AVX2 + FMA ---------------------------------------------------------------------- */

/* Block rows [j0, j0 + count) (count <= 6, a literal) against one tile: count x 2 ymm. */
AVX2_TARGET static inline __attribute__((always_inline)) void kernel_rows_avx2(
    float *restrict c, const float *restrict tile, const float *restrict block, int64_t len,
    int accumulate, int j0, const int count) {
    __m256 a[6][2];
    for (int j = 0; j < count; ++j)
        for (int v = 0; v < 2; ++v)
            a[j][v] = accumulate ? _mm256_load_ps(c + (j0 + j) * MT + 8 * v) : _mm256_setzero_ps();
    const float *p = block + j0 * KC;
    for (int64_t kk = 0; kk < len; ++kk) {
        const __m256 x0 = _mm256_load_ps(tile + kk * MT), x1 = _mm256_load_ps(tile + kk * MT + 8);
        for (int j = 0; j < count; ++j) {
            const __m256 wv = _mm256_broadcast_ss(p + j * KC + kk);
            a[j][0] = _mm256_fmadd_ps(wv, x0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(wv, x1, a[j][1]);
        }
    }
    for (int j = 0; j < count; ++j)
        for (int v = 0; v < 2; ++v) _mm256_store_ps(c + (j0 + j) * MT + 8 * v, a[j][v]);
}

/* AVX2 has 16 ymm registers: the 16 block rows in passes of 6, 6 and 4. */
AVX2_TARGET static void kernel_avx2(float *restrict c, const float *restrict tile,
                                    const float *restrict block, int64_t len, int accumulate) {
    kernel_rows_avx2(c, tile, block, len, accumulate, 0, 6);
    kernel_rows_avx2(c, tile, block, len, accumulate, 6, 6);
    kernel_rows_avx2(c, tile, block, len, accumulate, 12, 4);
}

/* Values [k0, k0 + len) of the 32-value block types and int8 rows [n0, n1) into dst rows
 * of KC floats (fill_block32_avx512's contract): each block as four vectors of 8
 * (block32_to_ps, the row kernels' decode). The generic row dequantizer this replaces on
 * AVX2 builds turns out ~1.75 values per cycle, 5-14 % of an AVX2 GEMM at 64-128 rows. */
AVX2_F16C_TARGET static void fill_block32_avx2(float *restrict dst, const uint8_t *w,
                                               int64_t row_bytes, int type, int64_t n0,
                                               int64_t n1, int64_t k0, int64_t len) {
    for (int64_t n = n0; n < n1; ++n, dst += KC) {
        const uint8_t *row = w + n * row_bytes;
        if (type == QTYPE_INT8) { /* unscaled: the row scale is applied to the sums */
            const int8_t *q = (const int8_t *)row + k0;
            int64_t i = 0;
            for (; i + 8 <= len; i += 8)
                _mm256_store_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64((const __m128i *)(q + i)))));
            for (; i < len; ++i) dst[i] = (float)q[i];
            continue;
        }
        const int64_t bb = block_bytes(type);
        for (int64_t b = 0; b < len / 32; ++b) {
            const uint8_t *p = row + (k0 / 32 + b) * bb;
            __m256 v[4];
            block32_to_ps(type, p, v);
            for (int j = 0; j < 4; ++j) _mm256_store_ps(dst + 32 * b + 8 * j, v[j]);
        }
    }
}

/* ---- AVX-512 ------------------------------------------------------------------------- */

/* All NR block rows against one tile: 16 zmm accumulators, per k one vector load of the
 * tile and NR broadcasts of block values. */
AVX512_TARGET static void kernel_avx512(float *restrict c, const float *restrict tile,
                                        const float *restrict block, int64_t len,
                                        int accumulate) {
    __m512 a[NR];
    for (int j = 0; j < NR; ++j) a[j] = accumulate ? _mm512_load_ps(c + j * MT) : _mm512_setzero_ps();
    for (int64_t kk = 0; kk < len; ++kk) {
        const __m512 xv = _mm512_load_ps(tile + kk * MT);
        for (int j = 0; j < NR; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(block[j * KC + kk]), xv, a[j]);
    }
    for (int j = 0; j < NR; ++j) _mm512_store_ps(c + j * MT, a[j]);
}

/* Sixteen rows of 16 floats (r[i]: row i) transposed in registers: r[c] = column c. */
AVX512_TARGET static inline void transpose16_avx512(__m512 r[16]) {
    __m512 a[16], b[16];
    for (int p = 0; p < 8; ++p) { /* pairs of rows interleaved within 128-bit lanes */
        a[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        a[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 4; ++q) { /* b[4q + c], lane L: rows 4q..4q+3 at column 4L + c */
        const __m512d lo0 = _mm512_castps_pd(a[4 * q]), lo2 = _mm512_castps_pd(a[4 * q + 2]);
        const __m512d hi1 = _mm512_castps_pd(a[4 * q + 1]), hi3 = _mm512_castps_pd(a[4 * q + 3]);
        b[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo2));
        b[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo2));
        b[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi1, hi3));
        b[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi1, hi3));
    }
    for (int c = 0; c < 4; ++c) { /* gather lane L of the four row quads: column 4L + c */
        const __m512 e0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44);
        const __m512 e1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xEE);
        const __m512 f0 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44);
        const __m512 f1 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(e0, f0, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(e0, f0, 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(e1, f1, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(e1, f1, 0xDD);
    }
}

/* 16 int8 / uint8 values as fp32. */
AVX512_TARGET static inline __m512 i8_to_ps(__m128i q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

AVX512_TARGET static inline __m512 u8_to_ps(__m128i q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
}

/* Values [k0, k0 + len) of the 32-value block types and int8 rows [n0, n1) into dst rows
 * of KC floats: a block is two vectors, its fp16 scale one F16C conversion. */
AVX512_TARGET static void fill_block32_avx512(float *restrict dst, const uint8_t *w,
                                              int64_t row_bytes, int type, int64_t n0,
                                              int64_t n1, int64_t k0, int64_t len) {
    const __m128i nibble = _mm_set1_epi8(15);
    for (int64_t n = n0; n < n1; ++n, dst += KC) {
        const uint8_t *row = w + n * row_bytes;
        if (type == QTYPE_INT8) { /* unscaled: the row scale is applied to the sums */
            const int8_t *q = (const int8_t *)row + k0;
            int64_t i = 0;
            for (; i + 16 <= len; i += 16)
                _mm512_store_ps(dst + i, i8_to_ps(_mm_loadu_si128((const __m128i *)(q + i))));
            for (; i < len; ++i) dst[i] = (float)q[i];
            continue;
        }
        const int64_t bb = block_bytes(type);
        for (int64_t b = 0; b < len / 32; ++b) {
            const uint8_t *p = row + (k0 / 32 + b) * bb;
            uint16_t h;
            memcpy(&h, p, sizeof h);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(h));
            __m512 lo, hi;
            if (type == QTYPE_Q8_0) {
                lo = i8_to_ps(_mm_loadu_si128((const __m128i *)(p + 2)));
                hi = i8_to_ps(_mm_loadu_si128((const __m128i *)(p + 18)));
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(p + (type == QTYPE_Q4_1 ? 4 : 2)));
                lo = u8_to_ps(_mm_and_si128(raw, nibble));
                hi = u8_to_ps(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble));
            }
            if (type == QTYPE_Q4_0) { /* d * (q - 8); q - 8 is exact in fp32 */
                lo = _mm512_sub_ps(lo, _mm512_set1_ps(8.0f));
                hi = _mm512_sub_ps(hi, _mm512_set1_ps(8.0f));
            }
            lo = _mm512_mul_ps(d, lo);
            hi = _mm512_mul_ps(d, hi);
            if (type == QTYPE_Q4_1) {
                memcpy(&h, p + 2, sizeof h);
                const __m512 m = _mm512_set1_ps(_cvtsh_ss(h));
                lo = _mm512_add_ps(lo, m);
                hi = _mm512_add_ps(hi, m);
            }
            _mm512_store_ps(dst + 32 * b, lo);
            _mm512_store_ps(dst + 32 * b + 16, hi);
        }
    }
}

AVX512_TARGET static inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* 32 bytes as two vectors of 16 int8 values each, as fp32 times `scale` (lo, hi). */
AVX512_TARGET static inline void store_i8x32(float *dst, __m256i q, float s_lo, float s_hi) {
    _mm512_store_ps(dst, _mm512_mul_ps(_mm512_set1_ps(s_lo), i8_to_ps(_mm256_castsi256_si128(q))));
    _mm512_store_ps(dst + 16,
                    _mm512_mul_ps(_mm512_set1_ps(s_hi), i8_to_ps(_mm256_extracti128_si256(q, 1))));
}

/* Values [k0, k0 + len) of Q4_K / Q6_K rows [n0, n1) into dst rows of KC floats (k0 and len
 * whole 256-value super-blocks; the quant_rows.h decode, 32 values per step). */
AVX512_TARGET static void fill_k_quant_avx512(float *restrict dst, const uint8_t *w,
                                              int64_t row_bytes, int type, int64_t n0,
                                              int64_t n1, int64_t k0, int64_t len) {
    const __m256i low4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3 << 4);
    for (int64_t n = n0; n < n1; ++n, dst += KC)
        for (int64_t sb = 0; sb < len / 256; ++sb) {
            float *out = dst + 256 * sb;
            if (type == QTYPE_Q4_K) {
                const uint8_t *b = w + n * row_bytes + (k0 / 256 + sb) * 144;
                const float d = fp16_at(b), dmin = fp16_at(b + 2);
                const uint8_t *q = b + 16;
                for (int j = 0; j < 4; ++j, q += 32, out += 64) { /* 64 values, 2 sub-blocks */
                    uint8_t sc, m;
                    scale_min_k4(2 * j, b + 4, &sc, &m);
                    const __m512 d1 = _mm512_set1_ps(d * (float)sc), m1 = _mm512_set1_ps(dmin * (float)m);
                    scale_min_k4(2 * j + 1, b + 4, &sc, &m);
                    const __m512 d2 = _mm512_set1_ps(d * (float)sc), m2 = _mm512_set1_ps(dmin * (float)m);
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)q);
                    const __m256i lo = _mm256_and_si256(raw, low4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                              _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
                    for (int i = 0; i < 4; ++i) {
                        const __m512 dv = i < 2 ? d1 : d2, mv = i < 2 ? m1 : m2;
                        _mm512_store_ps(out + 16 * i, _mm512_sub_ps(_mm512_mul_ps(dv, u8_to_ps(parts[i])), mv));
                    }
                }
            } else { /* QTYPE_Q6_K: 6-bit values from 4 low bits (ql) and 2 high bits (qh) */
                const uint8_t *b = w + n * row_bytes + (k0 / 256 + sb) * 210;
                const float d = fp16_at(b + 208);
                const int8_t *sc = (const int8_t *)(b + 192);
                const __m256i bias = _mm256_set1_epi8(32);
                for (int h = 0; h < 2; ++h, sc += 8, out += 128) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                    const __m256i q[4] = {
                        _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)),
                        _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(hb, two)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                                        _mm256_and_si256(_mm256_srli_epi16(hb, 2), two)),
                    };
                    for (int i = 0; i < 4; ++i)
                        store_i8x32(out + 32 * i, _mm256_sub_epi8(q[i], bias), d * (float)sc[2 * i],
                                    d * (float)sc[2 * i + 1]);
                }
            }
        }
}

AVX512_TARGET static void pack_tile_avx512(float *restrict dst, const float *restrict x,
                                           int64_t x_stride, int64_t m, int64_t k) {
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
        const int64_t len = min64(16, k - k0);
        const __mmask16 mask = (__mmask16)((1u << len) - 1u);
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
            r[i] = i < m ? _mm512_maskz_loadu_ps(mask, x + i * x_stride + k0) : _mm512_setzero_ps();
        transpose16_avx512(r);
        for (int64_t c = 0; c < len; ++c) _mm512_store_ps(dst + (k0 + c) * MT, r[c]);
    }
}

/* store_tile_portable on AVX-512: the 16 x 16 sums transposed in registers, then one
 * (masked, scaled) row store per activation row: a whole cache line when NR outputs fit. */
AVX512_TARGET static void store_tile_avx512(float *restrict out, int64_t out_stride,
                                            const float *restrict c, int64_t m, int64_t n,
                                            const float *restrict scales) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    __m512 r[16];
    for (int j = 0; j < NR; ++j) r[j] = _mm512_load_ps(c + j * MT);
    transpose16_avx512(r);
    if (scales) {
        const __m512 s = _mm512_maskz_loadu_ps(mask, scales);
        for (int i = 0; i < 16; ++i) r[i] = _mm512_mul_ps(s, r[i]);
    }
    for (int64_t i = 0; i < m; ++i) _mm512_mask_storeu_ps(out + i * out_stride, mask, r[i]);
}
