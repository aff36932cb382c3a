/*
 * Native fp32 CPU kernels, in the order of this file: the small per-layer elementwise ops
 * (RMSNorm, rotary), a vectorised exp and SiLU-and-mul, the KV write, paged decode
 * attention, paged prefill attention, one decode token through all layers (batch-1 decode),
 * argmax. Activations are fp32; the KV cache is fp32, bf16 or fp16 (kv_dtype.h: written
 * rounded, read widened, all arithmetic in fp32).
 *
 * Paged decode attention (one query token per request, read straight from the paged KV
 * cache, no gathered copy of the context) has one implementation, `decode_item`, used by
 * both the batched decode (`paged_decode_attention_f32`) and the whole-step batch-1 decode
 * (`decode_token_f32`): scores, softmax and the weighted sum of values for the query heads of
 * a range of KV heads of one request. k[r, t], request r's key of token t, is row
 * t % block_size of block block_tables[r, t / block_size] in the cache. Layout
 * (engine/attention/backend.py):
 *
 *   cache:         [num_blocks, block_size, num_kv_heads, head_dim]   (keys or values)
 *   query:         [num_reqs, num_heads, head_dim], row stride query_stride
 *   block_tables:  [num_reqs, *] int32, row stride block_table_stride
 *   out:           [num_reqs, num_heads, head_dim], contiguous
 *
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA/MQA). The inner loops over
 * head_dim are `omp simd` so the compiler vectorises them without -ffast-math (only those
 * reductions are reassociated). Attention logits may be soft-capped (Gemma 2):
 * s -> cap * tanh(s / cap), after the scale and before the mask, as transformers does.
 *
 * The elementwise ops (RMSNorm with the residual add, rotary embedding in place, the KV
 * write) each replace several torch ops: on a decode step's small tensors the per-op cost,
 * not the arithmetic, is what they save. The later sections carry their own comments.
 *
 * Built and loaded at run time by engine/native/build.py; the Python wrappers in
 * engine/native/ check shapes, dtypes and strides before calling.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h" /* this file's exports that other files call */
#include "quant_types.h" /* omp_threads / omp_id */

/* One vector register of floats: 16 with AVX-512, else 8. A vector_size wider than the
 * target's registers is legal C, but GCC splits it badly: built for AVX2 (x86-64-v3) with
 * 16 lanes, SiLU-and-mul ran 3.7x and the batched decode attention 1.13x slower than with 8
 * (64 rows, 30 layers, context 192; Zen 4). */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
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

/* The first key position a query at `position` sees with a sliding window of `window` keys
 * (itself included; 0 = no window). */
INLINE int64_t window_first(int64_t position, int64_t window) {
    return window > 0 && position + 1 > window ? position + 1 - window : 0;
}

/* ---- Elementwise ops of a decoder layer, fp32, one pass each ------------------------- */

/* Below this many elements an op runs on one thread (waking the pool costs more). */
#define MIN_PARALLEL_ELEMENTS 8192

/* One row of rms_norm_f32 (residual_out and residual NULL: no residual add). */
INLINE void rms_row(float *restrict o, float *residual_out, const float *x, const float *residual,
                    const float *restrict weight, int64_t cols, float eps) {
    const float *h = x;
    if (residual != NULL) {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) residual_out[c] = x[c] + residual[c];
        h = residual_out;
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

/* out = rms_norm(x + residual) * weight and residual_out = x + residual (residual may be
 * NULL: then just rms_norm(x) * weight). Rows of `cols` floats; x rows at x_stride. The
 * statistics are in fp32 as in transformers: x * rsqrt(mean(x^2) + eps), then * weight. */
void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride,
                  const float *residual, const float *weight, int64_t rows, int64_t cols,
                  float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r)
        rms_row(out + r * cols, residual == NULL ? NULL : residual_out + r * cols,
                x + r * x_stride, residual == NULL ? NULL : residual + r * cols, weight, cols, eps);
}

/* One head (x1 | x2) rotated in place by one token's cos/sin rows (see below). */
INLINE void rotate_head(float *restrict x, const float *restrict c, const float *restrict s,
                        int64_t half) {
    float *x2 = x + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x2[i];
        x[i] = a * c[i] + b * s[i];
        x2[i] = b * c[half + i] + a * s[half + i];
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
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < num_heads; ++h)
            rotate_head(x + r * x_stride + h * head_dim, cos + r * head_dim, sin + r * head_dim,
                        half);
}

/* ---- Vectorised exp, SiLU-and-mul --------------------------------------------------------
 *
 * GCC/clang vector extensions (portable: on targets with narrower registers the compiler
 * splits them), so the exp below vectorises without -ffast-math or a vector math library. */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

