/* A product of few rows by a weight held as one byte (or half a byte) per value and a scale and an offset per
   group (stages/byte_rows.py).

   W[n][k] = s[n][g] * q[n][k] + b[n][g], g = k / group, s and b float32 [N, K / group] (b NULL: b[n][g] is
   -zero * s[n][g], a format whose offset is its scale times a fixed zero point); q is uint8 [N, K] (`bits`
   8: the GGUF formats of two int4 planes, Q8_0, Q5_0, Q5_1, Q5_K, and 8-bit GPTQ) or [N, K / 2] (`bits` 4: one
   plane, Q4_0, Q4_1, Q4_K, 4-bit GPTQ / AWQ), each 16 bytes holding values k + j (low nibble) and k + 16 + j (high
   nibble) of a block of 32 at k.

   y[m][n] = sum over g of (s[n][g] * sum over k in g of q[n][k] * x[m][k]) + b[n][g] * X[m][g] (+ bias[n]), for
   M <= BYTE_MAX_ROWS rows of x [M, K] (float32, contiguous), X[m][g] the sum of row m's values in group g (summed
   first, in k order). Per output: one 16-lane accumulator over the groups in order (each group's values scaled
   once, then a fused multiply-add per 16 of k, in k order, whichever the bits), its lanes summed in a fixed tree,
   then the offsets' sum (each offset times its group's sum of x by one fused multiply-add, so no build contracts
   it otherwise), then the bias: a row's values do not depend on the other rows of the call.

   A step of few rows is bound by reading the weight (1.25 or 0.75 bytes per value, against 4 for float32): the
   output rows are shared statically by `threads` OpenMP threads (the libgomp torch has loaded), each streaming its
   rows of q once for every row of x. Nibble pairs are prefetched BYTE_PREFETCH bytes ahead as non-temporal
   (prefetchnta), their scales and offsets BYTE_PREFETCH_ROWS rows ahead: a 1-row step of the 104M qwen3 in Q4_K
   ~1.5x faster on an Intel VM where the hardware prefetcher alone left the kernel waiting; bytes, read at the
   bus's pace there already, were 0-8% slower with it and stay without.

   With AVX2 (csrc/cpu_isa.h) the 16-lane accumulator is two vectors of 8 (lanes 0-7 and 8-15) summed in the same
   tree, and the rows of x are taken AVX2_BYTE_ROWS at a time over the same output (its bytes read again from
   cache): the same operations per output in the same order, so both builds agree bit for bit. The whole weight is
   dequantized with AVX2 too; torch's int4 planes (the last function) in plain C, the same single rounding per
   operation.

   Built for the CPU it runs on (-march=native); without AVX-512 or AVX2 it only says so. Returns 0, -1 on
   arguments it refuses, -2 when built without the instructions, -3 when out of memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_isa.h"

#define BYTE_MAX_ROWS 8
#define BYTE_PREFETCH 2048 /* nibble pairs: bytes of q prefetched ahead (non-temporal), and rows ahead for the */
#define BYTE_PREFETCH_ROWS 4 /* scales and offsets */

#define AVX2_BYTE_ROWS 4

/* A product's body where the library was built without the instructions: its arguments unused, -2. */
#define NO_ISA_PRODUCT()                                                                                          \
    (void)x, (void)rows, (void)kk, (void)q, (void)bits, (void)s, (void)b, (void)zero, (void)n, (void)group,      \
        (void)bias, (void)y, (void)threads;                                                                       \
    return -2

/* The offset of group g of a row: its own (bn), or, where a format's offset is its scale times a fixed zero point
   (Q8_0, Q6_K, Q5_0, Q4_0: bn NULL), -zero * sn[g], exact in float32 for the formats' powers of two. */
#define OFFSET(bn, sn, zero, g) ((bn) ? (bn)[g] : -(zero) * (sn)[g])

int strata_byte_rows_isa(void) { return STRATA_ISA; }

/* Groups a multiple of 32, or of 16 for bytes (Q6_K's sub-blocks): a block of 32 values then has two scales, the
   first 16 values' and the last 16's (gstep 2 groups per block), else one (gstep 1, `span` values per group). */
static inline int group_ok(int64_t kk, int64_t group, int bits) {
    return (group >= 32 ? group % 32 == 0 : group == 16 && bits == 8) && kk % group == 0 && kk % 32 == 0;
}
static inline int64_t group_step(int64_t group) { return group == 16 ? 2 : 1; }
static inline int64_t group_span(int64_t group) { return group == 16 ? 32 : group; }

