/* Decode attention of a CPU stage straight through the chunk tables (stages/cpu_attention.py).

   One query token per entry. Entry e (slot slots[e]) sees the cells [lo[e], lens[e]) of its table; cell p lives at
   flat cell tables[slots[e] * table_stride + p / C] * C + p % C of the layer's pool arrays
   k, v [cells, kv_heads, head_dim]: float32, or int8 with k_scale, v_scale [cells, kv_heads] (value = q * scale,
   as stages/attention.py dequantizes), or bfloat16 (each row widened to float32 once per read). Query head r reads
   kv head r / group, as GQA reads.

   A part (a range of one entry's cells, every head) goes by blocks of at most BLOCK cells inside one chunk:
   scores of the block, then an online softmax (running max and sum per query head, the sums rescaled when the
   max grows), then the block's V rows added with their weights. Nothing is gathered or copied: each K/V row
   of the pool is read once, all its kv heads together. The parts of an entry are merged by their maxima.

   exp is exp_f of cpu_exp.h, so the softmax loops vectorize without libmvec.
   Built with -O3 -march=native -fopenmp for the CPU it runs on; the parts are shared by `threads` OpenMP
   threads (the same libgomp torch has loaded). Returns 0, or -1 on arguments it refuses. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_exp.h"

#define BLOCK 64
#define MAX_HEADS 128
#define MAX_ROW 8192 /* kv_heads * head_dim of an int8 or bfloat16 pool */
#define KV_F32 0
#define KV_INT8 1
#define KV_BF16 2

/* Cells [p0, p1) of one entry, every kv head: out the unnormalised sum of weighted V rows per query head
   [heads, head_dim], m the running max and l the sum of weights per query head (merged in the caller).
   T is the pool's element type; KROW(c) / VROW(c) cell c's K / V row of every kv head as floats: the pool's own
   row for float32, the row times its scales in a buffer of this thread for int8 (each row converted once,
   then read by every query head). */