INLINE vfloat vload(const float *p) {
    vfloat v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore(float *p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }

/* mask lanes (-1) take a, the others b. */
INLINE vfloat vselect(vint mask, vfloat a, vfloat b) {
    return (vfloat)(((vint)a & mask) | ((vint)b & ~mask));
}

/* Horizontal max and sum as trees over halves (a few vector ops, not LANES scalar ones). */
typedef float vhalf __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef int32_t vhalf_int __attribute__((vector_size(LANES / 2 * sizeof(int32_t))));
typedef float vquarter __attribute__((vector_size(LANES / 4 * sizeof(float))));
typedef int32_t vquarter_int __attribute__((vector_size(LANES / 4 * sizeof(int32_t))));

INLINE float vmax_lanes(vfloat v) {
    vhalf a, b;
    __builtin_memcpy(&a, &v, sizeof a);
    __builtin_memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    const vhalf_int a_wins = a > b;
    a = (vhalf)(((vhalf_int)a & a_wins) | ((vhalf_int)b & ~a_wins));
    vquarter c, d;
    __builtin_memcpy(&c, &a, sizeof c);
    __builtin_memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    const vquarter_int c_wins = c > d;
    c = (vquarter)(((vquarter_int)c & c_wins) | ((vquarter_int)d & ~c_wins));
    float m = c[0];
    for (int l = 1; l < LANES / 4; ++l) m = c[l] > m ? c[l] : m;
    return m;
}

INLINE float vsum_lanes(vfloat v) {
    vhalf a, b;
    __builtin_memcpy(&a, &v, sizeof a);
    __builtin_memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
    vquarter c, d;
    __builtin_memcpy(&c, &a, sizeof c);
    __builtin_memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c += d;
    float sum = 0.0f;
    for (int l = 0; l < LANES / 4; ++l) sum += c[l];
    return sum;
}

/* e^x per lane, within ~2 ulp of expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes'
 * expf polynomial, 2^n built in the exponent bits. Above 88.37 the result is +inf, below
 * -87.33 (where expf turns subnormal) it is 0, as torch's exp flushes; NaN stays NaN (the
 * comparisons are false for it). */
INLINE vfloat vexp(vfloat in) {
    const vfloat hi = (vfloat){0} + 88.3762626647949f, lo = (vfloat){0} + -87.3365478515625f;
    const vint overflow = in > hi, underflow = in < lo;
    vfloat x = vselect(overflow, hi, in);
    x = vselect(underflow, lo, x);
    /* n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer in the low mantissa bits. */
    const vfloat shifter = (vfloat){0} + 12582912.0f;
    const vfloat t = x * 1.44269504088896341f + shifter;
    const vfloat n = t - shifter;
    const vint ni = (vint)t - (vint)shifter;
    vfloat r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vfloat p = (vfloat){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const vfloat result = p * (vfloat)((ni + 127) << 23);
    return vselect(underflow, (vfloat){0}, vselect(overflow, (vfloat){0} + INFINITY, result));
}

/* o[i] = silu(gate[i]) * gate[inter + i]: one row of silu_and_mul_f32. */
INLINE void silu_mul_row(float *restrict o, const float *restrict gate, int64_t inter) {
    const float *up = gate + inter;
    int64_t i = 0;
    for (; i + LANES <= inter; i += LANES) {
        const vfloat g = vload(gate + i);
        vstore(o + i, g / (1.0f + vexp(-g)) * vload(up + i));
    }
    for (; i < inter; ++i) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* out[r, i] = silu(x[r, i]) * x[r, inter + i] with silu(g) = g / (1 + e^-g) (torch's
 * formula); x rows (gate | up) at x_stride, out rows contiguous. */
void silu_and_mul_f32(float *out, const float *x, int64_t x_stride, int64_t rows, int64_t inter,
                      int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * inter >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(out + r * inter, x + r * x_stride, inter);
}

/* ---- KV-cache element types and the KV write ------------------------------------------------
 *
 * The cache is fp32, bf16 or fp16 (kv_cache_dtype): kv_dtype.h holds the conversions and the
 * cache-typed dot/axpy/loads the attention kernels below read it with; every kernel taking a
 * cache takes its type code `kv_dtype` last. */
#include "kv_dtype.h"

/* Scatters rows of fp32 keys and values (row stride kv_stride, `row` floats each: all KV
 * heads) into the cache at slot_mapping (slot = block * block_size + offset; -1 = skip),
 * rounded to the cache's type. */
void write_kv_f32(void *key_cache, void *value_cache, const float *key, const float *value,
                  int64_t kv_stride, const int64_t *slot_mapping, int64_t rows, int64_t row,
                  int64_t kv_dtype) {
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t at = slot * row * kv_elem_bytes((int)kv_dtype); /* bytes */
        DISPATCH_KV_DTYPE(
            kv_store_row((char *)key_cache + at, key + t * kv_stride, row, KV);
            kv_store_row((char *)value_cache + at, value + t * kv_stride, row, KV),
            kv_dtype)
    }
}

/* ---- Paged decode attention ---------------------------------------------------------------
 *
 * One request's query token (at position seq_len - 1) for the query heads
 * h = kvh * group + g, kvh in [kvh0, kvh1), g in [g0, g1); it sees keys [first, seq_len).
 * q, out and scores are indexed by h: q + h * head_dim, out + h * head_dim,
 * scores + h * scores_stride + t (scores_stride >= seq_len). Three passes, each over the
 * blocks front to back (a block's rows hold all KV heads, read as one run when the range is
 * all of them): scores, softmax (max, vectorised exp, sum), then out = probs . values.
 * With `stats`, stats[2h] and stats[2h + 1] get the softmax's max and sum, so that the
 * outputs of several key ranges of one query can be merged (merge_parts). `sinks` (NULL:
 * none) holds a logit per query head that joins the softmax's sum and attends to no value
 * (GPT-OSS); a caller merging ranges passes it to merge_parts instead, so it counts once. */

/* Soft-capping of one attention logit (cap 0: none). */
INLINE float soft_cap(float s, float cap) { return cap > 0.0f ? cap * tanhf(s / cap) : s; }

/* Asks for the cache lines of KV heads [kvh0, kvh1) of one token row: the same row of the
 * next block, while this block is worked on. Blocks are scattered over the pool, so the
 * hardware prefetcher, which follows sequential streams, cannot guess the next one. */
INLINE void prefetch_row(const void *row, int64_t kvh0, int64_t kvh1, int64_t head_dim, int kv) {
    const char *first = kv_at(row, kvh0 * head_dim, kv);
    const char *last = kv_at(row, kvh1 * head_dim, kv);
    for (const char *p = first; p < last; p += 64) __builtin_prefetch(p, 0, 3);
}

/* Element offset of token row `t` (in [start, start + block_size)) of the block holding
 * positions start.. of a request, in a cache of token_stride elements per row. */
INLINE int64_t row_offset(const int32_t *table, int64_t start, int64_t t, int64_t block_size,
                          int64_t token_stride) {
    return ((int64_t)table[start / block_size] * block_size + (t - start)) * token_stride;
}

INLINE void decode_item(float *restrict out, const float *restrict q, float *restrict scores,
                        int64_t scores_stride, const void *key_cache, const void *value_cache,
                        const int32_t *table, int64_t seq_len, int64_t first, int64_t kvh0,
                        int64_t kvh1, int64_t g0, int64_t g1, int64_t group, int64_t head_dim,
                        int64_t block_size, int64_t token_stride, float scale, float cap,
                        const float *restrict sinks, float *restrict stats, int kv) {
    const int64_t first_block = first / block_size * block_size;
    for (int64_t start = first_block; start < seq_len; start += block_size) {
        const int64_t end = start + block_size < seq_len ? start + block_size : seq_len;
        const int has_next = end < seq_len;
        for (int64_t t = start > first ? start : first; t < end; ++t) {
            const void *k = kv_at(key_cache, row_offset(table, start, t, block_size, token_stride), kv);
            if (has_next)
                prefetch_row(kv_at(key_cache,
                                   row_offset(table, end, t - start + end, block_size, token_stride),
                                   kv),
                             kvh0, kvh1, head_dim, kv);
            for (int64_t kvh = kvh0; kvh < kvh1; ++kvh)
                for (int64_t g = g0; g < g1; ++g) {
                    const int64_t h = kvh * group + g;
                    const float s =
                        scale * dot_kv(q + h * head_dim, kv_at(k, kvh * head_dim, kv), head_dim, kv);
                    scores[h * scores_stride + t] = soft_cap(s, cap);
                }
        }
    }
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh)
        for (int64_t g = g0; g < g1; ++g) {
            float *row = scores + (kvh * group + g) * scores_stride;
            float best = -INFINITY;
            for (int64_t t = first; t < seq_len; ++t) best = row[t] > best ? row[t] : best;
            /* An attention sink: one more logit in the denominator, attending to nothing. */
            const float sink = sinks != NULL ? sinks[kvh * group + g] : -INFINITY;
            best = sink > best ? sink : best;
            vfloat sum = (vfloat){0};
            int64_t t = first;
            for (; t + LANES <= seq_len; t += LANES) {
                const vfloat p = vexp(vload(row + t) - best);
                vstore(row + t, p);
                sum += p;
            }
            float total = vsum_lanes(sum) + (sinks != NULL ? expf(sink - best) : 0.0f);
            for (; t < seq_len; ++t) {
                row[t] = expf(row[t] - best);
                total += row[t];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (t = first; t < seq_len; ++t) row[t] *= inv;
            if (stats != NULL) { /* this range's softmax max and sum, to merge ranges by */
                stats[2 * (kvh * group + g)] = best;
                stats[2 * (kvh * group + g) + 1] = total;
            }
        }
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh)
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t d = 0; d < head_dim; ++d) out[(kvh * group + g) * head_dim + d] = 0.0f;
    for (int64_t start = first_block; start < seq_len; start += block_size) {
        const int64_t end = start + block_size < seq_len ? start + block_size : seq_len;
        const int has_next = end < seq_len;
        for (int64_t t = start > first ? start : first; t < end; ++t) {
            const void *v =
                kv_at(value_cache, row_offset(table, start, t, block_size, token_stride), kv);
            if (has_next)
                prefetch_row(kv_at(value_cache,
                                   row_offset(table, end, t - start + end, block_size, token_stride),
                                   kv),
                             kvh0, kvh1, head_dim, kv);
            for (int64_t kvh = kvh0; kvh < kvh1; ++kvh)
                for (int64_t g = g0; g < g1; ++g) {
                    const int64_t h = kvh * group + g;
                    axpy_kv(out + h * head_dim, scores[h * scores_stride + t],
                            kv_at(v, kvh * head_dim, kv), head_dim, kv);
                }
        }
    }
}