#if STRATA_ISA == 512

/* The 16 bytes at q as float32. */
static inline __m512 bytes16(const uint8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

/* Values k .. k + 31 of a row (k a multiple of 32) as two times 16 floats: from bytes (bits 8) or from 16 bytes
   holding values k + j in the low nibble and k + 16 + j in the high one (bits 4). */
static inline void values32(const uint8_t *qn, int64_t k, int bits, __m512 *v0, __m512 *v1) {
    if (bits == 8) {
        *v0 = bytes16(qn + k);
        *v1 = bytes16(qn + k + 16);
    } else {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qn + k / 2)));
        *v0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
        *v1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    }
}

/* 16 floats rounded to bfloat16, to nearest even (finite values), stored under `mask`. */
static inline void store_bf16(uint16_t *dst, __mmask16 mask, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(r));
}

#define BYTE_ROWS(B, R)                                                                                           \
    case R: {                                                                                                     \
        __m512 acc[R];                                                                                            \
        float off[R];                                                                                             \
        for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps(), off[m] = 0.0f;                                  \
        for (int64_t g = 0; g < groups; g += gstep) {                                                             \
            const __m512 sa = _mm512_set1_ps(sn[g]), sb = _mm512_set1_ps(sn[g + gstep - 1]);                      \
            for (int64_t j = 0; j < span; j += 32) {                                                              \
                const int64_t k = g * group + j;                                                                  \
                __m512 w0, w1;                                                                                    \
                if (B == 4 && !((k / 2) & 63))                                                                    \
                    _mm_prefetch((const char *)(qn + k / 2 + BYTE_PREFETCH), _MM_HINT_NTA);                       \
                values32(qn, k, B, &w0, &w1);                                                                     \
                w0 = _mm512_mul_ps(w0, sa), w1 = _mm512_mul_ps(w1, sb);                                           \
                _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                             \
                    acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * kk + k), acc[m]);                        \
                    acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * kk + k + 16), acc[m]);                   \
                }                                                                                                 \
            }                                                                                                     \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) for (int64_t h = g; h < g + gstep; h++)           \
                off[m] = fmaf(OFFSET(bn, sn, zero, h), sums[m * groups + h], off[m]);                            \
        }                                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            y[m * n + i] = _mm512_reduce_add_ps(acc[m]) + off[m] + (bias ? bias[i] : 0.0f);                       \
        break;                                                                                                    \
    }

#define ALL_ROWS(B)                                                                                               \
    BYTE_ROWS(B, 1) BYTE_ROWS(B, 2) BYTE_ROWS(B, 3) BYTE_ROWS(B, 4) BYTE_ROWS(B, 5) BYTE_ROWS(B, 6) BYTE_ROWS(B, 7)  \
    BYTE_ROWS(B, 8)
#elif STRATA_ISA == 256
/* The 8 bytes at q as float32. */
static inline __m256 bytes8(const uint8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* Values k .. k + 31 of a row as four times 8 floats (AVX-512's two times 16: v[0], v[1] its first 16, v[2], v[3]
   its second), from bytes or nibble pairs as values32 reads them. */
static inline void values32x8(const uint8_t *qn, int64_t k, int bits, __m256 v[4]) {
    if (bits == 8) {
        for (int j = 0; j < 4; j++) v[j] = bytes8(qn + k + 8 * j);
    } else {
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qn + k / 2)));
        const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qn + k / 2 + 8)));
        const __m256i fifteen = _mm256_set1_epi32(15);
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, fifteen));
        v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, fifteen));
        v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
        v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
    }
}

