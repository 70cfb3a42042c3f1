/* A product of few rows read straight from a weight oneDNN has packed (stages/packed_rows.py).

   oneDNN packs a float32 [N, K] weight for its AVX-512 matmul as panels of 64 output columns: panel p holds
   columns 64p .. 64p + 63 for every k, k-major, `wp[p][k][c]` with k < Kp (K rounded up to 16) and N rounded up
   to 64. stages/packed_rows.py checks that layout against the plain weight before any of it is read here.

   y[m][n] = sum over k of x[m][k] * W[n][k] (+ bias[n]), for M <= MAX_ROWS rows of x [M, K] (contiguous). Each
   output is one accumulator summed in k order by fused multiply-adds, so a row's values do not depend on how
   many rows share the call. A step of few rows is bound by reading the weight: the panels are shared
   statically by `threads` OpenMP threads (the libgomp torch has loaded), each streaming its panels once for up
   to ROWS_PER_PASS rows (4 x ROWS_PER_PASS accumulators of 16 columns); more rows are taken ROWS_PER_PASS at a
   time over K_BLOCK values of k, so the block of the panel they share is read from cache.

   A panel read once (up to ROWS_PER_PASS rows) is prefetched PREFETCH_K values of k ahead as non-temporal
   (prefetchnta), so the weights streamed through do not evict what the rest of the step keeps in the caches (the
   layer's activations, the pool's rows, the interpreter): a 1-row step of the 104M qwen3 ~6% faster, the
   products alone as fast. A panel read again for more rows is left to the hardware prefetcher, since a
   non-temporal line may be gone before the second pass.

   With AVX2 (csrc/cpu_isa.h) a panel is read as 8 vectors of 8 columns. One row is one pass over the whole panel,
   streamed as above (8 accumulators); more rows are taken AVX2_ROWS_PER_PASS at a time over half a panel (4
   vectors, 12 accumulators: the 16 registers hold no more) and AVX2_K_BLOCK values of k (16 KiB, read again from
   L1 by each group of rows); the memory that follows the block is prefetched meanwhile, its lines spread evenly
   over all the passes of the block, so the next block arrives while this one is computed without more misses in
   flight than the core keeps (the 104M qwen3's 48 products, streamed, 2 threads, AMD EPYC Zen 3: 8 rows 28.1 ->
   18.8 ms, 4 rows 22.1 -> 18.0 ms, against no prefetch; 1 row streams as above). Every output is the same fused
   multiply-adds in the same order at either width, so the two builds agree bit for bit.

   Built for the CPU it runs on (-march=native); without AVX-512 or AVX2 (AVX512_BF16 for bfloat16) it only says
   so. Returns 0, -1 on arguments it refuses, -2 when built without the instructions, -3 when out of memory. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_isa.h"

#define MAX_ROWS 64
#define PANEL 64
#define ROWS_PER_PASS 6
#define K_BLOCK 128
#define PREFETCH_K 16
#define AVX2_ROWS_PER_PASS 3
#define AVX2_K_BLOCK 64


int strata_packed_rows_isa(void) { return STRATA_ISA; }

#if STRATA_ISA == 512

/* R rows of x (row stride ldx) times panel columns 0..63 over k in [k0, k1), the sums carried on from part (rows
   of 64 floats; from zero when k0 is 0) and left there: every output's sum runs in k order, however K is cut. */
#define PASS(R)                                                                                                   \
    case R: {                                                                                                     \
        __m512 acc[R][4];                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            for (int b = 0; b < 4; b++)                                                                           \
                acc[m][b] = k0 ? _mm512_load_ps(part + m * PANEL + 16 * b) : _mm512_setzero_ps();                 \
        for (int64_t k = k0; k < k1; k++) {                                                                       \
            const float *w = wp + k * PANEL;                                                                      \
            if (nta) {                                                                                            \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL), _MM_HINT_NTA);                               \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + 16), _MM_HINT_NTA);                          \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + 32), _MM_HINT_NTA);                          \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + 48), _MM_HINT_NTA);                          \
            }                                                                                                     \
            const __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16), w2 = _mm512_load_ps(w + 32),         \
                         w3 = _mm512_load_ps(w + 48);                                                             \
            _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) {                                                  \
                const __m512 a = _mm512_set1_ps(x[m * ldx + k]);                                                  \
                acc[m][0] = _mm512_fmadd_ps(a, w0, acc[m][0]);                                                    \
                acc[m][1] = _mm512_fmadd_ps(a, w1, acc[m][1]);                                                    \
                acc[m][2] = _mm512_fmadd_ps(a, w2, acc[m][2]);                                                    \
                acc[m][3] = _mm512_fmadd_ps(a, w3, acc[m][3]);                                                    \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            for (int b = 0; b < 4; b++) _mm512_store_ps(part + m * PANEL + 16 * b, acc[m][b]);                    \
        break;                                                                                                    \
    }