/* Work items: (request, KV-head chunk). With enough requests to keep every thread busy a
 * chunk is all KV heads (each block is then read as one contiguous run); with few requests
 * (batch-1 decode) it is one KV head, so the heads spread over the threads. (Items of one
 * query head balance 3 KV heads better over 2 threads, but each pays a whole pass over the
 * blocks for one dot product per key: a batch-1 step went 6.55 -> 6.75 ms with them.) */
static int64_t heads_per_item(int64_t num_reqs, int64_t num_kv_heads, int64_t threads) {
    return num_reqs >= 4 * threads ? num_kv_heads : 1;
}

/* Key ranges per item: with fewer than two items per thread (batch 1: 3 KV heads over 2
 * threads left one thread idle a third of the time) each context is split in up to
 * ATTENTION_MAX_PARTS (quant_types.h) ranges, whose outputs merge_parts combines. Only
 * where the caller gives the scratch for the partial outputs. */
static int64_t parts_per_item(int64_t items, int64_t threads, const float *partials) {
    if (partials == NULL || items >= 2 * threads) return 1;
    const int64_t parts = (2 * threads + items - 1) / items;
    return parts < ATTENTION_MAX_PARTS ? parts : ATTENTION_MAX_PARTS;
}

/* Key range [lo, hi) of part p of `parts` of the window [first, seq_len): block-aligned
 * cuts, so each part reads whole blocks (a part may be empty on a short context). */
INLINE void part_range(int64_t first, int64_t seq_len, int64_t p, int64_t parts,
                       int64_t block_size, int64_t *lo, int64_t *hi) {
    const int64_t len = seq_len - first;
    /* cut c: first + len * c / parts rounded down to a block start, not below first */
    int64_t cut[2];
    for (int i = 0; i < 2; ++i) {
        const int64_t at = (first + len * (p + i) / parts) / block_size * block_size;
        cut[i] = at > first ? at : first;
    }
    *lo = p == 0 ? first : cut[0];
    *hi = p + 1 == parts ? seq_len : (cut[1] > *lo ? cut[1] : *lo);
}

/* out[h] = the softmax-weighted mean of the parts' outputs out_p[h], each normalised over its
 * own range: weights sum_p * exp(max_p - max) (empty parts: sum 0); a sink (sinks != NULL)
 * adds exp(sink - max) to the total only. */
