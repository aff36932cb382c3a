/*
 * Dequantize-GEMM: weights in the storage types of quant_kernels.c (fp32 rows included)
 * against many activation rows (decode steps above GEMV_MAX_ROWS rows, prefill chunks).
 * Same contract as quant_linear_f32: out[r, n] = scale[n] * W[n] . x[r] in fp32, the result
 * of dequantize-then-matmul up to summation order.
 *
 * The weight is never dequantized whole: each thread takes panels of NR output rows and,
 * one KC-value k-block at a time, dequantizes the panel's block into an L1-resident buffer
 * and multiplies it into every activation row's sums before the next block. The textbook
 * GEMM roles are swapped so that the dequantized rows need no transpose: the vectors run
 * along the activation rows, and the weight values are broadcast.
 *
 *   block  (per thread)  block[j][kk]   = W[n0 + j, k0 + kk]          j < NR, kk < KC
 *   xpack  (shared)      xpack[t][k][i] = x[m0 + MT * t + i, k]       i < MT, 0 past rows
 *   cbuf   (per thread)  the panel's sums for every tile of the chunk, kept across
 *                        k-blocks and stored (transposed, scaled) after the last one
 *
 *   micro-kernel         acc[j][i] += block[j][kk] * xpack[t][k0 + kk][i]
 *
 * One vector load of packed activations serves NR outputs; block[j][kk] is a broadcast at
 * a constant offset from one pointer. A tile is 16 rows x 16 outputs: 16 zmm accumulators
 * on AVX-512 (measured at the FMA peak, as fast as two tiles x 12 outputs, and its stores
 * write whole 64-byte lines of the output), three passes of 6 / 6 / 4 outputs x 2 ymm on
 * AVX2, the same loops on arrays in portable C (quant_gemm_x86.h holds the x86 parts).
 * The activation rows go in chunks of at most CHUNK_BYTES of packed fp32 (about L2), each
 * chunk dequantizing the weight again: at 2 * chunk-rows flops per weight value that is a
 * few percent. Up to SPLIT_ROWS rows per thread the threads share a chunk and split the
 * panels (and the tiles too when there are too few panels); from there on each thread
 * packs its own slices of rows and takes them past every panel (no waiting on each other).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_types.h"

#define NR 16  /* outputs per panel: a 64-byte line of each output row */
#define KC 256 /* k-block: a Q4_K / Q6_K super-block, 8 Q8_0 / Q4_x blocks */
#define MT 16  /* activation rows per packed tile */
#define CHUNK_BYTES (1024 * 1024)
#define SPLIT_ROWS 256 /* rows per thread from which threads split the rows, not the panels */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- portable C ---------------------------------------------------------------------- */

static void pack_tile_portable(float *restrict dst, const float *restrict x, int64_t x_stride,
                               int64_t m, int64_t k) {
    for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t i = 0; i < MT; ++i) dst[kk * MT + i] = i < m ? x[i * x_stride + kk] : 0.0f;
}

/* c[j * MT + i] (+)= block row j . tile row i over `len` values: every kernel's contract. */
static void kernel_portable(float *restrict c, const float *restrict tile,
                            const float *restrict block, int64_t len, int accumulate) {
    float a[NR][MT];
    for (int j = 0; j < NR; ++j)
        for (int i = 0; i < MT; ++i) a[j][i] = accumulate ? c[j * MT + i] : 0.0f;
    for (int64_t kk = 0; kk < len; ++kk)
        for (int j = 0; j < NR; ++j) {
            const float wv = block[j * KC + kk];
            for (int i = 0; i < MT; ++i) a[j][i] += wv * tile[kk * MT + i];
        }
    memcpy(c, a, sizeof a);
}

/* out[i, j] = scale[j] * c[j * MT + i] for i < m, j < n. */
static void store_tile_portable(float *restrict out, int64_t out_stride, const float *restrict c,
                                int64_t m, int64_t n, const float *restrict scales) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j)
            out[i * out_stride + j] = (scales ? scales[j] : 1.0f) * c[j * MT + i];
}