/* Rows x[0 .. R) (R <= AVX2_BYTE_ROWS) by output i, lanes 0-7 of AVX-512's accumulator in lo, 8-15 in hi. */
#define BYTE_ROWS(B, R)                                                                                           \
    case R: {                                                                                                     \
        __m256 lo[R], hi[R];                                                                                      \
        float off[R];                                                                                             \
        for (int m = 0; m < R; m++) lo[m] = hi[m] = _mm256_setzero_ps(), off[m] = 0.0f;                           \
        for (int64_t g = 0; g < groups; g += gstep) {                                                             \
            const __m256 sa = _mm256_set1_ps(sn[g]), sb = _mm256_set1_ps(sn[g + gstep - 1]);                      \
            for (int64_t j = 0; j < span; j += 32) {                                                              \
                const int64_t k = g * group + j;                                                                  \
                __m256 w[4];                                                                                      \
                if (B == 4 && !((k / 2) & 63))                                                                    \
                    _mm_prefetch((const char *)(qn + k / 2 + BYTE_PREFETCH), _MM_HINT_NTA);                       \
                values32x8(qn, k, B, w);                                                                          \
                for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(w[v], v < 2 ? sa : sb);                          \
                _Pragma("GCC unroll 4") for (int m = 0; m < R; m++) {                                             \
                    const float *xk = x + m * kk + k;                                                             \
                    lo[m] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xk), lo[m]);                                    \
                    hi[m] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xk + 8), hi[m]);                                \
                    lo[m] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xk + 16), lo[m]);                               \
                    hi[m] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xk + 24), hi[m]);                               \
                }                                                                                                 \
            }                                                                                                     \
            _Pragma("GCC unroll 4") for (int m = 0; m < R; m++) for (int64_t h = g; h < g + gstep; h++)           \
                off[m] = fmaf(OFFSET(bn, sn, zero, h), sums[m * groups + h], off[m]);                            \
        }                                                                                                         \
        for (int m = 0; m < R; m++)                                                                               \
            y[m * n + i] = strata_reduce16(lo[m], hi[m]) + off[m] + (bias ? bias[i] : 0.0f);                      \
        break;                                                                                                    \
    }

#define ALL_ROWS(B) BYTE_ROWS(B, 1) BYTE_ROWS(B, 2) BYTE_ROWS(B, 3) BYTE_ROWS(B, 4)

/* Rows [m0, m0 + r) of x and y by output i of the weight (sums and y as the caller holds them). */
static void byte_rows_part(const float *x0, int64_t r, int64_t kk, const uint8_t *qn, const float *sn,
                           const float *bn, float zero, const float *sums0, int64_t groups, int64_t group, int bits,
                           const float *bias, float *y0, int64_t n, int64_t i) {
    const float *x = x0, *sums = sums0;
    const int64_t gstep = group_step(group), span = group_span(group);
    float *y = y0;
    if (bits == 8)
        switch (r) { ALL_ROWS(8) }
    else
        switch (r) { ALL_ROWS(4) }
}
#endif

int strata_byte_rows(const float *x, int64_t rows, int64_t kk, const uint8_t *q, int bits, const float *s,
                     const float *b, float zero, int64_t n, int64_t group, const float *bias, float *y, int threads) {
#if STRATA_ISA
    if (rows < 1 || rows > BYTE_MAX_ROWS || kk < 1 || n < 1 || (bits != 8 && bits != 4) || !group_ok(kk, group, bits) ||
        threads < 1)
        return -1;
    const int64_t groups = kk / group;
#if STRATA_ISA == 512
    const int64_t gstep = group_step(group), span = group_span(group);
#endif
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
        const uint8_t *qn = q + i * (kk * bits / 8);
        const float *sn = s + i * groups, *bn = b ? b + i * groups : NULL;
        for (int64_t line = 0; bits == 4 && line < groups; line += 16) {
            _mm_prefetch((const char *)(sn + BYTE_PREFETCH_ROWS * groups + line), _MM_HINT_NTA);
            if (bn) _mm_prefetch((const char *)(bn + BYTE_PREFETCH_ROWS * groups + line), _MM_HINT_NTA);
        }
#if STRATA_ISA == 512
        if (bits == 8)
            switch (rows) { ALL_ROWS(8) }
        else
            switch (rows) { ALL_ROWS(4) }
#else
        for (int64_t m = 0; m < rows; m += AVX2_BYTE_ROWS)
            byte_rows_part(x + m * kk, rows - m < AVX2_BYTE_ROWS ? rows - m : AVX2_BYTE_ROWS, kk, qn, sn, bn, zero,
                           sums + m * groups, groups, group, bits, bias, y + m * n, n, i);
#endif
    }
    free(sums);
    return 0;
#else
    NO_ISA_PRODUCT();
#endif
}