INLINE void merge_parts(float *restrict out, const float *restrict part_out,
                        const float *restrict part_stats, int64_t parts, int64_t num_heads,
                        int64_t h, int64_t head_dim, const float *restrict sinks) {
    float best = sinks != NULL ? sinks[h] : -INFINITY, weight[ATTENTION_MAX_PARTS], total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
        const float m = part_stats[(p * num_heads + h) * 2];
        best = m > best ? m : best;
    }
    if (sinks != NULL) total = expf(sinks[h] - best); /* the sink: a part with no value */
    for (int64_t p = 0; p < parts; ++p) {
        const float *st = part_stats + (p * num_heads + h) * 2;
        weight[p] = st[1] > 0.0f ? st[1] * expf(st[0] - best) : 0.0f;
        total += weight[p];
    }
    for (int64_t d = 0; d < head_dim; ++d) {
        float acc = 0.0f;
        for (int64_t p = 0; p < parts; ++p)
            if (weight[p] > 0.0f) acc += weight[p] * part_out[(p * num_heads + h) * head_dim + d];
        out[h * head_dim + d] = acc / total;
    }
}

/* out[r, h] = softmax(cap(scale * q[r, h] . k[r, t])) . v[r, t] over t in request r's window
 * (with `sinks`, NULL or [num_heads], sinks[h] one more logit of the softmax's sum);
 * scores is scratch of [num_reqs, num_heads, max_len] floats (max_len >= every seq_len).
 * The query, scores and out are fp32; the cache is of type kv_dtype (kv_dtype.h).
 * `partials` (NULL: none), scratch of num_reqs * ATTENTION_MAX_PARTS * num_heads *
 * (head_dim + 2) floats, lets a context be split over the threads when items are few.
 *
 * The work items are shared by the calling team (orphaned `omp for`s, which end in a
 * barrier): called from inside a parallel region every thread of it must call; outside one,
 * the calling thread does all of it. `threads` is the team's size (it sets the items). */
void paged_decode_attention_team_f32(float *out, const float *query, int64_t query_stride,
                                     float *scores, const void *key_cache,
                                     const void *value_cache, const int32_t *block_tables,
                                     int64_t block_table_stride, const int32_t *seq_lens,
                                     int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, int64_t max_len,
                                     int64_t window, float scale, float cap,
                                     const float *sinks, int64_t threads, float *partials,
                                     int64_t kv_dtype) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t chunk = heads_per_item(num_reqs, num_kv_heads, threads);
    const int64_t num_chunks = num_kv_heads / chunk;
    const int64_t parts = parts_per_item(num_reqs * num_chunks, threads, partials);
    /* per request: parts x [num_heads, head_dim] outputs, then parts x [num_heads, 2] stats */
    const int64_t part_floats = parts * num_heads * (head_dim + 2);
#pragma omp for collapse(3) schedule(static)
    for (int64_t r = 0; r < num_reqs; ++r) {
        for (int64_t c = 0; c < num_chunks; ++c) {
            for (int64_t p = 0; p < parts; ++p) {
                const int64_t seq_len = seq_lens[r], first = window_first(seq_len - 1, window);
                int64_t lo = first, hi = seq_len;
                float *o = out + r * num_heads * head_dim, *stats = NULL;
                if (parts > 1) {
                    part_range(first, seq_len, p, parts, block_size, &lo, &hi);
                    o = partials + r * part_floats + p * num_heads * head_dim;
                    stats = partials + r * part_floats + parts * num_heads * head_dim +
                            p * num_heads * 2;
                }
                DISPATCH_KV_DTYPE(
                    DISPATCH_HEAD_DIM(
                        decode_item(o, query + r * query_stride, scores + r * num_heads * max_len,
                                    max_len, key_cache, value_cache,
                                    block_tables + r * block_table_stride, hi, lo, c * chunk,
                                    (c + 1) * chunk, 0, group, group, D, block_size, token_stride,
                                    scale, cap, parts > 1 ? NULL : sinks, stats, KV),
                        head_dim),
                    kv_dtype)
            }
        }
    }
    if (parts > 1) {
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < num_reqs; ++r)
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *base = partials + r * part_floats;
                merge_parts(out + r * num_heads * head_dim, base,
                            base + parts * num_heads * head_dim, parts, num_heads, h, head_dim,
                            sinks);
            }
    }
}

/* paged_decode_attention_team_f32 on a team of its own of num_threads threads. */
void paged_decode_attention_f32(float *out, const float *query, int64_t query_stride,
                                float *scores, const void *key_cache, const void *value_cache,
                                const int32_t *block_tables, int64_t block_table_stride,
                                const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t max_len, int64_t window, float scale, float cap,
                                const float *sinks, int num_threads, int64_t kv_dtype) {
#pragma omp parallel num_threads(num_threads)
    paged_decode_attention_team_f32(out, query, query_stride, scores, key_cache, value_cache,
                                    block_tables, block_table_stride, seq_lens, num_reqs,
                                    num_heads, num_kv_heads, head_dim, block_size, max_len,
                                    window, scale, cap, sinks, omp_threads(), NULL, kv_dtype);
}

/* ---- Paged prefill attention --------------------------------------------------------------
 *
 * Causal attention for prefill chunks (any number of query tokens per request, after any
 * cached context), reading keys and values from the paged cache (the step's own keys are
 * written there first). Query token i of a request whose chunk has q_len tokens sits at
 * position seq_len - q_len + i and sees keys 0 ..= that position.
 *
 * One work item = (request, KV head, tile of PREFILL_ROWS query tokens): every query head
 * of the KV head's group for those tokens, so each key/value read from the cache serves
 * PREFILL_ROWS * group query rows. Keys go in segments of up to PREFILL_SEGMENT: a segment's
 * keys are transposed once per item into [LANES-key chunk][head_dim][LANES], so a query's
 * scores for LANES keys are head_dim vector FMAs (no horizontal sums). Each query row
 * scores the whole segment, then exponentiates it against the running max, and the
 * softmax is carried across segments online (rescaling the running sum and output, as
 * flash attention does): no [q_len, seq_len] score matrix, and the per-row bookkeeping
 * is once per segment, not once per key chunk. */

#define PREFILL_ROWS 16
#define PREFILL_SEGMENT 256

/* a = a * rescale + sum_j p[j] * values[j] over n value rows. With head_dim a multiple of
 * LANES (up to 8 LANES) the row stays in registers, in two interleaved sets of partial
 * sums (even and odd keys) so the FMA chains overlap. */
