/*
 * The kernels cpu_kernels.c exports that other translation units of the same library call
 * (decode_step_kernels.c chains them into one decode step). One declaration each: the
 * defining file includes this header too, so the compiler checks that each definition
 * matches what its callers were told. Python reaches the same functions through ctypes
 * (engine/native/build.py's _SIGNATURES).
 */
#ifndef PAGEDSERVE_CPU_KERNELS_H
#define PAGEDSERVE_CPU_KERNELS_H

#include <stdint.h>

void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride,
                  const float *residual, const float *weight, int64_t rows, int64_t cols,
                  float eps, int num_threads);
void rotary_inplace_f32(float *x, int64_t x_stride, const float *cos, const float *sin,
                        int64_t rows, int64_t num_heads, int64_t head_dim, int num_threads);
void write_kv_f32(void *key_cache, void *value_cache, const float *key, const float *value,
                  int64_t kv_stride, const int64_t *slot_mapping, int64_t rows, int64_t row,
                  int64_t kv_dtype);
void silu_and_mul_f32(float *out, const float *x, int64_t x_stride, int64_t rows, int64_t inter,
                      int num_threads);
void paged_decode_attention_team_f32(float *out, const float *query, int64_t query_stride,
                                     float *scores, const void *key_cache,
                                     const void *value_cache, const int32_t *block_tables,
                                     int64_t block_table_stride, const int32_t *seq_lens,
                                     int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, int64_t max_len,
                                     int64_t window, float scale, float cap,
                                     const float *sinks, int64_t threads, float *partials,
                                     int64_t kv_dtype);

#endif /* PAGEDSERVE_CPU_KERNELS_H */
