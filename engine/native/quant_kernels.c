/*
 * Linear layers on weights kept quantized: GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q6_K blocks exactly
 * as the file stores them, and per-output-channel int8 (weight-only, symmetric). Activations
 * and accumulation are fp32, so the result is that of the dequantized fp32 weight up to
 * summation order.
 *
 *   quant_linear_f32:     out[r, n] = W[n] . x[r]   (W row n dequantized once per call into
 *                         an L1-resident buffer and reused for every activation row r)
 *   quant_dequantize_f32: W[n0:n1] as fp32 (tests, the embedding lookup)
 *   quant_dequantize_block: part of W as fp32, unscaled (quant_gemm.c's weight panels)
 *
 * Why a per-row buffer and not a GEMM tile: decode steps have 1 to GEMV_MAX_ROWS (16)
 * activation rows, so the weight bytes read are the cost; more rows go through the GEMM
 * of quant_gemm.c instead.
 *
 * Three code paths are compiled from one source (quant_rows.h, included once per target):
 * portable C, AVX2+FMA and AVX-512; on both x86 paths the 32-value block types and int8
 * go through hand-written fused kernels instead (quant_fused_avx2.h, quant_fused_avx512.h).
 * The path is chosen at load time with __builtin_cpu_supports and can be forced
 * (quant_set_isa) so tests compare them.
 * Parallel over output rows with OpenMP, like the kernels in cpu_kernels.c.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_fp16.h" /* load_u16, half_to_float: the blocks' fp16 fields */
#include "quant_types.h"

#define QLANES 16
#define ISA(name) name##_portable
#include "quant_rows.h"
#undef ISA

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QUANT_HAVE_X86_PATHS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ISA(name) name##_avx2
#include "quant_rows.h"
#undef ISA
#pragma GCC pop_options

#undef QLANES
#define QLANES 32
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")
#define ISA(name) name##_avx512
#include "quant_rows.h"
#undef ISA
#pragma GCC pop_options
#include "quant_fused_avx2.h"
#include "quant_fused_avx512.h"
#include "quant_invariant_avx2.h"
#else
#define QUANT_HAVE_X86_PATHS 0
#endif

typedef void (*linear_rows_fn)(float *, int64_t, const float *, int64_t, int64_t,
                               const uint8_t *, int64_t, const float *, int, int64_t, int64_t,
                               int64_t, float *);
typedef void (*dequant_row_fn)(int, const uint8_t *, int64_t, float *);

static int forced_isa = -1;

/* Whether this CPU (and this build) can run `isa`. */
int quant_isa_supported(int isa) {
    if (isa == ISA_PORTABLE) return 1;
#if QUANT_HAVE_X86_PATHS
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
#endif
    return 0;
}

/* The path in use: the forced one, else the widest this CPU runs. */
int quant_active_isa(void) {
    if (forced_isa >= 0) return forced_isa;
    if (quant_isa_supported(ISA_AVX512)) return ISA_AVX512;
    if (quant_isa_supported(ISA_AVX2)) return ISA_AVX2;
    return ISA_PORTABLE;
}

/* Forces a path (-1: automatic again); returns 0, or -1 when this CPU cannot run it. */
int quant_set_isa(int isa) {
    if (isa >= 0 && !quant_isa_supported(isa)) return -1;
    forced_isa = isa;
    return 0;
}

static linear_rows_fn pick_linear(int type, int64_t k) {
#if QUANT_HAVE_X86_PATHS
    const int isa = quant_active_isa();
    if (isa != ISA_PORTABLE && fused_avx2_applies(type, k))
        return isa == ISA_AVX512 ? linear_rows_fused_avx512 : linear_rows_fused_avx2;
    switch (isa) {
    case ISA_AVX512: return linear_rows_avx512;
    case ISA_AVX2: return linear_rows_avx2;
    }
#endif
    return linear_rows_portable;
}

static dequant_row_fn pick_dequant(void) {
#if QUANT_HAVE_X86_PATHS
    switch (quant_active_isa()) {
    case ISA_AVX512: return dequant_row_avx512;
    case ISA_AVX2: return dequant_row_avx2;
    }
#endif
    return dequant_row_portable;
}

/* out[r, n] = scales[n] (or 1) * W[n] . x[r] for r < rows, n < n_out; W is n_out rows of
 * row_bytes bytes holding k values each. Returns 0, or -1 when a buffer cannot be allocated. */
int quant_linear_f32(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                     int64_t rows, const uint8_t *w, int64_t row_bytes, const float *scales,
                     int type, int64_t n_out, int64_t k, int num_threads) {
    const linear_rows_fn fn = pick_linear(type, k);
    const size_t buf_bytes = (size_t)((k * 4 + 63) / 64 * 64);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *wbuf = aligned_alloc(64, buf_bytes);
        if (wbuf == NULL) failed = 1;
        /* Contiguous chunks of output rows per thread: each streams its own weight bytes. */
        const int64_t threads = omp_threads(), id = omp_id();
        const int64_t per = (n_out + threads - 1) / threads;
        const int64_t n0 = id * per < n_out ? id * per : n_out;
        const int64_t n1 = n0 + per < n_out ? n0 + per : n_out;
        if (wbuf != NULL) fn(out, out_stride, x, x_stride, rows, w, row_bytes, scales, type, n0, n1, k, wbuf);
        free(wbuf);
    }
    return failed ? -1 : 0;
}

