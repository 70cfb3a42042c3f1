/* A product of few rows by a weight held as one byte per value and a scale and an offset per group
   (stages/byte_rows.py).

   W[n][k] = s[n][g] * q[n][k] + b[n][g], g = k / group: q uint8 [N, K], s and b float32 [N, K / group]. The GGUF
   formats of two int4 planes (Q8_0, Q5_0, Q5_1, Q5_K) and 8-bit GPTQ have this form.

   y[m][n] = sum over g of (s[n][g] * sum over k in g of q[n][k] * x[m][k]) + b[n][g] * X[m][g] (+ bias[n]), for
   M <= BYTE_MAX_ROWS rows of x [M, K] (float32, contiguous), X[m][g] the sum of row m's values in group g (summed
   first, in k order). Per output: one 16-lane accumulator over the groups in order (each group's values scaled
   once, then a fused multiply-add per 16 of k), its lanes summed in a fixed tree, then the offsets' sum (each
   offset times its group's sum of x by one fused multiply-add, so no build contracts it otherwise), then the
   bias: a row's values do not depend on the other rows of the call.

   A step of few rows is bound by reading the weight (1.25 bytes per value, against 4 for float32): the output rows
   are shared statically by `threads` OpenMP threads (the libgomp torch has loaded), each streaming its rows of q
   once for every row of x.

   Built for the CPU it runs on (-march=native); without AVX-512 it only says so. Returns 0, -1 on arguments it
   refuses, -2 when built without the instructions, -3 when out of memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BYTE_MAX_ROWS 8

int strata_byte_rows_isa(void) {
#ifdef __AVX512F__
    return 512;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
#include <immintrin.h>

/* The 16 bytes at q as float32. */
static inline __m512 bytes16(const uint8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

#define BYTE_ROWS(R)                                                                                                   \
    case R: {                                                                                                     \
        __m512 acc[R];                                                                                            \
        float off[R];                                                                                             \
        for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps(), off[m] = 0.0f;                                  \
        for (int64_t g = 0; g < groups; g++) {                                                                    \
            const __m512 scale = _mm512_set1_ps(sn[g]);                                                           \
            for (int64_t j = 0; j < group; j += 16) {                                                             \
                const int64_t k = g * group + j;                                                                  \
                const __m512 w = _mm512_mul_ps(bytes16(qn + k), scale);                                           \
                _Pragma("GCC unroll 8") for (int m = 0; m < R; m++)                                               \
                    acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * kk + k), acc[m]);                         \
            }                                                                                                     \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; m++)                                                   \
                off[m] = fmaf(bn[g], sums[m * groups + g], off[m]);                                               \
        }                                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            y[m * n + i] = _mm512_reduce_add_ps(acc[m]) + off[m] + (bias ? bias[i] : 0.0f);                       \
        break;                                                                                                    \
    }
#endif

int strata_byte_rows(const float *x, int64_t rows, int64_t kk, const uint8_t *q, const float *s, const float *b,
                     int64_t n, int64_t group, const float *bias, float *y, int threads) {
#ifdef __AVX512F__
    if (rows < 1 || rows > BYTE_MAX_ROWS || kk < 1 || n < 1 || group < 16 || group % 16 || kk % group || threads < 1)
        return -1;
    const int64_t groups = kk / group;
    float *sums = malloc(sizeof(float) * rows * groups);
    if (!sums) return -3;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.0f;
            for (int64_t j = 0; j < group; j++) t += x[m * kk + g * group + j];
            sums[m * groups + g] = t;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *qn = q + i * kk;
        const float *sn = s + i * groups, *bn = b + i * groups;
        switch (rows) { BYTE_ROWS(1) BYTE_ROWS(2) BYTE_ROWS(3) BYTE_ROWS(4) BYTE_ROWS(5) BYTE_ROWS(6) BYTE_ROWS(7) BYTE_ROWS(8) }
    }
    free(sums);
    return 0;
#else
    (void)x, (void)rows, (void)kk, (void)q, (void)s, (void)b, (void)n, (void)group, (void)bias, (void)y,
        (void)threads;
    return -2;
#endif
}