#if defined(__x86_64__) && defined(__GNUC__)
#define GEMM_HAVE_X86 1
#include "quant_gemm_x86.h"
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
    else if (isa == ISA_AVX2 && (type == QTYPE_Q8_0 || type == QTYPE_Q4_0 ||
                                 type == QTYPE_Q4_1 || type == QTYPE_INT8))
        fill_block32_avx2(block, w, row_bytes, type, n0, n0 + valid, k0, len);
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

/* Output rows [n0, n0 + NR) ∩ [.., n1) for packed tiles [t0, t1) of a chunk of m rows whose
 * output starts at `out`: per k-block, one dequantized block (L1-resident) goes past every
 * tile, whose sums wait in `cbuf` (NR * MT floats per tile) until the last k-block. */
static void panel_times_tiles(int isa, float *out, int64_t out_stride, const float *xpack,
                              int64_t k, int64_t m, int64_t t0, int64_t t1, const uint8_t *w,
                              int64_t row_bytes, int type, int64_t n0, int64_t n1,
                              const float *scales, float *block, float *cbuf) {
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t len = min64(KC, k - k0);
        const int accumulate = k0 > 0;
        fill_block(isa, block, w, row_bytes, type, n0, n1, k0, len);
        for (int64_t t = t0; t < t1; ++t) {
            const float *tile = xpack + t * k * MT + k0 * MT;
            float *c = cbuf + (t - t0) * NR * MT;
#if GEMM_HAVE_X86
            if (isa == ISA_AVX512)
                kernel_avx512(c, tile, block, len, accumulate);
            else if (isa == ISA_AVX2)
                kernel_avx2(c, tile, block, len, accumulate);
            else
#endif
                kernel_portable(c, tile, block, len, accumulate);
        }
    }
    const int64_t n = min64(NR, n1 - n0);
    const float *s = scales ? scales + n0 : NULL;
    for (int64_t t = t0; t < t1; ++t) {
        float *o = out + t * MT * out_stride + n0;
        const float *c = cbuf + (t - t0) * NR * MT;
        const int64_t rows = min64(MT, m - t * MT);
#if GEMM_HAVE_X86
        if (isa == ISA_AVX512) {
            store_tile_avx512(o, out_stride, c, rows, n, s);
            continue;
        }
#endif
        store_tile_portable(o, out_stride, c, rows, n, s);
    }
}

/* Long inputs: each work item is a slice of rows that one thread packs into its own buffer
 * and takes past every panel. Threads never wait on each other until the end, and each
 * dequantizes the whole weight once per slice (a slice has >= SPLIT_ROWS / 2 rows, so the
 * fill stays a few percent of the flops). */
static void gemm_row_slices(int isa, float *out, int64_t out_stride, const float *x,
                            int64_t x_stride, int64_t rows, const uint8_t *w, int64_t row_bytes,
                            const float *scales, int type, int64_t n_out, int64_t k,
                            int64_t chunk, float *xpack, float *scratch, size_t thread_floats,
                            int num_threads) {
    const int64_t panels = (n_out + NR - 1) / NR, tiles = (rows + MT - 1) / MT;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_threads(), id = omp_id();
        float *block = scratch + (size_t)id * thread_floats, *cbuf = block + NR * KC;
        float *mine = xpack + (size_t)(id * chunk * k);
        /* A multiple of the thread count of near-equal slices of at most `chunk` rows. */
        const int64_t per = (tiles + threads * (chunk / MT) - 1) / (threads * (chunk / MT));
        const int64_t slices = threads * per;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < slices; ++i) {
            const int64_t t0 = tiles * i / slices, t1 = tiles * (i + 1) / slices;
            const int64_t m0 = t0 * MT, m = min64(t1 * MT, rows) - m0;
            for (int64_t t = 0; t < t1 - t0; ++t)
                pack_tile(isa, mine + t * k * MT, x + (m0 + t * MT) * x_stride, x_stride,
                          min64(MT, m - t * MT), k);
            for (int64_t p = 0; p < panels && m > 0; ++p)
                panel_times_tiles(isa, out + m0 * out_stride, out_stride, mine, k, m, 0, t1 - t0,
                                  w, row_bytes, type, p * NR, n_out, scales, block, cbuf);
        }
    }
}

