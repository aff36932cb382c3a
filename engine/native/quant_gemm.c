/*
 * Dequantize-GEMM: quantized weights (the types of quant_kernels.c, fp32 rows included)
 * against many activation rows (batched decode steps above GEMV_MAX_ROWS rows, prefill
 * chunks). Same contract as quant_linear_f32: out[r, n] = scale[n] * W[n] . x[r] in fp32,
 * the result of dequantize-then-matmul up to summation order.
 *
 * The weight is dequantized a panel of NR output rows at a time into a small per-thread
 * buffer (never the whole fp32 matrix) and multiplied against every activation row before
 * the next panel. The textbook GEMM roles are swapped so that the dequantized rows need no
 * transpose: the vectors run along the activation rows, the weight is broadcast.
 *
 *   panel  (per thread)  panel[kb][j][kk] = W[n0 + j, kb * KC + kk]    j < NR, kk < KC
 *   xpack  (shared)      xpack[t][k][i]   = x[m0 + MT * t + i, k]      i < MT (0 past rows)
 *
 *   micro-kernel         acc[j][i] += panel[j][k] * xpack[t][k][i]     over all k
 *                        (one vector load of xpack serves NR outputs; panel[j][k] is an
 *                        embedded broadcast at a constant offset from one pointer)
 *
 * AVX-512 takes two 16-row tiles x 12 outputs (24 zmm accumulators), AVX2 one 16-row tile x
 * 6 outputs (12 ymm) twice per panel, portable C the same loops on arrays. The activation
 * rows go in chunks of at most CHUNK_BYTES of packed fp32, so a chunk stays in L2 while
 * every panel goes past it; each chunk dequantizes the panels again (cheap next to the
 * 2 * rows flops per weight). Work is split over panels, and over groups of row tiles as
 * well when there are too few panels to keep every thread busy.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_types.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 12  /* outputs per panel */
#define KC 256 /* panel k-block: a Q4_K / Q6_K super-block, 8 Q8_0 / Q4_x blocks */
#define MT 16  /* activation rows per packed tile */
#define CHUNK_BYTES (512 * 1024)

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }


/* ---- portable C ---------------------------------------------------------------------- */

static void pack_tile_portable(float *restrict dst, const float *restrict x, int64_t x_stride,
                               int64_t m, int64_t k) {
    for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t i = 0; i < MT; ++i) dst[kk * MT + i] = i < m ? x[i * x_stride + kk] : 0.0f;
}

/* c[j * 2 * MT + i] (+)= block row j . tile row i over `len` values, for one tile (i < MT):
 * the contract of every kernel, with `tiles` tiles (2 * MT rows) where it takes two. */
