/*
 * The greedy argmax of a step without the fp32 LM head: an 8-bit screen that bounds every
 * logit, then the few tokens that can still be the largest rescored in fp32 against the
 * head's own rows (engine/models/greedy_screen.py says where the engine uses it).
 *
 * The LM head W [V, K] is packed once as 8-bit quants with one fp32 scale per 32 values,
 * Wq = wd * wq (GGUF Q8_0's layout: an LM head stored as Q8_0 comes out exactly), and each
 * step's hidden rows h [R, K] the same way, Hq = hs * hq. Then for row r and token n
 *
 *   a[r, n]  = sum_b wd[n, b] hs[r, b] (sum_{k in b} wq[n, k] hq[r, k])    int32 sums, exact
 *   W_n . h_r - Wq_n . Hq_r = (W_n - Wq_n) . h_r + Wq_n . (h_r - Hq_r)
 *   |logit[r, n] - a[r, n]| <= hn[r] wen[n] + hen[r] wqn[n]                  (Cauchy-Schwarz)
 *
 * with hn = |h_r|, hen = |h_r - Hq_r| (plus fp32 rounding slack), wen = |W_n - Wq_n|,
 * wqn = |Wq_n| (Euclidean norms, the weight's computed once at packing). With
 * T[r] = max_n (a - bound), every token whose a + bound reaches T[r] is a candidate, and
 * the exact argmax is one of them: a token below T[r] is beaten for sure by the token
 * that set T[r]. On the default model a row has 3.4 candidates on average (76 at most in
 * 8192 rows); each is rescored as W_n . h_r in fp32 by the quantized kernels' one-row GEMV
 * on the head's own storage (quant_linear_range), and the largest wins, ties to the lowest
 * id. However many candidates a row has, the answer is exact: at worst (every logit within
 * the bound) the rescore is the row's fp32 GEMV.
 *
 * The int8 products are AVX-512 VNNI's vpdpbusd: 64 byte products per instruction against
 * the 16 of an fp32 FMA. vpdpbusd multiplies unsigned by signed bytes, so the weight goes
 * in as wq + 128 (register operand) and the activation quants as signed (broadcast from
 * memory); each block's sums start at -128 * sum(hq) to undo the offset.
 *
 *   weights   wq_packed[g][b][k4][j][i] = wq[16 g + j, 32 b + 4 k4 + i] + 128  (u8)
 *             wd[g][b][j] = wd[16 g + j, b], wen / wqn / pad [16 G] (pad: 0, or -inf on the
 *             padding rows past V, so they never set a row's threshold)
 *   rows      hq [rows][K] int8, hs [rows][nb], negcorr = -128 * sum(hq) per
 *             block (where each block's int32 sums start)
 *
 * On AVX2 (and AVX-512 without VNNI) the byte products are vpmaddubsw + vpmaddwd + add, 32
 * per three instructions against 8 per fp32 FMA, with 7-bit activation quants (see the
 * AVX2 section). The path follows the quantized kernels' (quant_active_isa: forced or
 * capped too); on the portable path there is no screen and the caller keeps the fp32 head.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_types.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* Outside the per-ISA pragmas below, so each intrinsic keeps its own target. */
#include <immintrin.h>
#endif

#define SCREEN_NR 16 /* vocabulary rows per group: one zmm of int32 sums */
#define SCREEN_KB 32 /* values per block: one weight scale, one activation scale */
#define SCREEN_RT 8  /* activation rows per register tile (8 int32 + 8 fp32 accumulators);
                        * fewer in the last tiles */

/* Floats of one thread's buffer for a dequantized head row (k values, whole lines). */
static inline int64_t row_floats(int64_t k) { return (k + 15) / 16 * 16; }

/* The screen's kernels for this CPU and the quantized kernels' active (or forced) path:
 * AVX-512 VNNI; AVX2 (also on AVX-512 CPUs without VNNI); none on the portable path. */
static int screen_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    const int isa = quant_active_isa();
    if (isa == ISA_AVX512 && __builtin_cpu_supports("avx512vnni")) return ISA_AVX512;
    if (isa == ISA_AVX512 || isa == ISA_AVX2) return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

int greedy_screen_supported(void) { return screen_isa() != ISA_PORTABLE; }

/* Quantizes row r of h (k values, k a multiple of 32, row stride ld) into hq / hs /
 * negcorr, quants in [-qmax, qmax], and writes the bound's row factors hn and hen (the
 * latter with the fp32 rounding slack of a). Returns 1 when a value is not finite (the
 * caller falls back to the fp32 logits), else 0. */