INLINE void accumulate_values(float *restrict a, float rescale, const float *restrict p,
                              const void *const *values, int64_t n, int64_t head_dim, int kv) {
    if (head_dim % LANES == 0 && head_dim <= 8 * LANES) {
        const int64_t vectors = head_dim / LANES;
        vfloat even[8], odd[8];
        for (int64_t v = 0; v < vectors; ++v) {
            even[v] = vload(a + v * LANES) * rescale;
            odd[v] = (vfloat){0};
        }
        int64_t j = 0;
        for (; j + 2 <= n; j += 2) {
            const float w0 = p[j], w1 = p[j + 1];
            for (int64_t v = 0; v < vectors; ++v) {
                even[v] += w0 * kv_loadv(values[j], v * LANES, kv);
                odd[v] += w1 * kv_loadv(values[j + 1], v * LANES, kv);
            }
        }
        if (j < n)
            for (int64_t v = 0; v < vectors; ++v) even[v] += p[j] * kv_loadv(values[j], v * LANES, kv);
        for (int64_t v = 0; v < vectors; ++v) vstore(a + v * LANES, even[v] + odd[v]);
        return;
    }
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale;
    for (int64_t j = 0; j < n; ++j) axpy_kv(a, p[j], values[j], head_dim, kv);
}

/* Scores of SCORE_ROWS query rows against one transposed key chunk ([head_dim][LANES]):
 * out[m] = q[m] . keys. Each key vector loaded serves SCORE_ROWS FMAs (a small GEMM
 * micro-kernel), so the loop is bound by FMAs, not loads. */
#define SCORE_ROWS 8

INLINE void chunk_scores(vfloat *restrict out, const float *const *q, const float *restrict keys,
                         int64_t head_dim) {
    vfloat acc[SCORE_ROWS];
    for (int m = 0; m < SCORE_ROWS; ++m) acc[m] = (vfloat){0};
    for (int64_t d = 0; d < head_dim; ++d) {
        const vfloat k = vload(keys + d * LANES);
        for (int m = 0; m < SCORE_ROWS; ++m) acc[m] += q[m][d] * k;
    }
    for (int m = 0; m < SCORE_ROWS; ++m) out[m] = acc[m];
}

/* accumulate_values for two rows sharing the value rows: each value vector loaded serves
 * both (head_dim a multiple of LANES, up to 8 LANES). */
INLINE void accumulate_values2(float *restrict a0, float *restrict a1, float rescale0,
                               float rescale1, const float *restrict p0, const float *restrict p1,
                               const void *const *values, int64_t n, int64_t head_dim, int kv) {
    const int64_t vectors = head_dim / LANES;
    vfloat r0[8], r1[8];
    for (int64_t v = 0; v < vectors; ++v) {
        r0[v] = vload(a0 + v * LANES) * rescale0;
        r1[v] = vload(a1 + v * LANES) * rescale1;
    }
    for (int64_t j = 0; j < n; ++j) {
        const float w0 = p0[j], w1 = p1[j];
        for (int64_t v = 0; v < vectors; ++v) {
            const vfloat x = kv_loadv(values[j], v * LANES, kv);
            r0[v] += w0 * x;
            r1[v] += w1 * x;
        }
    }
    for (int64_t v = 0; v < vectors; ++v) {
        vstore(a0 + v * LANES, r0[v]);
        vstore(a1 + v * LANES, r1[v]);
    }
}

/* One key row into a column of the transposed segment (stride LANES), widened to fp32. A
 * 16-bit row is widened a vector at a time first: per element, the conversion costs more
 * than the copy. */
INLINE void transpose_key(float *restrict column, const void *k, int64_t head_dim, int kv) {
    int64_t d = 0;
    if (kv != KV_F32)
        for (; d + LANES <= head_dim; d += LANES) {
            float wide[LANES];
            vstore(wide, kv_loadv(k, d, kv));
            for (int l = 0; l < LANES; ++l) column[(d + l) * LANES] = wide[l];
        }
    for (; d < head_dim; ++d) column[d * LANES] = kv_load1(k, d, kv);
}

