/* The elementwise work of a CPU stage's layer (stages/cpu_ops.py): RMSNorm with the residual add before it,
   the q/k heads' RMSNorm with the rotary embedding, and the SiLU-gated product of the MLP.

   Every array is float32 with contiguous rows. A call makes one pass over its rows; they are shared by `threads`
   OpenMP threads (the libgomp torch has loaded) only when there are enough of them (PARALLEL_FLOATS values), so
   a decode step's few rows stay on the calling thread, without a parallel region. exp is exp_f of cpu_exp.h,
   so the loops vectorize without libmvec. Each function returns 0, or -1 on arguments it refuses. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_exp.h"

#define PARALLEL_FLOATS 65536
#define MAX_HEAD_DIM 1024

/* 1 / sqrt(mean of x^2 + eps) over n values. */
static inline float inv_rms(const float *x, int n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* x, d, sum, out [rows, n]. d NULL: out = x * inv_rms(x) * w. Else sum = x + d, out = sum * inv_rms(sum) * w
   (the residual add and the norm after it). w [n], or NULL for no scale. */
int strata_rms_norm(const float *x, const float *d, float *sum, const float *w, float *out, int64_t rows, int n,
                    float eps, int threads) {
    if (rows < 0 || n < 1 || threads < 1 || (d && !sum)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * n;
        if (d) {
            float *st = sum + t * n;
            const float *dt = d + t * n;
#pragma omp simd
            for (int i = 0; i < n; i++) st[i] = xt[i] + dt[i];
            xt = st;
        }
        const float r = inv_rms(xt, n, eps);
        float *ot = out + t * n;
        if (w) {
#pragma omp simd
            for (int i = 0; i < n; i++) ot[i] = (xt[i] * r) * w[i];
        } else {
#pragma omp simd
            for (int i = 0; i < n; i++) ot[i] = xt[i] * r;
        }
    }
    return 0;
}

/* In place on qkv [rows, row_stride]: heads q heads then kv_heads k heads of head_dim values from the start of
   each row. Each head normed (q_norm / k_norm [head_dim]; both NULL: no norm), then rotated by its row of
   cos, sin [rows, head_dim] (rotate-half: the first half d gets x_d cos_d - x_{d+h} sin_d, the second
   x_d cos_d + x_{d-h} sin_d). */
int strata_qk_norm_rope(float *qkv, int64_t row_stride, int64_t rows, int heads, int kv_heads, int head_dim,
                        const float *q_norm, const float *k_norm, float eps, const float *cos, const float *sin,
                        int threads) {
    if (rows < 0 || heads < 1 || kv_heads < 0 || head_dim < 2 || head_dim % 2 || head_dim > MAX_HEAD_DIM ||
        threads < 1 || (!q_norm) != (!k_norm) || row_stride < (int64_t)(heads + kv_heads) * head_dim)
        return -1;
    const int all = heads + kv_heads, half = head_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows > 1 && rows * all * head_dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int h = 0; h < all; h++) {
            float *x = qkv + t * row_stride + (int64_t)h * head_dim;
            float y[MAX_HEAD_DIM];
            if (q_norm) {
                const float r = inv_rms(x, head_dim, eps);
                const float *w = h < heads ? q_norm : k_norm;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) y[i] = (x[i] * r) * w[i];
            } else {
                memcpy(y, x, sizeof(float) * head_dim);
            }
#pragma omp simd
            for (int i = 0; i < half; i++) x[i] = y[i] * c[i] + (-y[i + half]) * s[i];
#pragma omp simd
            for (int i = half; i < head_dim; i++) x[i] = y[i] * c[i] + y[i - half] * s[i];
        }
    }
    return 0;
}

/* gate_up [rows, 2 * inter] (gate then up), out [rows, inter] = silu(gate) * up, silu(g) = g / (1 + e^-g). */
int strata_silu_mul(const float *gate_up, float *out, int64_t rows, int inter, int threads) {
    if (rows < 0 || inter < 1 || threads < 1) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * inter >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) o[i] = (g[i] / (1.0f + exp_f(-g[i]))) * u[i];
    }
    return 0;
}
