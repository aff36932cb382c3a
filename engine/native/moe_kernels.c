/*
 * Mixture-of-experts grouped GEMM, fp32, for the `native` MoE path (engine/models/moe.py).
 *
 * The rows of a step (token x chosen expert) are sorted by expert, so expert e owns rows
 * [offsets[e], offsets[e + 1]). One call computes a projection for every expert:
 *
 *   out[i, :] = x[src(i), :] . w[e]^T        for i in expert e's rows
 *
 * with w [num_experts, n, k] row-major, src(i) = rows[i] (a token index, so the tokens are
 * gathered on the fly) or i when rows is NULL, and out [M, n] contiguous. Work items are
 * (expert, tile of TILE_N output columns); a tile's weight rows (TILE_N x k floats) stay in
 * cache while every token of the expert goes past them, four tokens at a time, so each
 * weight vector loaded serves four FMAs and each activation vector TILE_N. No Python loop
 * over experts, no per-token dispatch: one parallel region per projection.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define MOE_LANES 16
#define TILE_N 4
#define TILE_M 4

typedef float mvec __attribute__((vector_size(MOE_LANES * sizeof(float))));

static inline mvec mload(const float *p) {
    mvec v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float msum(mvec v) {
    float s = 0.0f;
    for (int l = 0; l < MOE_LANES; ++l) s += v[l];
    return s;
}

/* out rows r0..r0+m (m <= TILE_M) x columns c0..c0+nn (nn <= TILE_N). */
static inline void moe_tile(float *out, int64_t n, const float *const *xr, int64_t m,
                            const float *w, int64_t c0, int64_t nn, int64_t k) {
    if (k % MOE_LANES == 0 && m == TILE_M && nn == TILE_N) {
        mvec acc[TILE_N][TILE_M];
        for (int j = 0; j < TILE_N; ++j)
            for (int i = 0; i < TILE_M; ++i) acc[j][i] = (mvec){0};
        for (int64_t p = 0; p < k; p += MOE_LANES) {
            mvec xv[TILE_M];
            for (int i = 0; i < TILE_M; ++i) xv[i] = mload(xr[i] + p);
            for (int j = 0; j < TILE_N; ++j) {
                const mvec wv = mload(w + (c0 + j) * k + p);
                for (int i = 0; i < TILE_M; ++i) acc[j][i] += wv * xv[i];
            }
        }
        for (int i = 0; i < TILE_M; ++i)
            for (int j = 0; j < TILE_N; ++j) out[i * n + c0 + j] = msum(acc[j][i]);
        return;
    }
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < nn; ++j) {
            const float *wr = w + (c0 + j) * k;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t p = 0; p < k; ++p) s += xr[i][p] * wr[p];
            out[i * n + c0 + j] = s;
        }
}

void moe_grouped_gemm_f32(float *out, const float *x, int64_t x_stride, const int64_t *rows,
                          const float *w, const int64_t *offsets, int64_t num_experts, int64_t n,
                          int64_t k, int num_threads) {
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    /* Items only for experts with rows: item_expert[i] (tiles items each). */
    int64_t *busy = malloc((size_t)(num_experts > 0 ? num_experts : 1) * sizeof(int64_t));
    if (busy == NULL) abort();
    int64_t num_busy = 0;
    for (int64_t e = 0; e < num_experts; ++e)
        if (offsets[e + 1] > offsets[e]) busy[num_busy++] = e;
    const int64_t num_items = num_busy * tiles;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) if (num_items > 1)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t e = busy[item / tiles], c0 = (item % tiles) * TILE_N;
        const int64_t nn = n - c0 < TILE_N ? n - c0 : TILE_N;
        const float *we = w + e * n * k;
        for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += TILE_M) {
            const int64_t m = offsets[e + 1] - r0 < TILE_M ? offsets[e + 1] - r0 : TILE_M;
            const float *xr[TILE_M];
            for (int64_t i = 0; i < TILE_M; ++i) {
                const int64_t r = r0 + (i < m ? i : m - 1);
                xr[i] = x + (rows != NULL ? rows[r] : r) * x_stride;
            }
            moe_tile(out + r0 * n, n, xr, m, we, c0, nn, k);
        }
    }
    free(busy);
}