static void pass(const float *x, int64_t ldx, int rows, const float *wp, int64_t k0, int64_t k1, float *part,
                 int nta) {
    switch (rows) { PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) }
}
#elif STRATA_ISA == 256
/* One row over the whole panel (columns 0..63, 8 vectors), k in [k0, k1), as PASS carries its sums. */
static void pass_row(const float *x, const float *wp, int64_t k0, int64_t k1, float *part) {
    __m256 acc[8];
    for (int b = 0; b < 8; b++) acc[b] = k0 ? _mm256_load_ps(part + 8 * b) : _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const float *w = wp + k * PANEL;
        for (int line = 0; line < PANEL; line += 16) /* one pass over the panel: streamed, as PASS streams it */
            _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + line), _MM_HINT_NTA);
        const __m256 a = _mm256_broadcast_ss(x + k);
        _Pragma("GCC unroll 8") for (int b = 0; b < 8; b++)
            acc[b] = _mm256_fmadd_ps(a, _mm256_load_ps(w + 8 * b), acc[b]);
    }
    for (int b = 0; b < 8; b++) _mm256_store_ps(part + 8 * b, acc[b]);
}

/* R rows (row stride ldx) over half a panel: the 32 columns at wp (wp[k * PANEL + c]), sums in part (rows of
   PANEL floats, the half's 32 of them). The R values of x at k are held in registers and each vector of weights is
   loaded once for them (R accumulators of 4 vectors, R broadcasts and one weight vector: 16 registers at R = 3).
   The `lines` cache lines at pf are prefetched as k goes, evenly over the pass. */
#define PASS_HALF(R)                                                                                              \
    case R: {                                                                                                     \
        __m256 acc[R][4];                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            for (int b = 0; b < 4; b++)                                                                           \
                acc[m][b] = k0 ? _mm256_load_ps(part + m * PANEL + 8 * b) : _mm256_setzero_ps();                  \
        for (int64_t k = k0; k < k1; k++) {                                                                       \
            const float *w = wp + k * PANEL;                                                                      \
            for (int64_t t = (k - k0) * per; t < (k - k0 + 1) * per && t < lines; t++)                            \
                _mm_prefetch(pf + 64 * t, _MM_HINT_T0);                                                           \
            __m256 a[R];                                                                                          \
            for (int m = 0; m < R; m++) a[m] = _mm256_broadcast_ss(x + m * ldx + k);                             \
            _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++) {                                                  \
                const __m256 wb = _mm256_load_ps(w + 8 * b);                                                      \
                for (int m = 0; m < R; m++) acc[m][b] = _mm256_fmadd_ps(a[m], wb, acc[m][b]);                     \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            for (int b = 0; b < 4; b++) _mm256_store_ps(part + m * PANEL + 8 * b, acc[m][b]);                     \
        break;                                                                                                    \
    }

static void pass_half(const float *x, int64_t ldx, int rows, const float *wp, int64_t k0, int64_t k1, float *part,
                      const char *pf, int64_t lines) {
    const int64_t per = (lines + (k1 - k0) - 1) / (k1 - k0);
    switch (rows) { PASS_HALF(1) PASS_HALF(2) PASS_HALF(3) }
}
#endif

int strata_packed_rows(const float *x, int64_t rows, int64_t k, const float *wp, int64_t n, int64_t kp,
                       const float *bias, float *y, int threads) {
#if STRATA_ISA
    if (rows < 1 || rows > MAX_ROWS || k < 1 || n < 1 || kp < k || kp % 16 || threads < 1 || ((uintptr_t)wp & 63))
        return -1;
    const int64_t panels = (n + PANEL - 1) / PANEL;
#if STRATA_ISA == 512
    const int64_t block = rows <= ROWS_PER_PASS ? k : K_BLOCK;
#else
    const int64_t block = rows == 1 ? k : AVX2_K_BLOCK;
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float part[MAX_ROWS * PANEL] __attribute__((aligned(64)));
        const float *w = wp + p * kp * PANEL;
        for (int64_t k0 = 0; k0 < k; k0 += block) {
            const int64_t k1 = k0 + block < k ? k0 + block : k;
#if STRATA_ISA == 512
            for (int64_t m = 0; m < rows; m += ROWS_PER_PASS)
                pass(x + m * k, k, (int)(rows - m < ROWS_PER_PASS ? rows - m : ROWS_PER_PASS), w, k0, k1,
                     part + m * PANEL, block == k);
#else
            if (rows == 1)
                pass_row(x, w, k0, k1, part);
            else {
                /* the memory after this block (the next block, or the next panel's first), spread over its passes */
                const char *next = (const char *)(k1 < k ? w + k1 * PANEL : w + kp * PANEL);
                const int64_t groups = (rows + AVX2_ROWS_PER_PASS - 1) / AVX2_ROWS_PER_PASS, passes = 2 * groups;
                const int64_t lines = block * PANEL * 4 / 64;
                for (int half = 0; half < PANEL; half += PANEL / 2)
                    for (int64_t m = 0; m < rows; m += AVX2_ROWS_PER_PASS) {
                        const int64_t j = (half ? groups : 0) + m / AVX2_ROWS_PER_PASS;
                        const int64_t from = lines * j / passes, to = lines * (j + 1) / passes;
                        pass_half(x + m * k, k, (int)(rows - m < AVX2_ROWS_PER_PASS ? rows - m : AVX2_ROWS_PER_PASS),
                                  w + half, k0, k1, part + m * PANEL + half, next + 64 * from, to - from);
                    }
            }
#endif
        }
        const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
        for (int64_t m = 0; m < rows; m++) {
            float *out = y + m * n + c0;
            const float *q = part + m * PANEL;
            if (bias)
                for (int64_t c = 0; c < cols; c++) out[c] = q[c] + bias[c0 + c];
            else
                memcpy(out, q, cols * sizeof(float));
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)wp, (void)n, (void)kp, (void)bias, (void)y, (void)threads;
    return -2;
#endif
}

/* bfloat16. oneDNN packs a bfloat16 [N, K] weight for AVX512_BF16 as panels of 64 output columns over pairs of k:
   `wp[p][j][c][e]` is W[64p + c][2j + e], j < Kp / 2 with Kp K rounded up to 32, the padding zeros (checked by
   stages/packed_rows.py). x [M, K] and bias [N] are bfloat16, y [M, N] bfloat16: each output one float32 sum over
   the k pairs in order (vdpbf16ps), the bias added in float32, rounded to bfloat16 to nearest even. */
int strata_packed_rows_bf16_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* R rows of pairs xp (row stride ldx pairs) over pairs [j0, j1) of one panel, carried in part as PASS does. */
#define PASS_BF16(R)                                                                                              \
    case R: {                                                                                                     \
        __m512 acc[R][4];                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            for (int b = 0; b < 4; b++)                                                                           \
                acc[m][b] = j0 ? _mm512_load_ps(part + m * PANEL + 16 * b) : _mm512_setzero_ps();                 \
        for (int64_t j = j0; j < j1; j++) {                                                                       \
            const uint16_t *w = wp + j * PANEL * 2;                                                               \
            if (nta) {                                                                                            \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL), _MM_HINT_NTA);                               \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + 32), _MM_HINT_NTA);                          \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + 64), _MM_HINT_NTA);                          \
                _mm_prefetch((const char *)(w + PREFETCH_K * PANEL + 96), _MM_HINT_NTA);                          \
            }                                                                                                     \
            const __m512bh w0 = (__m512bh)_mm512_load_si512(w), w1 = (__m512bh)_mm512_load_si512(w + 32),         \
                           w2 = (__m512bh)_mm512_load_si512(w + 64), w3 = (__m512bh)_mm512_load_si512(w + 96);    \
            _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) {                                                  \
                const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[m * ldx + j]);                                  \
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, a);                                                   \
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, a);                                                   \
                acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, a);                                                   \
                acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, a);                                                   \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            for (int b = 0; b < 4; b++) _mm512_store_ps(part + m * PANEL + 16 * b, acc[m][b]);                    \
        break;                                                                                                    \
    }

