/*
 * One ISA's copy of the quantized row primitives, included by quant_kernels.c once per
 * instruction set under `#pragma GCC target(...)` with ISA(name) naming the copy
 * (name_portable, name_avx2, name_avx512). The loops are written so the compiler
 * vectorises them for the target in force: the same source is three real code paths.
 *
 * Block layouts (ggml's, all little-endian, fp16 scales):
 *   Q8_0  34 B / 32 values:  d, qs[32] int8                      w = d * q
 *   Q4_0  18 B / 32 values:  d, qs[16] (lo nibbles: 0..15,        w = d * (q - 8)
 *                                       hi nibbles: 16..31)
 *   Q4_1  20 B / 32 values:  d, m, qs[16] (as Q4_0)              w = d * q + m
 *   Q4_K 144 B / 256 values: d, dmin, scales[12] (8 6-bit scale/min pairs), qs[128]
 *   Q6_K 210 B / 256 values: ql[128], qh[64], scales[16] int8, d
 *   INT8 K B / row: int8 per value, one fp32 scale per row applied after the dot product.
 *   F32  4K B / row: plain fp32 (read in place, never copied).
 */

/* Dequantizes one 32-value block of Q8_0 / Q4_0 / Q4_1 into out[32]. */
static inline void ISA(dequant_block32)(int type, const uint8_t *restrict b, float *restrict out) {
    const float d = half_to_float(load_u16(b));
    if (type == QTYPE_Q8_0) {
        const int8_t *qs = (const int8_t *)(b + 2);
#pragma omp simd
        for (int j = 0; j < 32; ++j) out[j] = d * (float)qs[j];
    } else if (type == QTYPE_Q4_0) {
        const uint8_t *qs = b + 2;
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)((int)(qs[j] & 15) - 8);
            out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
    } else { /* QTYPE_Q4_1 */
        const float m = half_to_float(load_u16(b + 2));
        const uint8_t *qs = b + 4;
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)(qs[j] & 15) + m;
            out[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    }
}