static int prepare_row(int8_t *hq, float *hs, int32_t *negcorr, float *hn, float *hen,
                       const float *h, int64_t ld, int64_t r, int64_t k, int qmax) {
    const int64_t nb = k / SCREEN_KB;
    /* Rounding of a: each product wd * hs * int, and the sum over nb blocks, in fp32; each
     * term is at most |Wq_b| |Hq_b|. Generous: K + nb + 8 roundings of 2^-24 each. */
    const double gamma = ldexp((double)(k + nb + 8), -24);
    int bad = 0;
    {
        int8_t *q = hq + r * k;
        const float *x = h + r * ld;
        double norm2 = 0.0, err2 = 0.0, qnorm2 = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + b * SCREEN_KB;
            float amax = 0.0f;
            for (int i = 0; i < SCREEN_KB; ++i) {
                const float v = fabsf(xb[i]);
                if (!(v <= 3.0e38f)) bad = 1; /* inf or NaN */
                amax = v > amax ? v : amax;
            }
            const float s = amax / (float)qmax;
            const float inv = s > 0.0f ? 1.0f / s : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < SCREEN_KB; ++i) {
                float t = nearbyintf(xb[i] * inv);
                t = t > (float)qmax ? (float)qmax : (t < (float)-qmax ? (float)-qmax : t);
                const int32_t p = bad ? 0 : (int32_t)t;
                q[b * SCREEN_KB + i] = (int8_t)p;
                sum += p;
                const double hq_value = (double)p * (double)s, e = (double)xb[i] - hq_value;
                norm2 += (double)xb[i] * xb[i];
                err2 += e * e;
                qnorm2 += hq_value * hq_value;
            }
            hs[r * nb + b] = s;
            negcorr[r * nb + b] = -128 * sum;
        }
        const double slack = 1.0 + 1e-6; /* the norms' own rounding, and the cast to float */
        hn[r] = (float)(sqrt(norm2) * slack);
        hen[r] = (float)((sqrt(err2) + gamma * (sqrt(qnorm2) + sqrt(norm2))) * slack);
    }
    return bad;
}

/* A row's rescore: each candidate's exact fp32 logit against the head's own row. */
typedef struct {
    const float *h;       /* the row's hidden state, k values */
    const uint8_t *w;     /* the head: rows of row_bytes in `type` (QTYPE_F32: fp32) */
    int64_t row_bytes, k;
    const float *scales;  /* int8 row scales, else NULL */
    int type;
    float *row;           /* scratch of row_floats(k) floats, 64-byte aligned */
    int64_t best, count;  /* the best candidate so far (-1: none yet), candidates seen */
    float best_logit;
} rescore_t;

/* Candidate n: its logit W[n] . h by the quantized kernels' one-row GEMV (every storage
 * type, the active ISA), kept when it beats the best so far; candidates come in vocabulary
 * order, so ties keep the lowest id. */
static void rescore_candidate(rescore_t *s, int64_t n) {
    float logit;
    quant_linear_range(&logit, 1, s->h, s->k, 1, s->w + n * s->row_bytes, s->row_bytes,
                       s->scales != NULL ? s->scales + n : NULL, s->type, 0, 1, s->k, s->row);
    if (s->best < 0 || logit > s->best_logit) s->best = n, s->best_logit = logit;
    ++s->count;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

static inline __m512i bcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* a for rows [r0, r0 + RT) and one group of 16 tokens; stores them and raises the rows'
 * thresholds in tmax[r * 16 + j] (per-lane maxima of a - bound). RT is a constant at each
 * call site, so each tile height compiles to its own fully unrolled loop. */
static inline __attribute__((always_inline)) void
tile_avx512(const int RT, int64_t r0, float *a, int64_t a_ld, float *tmax, const int8_t *hq,
            const float *hs, const int32_t *negcorr, const float *hn, const float *hen,
            int64_t k, const uint8_t *wq, const float *wd, __m512 vwen, __m512 vwqn,
            __m512 vpad) {
    const int64_t nb = k / SCREEN_KB;
    __m512 acc[SCREEN_RT];
    for (int i = 0; i < RT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i sum[SCREEN_RT]; /* start at -128 sum(hq): the weights' +128, undone */
        for (int i = 0; i < RT; ++i) sum[i] = _mm512_set1_epi32(negcorr[(r0 + i) * nb + b]);
        const uint8_t *wb = wq + b * (SCREEN_KB * SCREEN_NR);
        const int8_t *xb = hq + r0 * k + b * SCREEN_KB;
        for (int k4 = 0; k4 < SCREEN_KB / 4; ++k4) {
            const __m512i w = _mm512_loadu_si512(wb + 64 * k4);
            for (int i = 0; i < RT; ++i)
                sum[i] = _mm512_dpbusd_epi32(sum[i], w, bcast_quad(xb + i * k + 4 * k4));
        }
        const __m512 d = _mm512_loadu_ps(wd + b * SCREEN_NR);
        for (int i = 0; i < RT; ++i) {
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(hs[(r0 + i) * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), scale, acc[i]);
        }
    }
    for (int i = 0; i < RT; ++i) {
        const int64_t r = r0 + i;
        _mm512_storeu_ps(a + r * a_ld, acc[i]);
        const __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(hn[r]), vwen,
                                             _mm512_mul_ps(_mm512_set1_ps(hen[r]), vwqn));
        const __m512 lower = _mm512_add_ps(_mm512_sub_ps(acc[i], bound), vpad);
        _mm512_storeu_ps(tmax + r * SCREEN_NR,
                         _mm512_max_ps(_mm512_loadu_ps(tmax + r * SCREEN_NR), lower));
    }
}