static void pass_bf16(const int32_t *xp, int64_t ldx, int rows, const uint16_t *wp, int64_t j0, int64_t j1,
                      float *part, int nta) {
    switch (rows) { PASS_BF16(1) PASS_BF16(2) PASS_BF16(3) PASS_BF16(4) PASS_BF16(5) PASS_BF16(6) }
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch converts */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* a NaN stays a NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif

int strata_packed_rows_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *wp, int64_t n, int64_t kp,
                            const uint16_t *bias, uint16_t *y, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (rows < 1 || rows > MAX_ROWS || k < 1 || n < 1 || kp < k || kp % 32 || threads < 1 || ((uintptr_t)wp & 63))
        return -1;
    const int64_t pairs = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL;
    int32_t *xs = malloc(rows * pairs * sizeof(int32_t)); /* x as pairs of k, an odd k's pair closed with a zero */
    if (!xs) return -3;
    for (int64_t m = 0; m < rows; m++) {
        uint16_t *dst = (uint16_t *)(xs + m * pairs);
        memcpy(dst, x + m * k, k * sizeof(uint16_t));
        if (k % 2) dst[k] = 0;
    }
    const int64_t block = rows <= ROWS_PER_PASS ? pairs : K_BLOCK / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float part[MAX_ROWS * PANEL] __attribute__((aligned(64)));
        const uint16_t *w = wp + p * kp * PANEL;
        for (int64_t j0 = 0; j0 < pairs; j0 += block) {
            const int64_t j1 = j0 + block < pairs ? j0 + block : pairs;
            for (int64_t m = 0; m < rows; m += ROWS_PER_PASS)
                pass_bf16(xs + m * pairs, pairs, (int)(rows - m < ROWS_PER_PASS ? rows - m : ROWS_PER_PASS), w, j0,
                          j1, part + m * PANEL, block == pairs);
        }
        const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
        for (int64_t m = 0; m < rows; m++) {
            uint16_t *out = y + m * n + c0;
            const float *q = part + m * PANEL;
            for (int64_t c = 0; c < cols; c++) out[c] = to_bf16(bias ? q[c] + from_bf16(bias[c0 + c]) : q[c]);
        }
    }
    free(xs);
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)wp, (void)n, (void)kp, (void)bias, (void)y, (void)threads;
    return -2;
#endif
}