/* The same product with the rows of x quantized to 8 bits (stages/byte_rows.py rule 7) and multiplied by integer
   dot products, as llama.cpp multiplies its quantized weights. Each block of 32 values of a row: d = absmax / 127,
   a = x * (1 / d) rounded to nearest even (0 where d is 0), clamped to +-127; X[m][g] = the sum over the blocks of
   group g of d * (the block's sum of a). Per output and row: the blocks' integer products (exact in 32 bits), each
   block's converted to float32 and added into one 8-lane accumulator, in k order, by one fused multiply-add times
   s[n][g] * d (nibbles: two blocks a step, lanes 0-3 the first's, 4-7 the second's), the lanes summed; then the
   offsets, b[n][g]
   times X[m][g] over the groups, 8 at a time (for bytes b + 128 s: they are multiplied as q - 128, |q - 128| <= 128,
   so a pair of products fits in 16 bits), then the bias. A row's values do not depend on the other rows of the
   call. 256-bit integer instructions on AVX2 and AVX-512 alike: the same sums on both. */
#if STRATA_ISA
/* A pair of blocks' scales as the nibble kernel's lanes take them: sa in lanes 0-3, sb in 4-7. */
static inline __m256 q8_scales(float sa, float sb) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sa)), _mm_set1_ps(sb), 1);
}

static inline float hsum8(__m256 v) {
    const __m128 t = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

/* Nibbles: k steps of 64 (two blocks), dd[m][pair] = [d_A x4, d_B x4]; pair P of every row by the scales SV. */
#define Q8_NIBBLE_PAIR(R, P, SV)                                                                                  \
    do {                                                                                                          \
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qn + 32 * (P)));                                \
        const __m256i wl = _mm256_and_si256(raw, low4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);   \
        const __m256 sv = (SV);                                                                                   \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                                     \
            const int8_t *am = a + m * kk + 64 * (P);                                                             \
            const __m256i lo = _mm256_loadu_si256((const __m256i *)am);                                           \
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(am + 32));                                    \
            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(wl, lo), _mm256_maddubs_epi16(wh, hi));      \
            const __m256 pf = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones16));                                 \
            const __m256 scale = _mm256_mul_ps(sv, _mm256_loadu_ps(dd + (m * pairs + (P)) * 8));                  \
            acc[m] = _mm256_fmadd_ps(pf, scale, acc[m]);                                                          \
        }                                                                                                         \
    } while (0)

/* Groups of 32 (per 1): 4 pairs a step, their 8 scales loaded at once; then any other pairs one by one. */
#define Q8_NIBBLE_ROWS(R)                                                                                         \
    case R: {                                                                                                     \
        __m256 acc[R];                                                                                            \
        for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();                                                 \
        int64_t p = 0;                                                                                            \
        for (; per == 1 && p + 4 <= pairs; p += 4) {                                                              \
            _mm_prefetch((const char *)(qn + 32 * p + BYTE_PREFETCH), _MM_HINT_NTA);                              \
            _mm_prefetch((const char *)(qn + 32 * p + 64 + BYTE_PREFETCH), _MM_HINT_NTA);                         \
            const __m256 s8 = _mm256_loadu_ps(sn + 2 * p);                                                        \
            Q8_NIBBLE_PAIR(R, p, _mm256_permutevar8x32_ps(s8, _mm256_load_si256(pick)));                          \
            Q8_NIBBLE_PAIR(R, p + 1, _mm256_permutevar8x32_ps(s8, _mm256_load_si256(pick + 1)));                  \
            Q8_NIBBLE_PAIR(R, p + 2, _mm256_permutevar8x32_ps(s8, _mm256_load_si256(pick + 2)));                  \
            Q8_NIBBLE_PAIR(R, p + 3, _mm256_permutevar8x32_ps(s8, _mm256_load_si256(pick + 3)));                  \
        }                                                                                                         \
        for (; p < pairs; p++) {                                                                                  \
            if (!(p & 1)) _mm_prefetch((const char *)(qn + 32 * p + BYTE_PREFETCH), _MM_HINT_NTA);               \
            Q8_NIBBLE_PAIR(R, p, q8_scales(sn[gh[4 * p]], sn[gh[4 * p + 2]])); /* blocks 2p and 2p + 1 */         \
        }                                                                                                         \
        for (int m = 0; m < R; m++) dot[m] = hsum8(acc[m]);                                                       \
        break;                                                                                                    \
    }

/* Bytes: k steps of 32 (one block), dd[m][block] = d; lanes 0-3 sum the block's first 16 values, 4-7 its last 16,
   scaled by their groups' scales (gh: the group of each half block). */