/* Every row against one group of 16 tokens: tiles of 8 rows, then 4 / 2 / 1. */
static void scores_group_avx512(float *a, int64_t a_ld, float *tmax, const int8_t *hq,
                                const float *hs, const int32_t *negcorr, const float *hn,
                                const float *hen, int64_t rows, int64_t k, const uint8_t *wq,
                                const float *wd, const float *wen, const float *wqn,
                                const float *pad) {
    const __m512 vwen = _mm512_loadu_ps(wen), vwqn = _mm512_loadu_ps(wqn);
    const __m512 vpad = _mm512_loadu_ps(pad);
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8)
        tile_avx512(8, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, vwen, vwqn, vpad);
    if (r0 + 4 <= rows) {
        tile_avx512(4, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, vwen, vwqn, vpad);
        r0 += 4;
    }
    if (r0 + 2 <= rows) {
        tile_avx512(2, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, vwen, vwqn, vpad);
        r0 += 2;
    }
    if (r0 < rows)
        tile_avx512(1, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, vwen, vwqn, vpad);
}

/* Row r's candidates: every n < vocab with a + bound >= threshold, rescored in order. */
static void rescore_avx512(rescore_t *s, const float *a, float hn, float hen, float threshold,
                           const float *wen, const float *wqn, int64_t vocab) {
    const __m512 vhn = _mm512_set1_ps(hn), vhen = _mm512_set1_ps(hen);
    const __m512 t = _mm512_set1_ps(threshold);
    for (int64_t n0 = 0; n0 < vocab; n0 += SCREEN_NR) {
        const int64_t left = vocab - n0;
        const __mmask16 valid = left >= SCREEN_NR ? 0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 bound = _mm512_fmadd_ps(
            vhn, _mm512_loadu_ps(wen + n0), _mm512_mul_ps(vhen, _mm512_loadu_ps(wqn + n0)));
        const __m512 upper = _mm512_add_ps(_mm512_loadu_ps(a + n0), bound);
        unsigned mask = _mm512_mask_cmp_ps_mask(valid, upper, t, _CMP_GE_OQ);
        for (; mask; mask &= mask - 1) rescore_candidate(s, n0 + __builtin_ctz(mask));
    }
}
#pragma GCC pop_options

/* ---- AVX2 ---------------------------------------------------------------------------- */
/* vpmaddubsw multiplies unsigned by signed bytes into 16-bit pair sums that saturate past
 * 32767: with the weight as q + 128 (up to 255) the activation quants stay within +-63
 * (2 * 255 * 63 = 32130), one bit fewer than on VNNI, which the bound accounts for. A
 * group's 16 tokens go as two halves of 8 (one ymm of int32 sums each). */
#pragma GCC push_options
#pragma GCC target("avx2,fma")

#define SCREEN_RT_AVX2 4 /* rows per tile: 8 ymm of int32 sums (two halves of 16 tokens) */

