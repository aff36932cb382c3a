/*
 * A decode step of 1..8 requests (one token each) through every decoder layer in one call,
 * on fp32 or quantized weights (engine/attention/cpu_decode_step.py drives it).
 *
 * A small decode batch is bound by streaming the weights, so every projection reads each
 * weight row once for all the batch's rows (the row kernels of quant_kernels.c, which
 * dequantize a block in registers or into an L1 buffer and use it for every activation
 * row; plain fp32 rows are read in place). Between the projections, the step calls the
 * exported kernels of cpu_kernels.c (RMSNorm, rotary, KV write, paged decode attention,
 * SiLU-and-mul): no Python, no torch dispatch, no tensor allocation per op, and one OpenMP
 * parallel region for the whole step (a barrier between phases costs about a third of a
 * fork/join, and a step has nine phases per layer). Per layer, as
 * DecoderLayer does it (neox rotary, GQA):
 *
 *   x = hidden (layer 0) or hidden + residual;  residual = x;  h = rms_norm(x) * w_in
 *   q | k | v = W_qkv h (+ b);  rotate q, k;  write k, v at each row's slot
 *   a = paged decode attention of each row's query over its context
 *   x = W_o a (+ b) + residual;  residual = x;  h = rms_norm(x) * w_post
 *   hidden = W_down (silu(gate) * up) (+ b),  gate | up = W_gate_up h (+ b)
 *
 * The caller applies the final norm to hidden + residual. Layer table (int64 per field):
 *
 *   [input_norm, post_norm, key_cache, value_cache,
 *    4 x linear (qkv, o, gate_up, down): bias, 3 x part (data, type, row_bytes, scales, n_out)]
 *
 * A linear's parts (a fused q|k|v whose members the file stores in different block types)
 * fill consecutive output columns; data == 0 ends the list. type is quant_kernels.c's
 * (0 = fp32 rows). The ISA path of the row kernels follows quant_set_isa.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h" /* rms_norm_f32, rotary, write_kv, silu_and_mul, attention */
#include "quant_types.h" /* omp_threads / omp_id, quant_linear_range */

#define MAX_PARTS 3
#define PART_FIELDS 5
#define LINEAR_FIELDS (1 + MAX_PARTS * PART_FIELDS)
enum { S_INPUT_NORM, S_POST_NORM, S_KEY_CACHE, S_VALUE_CACHE, S_LINEARS };
enum { L_QKV, L_O, L_GATE_UP, L_DOWN };
#define STEP_LAYER_FIELDS (S_LINEARS + 4 * LINEAR_FIELDS)

/* The number of fields per layer (checked by the Python side against its own table). */
int64_t decode_step_layer_fields(void) { return STEP_LAYER_FIELDS; }

#define PTR(type, v) ((type)(intptr_t)(v))

/* [*lo, *hi): the calling thread's even share of n items (the team splits them in order). */
static inline void team_share(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t per = (n + omp_threads() - 1) / omp_threads(), start = omp_id() * per;
    *lo = start < n ? start : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* out[r, :] = W x[r] (+ bias) for r < rows, by the calling team: every part's output rows
 * split evenly over it, each thread streaming its own slice of the weight once; ends in a
 * barrier. wbufs: per-thread scratch of wbuf_floats floats (64-byte aligned). */
static void linear_step(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                        int64_t rows, const int64_t *lin, int64_t k, float *wbufs,
                        int64_t wbuf_floats) {
    int64_t col = 0;
    for (int p = 0; p < MAX_PARTS; ++p) {
        const int64_t *part = lin + 1 + p * PART_FIELDS;
        if (part[0] == 0) break;
        const int64_t n_out = part[4];
        int64_t n0, n1;
        team_share(n_out, &n0, &n1);
        quant_linear_range(out + col, out_stride, x, x_stride, rows,
                           PTR(const uint8_t *, part[0]), part[2], PTR(const float *, part[3]),
                           (int)part[1], n0, n1, k, wbufs + omp_id() * wbuf_floats);
        if (lin[0] != 0) {
            const float *bias = PTR(const float *, lin[0]) + col;
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t n = n0; n < n1; ++n) out[r * out_stride + col + n] += bias[n];
        }
        col += n_out;
    }
#pragma omp barrier
}

/* Scratch (floats): normed [rows, hidden], qkv [rows, q + 2 kv], attn [rows, q],
 * gate_up [rows, 2 inter], act [rows, inter], scores [rows, num_heads, max_len]; the row
 * kernels' per-thread buffers are allocated here. Returns 0, or -1 when that fails. */