/* Dequantizes one 256-value Q4_K super-block into out[256]. */
static inline void ISA(dequant_q4_k)(const uint8_t *restrict b, float *restrict out) {
    const float d = half_to_float(load_u16(b));
    const float dmin = half_to_float(load_u16(b + 2));
    const uint8_t *scales = b + 4;
    const uint8_t *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
#pragma omp simd
        for (int l = 0; l < 32; ++l) {
            out[j + l] = d1 * (float)(q[l] & 15) - m1;
            out[j + 32 + l] = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

/* Dequantizes one 256-value Q6_K super-block into out[256]. */
static inline void ISA(dequant_q6_k)(const uint8_t *restrict b, float *restrict out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_to_float(load_u16(b + 208));
    for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
        /* values l in [16h, 16h + 16) of each quarter share one scale: constant per loop,
         * so the loop vectorises without gathering scales */
        for (int h = 0; h < 2; ++h) {
            const float s1 = d * (float)sc[h], s2 = d * (float)sc[h + 2];
            const float s3 = d * (float)sc[h + 4], s4 = d * (float)sc[h + 6];
#pragma omp simd
            for (int l = 16 * h; l < 16 * h + 16; ++l) {
                const int q1 = (int)((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[n + l] = s1 * (float)q1;
                out[n + l + 32] = s2 * (float)q2;
                out[n + l + 64] = s3 * (float)q3;
                out[n + l + 96] = s4 * (float)q4;
            }
        }
    }
}

/* Dequantizes one weight row of `k` values (k a multiple of the block size) into out[k]. */
static void ISA(dequant_row)(int type, const uint8_t *restrict row, int64_t k,
                             float *restrict out) {
    switch (type) {
    case QTYPE_Q8_0:
    case QTYPE_Q4_0:
    case QTYPE_Q4_1: {
        const int64_t bytes = block_bytes(type);
        for (int64_t i = 0; i < k / 32; ++i) ISA(dequant_block32)(type, row + i * bytes, out + 32 * i);
        break;
    }
    case QTYPE_Q4_K:
        for (int64_t i = 0; i < k / 256; ++i) ISA(dequant_q4_k)(row + 144 * i, out + 256 * i);
        break;
    case QTYPE_Q6_K:
        for (int64_t i = 0; i < k / 256; ++i) ISA(dequant_q6_k)(row + 210 * i, out + 256 * i);
        break;
    case QTYPE_F32:
        memcpy(out, row, (size_t)k * sizeof(float));
        break;
    default: { /* QTYPE_INT8 */
        const int8_t *q = (const int8_t *)row;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) out[i] = (float)q[i];
    }
    }
}

/* a . b over n floats, partial sums in QLANES independent lanes (one or two registers). */
static float ISA(dot)(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[QLANES] = {0.0f};
    int64_t i = 0;
    for (; i + QLANES <= n; i += QLANES) {
#pragma omp simd
        for (int l = 0; l < QLANES; ++l) acc[l] += a[i + l] * b[i + l];
    }
    float sum = 0.0f;
    for (int l = 0; l < QLANES; ++l) sum += acc[l];
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* fp32 weight rows, QLANES / 2 floats per vector (one ymm on AVX2, one zmm on AVX-512). */
typedef float ISA(vec) __attribute__((vector_size(QLANES / 2 * sizeof(float))));
#define VW (QLANES / 2)

static inline ISA(vec) ISA(vload)(const float *p) {
    ISA(vec) v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float ISA(vsum)(ISA(vec) v) {
    float s = 0.0f;
    for (int l = 0; l < VW; ++l) s += v[l];
    return s;
}

/* Four fp32 weight rows (w0 + j * ws) against NR (1..4) activation rows: 4 x NR vector
 * accumulators; each weight vector loaded once serves every row. NR is a literal. */
static inline __attribute__((always_inline)) void ISA(f32_tile)(
    float *restrict out, int64_t out_stride, const float *restrict x, int64_t x_stride,
    const float *restrict w0, int64_t ws, int64_t k, const int nr) {
    ISA(vec) acc[4][4];
    for (int j = 0; j < 4; ++j)
        for (int r = 0; r < nr; ++r) acc[j][r] = (ISA(vec)){0};
    int64_t i = 0;
    for (; i + VW <= k; i += VW) {
        ISA(vec) xv[4];
        for (int r = 0; r < nr; ++r) xv[r] = ISA(vload)(x + r * x_stride + i);
        for (int j = 0; j < 4; ++j) {
            const ISA(vec) v = ISA(vload)(w0 + j * ws + i);
            for (int r = 0; r < nr; ++r) acc[j][r] += v * xv[r];
        }
    }
    for (int j = 0; j < 4; ++j)
        for (int r = 0; r < nr; ++r) {
            float sum = ISA(vsum)(acc[j][r]);
            for (int64_t t = i; t < k; ++t) sum += w0[j * ws + t] * x[r * x_stride + t];
            out[r * out_stride + j] = sum;
        }
}

/* Activation rows per tile: 16 accumulators fit AVX-512's 32 registers, AVX2 takes 8. */
#define F32_TILE_ROWS (QLANES == 32 ? 4 : 2)

/* out[r, n] = W[n] . x[r] for fp32 rows n in [n0, n1): tiles of four weight rows (L1-resident
 * while every activation row goes past them, F32_TILE_ROWS at a time), then the rest. */
static void ISA(linear_rows_f32)(float *restrict out, int64_t out_stride,
                                 const float *restrict x, int64_t x_stride, int64_t rows,
                                 const uint8_t *restrict w, int64_t row_bytes, int64_t n0,
                                 int64_t n1, int64_t k) {
    const int64_t ws = row_bytes / (int64_t)sizeof(float);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const float *w0 = (const float *)(w + n * row_bytes);
        for (int64_t r = 0; r < rows;) {
            float *o = out + r * out_stride + n;
            const float *xr = x + r * x_stride;
            const int64_t left = rows - r;
            if (F32_TILE_ROWS == 4 && left >= 4) {
                ISA(f32_tile)(o, out_stride, xr, x_stride, w0, ws, k, 4);
                r += 4;
            } else if (F32_TILE_ROWS == 4 && left == 3) {
                ISA(f32_tile)(o, out_stride, xr, x_stride, w0, ws, k, 3);
                r += 3;
            } else if (left >= 2) {
                ISA(f32_tile)(o, out_stride, xr, x_stride, w0, ws, k, 2);
                r += 2;
            } else {
                ISA(f32_tile)(o, out_stride, xr, x_stride, w0, ws, k, 1);
                r += 1;
            }
        }
    }
    for (; n < n1; ++n) {
        const float *wrow = (const float *)(w + n * row_bytes);
        for (int64_t r = 0; r < rows; ++r) out[r * out_stride + n] = ISA(dot)(wrow, x + r * x_stride, k);
    }
}
#undef F32_TILE_ROWS
#undef VW

/* out[r, n] = scale[n] * (W[n] . x[r]) for output rows [n0, n1) and every activation row,
 * W[n] dequantized once into `wbuf` (k floats, L1-resident) and reused across the rows. */
static void ISA(linear_rows)(float *restrict out, int64_t out_stride, const float *restrict x,
                             int64_t x_stride, int64_t rows, const uint8_t *restrict w,
                             int64_t row_bytes, const float *restrict scales, int type,
                             int64_t n0, int64_t n1, int64_t k, float *restrict wbuf) {
    if (type == QTYPE_F32) { /* read in place, no scales */
        ISA(linear_rows_f32)(out, out_stride, x, x_stride, rows, w, row_bytes, n0, n1, k);
        return;
    }
    for (int64_t n = n0; n < n1; ++n) {
        ISA(dequant_row)(type, w + n * row_bytes, k, wbuf);
        const float s = scales ? scales[n] : 1.0f;
        for (int64_t r = 0; r < rows; ++r) out[r * out_stride + n] = s * ISA(dot)(wbuf, x + r * x_stride, k);
    }
}