static void kernel_portable(float *restrict c, const float *restrict tile,
                            const float *restrict block, int64_t len, int accumulate) {
    float a[NR][MT];
    for (int j = 0; j < NR; ++j)
        for (int i = 0; i < MT; ++i) a[j][i] = accumulate ? c[j * 2 * MT + i] : 0.0f;
    for (int64_t kk = 0; kk < len; ++kk)
        for (int j = 0; j < NR; ++j) {
            const float wv = block[j * KC + kk];
            for (int i = 0; i < MT; ++i) a[j][i] += wv * tile[kk * MT + i];
        }
    for (int j = 0; j < NR; ++j) memcpy(c + j * 2 * MT, a[j], sizeof a[j]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define GEMM_HAVE_X86 1
#include <immintrin.h>
#define AVX2_TARGET __attribute__((target("avx2,fma")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* ---- AVX2 + FMA ---------------------------------------------------------------------- */

/* Block rows [j0, j0 + 6) against one tile: 6 x 2 ymm accumulators. */
AVX2_TARGET static inline void kernel6_avx2(float *restrict c, const float *restrict tile,
                                            const float *restrict block, int64_t len,
                                            int accumulate, int j0) {
    __m256 a[6][2];
    for (int j = 0; j < 6; ++j)
        for (int v = 0; v < 2; ++v)
            a[j][v] = accumulate ? _mm256_load_ps(c + (j0 + j) * 2 * MT + 8 * v) : _mm256_setzero_ps();
    const float *p = block + j0 * KC;
    for (int64_t kk = 0; kk < len; ++kk) {
        const __m256 x0 = _mm256_load_ps(tile + kk * MT), x1 = _mm256_load_ps(tile + kk * MT + 8);
        for (int j = 0; j < 6; ++j) {
            const __m256 wv = _mm256_broadcast_ss(p + j * KC + kk);
            a[j][0] = _mm256_fmadd_ps(wv, x0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(wv, x1, a[j][1]);
        }
    }
    for (int j = 0; j < 6; ++j)
        for (int v = 0; v < 2; ++v) _mm256_store_ps(c + (j0 + j) * 2 * MT + 8 * v, a[j][v]);
}

AVX2_TARGET static void kernel_avx2(float *restrict c, const float *restrict tile,
                                    const float *restrict block, int64_t len, int accumulate) {
    kernel6_avx2(c, tile, block, len, accumulate, 0);
    kernel6_avx2(c, tile, block, len, accumulate, 6);
}

/* ---- AVX-512 ------------------------------------------------------------------------- */

/* All NR block rows against `tiles` (1 or 2, a literal) tiles, tile_stride floats apart:
 * 24 zmm accumulators, each k one vector load per tile and NR broadcasts. */
AVX512_TARGET static inline __attribute__((always_inline)) void kernel_avx512(
    float *restrict c, const float *restrict tile, int64_t tile_stride,
    const float *restrict block, int64_t len, int accumulate, const int tiles) {
    __m512 a[NR][2];
    for (int j = 0; j < NR; ++j)
        for (int v = 0; v < tiles; ++v)
            a[j][v] = accumulate ? _mm512_load_ps(c + j * 2 * MT + MT * v) : _mm512_setzero_ps();
    for (int64_t kk = 0; kk < len; ++kk) {
        const __m512 x0 = _mm512_load_ps(tile + kk * MT);
        const __m512 x1 = tiles == 2 ? _mm512_load_ps(tile + tile_stride + kk * MT) : x0;
        for (int j = 0; j < NR; ++j) {
            const __m512 wv = _mm512_set1_ps(block[j * KC + kk]);
            a[j][0] = _mm512_fmadd_ps(wv, x0, a[j][0]);
            if (tiles == 2) a[j][1] = _mm512_fmadd_ps(wv, x1, a[j][1]);
        }
    }
    for (int j = 0; j < NR; ++j)
        for (int v = 0; v < tiles; ++v) _mm512_store_ps(c + j * 2 * MT + MT * v, a[j][v]);
}

AVX512_TARGET static void kernel1_avx512(float *restrict c, const float *restrict tile,
                                         const float *restrict block, int64_t len,
                                         int accumulate) {
    kernel_avx512(c, tile, 0, block, len, accumulate, 1);
}

AVX512_TARGET static void kernel2_avx512(float *restrict c, const float *restrict tile,
                                         int64_t tile_stride, const float *restrict block,
                                         int64_t len, int accumulate) {
    kernel_avx512(c, tile, tile_stride, block, len, accumulate, 2);
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
        const int64_t bb = type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_0 ? 18 : 20;
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

static inline float fp16_at(const uint8_t *p) {
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
/* store_tile on AVX-512: each 16 rows x NR sums transposed in registers, then one masked
 * store of the row's (scaled) outputs. */
AVX512_TARGET static void store_tile_avx512(float *restrict out, int64_t out_stride,
                                            const float *restrict c, int64_t m, int64_t n,
                                            const float *restrict scales) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 s = scales ? _mm512_maskz_loadu_ps(mask, scales) : _mm512_set1_ps(1.0f);
    for (int64_t h = 0; h < m; h += MT) {
        __m512 r[16];
        for (int j = 0; j < 16; ++j) r[j] = j < NR ? _mm512_load_ps(c + j * 2 * MT + h) : _mm512_setzero_ps();
        transpose16_avx512(r);
        for (int64_t i = 0; i < min64(MT, m - h); ++i)
            _mm512_mask_storeu_ps(out + (h + i) * out_stride, mask, _mm512_mul_ps(s, r[i]));
    }
}
#else
#define GEMM_HAVE_X86 0
#endif

/* ---- driver -------------------------------------------------------------------------- */

/* block[j][kk] = W[n0 + j, k0 + kk] for j < NR (zero rows past n1), kk < len. */
static void fill_block(int isa, float *restrict block, const uint8_t *w, int64_t row_bytes,
                       int type, int64_t n0, int64_t n1, int64_t k0, int64_t len) {
    const int64_t valid = min64(NR, n1 - n0);
#if GEMM_HAVE_X86
    if (isa == ISA_AVX512 && (type == QTYPE_Q8_0 || type == QTYPE_Q4_0 || type == QTYPE_Q4_1 ||
                              type == QTYPE_INT8))
        fill_block32_avx512(block, w, row_bytes, type, n0, n0 + valid, k0, len);
    else if (isa == ISA_AVX512 && (type == QTYPE_Q4_K || type == QTYPE_Q6_K))
        fill_k_quant_avx512(block, w, row_bytes, type, n0, n0 + valid, k0, len);
    else
#endif
        quant_dequantize_block(block, KC, w, row_bytes, type, n0, n0 + valid, k0, len);
    if (valid < NR) memset(block + valid * KC, 0, (size_t)(NR - valid) * KC * sizeof(float));
    (void)isa;
}

/* Packs activation rows [0, m) (m <= MT) into one tile of k * MT floats. */
static void pack_tile(int isa, float *dst, const float *x, int64_t x_stride, int64_t m,
                      int64_t k) {
#if GEMM_HAVE_X86
    if (isa == ISA_AVX512) {
        pack_tile_avx512(dst, x, x_stride, m, k);
        return;
    }
#endif
    (void)isa;
    pack_tile_portable(dst, x, x_stride, m, k);
}

/* out[i, j] = scale[j] * c[j * 2 * MT + i] for i < m, j < n. */
static void store_tile(float *restrict out, int64_t out_stride, const float *restrict c,
                       int64_t m, int64_t n, const float *restrict scales) {
    for (int64_t i = 0; i < m; ++i) {
        float *o = out + i * out_stride;
        if (scales)
            for (int64_t j = 0; j < n; ++j) o[j] = scales[j] * c[j * 2 * MT + i];
        else
            for (int64_t j = 0; j < n; ++j) o[j] = c[j * 2 * MT + i];
    }
}

/* Output rows [n0, n0 + NR) ∩ [.., n1) for packed tiles [t0, t1) (t0 even) of a chunk of m
 * rows whose output starts at `out`: per k-block, one dequantized block (L1-resident) goes
 * past every tile pair, whose sums wait in `cbuf` (NR * 2 * MT floats per pair). */
static void panel_times_tiles(int isa, float *out, int64_t out_stride, const float *xpack,
                              int64_t k, int64_t m, int64_t t0, int64_t t1, const uint8_t *w,
                              int64_t row_bytes, int type, int64_t n0, int64_t n1,
                              const float *scales, float *block, float *cbuf) {
    const int64_t tile_floats = k * MT, pair_floats = NR * 2 * MT;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t len = min64(KC, k - k0);
        const int accumulate = k0 > 0;
        fill_block(isa, block, w, row_bytes, type, n0, n1, k0, len);
        for (int64_t t = t0; t < t1;) {
            const float *tile = xpack + t * tile_floats + k0 * MT;
            float *c = cbuf + (t - t0) / 2 * pair_floats + (t - t0) % 2 * MT;
#if GEMM_HAVE_X86
            if (isa == ISA_AVX512 && t + 1 < t1) {
                kernel2_avx512(c, tile, tile_floats, block, len, accumulate);
                t += 2;
                continue;
            }
            if (isa == ISA_AVX512)
                kernel1_avx512(c, tile, block, len, accumulate);
            else if (isa == ISA_AVX2)
                kernel_avx2(c, tile, block, len, accumulate);
            else
#endif
                kernel_portable(c, tile, block, len, accumulate);
            t += 1;
        }
    }
    const int64_t n = min64(NR, n1 - n0);
    for (int64_t t = t0; t < t1; t += 2) {
        float *o = out + t * MT * out_stride + n0;
        const float *c = cbuf + (t - t0) / 2 * pair_floats, *s = scales ? scales + n0 : NULL;
        const int64_t rows = min64(2 * MT, m - t * MT);
#if GEMM_HAVE_X86
        if (isa == ISA_AVX512) {
            store_tile_avx512(o, out_stride, c, rows, n, s);
            continue;
        }
#endif
        store_tile(o, out_stride, c, rows, n, s);
    }
}

int64_t tune_chunk_kb = 0;
void quant_gemm_tune(int64_t chunk_kb) { tune_chunk_kb = chunk_kb; }

/* out[r, n] = scales[n] (or 1) * W[n] . x[r]: see the file comment. Returns 0, or -1 when a
 * buffer cannot be allocated. */
int quant_gemm_f32(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                   int64_t rows, const uint8_t *w, int64_t row_bytes, const float *scales,
                   int type, int64_t n_out, int64_t k, int num_threads) {
    if (rows <= 0 || n_out <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const int isa = quant_active_isa();
    const int64_t panels = (n_out + NR - 1) / NR;
    /* Rows per chunk: a multiple of 2 * MT whose packed copy fits CHUNK_BYTES. */
    const int64_t chunk_bytes = tune_chunk_kb ? tune_chunk_kb * 1024 : CHUNK_BYTES;
    int64_t chunk = chunk_bytes / (int64_t)(k * sizeof(float)) / (2 * MT) * (2 * MT);
    if (chunk < 2 * MT) chunk = 2 * MT;
    chunk = min64(chunk, (rows + 2 * MT - 1) / (2 * MT) * (2 * MT));
    const int64_t pairs_max = chunk / (2 * MT);
    /* per thread: one dequantized block, then the sums of every tile pair of a chunk */
    const size_t thread_floats = (size_t)(NR * KC + pairs_max * NR * 2 * MT);
    float *xpack = aligned_alloc(64, (size_t)(chunk * k) * sizeof(float));
    float *scratch = aligned_alloc(64, thread_floats * sizeof(float) * (size_t)num_threads);
    if (xpack == NULL || scratch == NULL) {
        free(xpack);
        free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int64_t threads = 1, id = 0;
#endif
        float *block = scratch + (size_t)id * thread_floats, *cbuf = block + NR * KC;
        for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
            const int64_t m = min64(chunk, rows - m0), tiles = (m + MT - 1) / MT;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t)
                pack_tile(isa, xpack + t * k * MT, x + (m0 + t * MT) * x_stride, x_stride,
                          min64(MT, m - t * MT), k);
            /* Work items: (panel, group of tile pairs), panel-major, a contiguous range per
             * thread; a thread's items on one panel run as one tile range, so each panel is
             * dequantized once per thread that needs it. */
            const int64_t pairs = (tiles + 1) / 2;
            int64_t groups = 1;
            if (panels < 4 * threads) groups = min64(pairs, (4 * threads + panels - 1) / panels);
            const int64_t items = panels * groups, per = (items + threads - 1) / threads;
            const int64_t i0 = min64(items, id * per), i1 = min64(items, i0 + per);
            for (int64_t item = i0; item < i1;) {
                const int64_t p = item / groups, g0 = item % groups;
                const int64_t g1 = min64(groups, g0 + (i1 - item)); /* exclusive */
                const int64_t t0 = min64(tiles, pairs * g0 / groups * 2);
                const int64_t t1 = min64(tiles, pairs * g1 / groups * 2);
                if (t0 < t1)
                    panel_times_tiles(isa, out + m0 * out_stride, out_stride, xpack, k, m, t0, t1,
                                      w, row_bytes, type, p * NR, n_out, scales, block, cbuf);
                item += g1 - g0;
            }
#pragma omp barrier
        }
    }
    free(xpack);
    free(scratch);
    return 0;
}
