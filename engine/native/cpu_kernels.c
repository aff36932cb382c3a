/*
 * Native fp32 CPU kernels: paged decode attention and the small per-layer elementwise ops.
 *
 * Paged decode attention (one query token per request, read straight from the paged KV
 * cache, no gathered copy of the context) is two passes with a softmax in between (done by
 * torch, whose exp is vectorised):
 *
 *   paged_decode_scores:  scores[r, h, t] = scale * q[r, h] . k[r, t]   (t < seq_len[r];
 *                         -inf for seq_len[r] <= t < max_len)
 *   paged_decode_values:  out[r, h] = sum_t probs[r, h, t] * v[r, t]    (t < seq_len[r])
 *
 * where k[r, t] is the key of request r's token t: row t % block_size of block
 * block_tables[r, t / block_size] in the cache. Layout (engine/attention/backend.py):
 *
 *   cache:         [num_blocks, block_size, num_kv_heads, head_dim]   (keys or values)
 *   query:         [num_reqs, num_heads, head_dim], row stride query_stride
 *   block_tables:  [num_reqs, *] int32, row stride block_table_stride
 *   scores/probs:  [num_reqs, num_heads, max_len], contiguous
 *   out:           [num_reqs, num_heads, head_dim], contiguous
 *
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA/MQA). The inner loops over
 * head_dim are `omp simd` so the compiler vectorises them without -ffast-math (only those
 * reductions are reassociated).
 *
 * The elementwise ops (RMSNorm with the residual add, rotary embedding in place, the KV
 * write) each replace several torch ops: on a decode step's small tensors the per-op cost,
 * not the arithmetic, is what they save.
 *
 * Built and loaded at run time by engine/native/__init__.py, whose wrappers check shapes,
 * dtypes and strides before calling.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* a . b over n floats. With n a multiple of LANES the partial sums live in LANES
 * independent lanes (one vector register), so the chain is n / LANES FMAs long. */
INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    if (n % LANES == 0) {
        float acc[LANES] = {0.0f};
        for (int64_t i = 0; i < n; i += LANES) {
#pragma omp simd
            for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; ++l) sum += acc[l];
        return sum;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

INLINE void axpy(float *restrict y, float alpha, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

/* One request, KV heads [kvh0, kvh1): the scores of their query heads over seq_len keys.
 * Blocks are the outer loop, so a block's rows (all KV heads) are read front to back. */
INLINE void scores_one(float *restrict row, const float *restrict q, const float *key_cache,
                       const int32_t *table, int64_t seq_len, int64_t max_len, int64_t kvh0,
                       int64_t kvh1, int64_t group, int64_t head_dim, int64_t block_size,
                       int64_t token_stride, float scale) {
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const float *block = key_cache + (int64_t)table[start / block_size] * block_size * token_stride;
        const int64_t end = start + block_size < seq_len ? start + block_size : seq_len;
        for (int64_t t = start; t < end; ++t) {
            const float *k = block + (t - start) * token_stride;
            for (int64_t kvh = kvh0; kvh < kvh1; ++kvh)
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t h = kvh * group + g;
                    row[h * max_len + t] = scale * dot(q + h * head_dim, k + kvh * head_dim, head_dim);
                }
        }
    }
    for (int64_t h = kvh0 * group; h < kvh1 * group; ++h)
        for (int64_t t = seq_len; t < max_len; ++t) row[h * max_len + t] = -INFINITY;
}

/* One request, KV heads [kvh0, kvh1): out rows of their query heads = probs . values. */
INLINE void values_one(float *restrict o, const float *restrict p, const float *value_cache,
                       const int32_t *table, int64_t seq_len, int64_t max_len, int64_t kvh0,
                       int64_t kvh1, int64_t group, int64_t head_dim, int64_t block_size,
                       int64_t token_stride) {
    for (int64_t i = kvh0 * group * head_dim; i < kvh1 * group * head_dim; ++i) o[i] = 0.0f;
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const float *block =
            value_cache + (int64_t)table[start / block_size] * block_size * token_stride;
        const int64_t end = start + block_size < seq_len ? start + block_size : seq_len;
        for (int64_t t = start; t < end; ++t) {
            const float *v = block + (t - start) * token_stride;
            for (int64_t kvh = kvh0; kvh < kvh1; ++kvh)
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t h = kvh * group + g;
                    axpy(o + h * head_dim, p[h * max_len + t], v + kvh * head_dim, head_dim);
                }
        }
    }
}

/* The common head sizes get their own copies with head_dim a constant, so the loops above
 * are fully unrolled; other sizes take the generic copy. */
#define DISPATCH_HEAD_DIM(call, head_dim) \
    switch (head_dim) {                   \
        case 64: {                        \
            const int64_t D = 64;         \
            call;                         \
            break;                        \
        }                                 \
        case 128: {                       \
            const int64_t D = 128;        \
            call;                         \
            break;                        \
        }                                 \
        default: {                        \
            const int64_t D = head_dim;   \
            call;                         \
        }                                 \
    }