#define Q8_BYTE_ROWS(R)                                                                                           \
    case R: {                                                                                                     \
        __m256 acc[R];                                                                                            \
        for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();                                                 \
        for (int64_t blk = 0; blk < blocks; blk++) {                                                              \
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qn + 32 * blk)), top);       \
            const __m256i wabs = _mm256_abs_epi8(w);                                                              \
            const __m256 sv = q8_scales(sn[gh[2 * blk]], sn[gh[2 * blk + 1]]);                                    \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                                 \
                const __m256i am = _mm256_loadu_si256((const __m256i *)(a + m * kk + 32 * blk));                 \
                const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(am, w));                          \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones16)),                      \
                                         _mm256_mul_ps(sv, _mm256_set1_ps(dd[m * blocks + blk])), acc[m]);        \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < R; m++) dot[m] = hsum8(acc[m]);                                                       \
        break;                                                                                                    \
    }
#define Q8_ALL(M) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8)

/* The rows of x as 8-bit blocks: a [rows][kk] int8, for nibbles each pair of blocks A, B reordered A 0-15, B 0-15,
   A 16-31, B 16-31 (the 32 bytes of the pair's nibbles give, low nibbles then high ones, the values in that
   order); dd (nibbles: [rows][kk / 64][8], bytes: [rows][kk / 32]); sums [rows][kk / group] (X above). Eight values
   at a time: the absmax by max (a NaN skipped, as fabsf(v) > amax skips it), each value x * (1 / d) rounded to
   nearest even and clamped as nearbyintf and two comparisons would, the halves' sums in integers. */
static inline int hsum8i(__m256i v) {
    const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i u = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
}

static void quantize_rows8(const float *x, int64_t rows, int64_t kk, int64_t group, int bits, int8_t *a, float *dd,
                           float *sums) {
    const int64_t blocks = kk / 32, per = group < 32 ? 1 : group / 32, groups = kk / group;
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the packs' 4-byte pieces back in order */
    for (int64_t m = 0; m < rows; m++)
        for (int64_t blk = 0, g = 0, in = 0; blk < blocks; blk++) { /* g: blk / per, in: blk % per */
            const float *xb = x + m * kk + blk * 32;
            __m256 xv[4], amax8 = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++)
                xv[j] = _mm256_loadu_ps(xb + 8 * j), amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, xv[j]), amax8);
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            __m256i v[4];
            for (int j = 0; j < 4; j++) {
                const __m256 r = _mm256_round_ps(_mm256_mul_ps(xv[j], _mm256_set1_ps(id)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            }
            const int sum[2] = {hsum8i(_mm256_add_epi32(v[0], v[1])), hsum8i(_mm256_add_epi32(v[2], v[3]))};
            const __m256i q = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
            int8_t *ab = a + m * kk + (bits == 4 ? (blk & ~(int64_t)1) * 32 + (blk & 1) * 16 : blk * 32);
            if (bits == 4) { /* values 16-31 32 bytes on, after the pair's other block's first 16 */
                _mm_storeu_si128((__m128i *)ab, _mm256_castsi256_si128(q));
                _mm_storeu_si128((__m128i *)(ab + 32), _mm256_extracti128_si256(q, 1));
            } else {
                _mm256_storeu_si256((__m256i *)ab, q);
            }
            if (bits == 4)
                for (int j = 0; j < 4; j++) dd[m * blocks * 4 + (blk / 2) * 8 + (blk & 1) * 4 + j] = d;
            else
                dd[m * blocks + blk] = d;
            if (group == 16) { /* two groups a block */
                sums[m * groups + 2 * blk] = d * (float)sum[0];
                sums[m * groups + 2 * blk + 1] = d * (float)sum[1];
                continue;
            }
            float *at = sums + m * groups + g;
            *at = (in ? *at : 0.0f) + d * (float)(sum[0] + sum[1]);
            if (++in == per) g++, in = 0;
        }
}
#endif