static inline __attribute__((always_inline)) void
tile_avx2(const int RT, int64_t r0, float *a, int64_t a_ld, float *tmax, const int8_t *hq,
          const float *hs, const int32_t *negcorr, const float *hn, const float *hen, int64_t k,
          const uint8_t *wq, const float *wd, const float *wen, const float *wqn,
          const float *pad) {
    const int64_t nb = k / SCREEN_KB;
    const __m256i ones = _mm256_set1_epi16(1);
    /* fp32 sums in L1 (16 registers hold the int32 ones and the operands) */
    __m256 acc[SCREEN_RT_AVX2][2];
    for (int i = 0; i < RT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i lo[SCREEN_RT_AVX2], hi[SCREEN_RT_AVX2];
        for (int i = 0; i < RT; ++i)
            lo[i] = hi[i] = _mm256_set1_epi32(negcorr[(r0 + i) * nb + b]);
        const uint8_t *wb = wq + b * (SCREEN_KB * SCREEN_NR);
        const int8_t *xb = hq + r0 * k + b * SCREEN_KB;
        for (int k4 = 0; k4 < SCREEN_KB / 4; ++k4) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * k4));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * k4 + 32));
            for (int i = 0; i < RT; ++i) {
                int32_t xq;
                memcpy(&xq, xb + i * k + 4 * k4, sizeof xq);
                const __m256i x = _mm256_set1_epi32(xq);
                const __m256i p0 = _mm256_maddubs_epi16(w0, x), p1 = _mm256_maddubs_epi16(w1, x);
                lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(p0, ones));
                hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(p1, ones));
            }
        }
        const __m256 d0 = _mm256_loadu_ps(wd + b * SCREEN_NR);
        const __m256 d1 = _mm256_loadu_ps(wd + b * SCREEN_NR + 8);
        for (int i = 0; i < RT; ++i) {
            const __m256 s = _mm256_set1_ps(hs[(r0 + i) * nb + b]);
            const __m256 s0 = _mm256_mul_ps(d0, s), s1 = _mm256_mul_ps(d1, s);
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[i]), s0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i]), s1, acc[i][1]);
        }
    }
    for (int i = 0; i < RT; ++i) {
        const int64_t r = r0 + i;
        for (int half = 0; half < 2; ++half) {
            _mm256_storeu_ps(a + r * a_ld + 8 * half, acc[i][half]);
            const __m256 vwqn = _mm256_loadu_ps(wqn + 8 * half);
            const __m256 vwen = _mm256_loadu_ps(wen + 8 * half);
            const __m256 bound = _mm256_fmadd_ps(_mm256_set1_ps(hn[r]), vwen,
                                                 _mm256_mul_ps(_mm256_set1_ps(hen[r]), vwqn));
            const __m256 lower = _mm256_add_ps(_mm256_sub_ps(acc[i][half], bound),
                                               _mm256_loadu_ps(pad + 8 * half));
            float *t = tmax + r * SCREEN_NR + 8 * half;
            _mm256_storeu_ps(t, _mm256_max_ps(_mm256_loadu_ps(t), lower));
        }
    }
}

static void scores_group_avx2(float *a, int64_t a_ld, float *tmax, const int8_t *hq,
                              const float *hs, const int32_t *negcorr, const float *hn,
                              const float *hen, int64_t rows, int64_t k, const uint8_t *wq,
                              const float *wd, const float *wen, const float *wqn,
                              const float *pad) {
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
        tile_avx2(4, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, wen, wqn, pad);
    if (r0 + 2 <= rows) {
        tile_avx2(2, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, wen, wqn, pad);
        r0 += 2;
    }
    if (r0 < rows)
        tile_avx2(1, r0, a, a_ld, tmax, hq, hs, negcorr, hn, hen, k, wq, wd, wen, wqn, pad);
}

/* rescore_avx512's contract, 8 tokens at a time. */
static void rescore_avx2(rescore_t *s, const float *a, float hn, float hen, float threshold,
                         const float *wen, const float *wqn, int64_t vocab) {
    const __m256 vhn = _mm256_set1_ps(hn), vhen = _mm256_set1_ps(hen);
    const __m256 t = _mm256_set1_ps(threshold);
    for (int64_t n0 = 0; n0 < vocab; n0 += 8) {
        const int64_t left = vocab - n0;
        const unsigned valid = left >= 8 ? 0xFFu : (1u << left) - 1;
        const __m256 bound = _mm256_fmadd_ps(
            vhn, _mm256_loadu_ps(wen + n0), _mm256_mul_ps(vhen, _mm256_loadu_ps(wqn + n0)));
        const __m256 upper = _mm256_add_ps(_mm256_loadu_ps(a + n0), bound);
        unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(upper, t, _CMP_GE_OQ)) & valid;
        for (; mask; mask &= mask - 1) rescore_candidate(s, n0 + __builtin_ctz(mask));
    }
}
#pragma GCC pop_options
#define SCREEN_HAVE_X86 1
#else
#define SCREEN_HAVE_X86 0
#endif

