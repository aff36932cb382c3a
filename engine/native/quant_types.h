/*
 * What quant_kernels.c, quant_gemm.c and decode_step_kernels.c share: the weight storage
 * types, the ISA paths, the OpenMP team helpers (cpu_kernels.c's too, with the attention's
 * split limit) and the quant_kernels.c entry points the GEMM calls.
 */
#ifndef PAGEDSERVE_QUANT_TYPES_H
#define PAGEDSERVE_QUANT_TYPES_H

#include <stdint.h>

/* The calling thread's team size and number (1 and 0 without OpenMP). */
#ifdef _OPENMP
#include <omp.h>
static inline int64_t omp_threads(void) { return omp_get_num_threads(); }
static inline int64_t omp_id(void) { return omp_get_thread_num(); }
#else
static inline int64_t omp_threads(void) { return 1; }
static inline int64_t omp_id(void) { return 0; }
#endif

/* Key ranges a batch-1 decode attention item may be split into
 * (paged_decode_attention_team_f32 in cpu_kernels.c; decode_step_kernels.c sizes the scratch
 * for the partial outputs with it). */
#define ATTENTION_MAX_PARTS 4

/* ggml type ids, plus our own id for per-channel int8. F32 is plain fp32 rows (the weight's
 * own memory): the same row kernels then serve fp32 layers (engine/models/linear_select.py
 * and the batched decode step). */
#define QTYPE_F32 0
#define QTYPE_Q4_0 2
#define QTYPE_Q4_1 3
#define QTYPE_Q8_0 8
#define QTYPE_Q4_K 12
#define QTYPE_Q6_K 14
#define QTYPE_INT8 1024

#define ISA_PORTABLE 0
#define ISA_AVX2 1
#define ISA_AVX512 2

/* Bytes of one block of a ggml type (32 values; 256 for the k-quants; F32: one value). */
static inline int64_t block_bytes(int type) {
    switch (type) {
    case QTYPE_Q8_0: return 34;
    case QTYPE_Q4_0: return 18;
    case QTYPE_Q4_1: return 20;
    case QTYPE_Q4_K: return 144;
    case QTYPE_Q6_K: return 210;
    case QTYPE_F32: return 4;
    default: return 1;
    }
}

/* The j-th 6-bit (scale, min) pair of a Q4_K super-block's 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

int quant_isa_supported(int isa);
int quant_active_isa(void);

/* Values [k0, k0 + len) of weight rows [n0, n1) as fp32, row n at out + (n - n0) * ld,
 * without the int8 row scales; k0 and len are whole blocks of the type. */
void quant_dequantize_block(float *out, int64_t ld, const uint8_t *w, int64_t row_bytes,
                            int type, int64_t n0, int64_t n1, int64_t k0, int64_t len);

/* out[r * out_stride + n] = scales[n] (or 1) * W[n] . x[r] for n in [n0, n1), r < rows, on
 * the calling thread (quant_kernels.c); wbuf: k floats rounded up to 16, 64-byte aligned. */
void quant_linear_range(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                        int64_t rows, const uint8_t *w, int64_t row_bytes, const float *scales,
                        int type, int64_t n0, int64_t n1, int64_t k, float *wbuf);

#endif
