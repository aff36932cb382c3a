/*
 * The int8 route of the quantized linear for batched steps: the activations quantized to
 * 8 bits, integer dot products against the weight's own 4/8-bit block quants, as the greedy
 * screen does for the LM head (greedy_screen.c) and llama.cpp does for its q8 dot products.
 *
 * Activation row r is quantized per 32-value block b (the weight's block): x = xd * xq with
 * xq in [-127, 127] and xs = sum(xq). A weight block is W = d * q + m (Q4_1), d * (q - 8)
 * (Q4_0) or d * q (Q8_0), so with integer v = q (Q4_1), q - 8 or q:
 *
 *   W_n,b . x_r,b = d[n, b] xd[r, b] (v_n,b . xq_r,b) + m[n, b] xd[r, b] xs[r, b]
 *
 * The integer dots are exact; the result differs from dequantize-then-matmul by the
 * activation's rounding only (relative error about 2^-8 per block, llama.cpp's too). That is
 * why the timed trial (engine/layers/quant_select.py) keeps this route only where it is
 * faster, and checks it against the fp32 route on the real weight first.
 *
 * As in quant_gemm.c the weight is never unpacked whole: per panel of I8_NR = 16 output rows
 * one thread unpacks all of K into an L1/L2-resident buffer laid out as the screen's packed
 * head, wbuf[b][k4][j][i] = v[n0 + j, 32 b + 4 k4 + i] (+ 128 on VNNI, see below), with the
 * block scales wd[b][j] and mins wm[b][j], and takes it past every activation row: one
 * 64-byte load serves 16 outputs x 4 values, the row's 4 quants are a broadcast.
 *
 *   AVX-512 VNNI  vpdpbusd: unsigned weight bytes (v + 128) by signed activation quants, 64
 *                 products per instruction; each block's int32 sums start at -128 xs.
 *   AVX2          vpmaddubsw on |v| and sign(xq, v) (the products stay within int16:
 *                 2 * 128 * 127 < 32768), vpmaddwd to int32: 32 products per 4 instructions
 *                 (also AVX-512 CPUs without VNNI).
 *
 * AVX-VNNI (the VEX form on AVX2-only CPUs) and AMX-INT8 are not here: no CPU this was
 * written on runs them, so they could not be tested; those CPUs take the AVX2 path.
 * The path follows the quantized kernels' active (or forced) ISA, like the screen's; the
 * portable build has no int8 route (quant_linear_i8 returns -2).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_fp16.h" /* load_u16, half_to_float: the blocks' fp16 fields */
#include "quant_types.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define I8_HAVE_X86 1
#else
#define I8_HAVE_X86 0
#endif

#define I8_NR 16 /* outputs per panel: one zmm of int32 sums */
#define I8_KB 32 /* values per block: one weight scale, one activation scale */

static inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The int8 route for this CPU and the active (or forced) quantized path: ISA_AVX512 (with
 * VNNI), ISA_AVX2, or ISA_PORTABLE for none. */
static int i8_isa(void) {
#if I8_HAVE_X86
    __builtin_cpu_init();
    const int isa = quant_active_isa();
    if (isa == ISA_AVX512 && __builtin_cpu_supports("avx512vnni")) return ISA_AVX512;
    if (isa == ISA_AVX512 || isa == ISA_AVX2) return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

static int i8_type(int type) {
    return type == QTYPE_Q4_0 || type == QTYPE_Q4_1 || type == QTYPE_Q8_0;
}

/* 1 when this CPU (and forced path) has the int8 route for weights of `type`; the route's
 * ISA (ISA_AVX512: VNNI, ISA_AVX2) is in *isa when isa is not NULL. */
int quant_linear_i8_supported(int type, int *isa) {
    const int path = i8_isa();
    if (isa != NULL) *isa = path;
    return path != ISA_PORTABLE && i8_type(type);
}

/* Row r of x (k values): xq (int8), and per block xd (scale), xc (the int32 sums' start:
 * bias * xs) and xm (xd * xs, the mins' factor). A block holding inf or NaN gets a NaN
 * scale and zero quants, so its outputs are NaN as the fp32 route's would be. */
static void quantize_row(int8_t *xq, float *xd, int32_t *xc, float *xm, const float *x,
                         int64_t k, int32_t bias) {
    for (int64_t b = 0; b < k / I8_KB; ++b) {
        const float *xb = x + b * I8_KB;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < I8_KB; ++i) {
            const float v = fabsf(xb[i]);
            finite &= v <= 3.4e38f;
            amax = v > amax ? v : amax;
        }
        const float s = finite ? amax / 127.0f : NAN;
        const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < I8_KB; ++i) {
            float t = finite ? nearbyintf(xb[i] * inv) : 0.0f;
            t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
            xq[b * I8_KB + i] = (int8_t)t;
            sum += (int32_t)t;
        }
        xd[b] = s;
        xc[b] = bias * sum;
        xm[b] = s * (float)sum;
    }
}