int strata_byte_rows_q8(const float *x, int64_t rows, int64_t kk, const uint8_t *q, int bits, const float *s,
                        const float *b, float zero, int64_t n, int64_t group, const float *bias, float *y,
                        int threads) {
#if STRATA_ISA
    if (rows < 1 || rows > BYTE_MAX_ROWS || kk < 1 || n < 1 || (bits != 8 && bits != 4) || !group_ok(kk, group, bits) ||
        (bits == 4 && kk % 64) || threads < 1)
        return -1;
    const int64_t groups = kk / group, blocks = kk / 32, pairs = kk / 64;
    int8_t *a = malloc((size_t)(rows * kk));
    float *dd = malloc(sizeof(float) * rows * blocks * 4), *sums = malloc(sizeof(float) * rows * groups);
    int32_t *gh = malloc(sizeof(int32_t) * blocks * 2); /* the group of each half block */
    if (!a || !dd || !sums || !gh) {
        free(a), free(dd), free(sums), free(gh);
        return -3;
    }
    quantize_rows8(x, rows, kk, group, bits, a, dd, sums);
    for (int64_t half = 0, g = 0, in = 0; half < 2 * blocks; half++) { /* 16 * half / group, without dividing */
        gh[half] = (int32_t)g;
        if ((in += 16) == group) g++, in = 0;
    }
    const int64_t per = group / 32; /* 1: scales of pairs taken from 8 at a time by `pick` (nibbles: group >= 32) */
    static const int32_t pick_[4][8] __attribute__((aligned(32))) = {
        {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5}, {6, 6, 6, 6, 7, 7, 7, 7}};
    const __m256i *pick = (const __m256i *)pick_;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *qn = q + i * (kk * bits / 8);
        const float *sn = s + i * groups, *bn = b ? b + i * groups : NULL;
        const __m256i low4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(-128), ones16 = _mm256_set1_epi16(1);
        float dot[BYTE_MAX_ROWS];
        (void)low4, (void)top, (void)pairs;
        for (int64_t line = 0; line < groups; line += 16) {
            _mm_prefetch((const char *)(sn + BYTE_PREFETCH_ROWS * groups + line), _MM_HINT_NTA);
            if (bn) _mm_prefetch((const char *)(bn + BYTE_PREFETCH_ROWS * groups + line), _MM_HINT_NTA);
        }
        if (bits == 8)
            switch (rows) { Q8_ALL(Q8_BYTE_ROWS) }
        else
            switch (rows) { Q8_ALL(Q8_NIBBLE_ROWS) }
        /* the offsets: 8 groups a step, then the rest in order; none for bytes whose zero point is 128 (Q8_0: b +
           128 s is 0 in every group) */
        const int none = bits == 8 && !bn && zero == 128.0f;
        for (int64_t m = 0; m < rows; m++) {
            const float *xs = sums + m * groups;
            __m256 o8 = _mm256_setzero_ps();
            int64_t g = 0;
            for (; !none && g + 8 <= groups; g += 8) {
                const __m256 s8 = _mm256_loadu_ps(sn + g);
                __m256 bg = bn ? _mm256_loadu_ps(bn + g) : _mm256_mul_ps(_mm256_set1_ps(-zero), s8);
                if (bits == 8) bg = _mm256_fmadd_ps(_mm256_set1_ps(128.0f), s8, bg);
                o8 = _mm256_fmadd_ps(bg, _mm256_loadu_ps(xs + g), o8);
            }
            float off = hsum8(o8);
            for (; !none && g < groups; g++) {
                const float bg = OFFSET(bn, sn, zero, g);
                off = fmaf(bits == 8 ? fmaf(128.0f, sn[g], bg) : bg, xs[g], off);
            }
            y[m * n + i] = dot[m] + off + (bias ? bias[i] : 0.0f);
        }
    }
    free(a), free(dd), free(sums), free(gh);
    return 0;
#else
    NO_ISA_PRODUCT();
#endif
}

/* f rounded to bfloat16 to nearest even (finite values), as store_bf16 rounds. */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The whole weight, dequantized: out[n][k] = s[n][g] * q[n][k] + b[n][g] by one fused multiply-add in float32, into
   float32 `out` (bf16 0) or rounded to bfloat16 to nearest even (bf16 1: `out` holds uint16 words), the rows shared
   statically by `threads` OpenMP threads. A prefill piece multiplies it by one GEMM (stages/byte_rows.py rule 3).
   Returns 0, -1 on arguments it refuses, -2 when built without the instructions. */