/* tokens[r] = the argmax over n < vocab of the head's fp32 logit W[n] . h[r] (ties: the
 * lowest n), for rows [0, rows) of h (row stride ld, width k_padded: the hidden size k
 * rounded up to 32, zeros past k). The screen's packed head: wq / wd / wen / wqn / pad;
 * the exact head for the rescore: w (vocab rows of row_bytes in the storage `type` of
 * quant_kernels.c, QTYPE_F32 for fp32), with per-row scales for int8 (else NULL).
 * counts[r] (if not NULL) = row r's candidates. Returns 0; -1 when h holds a value that is
 * not finite, -2 when this CPU or the forced ISA has no screen, -3 when a buffer cannot be
 * allocated: the caller then takes the fp32 logits. */
int greedy_screen_argmax(int64_t *tokens, int32_t *counts, const float *h, int64_t ld,
                         int64_t rows, int64_t k_padded, int64_t k, const uint8_t *wq,
                         const float *wd, const float *wen, const float *wqn, const float *pad,
                         const uint8_t *w, int64_t row_bytes, const float *scales, int type,
                         int64_t vocab, int num_threads) {
    if (rows <= 0) return 0;
    const int isa = screen_isa();
    if (isa == ISA_PORTABLE) return -2;
#if SCREEN_HAVE_X86
    if (num_threads < 1) num_threads = 1;
    const int vnni = isa == ISA_AVX512;
    const int64_t nb = k_padded / SCREEN_KB, groups = (vocab + SCREEN_NR - 1) / SCREEN_NR;
    const int64_t a_ld = groups * SCREEN_NR;
    int8_t *hq = aligned_alloc(64, (size_t)((rows * k_padded + 63) / 64 * 64));
    float *hs = malloc(sizeof(float) * (size_t)(rows * nb));
    int32_t *negcorr = malloc(sizeof(int32_t) * (size_t)(rows * nb));
    float *hn = malloc(sizeof(float) * (size_t)rows);
    float *hen = malloc(sizeof(float) * (size_t)rows);
    float *a = malloc(sizeof(float) * (size_t)(rows * a_ld));
    float *tmax = malloc(sizeof(float) * (size_t)(num_threads * rows * SCREEN_NR));
    float *row_bufs = aligned_alloc(64, sizeof(float) * (size_t)(num_threads * row_floats(k)));
    int status = hq && hs && negcorr && hn && hen && a && tmax && row_bufs ? 0 : -3;
    if (status == 0) {
        for (int64_t i = 0; i < num_threads * rows * SCREEN_NR; ++i) tmax[i] = -INFINITY;
        int bad = 0;
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t threads = omp_threads(), id = omp_id();
            float *mine = tmax + id * rows * SCREEN_NR;
            float *row = row_bufs + id * row_floats(k);
#pragma omp for schedule(static) reduction(| : bad)
            for (int64_t r = 0; r < rows; ++r)
                bad |= prepare_row(hq, hs, negcorr, hn, hen, h, ld, r, k_padded, vnni ? 127 : 63);
            if (!bad) {
#pragma omp for schedule(dynamic, 8)
                for (int64_t g = 0; g < groups; ++g)
                    (vnni ? scores_group_avx512 : scores_group_avx2)(
                        a + g * SCREEN_NR, a_ld, mine, hq, hs, negcorr, hn, hen, rows, k_padded,
                        wq + g * nb * SCREEN_KB * SCREEN_NR, wd + g * nb * SCREEN_NR,
                        wen + g * SCREEN_NR, wqn + g * SCREEN_NR, pad + g * SCREEN_NR);
#pragma omp for schedule(dynamic, 1)
                for (int64_t r = 0; r < rows; ++r) {
                    float threshold = -INFINITY;
                    for (int64_t t = 0; t < threads; ++t)
                        for (int j = 0; j < SCREEN_NR; ++j) {
                            const float v = tmax[(t * rows + r) * SCREEN_NR + j];
                            threshold = v > threshold ? v : threshold;
                        }
                    rescore_t state = {h + r * ld, w, row_bytes, k, scales, type, row, -1, 0, 0.0f};
                    (vnni ? rescore_avx512 : rescore_avx2)(&state, a + r * a_ld, hn[r], hen[r],
                                                           threshold, wen, wqn, vocab);
                    tokens[r] = state.best;
                    if (counts != NULL) counts[r] = (int32_t)state.count;
                }
            }
        }
        if (bad) status = -1;
    }
    free(row_bufs);
    free(hq);
    free(hs);
    free(negcorr);
    free(hn);
    free(hen);
    free(a);
    free(tmax);
    return status;
#else
    (void)tokens, (void)counts, (void)h, (void)ld, (void)k_padded, (void)k, (void)wq, (void)wd;
    (void)wen, (void)wqn, (void)pad, (void)w, (void)row_bytes, (void)scales, (void)type;
    (void)vocab, (void)num_threads;
    return -2;
#endif
}