/* Batch-invariant linear (EngineArgs `batch_invariant`): the same contract as
 * quant_linear_f32, but out[r, n] is computed the same way whatever `rows` is and wherever
 * row r sits: one reduction per (r, n) over k in a fixed order (quant_invariant_avx2.h for
 * the fused block types, the plain row kernels of quant_rows.h otherwise, whose per-row
 * sums never depend on the row count), threads split over output rows only (never over k),
 * and the rows walked in tiles of INVARIANT_ROW_TILE so a long prefill's activations stay
 * in cache (the tiling changes which rows share a pass, not any row's sums). */
#define INVARIANT_ROW_TILE 64

static linear_rows_fn pick_invariant(int type, int64_t k) {
#if QUANT_HAVE_X86_PATHS
    const int isa = quant_active_isa();
    if (isa != ISA_PORTABLE && fused_avx2_applies(type, k)) return linear_rows_invariant_avx2;
    switch (isa) {
    case ISA_AVX512: return linear_rows_avx512;
    case ISA_AVX2: return linear_rows_avx2;
    }
#endif
    (void)type;
    (void)k;
    return linear_rows_portable;
}

int quant_linear_invariant_f32(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                               int64_t rows, const uint8_t *w, int64_t row_bytes,
                               const float *scales, int type, int64_t n_out, int64_t k,
                               int num_threads) {
    const linear_rows_fn fn = pick_invariant(type, k);
    const size_t buf_bytes = (size_t)((k * 4 + 63) / 64 * 64);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *wbuf = aligned_alloc(64, buf_bytes);
        if (wbuf == NULL) failed = 1;
        const int64_t threads = omp_threads(), id = omp_id();
        const int64_t per = (n_out + threads - 1) / threads;
        const int64_t n0 = id * per < n_out ? id * per : n_out;
        const int64_t n1 = n0 + per < n_out ? n0 + per : n_out;
        for (int64_t r0 = 0; wbuf != NULL && n0 < n1 && r0 < rows; r0 += INVARIANT_ROW_TILE) {
            const int64_t tile = rows - r0 < INVARIANT_ROW_TILE ? rows - r0 : INVARIANT_ROW_TILE;
            fn(out + r0 * out_stride, out_stride, x + r0 * x_stride, x_stride, tile, w, row_bytes,
               scales, type, n0, n1, k, wbuf);
        }
        free(wbuf);
    }
    return failed ? -1 : 0;
}

/* quant_linear_f32's work for output rows [n0, n1) only, on the calling thread: for callers
 * that split the rows over their own parallel region (engine/native/decode_step_kernels.c).
 * wbuf: k floats, 64-byte aligned. */
void quant_linear_range(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                        int64_t rows, const uint8_t *w, int64_t row_bytes, const float *scales,
                        int type, int64_t n0, int64_t n1, int64_t k, float *wbuf) {
    if (n0 < n1) pick_linear(type, k)(out, out_stride, x, x_stride, rows, w, row_bytes, scales, type, n0, n1, k, wbuf);
}

/* out[n - n0, :] = dequantized W[n] (times scales[n] for int8) for n0 <= n < n1. */
void quant_dequantize_f32(float *out, const uint8_t *w, int64_t row_bytes, const float *scales,
                          int type, int64_t n0, int64_t n1, int64_t k, int num_threads) {
    const dequant_row_fn fn = pick_dequant();
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = n0; n < n1; ++n) {
        float *row = out + (n - n0) * k;
        fn(type, w + n * row_bytes, k, row);
        if (scales != NULL) {
            const float s = scales[n];
            for (int64_t i = 0; i < k; ++i) row[i] *= s;
        }
    }
}

static inline int64_t block_values(int type) {
    switch (type) {
    case QTYPE_Q8_0:
    case QTYPE_Q4_0:
    case QTYPE_Q4_1: return 32;
    case QTYPE_Q4_K:
    case QTYPE_Q6_K: return 256;
    default: return 1;
    }
}

void quant_dequantize_block(float *out, int64_t ld, const uint8_t *w, int64_t row_bytes,
                            int type, int64_t n0, int64_t n1, int64_t k0, int64_t len) {
    const dequant_row_fn fn = pick_dequant();
    const uint8_t *start = w + k0 / block_values(type) * block_bytes(type);
    for (int64_t n = n0; n < n1; ++n) fn(type, start + n * row_bytes, len, out + (n - n0) * ld);
}
