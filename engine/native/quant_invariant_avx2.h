/*
 * The batch-invariant row body for the 32-value block types (Q8_0, Q4_0, Q4_1) and int8
 * rows on x86, included by quant_kernels.c after quant_fused_avx2.h (EngineArgs
 * `batch_invariant`, docs/determinism.md).
 *
 * linear_rows_fused_avx2 picks its reduction by the number of activation rows (one row:
 * the factored loop; two: four accumulators per row; more: two per row), so a row's sums
 * round differently in a batch than alone. Here every activation row goes through
 * fused_rows, whose accumulation for row j (two accumulators, the same FMAs in the same
 * order) does not depend on how many rows share the call: the rows are taken four at a
 * time only so that each dequantized block serves several of them. The AVX2 body runs on
 * AVX-512 CPUs too, so a row's bits are the same on both kinds of machine.
 */

AVX2_TARGET static inline __attribute__((always_inline)) void invariant_avx2_body(
    float *restrict out, int64_t out_stride, const float *restrict x, int64_t x_stride,
    int64_t rows, const uint8_t *restrict w, int64_t row_bytes, const float *restrict scales,
    int type, int64_t n0, int64_t n1, int64_t k) {
    const int64_t nb = k / 32, bb = type == QTYPE_INT8 ? 32 : block_bytes(type);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        const float s = scales ? scales[n] : 1.0f;
        float y[4];
        for (int64_t r = 0; r < rows; r += 4) {
            const float *xr = x + r * x_stride;
            const int64_t nr = rows - r < 4 ? rows - r : 4;
            switch (nr) { /* a literal per call: each count its own loop */
            case 1: fused_rows(row, type, nb, bb, xr, x_stride, 1, y); break;
            case 2: fused_rows(row, type, nb, bb, xr, x_stride, 2, y); break;
            case 3: fused_rows(row, type, nb, bb, xr, x_stride, 3, y); break;
            default: fused_rows(row, type, nb, bb, xr, x_stride, 4, y); break;
            }
            for (int64_t j = 0; j < nr; ++j) out[(r + j) * out_stride + n] = s * y[j];
        }
    }
}

/* Same contract as linear_rows_fused_avx2 (and the types fused_avx2_applies admits). */
AVX2_TARGET static void linear_rows_invariant_avx2(float *restrict out, int64_t out_stride,
                                                   const float *restrict x, int64_t x_stride,
                                                   int64_t rows, const uint8_t *restrict w,
                                                   int64_t row_bytes, const float *restrict scales,
                                                   int type, int64_t n0, int64_t n1, int64_t k,
                                                   float *restrict unused) {
    (void)unused;
    DISPATCH_FUSED_TYPE(
        invariant_avx2_body(out, out_stride, x, x_stride, rows, w, row_bytes, scales, T, n0, n1, k),
        type)
}