/* Work items: (request, KV-head chunk). With enough requests to keep every thread busy a
 * chunk is all KV heads (each block is then read as one contiguous run); with few requests
 * (batch-1 decode) it is one KV head, so the heads spread over the threads. */
static int64_t heads_per_item(int64_t num_reqs, int64_t num_kv_heads, int num_threads) {
    return num_reqs >= 4 * (int64_t)num_threads ? num_kv_heads : 1;
}

void paged_decode_scores(float *scores, const float *query, int64_t query_stride,
                         const float *key_cache, const int32_t *block_tables,
                         int64_t block_table_stride, const int32_t *seq_lens, int64_t num_reqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_len, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t chunk = heads_per_item(num_reqs, num_kv_heads, num_threads);
    const int64_t num_chunks = num_kv_heads / chunk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_reqs; ++r) {
        for (int64_t c = 0; c < num_chunks; ++c) {
            float *row = scores + r * num_heads * max_len;
            const float *q = query + r * query_stride;
            const int32_t *table = block_tables + r * block_table_stride;
            DISPATCH_HEAD_DIM(scores_one(row, q, key_cache, table, seq_lens[r], max_len, c * chunk,
                                         (c + 1) * chunk, group, D, block_size, token_stride, scale),
                              head_dim)
        }
    }
}

void paged_decode_values(float *out, const float *probs, const float *value_cache,
                         const int32_t *block_tables, int64_t block_table_stride,
                         const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         int64_t max_len, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t chunk = heads_per_item(num_reqs, num_kv_heads, num_threads);
    const int64_t num_chunks = num_kv_heads / chunk;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_reqs; ++r) {
        for (int64_t c = 0; c < num_chunks; ++c) {
            float *o = out + r * num_heads * head_dim;
            const float *p = probs + r * num_heads * max_len;
            const int32_t *table = block_tables + r * block_table_stride;
            DISPATCH_HEAD_DIM(values_one(o, p, value_cache, table, seq_lens[r], max_len, c * chunk,
                                         (c + 1) * chunk, group, D, block_size, token_stride),
                              head_dim)
        }
    }
}

/* ---- Elementwise ops of a decoder layer, fp32, one pass each ------------------------- */

/* Below this many elements an op runs on one thread (waking the pool costs more). */
#define MIN_PARALLEL_ELEMENTS 65536

/* out = rms_norm(x + residual) * weight and residual_out = x + residual (residual may be
 * NULL: then just rms_norm(x) * weight). Rows of `cols` floats; x rows at x_stride. The
 * statistics are in fp32 as in transformers: x * rsqrt(mean(x^2) + eps), then * weight. */
void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride,
                  const float *residual, const float *weight, int64_t rows, int64_t cols,
                  float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float *o = out + r * cols;
        const float *h = xr;
        if (residual != NULL) {
            float *res = residual_out + r * cols;
            const float *rr = residual + r * cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) res[c] = xr[c] + rr[c];
            h = res;
        }
        float acc[LANES] = {0.0f};
        int64_t c = 0;
        for (; c + LANES <= cols; c += LANES) {
#pragma omp simd
            for (int l = 0; l < LANES; ++l) acc[l] += h[c + l] * h[c + l];
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; ++l) sum += acc[l];
        for (; c < cols; ++c) sum += h[c] * h[c];
        const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
        for (int64_t i = 0; i < cols; ++i) o[i] = weight[i] * (h[i] * inv);
    }
}

/* Neox rotary embedding in place on `num_heads` heads of each row of x (row stride
 * x_stride, heads contiguous): with (x1 | x2) the halves of a head,
 *   x1' = x1 * cos1 + x2 * sin1,   x2' = x2 * cos2 + x1 * sin2
 * where cos = (cos1 | cos2) and sin = (sin1 | sin2) are the full-width rows the model builds
 * ((cos | cos) and (-sin | sin)), one per token, row stride head_dim. */
void rotary_inplace_f32(float *x, int64_t x_stride, const float *cos, const float *sin,
                        int64_t rows, int64_t num_heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * num_heads * head_dim >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * head_dim;
        const float *s = sin + r * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            float *x1 = x + r * x_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] + b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* Scatters rows of keys and values (row stride kv_stride, `row` floats each: all KV heads)
 * into the cache at slot_mapping (slot = block * block_size + offset; -1 = skip). */
void write_kv_f32(float *key_cache, float *value_cache, const float *key, const float *value,
                  int64_t kv_stride, const int64_t *slot_mapping, int64_t rows, int64_t row) {
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        float *kc = key_cache + slot * row;
        float *vc = value_cache + slot * row;
        const float *k = key + t * kv_stride;
        const float *v = value + t * kv_stride;
#pragma omp simd
        for (int64_t i = 0; i < row; ++i) {
            kc[i] = k[i];
            vc[i] = v[i];
        }
    }
}