INLINE void prefill_item(float *out, int64_t out_stride, const float *query,
                         int64_t query_stride, const void *key_cache, const void *value_cache,
                         const int32_t *table, int64_t num_cached, int64_t row0, int64_t row1,
                         int64_t kvh, int64_t group, int64_t head_dim, int64_t block_size,
                         int64_t token_stride, float scale, float cap, int64_t window,
                         const float *sinks, float *scratch, int kv, int invariant) {
    const int64_t num_rows = (row1 - row0) * group;
    float *keys = scratch;                          /* [PREFILL_SEGMENT / LANES][head_dim][LANES] */
    float *probs = keys + PREFILL_SEGMENT * head_dim; /* [SCORE_ROWS][PREFILL_SEGMENT] */
    float *acc = probs + SCORE_ROWS * PREFILL_SEGMENT; /* [num_rows][head_dim] */
    float *run_max = acc + num_rows * head_dim;
    float *run_sum = run_max + num_rows;
    const void *values[PREFILL_SEGMENT];
    for (int64_t i = 0; i < num_rows * head_dim; ++i) acc[i] = 0.0f;
    for (int64_t i = 0; i < num_rows; ++i) {
        run_max[i] = -INFINITY;
        run_sum[i] = 0.0f;
    }
    vint lane;
    for (int l = 0; l < LANES; ++l) lane[l] = l;
    const int64_t num_keys = num_cached + row1; /* what the tile's last row sees */
    /* The tile's first row sees nothing before its window: start the walk there. Batch-
     * invariant: at the segment boundary below it, so that the segments (and the online
     * softmax's steps) are the same for a row whichever tile it is in. */
    int64_t walk_from = window_first(num_cached + row0, window);
    if (invariant) walk_from = walk_from / PREFILL_SEGMENT * PREFILL_SEGMENT;
    for (int64_t s0 = walk_from; s0 < num_keys; s0 += PREFILL_SEGMENT) {
        const int64_t seg = num_keys - s0 < PREFILL_SEGMENT ? num_keys - s0 : PREFILL_SEGMENT;
        const int64_t padded = (seg + LANES - 1) / LANES * LANES;
        for (int64_t j = 0; j < padded; ++j) {
            float *column = keys + (j / LANES) * head_dim * LANES + j % LANES;
            if (j < seg) {
                const int64_t t = s0 + j;
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const void *k = kv_at(key_cache, slot * token_stride + kvh * head_dim, kv);
                values[j] = kv_at(value_cache, slot * token_stride + kvh * head_dim, kv);
                transpose_key(column, k, head_dim, kv);
            } else {
                for (int64_t d = 0; d < head_dim; ++d) column[d * LANES] = 0.0f;
            }
        }
        /* Query rows (token i, head g) numbered row = (i - row0) * group + g, in blocks of
         * SCORE_ROWS (the last block repeats its final row to fill up; those extra scores
         * are ignored). */
        for (int64_t b0 = 0; b0 < num_rows; b0 += SCORE_ROWS) {
            const float *q[SCORE_ROWS];
            int64_t visible[SCORE_ROWS], from[SCORE_ROWS], most = 0;
            for (int m = 0; m < SCORE_ROWS; ++m) {
                const int64_t row = b0 + m < num_rows ? b0 + m : num_rows - 1;
                const int64_t i = row0 + row / group, h = kvh * group + row % group;
                q[m] = query + i * query_stride + h * head_dim;
                /* Keys of this segment the row sees: up to its own position. */
                const int64_t v = num_cached + i + 1 - s0;
                visible[m] = v < 0 ? 0 : (v < seg ? v : seg);
                /* ... and from its window's start on (nothing here if that is past it). */
                const int64_t f = window_first(num_cached + i, window) - s0;
                from[m] = f < 0 ? 0 : f;
                if (from[m] >= visible[m]) visible[m] = 0;
                most = visible[m] > most ? visible[m] : most;
            }
            if (most == 0) continue;
            const int64_t chunks = (most + LANES - 1) / LANES;
            const int64_t stride = PREFILL_SEGMENT; /* probs row stride */
            vfloat best[SCORE_ROWS];
            for (int m = 0; m < SCORE_ROWS; ++m) best[m] = (vfloat){0} - INFINITY;
            for (int64_t c = 0; c < chunks; ++c) {
                vfloat sc[SCORE_ROWS];
                chunk_scores(sc, q, keys + c * head_dim * LANES, head_dim);
                for (int m = 0; m < SCORE_ROWS; ++m) {
                    const vint seen = (lane < (int32_t)(visible[m] - c * LANES)) &
                                      (lane >= (int32_t)(from[m] - c * LANES));
                    vfloat x = sc[m] * scale;
                    if (cap > 0.0f)
                        for (int l = 0; l < LANES; ++l) x[l] = soft_cap(x[l], cap);
                    x = vselect(seen, x, (vfloat){0} - INFINITY);
                    vstore(probs + m * stride + c * LANES, x);
                    best[m] = vselect(x > best[m], x, best[m]);
                }
            }
            float rescale[SCORE_ROWS];
            const int rows_here = num_rows - b0 < SCORE_ROWS ? (int)(num_rows - b0) : SCORE_ROWS;
            for (int m = 0; m < rows_here; ++m) {
                if (visible[m] == 0) continue;
                const int64_t row = b0 + m;
                const float new_max = fmaxf(run_max[row], vmax_lanes(best[m]));
                rescale[m] = expf(run_max[row] - new_max); /* 0 on the first segment */
                vfloat total = (vfloat){0};
                float *pm = probs + m * stride;
                for (int64_t c = 0; c < chunks; ++c) {
                    /* exp(-inf - max) is 0 for masked keys: vexp flushes to 0. */
                    const vfloat pc = vexp(vload(pm + c * LANES) - new_max);
                    vstore(pm + c * LANES, pc);
                    total += pc;
                }
                run_sum[row] = run_sum[row] * rescale[m] + vsum_lanes(total);
                run_max[row] = new_max;
            }
            /* probs are 0 past each row's visible keys (up to `most`), so rows of a pair can
             * share the pass over the value rows. Not when batch-invariant: the pair's single
             * chain per row sums otherwise than accumulate_values' even/odd chains, and which
             * rows pair up depends on the tile (the chunk) a row is in. */
            int m = 0;
            if (!invariant && head_dim % LANES == 0 && head_dim <= 8 * LANES)
                for (; m + 1 < rows_here; m += 2) {
                    if (visible[m] == 0 || visible[m + 1] == 0) break;
                    accumulate_values2(acc + (b0 + m) * head_dim, acc + (b0 + m + 1) * head_dim,
                                       rescale[m], rescale[m + 1], probs + m * stride,
                                       probs + (m + 1) * stride, values,
                                       visible[m] > visible[m + 1] ? visible[m] : visible[m + 1],
                                       head_dim, kv);
                }
            for (; m < rows_here; ++m)
                if (visible[m] > 0)
                    accumulate_values(acc + (b0 + m) * head_dim, rescale[m], probs + m * stride,
                                      values, visible[m], head_dim, kv);
        }
    }
    for (int64_t i = row0; i < row1; ++i)
        for (int64_t g = 0; g < group; ++g) {
            const int64_t row = (i - row0) * group + g;
            float inv = 1.0f / run_sum[row];
            if (sinks != NULL) { /* the sink joins the sum (at a common max), no value */
                const float sink = sinks[kvh * group + g];
                const float best = fmaxf(run_max[row], sink);
                const float rescale = expf(run_max[row] - best);
                inv = rescale / (run_sum[row] * rescale + expf(sink - best));
            }
            float *o = out + i * out_stride + (kvh * group + g) * head_dim;
            const float *a = acc + row * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o[d] = a[d] * inv;
        }
}

/* Requests [first_req, num_reqs) of the batch (`sinks`: NULL, or [num_heads] logits that
 * join each row's softmax sum, as in decode_item); their query rows are
 * query_start_loc[r] .. query_start_loc[r + 1] of query/out (row strides query_stride and
 * out_stride, heads contiguous within a row). Other rows of out are not touched. */