/* Weight rows [n0, n0 + valid) (valid <= I8_NR) of all k into wbuf / wd / wm (layout in the
 * file comment), each integer v stored as v + bias (128 for vpdpbusd's unsigned operand, 0
 * for the signed AVX2 path); rows past `valid` get zero scales. */
static void fill_panel(uint8_t *wbuf, float *wd, float *wm, const uint8_t *w, int64_t row_bytes,
                       int type, int64_t n0, int64_t valid, int64_t k, int bias) {
    const int64_t nb = k / I8_KB, bb = block_bytes(type);
    for (int64_t j = 0; j < I8_NR; ++j) {
        if (j >= valid) {
            for (int64_t b = 0; b < nb; ++b) {
                wd[b * I8_NR + j] = wm[b * I8_NR + j] = 0.0f;
                for (int k4 = 0; k4 < I8_KB / 4; ++k4)
                    memset(wbuf + ((b * 8 + k4) * I8_NR + j) * 4, bias, 4);
            }
            continue;
        }
        const uint8_t *row = w + (n0 + j) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bb;
            uint8_t v[I8_KB];
            if (type == QTYPE_Q8_0) {
                wd[b * I8_NR + j] = half_to_float(load_u16(blk));
                wm[b * I8_NR + j] = 0.0f;
                for (int i = 0; i < I8_KB; ++i) v[i] = (uint8_t)((int8_t)blk[2 + i] + bias);
            } else {
                const int q1 = type == QTYPE_Q4_1;
                const uint8_t *qs = blk + (q1 ? 4 : 2);
                const int off = bias - (q1 ? 0 : 8);
                wd[b * I8_NR + j] = half_to_float(load_u16(blk));
                wm[b * I8_NR + j] = q1 ? half_to_float(load_u16(blk + 2)) : 0.0f;
                for (int i = 0; i < 16; ++i) {
                    v[i] = (uint8_t)((qs[i] & 0xF) + off);
                    v[i + 16] = (uint8_t)((qs[i] >> 4) + off);
                }
            }
            for (int k4 = 0; k4 < I8_KB / 4; ++k4)
                memcpy(wbuf + ((b * 8 + k4) * I8_NR + j) * 4, v + 4 * k4, 4);
        }
    }
}

/* What a panel's row tiles read. */
typedef struct {
    const int8_t *xq;
    const float *xd, *xm;
    const int32_t *xc;
    const uint8_t *wbuf;
    const float *wd, *wm;
    int64_t k, nb;
    int has_min;
} panel_t;

#if I8_HAVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")

#define I8_RT 8 /* rows per tile: 8 zmm of int32 sums, 8 of fp32 sums */

static inline __m512i i8_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* fill_panel for VNNI (bias 128), 16 rows at a time: each gather takes one dword of a block
 * from 16 weight rows, which is one 64-byte line of wbuf as it stands (Q8_0), or two after
 * splitting the nibbles (Q4_x: low nibbles are values 0..15, high ones 16..31). */
static void fill_panel_vnni(uint8_t *wbuf, float *wd, float *wm, const uint8_t *w,
                            int64_t row_bytes, int type, int64_t n0, int64_t valid, int64_t k) {
    const int64_t nb = k / I8_KB, bb = block_bytes(type);
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int32_t)row_bytes));
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m512i zero = _mm512_setzero_si512(), nibble = _mm512_set1_epi8(0x0F);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i off = _mm512_set1_epi8((char)(type == QTYPE_Q4_1 ? 128 : 120));
    const uint8_t *base = w + n0 * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = base + b * bb;
        uint8_t *dst = wbuf + b * (I8_KB * I8_NR);
        const __m512i head = _mm512_mask_i32gather_epi32(zero, mask, idx, blk, 1);
        _mm512_storeu_ps(wd + b * I8_NR, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
        if (type == QTYPE_Q4_1)
            _mm512_storeu_ps(wm + b * I8_NR,
                             _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
        else
            _mm512_storeu_ps(wm + b * I8_NR, _mm512_setzero_ps());
        if (type == QTYPE_Q8_0) {
            for (int k4 = 0; k4 < 8; ++k4) {
                const __m512i g = _mm512_mask_i32gather_epi32(zero, mask, idx, blk + 2 + 4 * k4, 1);
                _mm512_store_si512(dst + 64 * k4, _mm512_xor_si512(g, flip));
            }
        } else {
            const uint8_t *qs = blk + (type == QTYPE_Q4_1 ? 4 : 2);
            for (int k4 = 0; k4 < 4; ++k4) {
                const __m512i g = _mm512_mask_i32gather_epi32(zero, mask, idx, qs + 4 * k4, 1);
                const __m512i lo = _mm512_and_si512(g, nibble);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(g, 4), nibble);
                _mm512_store_si512(dst + 64 * k4, _mm512_add_epi8(lo, off));
                _mm512_store_si512(dst + 64 * (k4 + 4), _mm512_add_epi8(hi, off));
            }
        }
    }
}