#define HALF_BF16 _mm256_set1_epi32(0x7FFF) /* AVX2: rounding to bfloat16 adds this and the kept word's last bit */
int strata_byte_dequant(const uint8_t *q, int bits, const float *s, const float *b, float zero, int64_t n, int64_t kk,
                        int64_t group, void *out, int bf16, int threads) {
    if (n < 1 || kk < 1 || (bits != 8 && bits != 4) || !group_ok(kk, group, bits) || threads < 1)
        return -1;
#if STRATA_ISA
    const int64_t groups = kk / group, gstep = group_step(group), span = group_span(group);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *qn = q + i * (kk * bits / 8);
        for (int64_t g = 0; g < groups; g += gstep) {
            const float *sn = s + i * groups, *bn = b ? b + i * groups : NULL;
            const float sg = sn[g], bg = OFFSET(bn, sn, zero, g);
            const float sh = sn[g + gstep - 1], bh = OFFSET(bn, sn, zero, g + gstep - 1); /* the last 16 values' */
            for (int64_t k = g * group; k < g * group + span; k += 32) {
#if STRATA_ISA == 512
                __m512 v0, v1;
                values32(qn, k, bits, &v0, &v1);
                v0 = _mm512_fmadd_ps(_mm512_set1_ps(sg), v0, _mm512_set1_ps(bg));
                v1 = _mm512_fmadd_ps(_mm512_set1_ps(sh), v1, _mm512_set1_ps(bh));
                if (bf16) {
                    store_bf16((uint16_t *)out + i * kk + k, 0xFFFF, v0);
                    store_bf16((uint16_t *)out + i * kk + k + 16, 0xFFFF, v1);
                } else {
                    _mm512_storeu_ps((float *)out + i * kk + k, v0);
                    _mm512_storeu_ps((float *)out + i * kk + k + 16, v1);
                }
#else
                __m256 v[4];
                values32x8(qn, k, bits, v);
                for (int j = 0; j < 4; j++)
                    v[j] = _mm256_fmadd_ps(_mm256_set1_ps(j < 2 ? sg : sh), v[j], _mm256_set1_ps(j < 2 ? bg : bh));
                if (bf16) {
                    __m256i r[4];
                    for (int j = 0; j < 4; j++) { /* round to nearest even, as store_bf16 */
                        const __m256i u = _mm256_castps_si256(v[j]);
                        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
                        r[j] = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(HALF_BF16, odd)), 16);
                    }
                    uint16_t *dst = (uint16_t *)out + i * kk + k;
                    for (int j = 0; j < 4; j += 2) /* pack works per 128-bit lane: put the quarters back in order */
                        _mm256_storeu_si256((__m256i *)(dst + 8 * j),
                                            _mm256_permute4x64_epi64(_mm256_packus_epi32(r[j], r[j + 1]), 0xD8));
                } else {
                    for (int j = 0; j < 4; j++) _mm256_storeu_ps((float *)out + i * kk + k + 8 * j, v[j]);
                }
#endif
            }
        }
    }
    return 0;
#else
    (void)q, (void)s, (void)b, (void)zero, (void)out, (void)bf16;
    return -2;
#endif
}

/* Rows ids[0 .. nids) of an [n, kk] weight, each dequantized by strata_byte_dequant (the same values), into out
   [nids, kk] (an embedding's lookup, stages/byte_rows.py ByteLinear.rows): no gathered copy of the rows' bytes,
   scales and offsets. Returns 0, -1 on arguments it refuses (an id outside [0, n): nothing written), or what
   strata_byte_dequant returned. */
int strata_byte_dequant_rows(const uint8_t *q, int bits, const float *s, const float *b, float zero, const int64_t *ids,
                             int64_t nids, int64_t n, int64_t kk, int64_t group, void *out, int bf16, int threads) {
    if (nids < 1 || n < 1 || kk < 1 || (bits != 8 && bits != 4) || !group_ok(kk, group, bits) || threads < 1)
        return -1;
    for (int64_t r = 0; r < nids; r++)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    const int64_t groups = kk / group, row_bytes = kk * bits / 8;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (nids > 1) reduction(| : failed)
    for (int64_t r = 0; r < nids; r++) {
        const int64_t i = ids[r];
        failed |= strata_byte_dequant(q + i * row_bytes, bits, s + i * groups, b ? b + i * groups : NULL, zero, 1, kk,
                                      group, (char *)out + r * kk * (bf16 ? 2 : 4), bf16, 1) != 0;
    }
    return failed ? -2 : 0;
}