static void prefill_attention(float *out, int64_t out_stride, const float *query,
                              int64_t query_stride, const void *key_cache,
                              const void *value_cache, const int32_t *block_tables,
                              int64_t block_table_stride, const int32_t *query_start_loc,
                              const int32_t *seq_lens, int64_t first_req, int64_t num_reqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int64_t window, float scale, float cap,
                              const float *sinks, int num_threads, int64_t kv_dtype,
                              int invariant) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    /* Items are numbered request by request: item_start[r - first_req] is r's first. */
    const int64_t count = num_reqs - first_req;
    int64_t *item_start = malloc((size_t)(count + 1) * sizeof(int64_t));
    if (item_start == NULL) abort();
    item_start[0] = 0;
    for (int64_t r = first_req; r < num_reqs; ++r) {
        const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
        const int64_t tiles = (q_len + PREFILL_ROWS - 1) / PREFILL_ROWS;
        item_start[r - first_req + 1] = item_start[r - first_req] + tiles * num_kv_heads;
    }
    const int64_t num_items = item_start[count];
    const size_t scratch_floats =
        (size_t)(PREFILL_SEGMENT * (head_dim + SCORE_ROWS) + PREFILL_ROWS * group * (head_dim + 2));
#pragma omp parallel num_threads(num_threads) if (num_items > 1)
    {
        float *scratch = malloc(scratch_floats * sizeof(float));
        if (scratch == NULL) abort();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            int64_t lo = 0, hi = count; /* the request: item_start[lo] <= item < [lo + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (item_start[mid] <= item) lo = mid;
                else hi = mid;
            }
            const int64_t r = first_req + lo, local = item - item_start[lo];
            const int64_t tile = local / num_kv_heads, kvh = local % num_kv_heads;
            const int64_t start = query_start_loc[r];
            const int64_t q_len = query_start_loc[r + 1] - start;
            const int64_t row0 = tile * PREFILL_ROWS;
            const int64_t row1 = row0 + PREFILL_ROWS < q_len ? row0 + PREFILL_ROWS : q_len;
            const int32_t *table = block_tables + r * block_table_stride;
            DISPATCH_KV_DTYPE(
                DISPATCH_HEAD_DIM(
                    prefill_item(out + start * out_stride, out_stride,
                                 query + start * query_stride, query_stride, key_cache,
                                 value_cache, table, seq_lens[r] - q_len, row0, row1, kvh, group,
                                 D, block_size, token_stride, scale, cap, window, sinks, scratch,
                                 KV, invariant),
                    head_dim),
                kv_dtype)
        }
        free(scratch);
    }
    free(item_start);
}

/* ---- One decode token through every decoder layer ------------------------------------------
 *
 * Batch-1 decode reads every weight once per token and is bound by memory bandwidth, so
 * what a step costs beyond streaming the weights is per-op overhead: a dozen ops per layer,
 * each a Python call, a dispatch and an OpenMP fork/join. decode_token_f32 runs all the
 * decoder layers of one token in a single call and a single parallel region: the
 * matrix-vector products are split over the threads by output rows, the small steps in
 * between run on one thread. Per layer, as LlamaDecoderLayer does it (neox rotary, GQA):
 *
 *   x = hidden (layer 0) or hidden + residual;  residual = x;  h = rms_norm(x) * w_in
 *   q | k | v = W_qkv h (+ b);  rotate q, k;  write k, v to the cache at `slot`
 *   a = softmax(q k^T * scale) v over the seq_len cached tokens (this one included)
 *   x = W_o a (+ b) + residual;  residual = x;  h = rms_norm(x) * w_post
 *   hidden = W_down (silu(gate) * up) (+ b),  gate | up = W_gate_up h (+ b)
 *
 * The caller applies the final norm to hidden + residual. `layers` holds, per layer,
 * DECODE_LAYER_FIELDS addresses in the order of the enum below (0 for an absent bias). */

enum {
    F_INPUT_NORM,
    F_QKV_WEIGHT,
    F_QKV_BIAS,
    F_O_WEIGHT,
    F_O_BIAS,
    F_POST_NORM,
    F_GATE_UP_WEIGHT,
    F_GATE_UP_BIAS,
    F_DOWN_WEIGHT,
    F_DOWN_BIAS,
    F_KEY_CACHE,
    F_VALUE_CACHE,
    DECODE_LAYER_FIELDS
};

/* y = W x (+ b) for W [n, k] row-major; the calling team splits the rows (orphaned `for`). */
INLINE void gemv_rows(float *restrict y, const float *restrict w, const float *restrict bias,
                      const float *restrict x, int64_t n, int64_t k) {
#pragma omp for schedule(static)
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
        const int64_t rows = n - r0 < 4 ? n - r0 : 4;
        if (rows == 4 && k % LANES == 0) {
            const float *w0 = w + r0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            vfloat a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < k; i += LANES) {
                const vfloat xv = vload(x + i);
                a0 += vload(w0 + i) * xv;
                a1 += vload(w1 + i) * xv;
                a2 += vload(w2 + i) * xv;
                a3 += vload(w3 + i) * xv;
            }
            y[r0] = vsum_lanes(a0);
            y[r0 + 1] = vsum_lanes(a1);
            y[r0 + 2] = vsum_lanes(a2);
            y[r0 + 3] = vsum_lanes(a3);
        } else {
            for (int64_t r = r0; r < r0 + rows; ++r) y[r] = dot(w + r * k, x, k);
        }
        if (bias != NULL)
            for (int64_t r = r0; r < r0 + rows; ++r) y[r] += bias[r];
    }
}