/* Shorter inputs: the rows packed once per chunk (shared), the panels split over threads,
 * and their tiles too when there are too few panels to keep the threads busy. */
static void gemm_panels(int isa, float *out, int64_t out_stride, const float *x,
                        int64_t x_stride, int64_t rows, const uint8_t *w, int64_t row_bytes,
                        const float *scales, int type, int64_t n_out, int64_t k, int64_t chunk,
                        float *xpack, float *scratch, size_t thread_floats, int num_threads) {
    const int64_t panels = (n_out + NR - 1) / NR;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_threads(), id = omp_id();
        float *block = scratch + (size_t)id * thread_floats, *cbuf = block + NR * KC;
        for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
            const int64_t m = min64(chunk, rows - m0), tiles = (m + MT - 1) / MT;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tiles; ++t)
                pack_tile(isa, xpack + t * k * MT, x + (m0 + t * MT) * x_stride, x_stride,
                          min64(MT, m - t * MT), k);
            int64_t groups = 1; /* row-tile groups per panel */
            if (panels < 4 * threads) groups = min64(tiles, (4 * threads + panels - 1) / panels);
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < panels * groups; ++item) {
                const int64_t p = item / groups, g = item % groups;
                const int64_t t0 = tiles * g / groups, t1 = tiles * (g + 1) / groups;
                if (t0 < t1)
                    panel_times_tiles(isa, out + m0 * out_stride, out_stride, xpack, k, m, t0, t1,
                                      w, row_bytes, type, p * NR, n_out, scales, block, cbuf);
            }
        }
    }
}

/* out[r, n] = scales[n] (or 1) * W[n] . x[r]: see the file comment. Returns 0, or -1 when a
 * buffer cannot be allocated. Both schedules are dynamic: on a shared machine a thread that
 * loses its core for a while holds up only its current item, not a fixed share. */
int quant_gemm_f32(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                   int64_t rows, const uint8_t *w, int64_t row_bytes, const float *scales,
                   int type, int64_t n_out, int64_t k, int num_threads) {
    if (rows <= 0 || n_out <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const int isa = quant_active_isa();
    /* Rows per chunk: a multiple of MT whose packed copy fits CHUNK_BYTES. */
    int64_t chunk = CHUNK_BYTES / (int64_t)(k * sizeof(float)) / MT * MT;
    if (chunk < MT) chunk = MT;
    chunk = min64(chunk, (rows + MT - 1) / MT * MT);
    const int split_rows = rows >= SPLIT_ROWS * num_threads;
    /* per thread: one dequantized block, then the sums of every tile of a chunk */
    const size_t thread_floats = (size_t)(NR * KC + chunk * NR);
    const size_t pack_floats = (size_t)(chunk * k) * (split_rows ? (size_t)num_threads : 1);
    float *xpack = aligned_alloc(64, pack_floats * sizeof(float));
    float *scratch = aligned_alloc(64, thread_floats * sizeof(float) * (size_t)num_threads);
    if (xpack != NULL && scratch != NULL)
        (split_rows ? gemm_row_slices : gemm_panels)(isa, out, out_stride, x, x_stride, rows, w,
                                                     row_bytes, scales, type, n_out, k, chunk,
                                                     xpack, scratch, thread_floats, num_threads);
    const int failed = xpack == NULL || scratch == NULL;
    free(xpack);
    free(scratch);
    return failed ? -1 : 0;
}