/* One int4 plane in the layout torch's CPU packer writes (stages/quant_linear.py checks it: `cpu_block`), added
   into `acc`, the weight transposed: float32 [k, n] (row k holds the n outputs' values at k). `packed` is bytes
   [rows / block][k][block / 2], `block` the packer's row block (64 where its kernel is built for AVX-512, 32 for
   AVX2): the low nibble of byte [r][k][i] is row block * r + i, its high nibble row block * r + block / 2 + i; sz
   is [k / group][rows][2], each row's scale and zero in float32; rows >= n, a multiple of block. Per value, as
   stages/quant_linear.py's QuantLinear.dequantize runs it in torch, each operation rounded to float32 on its own (no
   fused multiply-add): base = zero - 8 * scale; w = v * scale + base; acc = w (`first`) or acc + w; with `out16`
   (the last plane of a bfloat16 weight) that sum goes, rounded to bfloat16 to nearest even, to out16 [k, n]
   instead. Written transposed, each k of a row block is `block` contiguous values; a GEMM reads either layout.
   Returns 0, -1 on arguments it refuses. */
__attribute__((optimize("fp-contract=off"))) int strata_int4pack_dequant_t(const uint8_t *packed, const float *sz,
                                                                          int64_t rows, int64_t block, int64_t n,
                                                                          int64_t kk, int64_t group, int first,
                                                                          float *acc, uint16_t *out16, int threads) {
    if (n < 1 || (block != 64 && block != 32) || rows < n || rows % block || kk < 1 || group < 1 || kk % group ||
        threads < 1)
        return -1;
    const int64_t blocks = rows / block, groups = kk / group, half = block / 2;
#if STRATA_ISA == 512
    if (block == 64) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < blocks; r++) {
            const int64_t n0 = r * 64, width = n - n0 < 64 ? n - n0 : 64;
            __mmask16 mask[4];
            for (int j = 0; j < 4; j++) {
                const int64_t left = width - 16 * j;
                mask[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            }
            for (int64_t g = 0; g < groups; g++) {
                float sc[64] __attribute__((aligned(64))), base[64] __attribute__((aligned(64)));
                for (int i = 0; i < 64; i++) {
                    const float *e = sz + ((g * rows) + n0 + i) * 2;
                    sc[i] = e[0];
                    base[i] = e[1] - 8.0f * e[0];
                }
                for (int64_t k = g * group; k < (g + 1) * group; k++) {
                    const uint8_t *b = packed + (r * kk + k) * 32;
                    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                    const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
                    const __m512i fifteen = _mm512_set1_epi32(15);
                    const __m512i v[4] = {_mm512_and_si512(b0, fifteen), _mm512_and_si512(b1, fifteen),
                                          _mm512_srli_epi32(b0, 4), _mm512_srli_epi32(b1, 4)};
                    float *dst = acc + k * n + n0;
                    for (int j = 0; j < 4; j++) {
                        if (!mask[j]) continue;
                        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(v[j]), _mm512_load_ps(sc + 16 * j));
                        const __m512 w = _mm512_add_ps(scaled, _mm512_load_ps(base + 16 * j));
                        const __m512 out =
                            first ? w : _mm512_add_ps(_mm512_maskz_loadu_ps(mask[j], dst + 16 * j), w);
                        if (out16) /* the last plane: rounded to bfloat16 */
                            store_bf16(out16 + k * n + n0 + 16 * j, mask[j], out);
                        else
                            _mm512_mask_storeu_ps(dst + 16 * j, mask[j], out);
                    }
                }
            }
        }
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < blocks; r++) {
        const int64_t n0 = r * block, width = n - n0 < block ? n - n0 : block;
        for (int64_t g = 0; g < groups; g++) {
            float sc[64], base[64];
            for (int64_t i = 0; i < block; i++) {
                const float *e = sz + ((g * rows) + n0 + i) * 2;
                sc[i] = e[0];
                base[i] = e[1] - 8.0f * e[0];
            }
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                const uint8_t *b = packed + (r * kk + k) * half;
                for (int64_t i = 0; i < width; i++) {
                    const int v = i < half ? b[i] & 15 : b[i - half] >> 4;
                    const float w = (float)v * sc[i] + base[i];
                    const float out = first ? w : acc[k * n + n0 + i] + w;
                    if (out16) /* the last plane: rounded to bfloat16 */
                        out16[k * n + n0 + i] = round_bf16(out);
                    else
                        acc[k * n + n0 + i] = out;
                }
            }
        }
    }
    return 0;
}