int decode_step_f32(float *hidden, float *residual, const int64_t *layers, int64_t num_layers,
                    int64_t rows, float *scratch, const float *cos, const float *sin,
                    const int32_t *block_tables, int64_t block_table_stride,
                    const int32_t *seq_lens, const int64_t *slot_mapping, int64_t max_len,
                    int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t inter, int64_t block_size, int64_t window,
                    float eps, float scale, int num_threads, int64_t kv_dtype) {
    const int64_t H = hidden_size, q_size = num_heads * head_dim;
    const int64_t kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    float *normed = scratch;              /* [rows, H] */
    float *qkv = normed + rows * H;       /* [rows, qkv_size] */
    float *attn = qkv + rows * qkv_size;  /* [rows, q_size] */
    float *gate_up = attn + rows * q_size; /* [rows, 2 inter] */
    float *act = gate_up + rows * 2 * inter; /* [rows, inter] */
    float *scores = act + rows * inter;   /* [rows, num_heads, max_len] */
    int64_t k_max = H > q_size ? H : q_size;
    k_max = k_max > inter ? k_max : inter;
    const int64_t wbuf_floats = (k_max + 15) / 16 * 16;
    /* the row kernels' per-thread buffers, then the attention's partial outputs of split
     * contexts (paged_decode_attention_team_f32) */
    const int64_t partial_floats = rows * ATTENTION_MAX_PARTS * num_heads * (head_dim + 2);
    float *wbufs = aligned_alloc(
        64, (size_t)((wbuf_floats * num_threads + partial_floats + 15) / 16 * 16) * sizeof(float));
    if (wbufs == NULL) return -1;
    float *partials = wbufs + wbuf_floats * num_threads;
    /* One parallel region for the whole step: the projections and the attention are split
     * over the team, the small row-wise ops between them run on one thread (`single`, on
     * the rows of a decode batch they are microseconds); a barrier ends every phase. */
#pragma omp parallel num_threads(num_threads)
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t *f = layers + l * STEP_LAYER_FIELDS;
        const int64_t *lin = f + S_LINEARS;
        void *key_cache = PTR(void *, f[S_KEY_CACHE]); /* of type kv_dtype (kv_dtype.h) */
        void *value_cache = PTR(void *, f[S_VALUE_CACHE]);
#pragma omp single
        if (l == 0) { /* no residual yet: it starts as the embedding */
            rms_norm_f32(normed, NULL, hidden, H, NULL, PTR(const float *, f[S_INPUT_NORM]),
                         rows, H, eps, 1);
            memcpy(residual, hidden, (size_t)(rows * H) * sizeof(float));
        } else {
            rms_norm_f32(normed, residual, hidden, H, residual,
                         PTR(const float *, f[S_INPUT_NORM]), rows, H, eps, 1);
        }
        linear_step(qkv, qkv_size, normed, H, rows, lin + L_QKV * LINEAR_FIELDS, H, wbufs,
                    wbuf_floats);
#pragma omp single
        {
            rotary_inplace_f32(qkv, qkv_size, cos, sin, rows, num_heads + num_kv_heads,
                               head_dim, 1);
            write_kv_f32(key_cache, value_cache, qkv + q_size, qkv + q_size + kv_size, qkv_size,
                         slot_mapping, rows, kv_size, kv_dtype);
        }
        paged_decode_attention_team_f32(attn, qkv, qkv_size, scores, key_cache, value_cache,
                                        block_tables, block_table_stride, seq_lens, rows,
                                        num_heads, num_kv_heads, head_dim, block_size, max_len,
                                        window, scale, 0.0f, NULL, omp_threads(), partials,
                                        kv_dtype);
        linear_step(hidden, H, attn, q_size, rows, lin + L_O * LINEAR_FIELDS, q_size, wbufs,
                    wbuf_floats);
#pragma omp single
        rms_norm_f32(normed, residual, hidden, H, residual, PTR(const float *, f[S_POST_NORM]),
                     rows, H, eps, 1);
        linear_step(gate_up, 2 * inter, normed, H, rows, lin + L_GATE_UP * LINEAR_FIELDS, H,
                    wbufs, wbuf_floats);
        { /* rows split over the team: 8 rows of SiLU-and-mul are worth two threads */
            int64_t r0, r1;
            team_share(rows, &r0, &r1);
            if (r0 < r1)
                silu_and_mul_f32(act + r0 * inter, gate_up + r0 * 2 * inter, 2 * inter, r1 - r0,
                                 inter, 1);
#pragma omp barrier
        }
        linear_step(hidden, H, act, inter, rows, lin + L_DOWN * LINEAR_FIELDS, inter, wbufs,
                    wbuf_floats);
    }
    free(wbufs);
    return 0;
}