#define DEFINE_RANGE(NAME, T, KROW, VROW)                                                                      \
static inline __attribute__((always_inline)) void NAME(                                                        \
        const float *q, const T *k, const T *v, const float *k_scale, const float *v_scale,                    \
        const int32_t *table, int p0, int p1, int kv_heads, int group, int head_dim, int chunk_cells,          \
        float scale, float *out, float *m, float *l) {                                                         \
    static __thread float s[MAX_HEADS][BLOCK];                                                                 \
    static __thread float row[MAX_ROW];                                                                        \
    const int heads = kv_heads * group;                                                                        \
    const int64_t row_stride = (int64_t)kv_heads * head_dim;                                                   \
    (void)k_scale;                                                                                             \
    (void)v_scale;                                                                                             \
    (void)row;                                                                                                 \
    for (int r = 0; r < heads; r++) {                                                                          \
        m[r] = -FLT_MAX;                                                                                       \
        l[r] = 0.0f;                                                                                           \
    }                                                                                                          \
    memset(out, 0, sizeof(float) * heads * head_dim);                                                          \
    int p = p0;                                                                                                \
    while (p < p1) {                                                                                           \
        const int offset = p % chunk_cells;                                                                    \
        int n = chunk_cells - offset;                                                                          \
        if (n > BLOCK) n = BLOCK;                                                                              \
        if (n > p1 - p) n = p1 - p;                                                                            \
        const int64_t cell = (int64_t)table[p / chunk_cells] * chunk_cells + offset;                           \
        for (int i = 0; i < n; i++) { /* one K row of every kv head: one contiguous read */                   \
            const float *kr = KROW(cell + i);                                                                  \
            for (int r = 0; r < heads; r++) {                                                                  \
                const int h = r / group;                                                                       \
                const float *qr = q + (int64_t)r * head_dim;                                                   \
                const float *kh = kr + (int64_t)h * head_dim;                                                  \
                float dot = 0.0f;                                                                              \
                _Pragma("omp simd reduction(+ : dot)")                                                         \
                for (int d = 0; d < head_dim; d++) dot += qr[d] * kh[d];                                       \
                s[r][i] = dot * scale;                                                                         \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < heads; r++) {                                                                      \
            float mb = m[r];                                                                                   \
            for (int i = 0; i < n; i++) mb = s[r][i] > mb ? s[r][i] : mb;                                      \
            const float corr = exp_f(m[r] - mb);                                                             \
            float sum = 0.0f;                                                                                  \
            _Pragma("omp simd reduction(+ : sum)")                                                             \
            for (int i = 0; i < n; i++) {                                                                      \
                s[r][i] = exp_f(s[r][i] - mb);                                                               \
                sum += s[r][i];                                                                                \
            }                                                                                                  \
            l[r] = l[r] * corr + sum;                                                                          \
            m[r] = mb;                                                                                         \
            if (corr != 1.0f) {                                                                                \
                float *o = out + (int64_t)r * head_dim;                                                        \
                _Pragma("omp simd")                                                                            \
                for (int d = 0; d < head_dim; d++) o[d] *= corr;                                               \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < n; i++) {                                                                          \
            const float *vr = VROW(cell + i);                                                                  \
            for (int r = 0; r < heads; r++) {                                                                  \
                const int h = r / group;                                                                       \
                float *o = out + (int64_t)r * head_dim;                                                        \
                const float *vh = vr + (int64_t)h * head_dim, w = s[r][i];                                     \
                _Pragma("omp simd")                                                                            \
                for (int d = 0; d < head_dim; d++) o[d] += w * vh[d];                                          \
            }                                                                                                  \
        }                                                                                                      \
        p += n;                                                                                                \
    }                                                                                                          \
}

/* An int8 row [kv_heads, head_dim] times its per-head scales, into `out`. */
static inline const float *dequant_row(const int8_t *x, const float *scales, int kv_heads, int head_dim,
                                       float *out) {
    for (int h = 0; h < kv_heads; h++) {
        const float sc = scales[h];
        const int8_t *xh = x + (int64_t)h * head_dim;
        float *oh = out + (int64_t)h * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) oh[d] = (float)xh[d] * sc;
    }
    return out;
}

/* A bfloat16 row [kv_heads * head_dim] widened to float32 into `out`. */
static inline const float *widen_row(const uint16_t *x, int64_t width, float *out) {
#pragma omp simd
    for (int64_t d = 0; d < width; d++) {
        const uint32_t u = (uint32_t)x[d] << 16;
        memcpy(out + d, &u, sizeof u);
    }
    return out;
}

#define K_F32(c) (k + (c) * row_stride)
#define V_F32(c) (v + (c) * row_stride)
#define K_I8(c) dequant_row(k + (c) * row_stride, k_scale + (c) * kv_heads, kv_heads, head_dim, row)
#define V_I8(c) dequant_row(v + (c) * row_stride, v_scale + (c) * kv_heads, kv_heads, head_dim, row)
DEFINE_RANGE(range_f32, float, K_F32, V_F32)
DEFINE_RANGE(range_i8, int8_t, K_I8, V_I8)
#define K_BF(c) widen_row(k + (c) * row_stride, row_stride, row)
#define V_BF(c) widen_row(v + (c) * row_stride, row_stride, row)
DEFINE_RANGE(range_bf16, uint16_t, K_BF, V_BF)

/* One part through range_f32, range_i8 or range_bf16 (kv_kind KV_F32, KV_INT8, KV_BF16), head_dim a constant for
   the usual 64 and 128 (the loops over it then unroll into whole vectors) and a variable otherwise. */
#define PART_ARGS q, k, v, k_scale, v_scale, table, p0, p1, kv_heads, group
#define PART_TAIL chunk_cells, scale, out, m, l
static void part(const float *q, const void *k, const void *v, const float *k_scale, const float *v_scale,
                 int kv_kind, const int32_t *table, int p0, int p1, int kv_heads, int group, int head_dim,
                 int chunk_cells, float scale, float *out, float *m, float *l) {
    if (kv_kind == KV_BF16) {
        if (head_dim == 64) range_bf16(PART_ARGS, 64, PART_TAIL);
        else if (head_dim == 128) range_bf16(PART_ARGS, 128, PART_TAIL);
        else range_bf16(PART_ARGS, head_dim, PART_TAIL);
    } else if (kv_kind == KV_INT8) {
        if (head_dim == 64) range_i8(PART_ARGS, 64, PART_TAIL);
        else if (head_dim == 128) range_i8(PART_ARGS, 128, PART_TAIL);
        else range_i8(PART_ARGS, head_dim, PART_TAIL);
    } else {
        if (head_dim == 64) range_f32(PART_ARGS, 64, PART_TAIL);
        else if (head_dim == 128) range_f32(PART_ARGS, 128, PART_TAIL);
        else range_f32(PART_ARGS, head_dim, PART_TAIL);
    }
}

/* q [entries, kv_heads * group, head_dim]; out the same shape; kv_kind KV_F32, KV_INT8 or KV_BF16; k_scale,
   v_scale the int8 pool's scales, NULL otherwise.
   Entry e's cells are cut into parts of `part_cells` from lo[e] / part_cells * part_cells on, parts
   part_first[e] .. part_first[e + 1] - 1, so one long conversation still shares out over the threads; `work`
   holds each part's partial sums: parts_total * heads * (head_dim + 2) floats. */
int strata_paged_decode(const float *q, const void *k, const void *v, const float *k_scale, const float *v_scale,
                        int kv_kind, const int32_t *tables, int64_t table_stride, const int32_t *slots,
                        const int32_t *lens, const int32_t *lo, int entries, int kv_heads, int group, int head_dim,
                        int chunk_cells, float scale, int part_cells, const int32_t *part_first, float *work,
                        float *out, int threads) {
    const int heads = kv_heads * group;
    if (entries < 0 || kv_heads < 1 || group < 1 || heads > MAX_HEADS || head_dim < 1 || chunk_cells < 1 ||
        part_cells < 1 || threads < 1 || kv_kind < KV_F32 || kv_kind > KV_BF16 ||
        (kv_kind == KV_INT8 && (!k_scale || !v_scale)) || (kv_kind != KV_F32 && kv_heads * head_dim > MAX_ROW))
        return -1;
    const int parts = part_first[entries];
    const int64_t part_floats = (int64_t)heads * (head_dim + 2);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < parts; t++) {
            int e = 0;
            while (part_first[e + 1] <= t) e++;
            const int first = lo[e] / part_cells * part_cells + (t - part_first[e]) * part_cells;
            const int p0 = first > lo[e] ? first : lo[e];
            const int p1 = first + part_cells < lens[e] ? first + part_cells : lens[e];
            float *w = work + t * part_floats;
            const float *qe = q + (int64_t)e * heads * head_dim;
            const int32_t *table = tables + (int64_t)slots[e] * table_stride;
            float *m = w + (int64_t)heads * head_dim, *l = w + (int64_t)heads * (head_dim + 1);
            part(qe, k, v, k_scale, v_scale, kv_kind, table, p0, p1, kv_heads, group, head_dim, chunk_cells, scale, w,
                 m, l);
        }
#pragma omp for schedule(static)
        for (int er = 0; er < entries * heads; er++) {  /* merge the parts of entry e, query head r */
            const int e = er / heads, r = er % heads;
            float big = -FLT_MAX, total = 0.0f;
            for (int t = part_first[e]; t < part_first[e + 1]; t++) {
                const float mt = work[t * part_floats + (int64_t)heads * head_dim + r];
                big = mt > big ? mt : big;
            }
            float *o = out + (int64_t)er * head_dim;
            memset(o, 0, sizeof(float) * head_dim);
            for (int t = part_first[e]; t < part_first[e + 1]; t++) {
                const float *w = work + t * part_floats;
                const float f = exp_f(w[(int64_t)heads * head_dim + r] - big);
                total += f * w[(int64_t)heads * (head_dim + 1) + r];
                const float *a = w + (int64_t)r * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) o[d] += f * a[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    return 0;
}