/* out rows [r0, r0 + RT), columns [0, valid) of the panel. RT is a constant at each call
 * site, so each tile height compiles to its own unrolled loop. */
static inline __attribute__((always_inline)) void
tile_vnni(const int RT, const panel_t *p, int64_t r0, float *out, int64_t out_stride,
          __mmask16 mask) {
    __m512 acc[I8_RT];
    for (int i = 0; i < RT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p->nb; ++b) {
        __m512i sum[I8_RT];
        for (int i = 0; i < RT; ++i) sum[i] = _mm512_set1_epi32(p->xc[(r0 + i) * p->nb + b]);
        const uint8_t *wb = p->wbuf + b * (I8_KB * I8_NR);
        const int8_t *xb = p->xq + r0 * p->k + b * I8_KB;
        for (int k4 = 0; k4 < I8_KB / 4; ++k4) {
            const __m512i w = _mm512_load_si512(wb + 64 * k4);
            for (int i = 0; i < RT; ++i)
                sum[i] = _mm512_dpbusd_epi32(sum[i], w, i8_bcast(xb + i * p->k + 4 * k4));
        }
        const __m512 d = _mm512_loadu_ps(p->wd + b * I8_NR);
        for (int i = 0; i < RT; ++i) {
            const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(p->xd[(r0 + i) * p->nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), s, acc[i]);
        }
        if (p->has_min) {
            const __m512 m = _mm512_loadu_ps(p->wm + b * I8_NR);
            for (int i = 0; i < RT; ++i)
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(p->xm[(r0 + i) * p->nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < RT; ++i) _mm512_mask_storeu_ps(out + (r0 + i) * out_stride, mask, acc[i]);
}

static void panel_vnni(const panel_t *p, int64_t rows, float *out, int64_t out_stride,
                       int64_t valid) {
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8) tile_vnni(8, p, r0, out, out_stride, mask);
    if (r0 + 4 <= rows) tile_vnni(4, p, r0, out, out_stride, mask), r0 += 4;
    if (r0 + 2 <= rows) tile_vnni(2, p, r0, out, out_stride, mask), r0 += 2;
    if (r0 < rows) tile_vnni(1, p, r0, out, out_stride, mask);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#define I8_RT_AVX2 4 /* rows per tile: two ymm halves of 8 outputs each */

static inline __attribute__((always_inline)) void
tile_avx2(const int RT, const panel_t *p, int64_t r0, float *out, int64_t out_stride,
          int64_t valid) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[I8_RT_AVX2][2];
    for (int i = 0; i < RT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p->nb; ++b) {
        __m256i lo[I8_RT_AVX2], hi[I8_RT_AVX2];
        for (int i = 0; i < RT; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
        const uint8_t *wb = p->wbuf + b * (I8_KB * I8_NR);
        const int8_t *xb = p->xq + r0 * p->k + b * I8_KB;
        for (int k4 = 0; k4 < I8_KB / 4; ++k4) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + 64 * k4));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(wb + 64 * k4 + 32));
            const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            for (int i = 0; i < RT; ++i) {
                int32_t xv;
                memcpy(&xv, xb + i * p->k + 4 * k4, sizeof xv);
                const __m256i x = _mm256_set1_epi32(xv);
                const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0));
                const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1));
                lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(p0, ones));
                hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(p1, ones));
            }
        }
        const __m256 d0 = _mm256_loadu_ps(p->wd + b * I8_NR);
        const __m256 d1 = _mm256_loadu_ps(p->wd + b * I8_NR + 8);
        for (int i = 0; i < RT; ++i) {
            const __m256 s = _mm256_set1_ps(p->xd[(r0 + i) * p->nb + b]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[i]), _mm256_mul_ps(d0, s), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i]), _mm256_mul_ps(d1, s), acc[i][1]);
        }
        if (p->has_min) {
            const __m256 m0 = _mm256_loadu_ps(p->wm + b * I8_NR);
            const __m256 m1 = _mm256_loadu_ps(p->wm + b * I8_NR + 8);
            for (int i = 0; i < RT; ++i) {
                const __m256 xm = _mm256_set1_ps(p->xm[(r0 + i) * p->nb + b]);
                acc[i][0] = _mm256_fmadd_ps(m0, xm, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(m1, xm, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < RT; ++i) {
        float *o = out + (r0 + i) * out_stride;
        if (valid == I8_NR) {
            _mm256_storeu_ps(o, acc[i][0]);
            _mm256_storeu_ps(o + 8, acc[i][1]);
        } else {
            float tmp[I8_NR];
            _mm256_storeu_ps(tmp, acc[i][0]);
            _mm256_storeu_ps(tmp + 8, acc[i][1]);
            memcpy(o, tmp, (size_t)valid * sizeof(float));
        }
    }
}

static void panel_avx2(const panel_t *p, int64_t rows, float *out, int64_t out_stride,
                       int64_t valid) {
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) tile_avx2(4, p, r0, out, out_stride, valid);
    if (r0 + 2 <= rows) tile_avx2(2, p, r0, out, out_stride, valid), r0 += 2;
    if (r0 < rows) tile_avx2(1, p, r0, out, out_stride, valid);
}
#pragma GCC pop_options
#endif

/* out[r * out_stride + n] = W[n] . x[r] for r < rows, n < n_out through the int8 route (see
 * the file comment), W: n_out rows of row_bytes in `type` (Q4_0, Q4_1, Q8_0), k a multiple
 * of 32. Returns 0; -2 where this CPU, the forced path or the type has no int8 route; -3
 * when a buffer cannot be allocated. */
int quant_linear_i8(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                    int64_t rows, const uint8_t *w, int64_t row_bytes, int type, int64_t n_out,
                    int64_t k, int num_threads) {
    int isa;
    if (!quant_linear_i8_supported(type, &isa) || k % I8_KB != 0) return -2;
    if (rows <= 0 || n_out <= 0) return 0;
#if I8_HAVE_X86
    if (num_threads < 1) num_threads = 1;
    const int vnni = isa == ISA_AVX512;
    const int bias = vnni ? 128 : 0;
    const int64_t nb = k / I8_KB, panels = (n_out + I8_NR - 1) / I8_NR;
    const size_t wbytes = (size_t)(nb * I8_KB * I8_NR), wfloats = (size_t)(2 * nb * I8_NR);
    const size_t per_thread = wbytes + wfloats * sizeof(float); /* a multiple of 64 */
    int8_t *xq = aligned_alloc(64, (size_t)((rows * k + 63) / 64 * 64));
    float *xd = malloc(sizeof(float) * (size_t)(rows * nb));
    float *xm = malloc(sizeof(float) * (size_t)(rows * nb));
    int32_t *xc = malloc(sizeof(int32_t) * (size_t)(rows * nb));
    uint8_t *scratch = aligned_alloc(64, per_thread * (size_t)num_threads);
    const int status = xq && xd && xm && xc && scratch ? 0 : -3;
    if (status == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            uint8_t *wbuf = scratch + per_thread * (size_t)omp_id();
            float *wd = (float *)(wbuf + wbytes), *wm = wd + nb * I8_NR;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r)
                quantize_row(xq + r * k, xd + r * nb, xc + r * nb, xm + r * nb, x + r * x_stride,
                             k, -bias);
            const panel_t p = {xq, xd, xm, xc, wbuf, wd, wm, k, nb, type == QTYPE_Q4_1};
#pragma omp for schedule(dynamic, 1)
            for (int64_t panel = 0; panel < panels; ++panel) {
                const int64_t n0 = panel * I8_NR, valid = min_i64(I8_NR, n_out - n0);
                if (vnni) {
                    fill_panel_vnni(wbuf, wd, wm, w, row_bytes, type, n0, valid, k);
                    panel_vnni(&p, rows, out + n0, out_stride, valid);
                } else {
                    fill_panel(wbuf, wd, wm, w, row_bytes, type, n0, valid, k, bias);
                    panel_avx2(&p, rows, out + n0, out_stride, valid);
                }
            }
        }
    }
    free(xq);
    free(xd);
    free(xm);
    free(xc);
    free(scratch);
    return status;
#else
    (void)out, (void)out_stride, (void)x, (void)x_stride, (void)w, (void)row_bytes, (void)isa;
    (void)num_threads;
    return -2;
#endif
}