void decode_token_f32(float *hidden, float *residual, const int64_t *layers, int64_t num_layers,
                      float *scratch, const float *cos, const float *sin, const int32_t *table,
                      int64_t seq_len, int64_t slot, int64_t hidden_size, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t block_size,
                      int64_t window, float eps, float scale, int num_threads, int64_t kv_dtype) {
    const int64_t group = num_heads / num_kv_heads, half = head_dim / 2;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t token_stride = kv_size;
    float *normed = scratch;                    /* [hidden_size] */
    float *qkv = normed + hidden_size;          /* [q_size + 2 kv_size] */
    float *attn = qkv + q_size + 2 * kv_size;   /* [q_size] */
    float *gate_up = attn + q_size;             /* [2 inter] */
    float *act = gate_up + 2 * inter;           /* [inter] */
    float *scores = act + inter;                /* [num_heads][seq_len] */
#pragma omp parallel num_threads(num_threads)
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t *f = layers + l * DECODE_LAYER_FIELDS;
#define FIELD(i) ((const float *)(intptr_t)f[i])
        /* of type kv_dtype (kv_dtype.h) */
        char *key_cache = (char *)(intptr_t)f[F_KEY_CACHE];
        char *value_cache = (char *)(intptr_t)f[F_VALUE_CACHE];
#pragma omp single
        if (l == 0) { /* no residual yet: it starts as the embedding */
            rms_row(normed, NULL, hidden, NULL, FIELD(F_INPUT_NORM), hidden_size, eps);
            for (int64_t c = 0; c < hidden_size; ++c) residual[c] = hidden[c];
        } else {
            rms_row(normed, residual, hidden, residual, FIELD(F_INPUT_NORM), hidden_size, eps);
        }
        gemv_rows(qkv, FIELD(F_QKV_WEIGHT), FIELD(F_QKV_BIAS), normed, q_size + 2 * kv_size,
                  hidden_size);
#pragma omp single
        {
            for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) /* q and k heads */
                rotate_head(qkv + h * head_dim, cos, sin, half);
            const int64_t at = slot * token_stride * kv_elem_bytes((int)kv_dtype); /* bytes */
            DISPATCH_KV_DTYPE(kv_store_row(key_cache + at, qkv + q_size, kv_size, KV);
                              kv_store_row(value_cache + at, qkv + q_size + kv_size, kv_size, KV),
                              kv_dtype)
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < num_heads; ++h)
            DISPATCH_KV_DTYPE(
                decode_item(attn, qkv, scores, seq_len, key_cache, value_cache, table, seq_len,
                            window_first(seq_len - 1, window), h / group, h / group + 1,
                            h % group, h % group + 1, group, head_dim, block_size, token_stride,
                            scale, 0.0f, NULL, NULL, KV),
                kv_dtype)
        gemv_rows(hidden, FIELD(F_O_WEIGHT), FIELD(F_O_BIAS), attn, hidden_size, q_size);
#pragma omp single
        rms_row(normed, residual, hidden, residual, FIELD(F_POST_NORM), hidden_size, eps);
        gemv_rows(gate_up, FIELD(F_GATE_UP_WEIGHT), FIELD(F_GATE_UP_BIAS), normed, 2 * inter,
                  hidden_size);
#pragma omp single
        silu_mul_row(act, gate_up, inter);
        gemv_rows(hidden, FIELD(F_DOWN_WEIGHT), FIELD(F_DOWN_BIAS), act, hidden_size, inter);
#undef FIELD
    }
}

/* ---- Greedy sampling ------------------------------------------------------------------------
 *
 * out[r] = the index of the largest value of row r (rows of `cols` floats at row_stride), the
 * first one on ties, and the first NaN if the row has one: torch.argmax's contract. A
 * vectorised max pass, then a scan for the first index holding it; rows split over threads. */
void argmax_rows_f32(int64_t *out, const float *x, int64_t row_stride, int64_t rows, int64_t cols,
                     int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= MIN_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * row_stride;
        vfloat best = (vfloat){0} - INFINITY;
        vint nan = {0};
        int64_t c = 0;
        for (; c + LANES <= cols; c += LANES) {
            const vfloat v = vload(row + c);
            nan |= v != v;
            best = vselect(v > best, v, best);
        }
        float top = vmax_lanes(best);
        int has_nan = 0;
        for (int l = 0; l < LANES; ++l) has_nan |= nan[l] != 0;
        for (; c < cols; ++c) {
            has_nan |= row[c] != row[c];
            top = row[c] > top ? row[c] : top;
        }
        int64_t index = 0;
        for (c = 0; c < cols; ++c)
            if (has_nan ? row[c] != row[c] : row[c] == top) {
                index = c;
                break;
            }
        out[r] = index;
    }
}

/* Requests [first_req, num_reqs) of the batch (see prefill_attention). */
void paged_prefill_attention(float *out, int64_t out_stride, const float *query,
                             int64_t query_stride, const void *key_cache,
                             const void *value_cache, const int32_t *block_tables,
                             int64_t block_table_stride, const int32_t *query_start_loc,
                             const int32_t *seq_lens, int64_t first_req, int64_t num_reqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t window, float scale, float cap,
                             const float *sinks, int num_threads, int64_t kv_dtype) {
    prefill_attention(out, out_stride, query, query_stride, key_cache, value_cache, block_tables,
                      block_table_stride, query_start_loc, seq_lens, first_req, num_reqs,
                      num_heads, num_kv_heads, head_dim, block_size, window, scale, cap, sinks,
                      num_threads, kv_dtype, 0);
}

/* paged_prefill_attention computing each query row the same way whatever the chunk, tile
 * or batch it is in (EngineArgs `batch_invariant`, docs/determinism.md): the batch-invariant
 * CPU backend sends decode rows here too, as one-token chunks, so that a token's attention
 * has the same bits whether it was decoded, prefilled whole, prefilled in chunks or
 * recomputed after a preemption. */
void paged_prefill_attention_invariant(float *out, int64_t out_stride, const float *query,
                                       int64_t query_stride, const void *key_cache,
                                       const void *value_cache, const int32_t *block_tables,
                                       int64_t block_table_stride,
                                       const int32_t *query_start_loc, const int32_t *seq_lens,
                                       int64_t first_req, int64_t num_reqs, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t window, float scale,
                                       float cap, const float *sinks, int num_threads,
                                       int64_t kv_dtype) {
    prefill_attention(out, out_stride, query, query_stride, key_cache, value_cache, block_tables,
                      block_table_stride, query_start_loc, seq_lens, first_req, num_reqs,
                      num_heads, num_kv_heads, head_dim, block_size, window, scale, cap, sinks,
                      num_threads, kv_dtype, 1);
}
