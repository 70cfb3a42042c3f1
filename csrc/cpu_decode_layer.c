/* A dense decoder layer of a CPU stage over a step of decode rows, in one call (stages/decode_layer.py).

   The layer of stages/model.py, step for step, with the functions its Python path calls (the four sources
   included below, compiled into this library), in the same order and with the same arguments, so the layer's
   output and the K/V rows it writes are the same bit for bit:

       h = rms_norm(x) * in_norm
       qkv = h W_qkv (+ b)                      q and k heads normed (q_norm, k_norm) and rotated in place
                                                (W_qkv in one form, or its rows in two: qkv, then qkv_rest)
       K/V rows of each row's cell <- its k and v heads
       attn = decode attention of the q heads through the tables
       s = x + attn W_o (+ b),  h = rms_norm(s) * post_norm
       out = s + (silu(gate) * up)(h W_gate_up (+ b)) W_down (+ b)

   The pool's arrays are [cells, kv_heads * head_dim]: float32 (k_scale, v_scale NULL), or int8 with float32
   scales [cells, kv_heads], each new row quantized per kv head as stages/attention.py's quantize_int8 does
   (scale = absmax / 127, value = x / max(scale, FLT_MIN) rounded half to even, clamped to +-127). `out` may be
   `x`. Scratch holds strata_decode_layer_scratch(...) floats. Returns 0, -1 on arguments it refuses (nothing
   written), or what a product returned. */
#include <float.h>
#include <math.h>

#include "cpu_byte_rows.c"
#include "cpu_exp.h"
#include "cpu_layer_ops.c"
#include "cpu_packed_rows.c"
#include "cpu_paged_decode.c"

typedef struct {
    const float *panels, *bias; /* oneDNN's packed panels (cpu_packed_rows.c); bias [n] or NULL */
    int64_t n, k, kp;
    const uint8_t *bytes; /* or, with panels NULL, bytes ([n, k], or [n, k / 2] at 4 bits) and per group a scale */
    const float *scale, *offset; /* and an offset, [n, k / group] (cpu_byte_rows.c; offset NULL: -zero * scale) */
    float zero;
    int64_t group;
    int bits;
    int int8; /* byte rows: the rows of x as 8-bit rows (cpu_byte_rows.c strata_byte_rows_q8) */
} strata_weight;

typedef int (*byte_rows_fn)(const float *, int64_t, int64_t, const uint8_t *, int, const float *, const float *,
                            float, int64_t, int64_t, const float *, float *, int);

/* y [rows, n] = x [rows, k] times the weight (+ bias), by whichever kernel reads its form. */
static int product(const strata_weight *w, const float *x, int64_t rows, float *y, int threads) {
    if (w->panels) return strata_packed_rows(x, rows, w->k, w->panels, w->n, w->kp, w->bias, y, threads);
    if (w->bytes) {
        const byte_rows_fn f = w->int8 ? strata_byte_rows_q8 : strata_byte_rows;
        return f(x, rows, w->k, w->bytes, w->bits, w->scale, w->offset, w->zero, w->n, w->group, w->bias, y, threads);
    }
    return -1;
}

/* y [rows, a.n + b.n] = x times the rows of a, then those of b (b.n 0: a alone), each product into `stage`
   [rows, a.n + b.n] first and its rows then copied into place. */
static int product_parts(const strata_weight *a, const strata_weight *b, const float *x, int64_t rows, float *y,
                         float *stage, int threads) {
    if (!b->n) return product(a, x, rows, y, threads);
    const int64_t n = a->n + b->n;
    int rc;
    if ((rc = product(a, x, rows, stage, threads)) != 0 || (rc = product(b, x, rows, stage + rows * a->n, threads)))
        return rc;
    for (int64_t t = 0; t < rows; t++) {
        memcpy(y + t * n, stage + t * a->n, sizeof(float) * a->n);
        memcpy(y + t * n + a->n, stage + rows * a->n + t * b->n, sizeof(float) * b->n);
    }
    return 0;
}

typedef struct { /* what stays the same for a layer */
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm NULL: no q/k norm */
    strata_weight qkv, o, gate_up, down;
    strata_weight qkv_rest; /* n 0: none; else the fused qkv's last rows, held in another form than its first qkv.n
                               (a Q4_K_M layer's Q6_K v rows after its Q4_K q and k: stages/quant_linear.py RowStack) */
} strata_layer;

typedef struct { /* what stays the same over a step's layers */
    int64_t rows;
    int hidden, heads, kv_heads, head_dim, threads;
    float eps, scale;
    const float *cos, *sin;   /* [rows, head_dim] */
    const int64_t *cells;     /* [rows]: the flat pool cell of each row's new K/V */
    const int32_t *tables;    /* the attention plan of stages/cpu_attention.py */
    int64_t table_stride;
    const int32_t *slots, *lens, *lo, *part_first;
    int chunk_cells, part_cells;
    float *work;
    float *scratch;
    int64_t scratch_floats;
} strata_step;

/* One new K or V row (kv_heads heads of head_dim) into cell `cell` of a float32 pool, or quantized into an int8
   pool and its scales. */
static void put_row(const float *src, void *pool, float *scales, int64_t cell, int kv_heads, int head_dim) {
    const int64_t width = (int64_t)kv_heads * head_dim;
    if (!scales) {
        memcpy((float *)pool + cell * width, src, sizeof(float) * width);
        return;
    }
    int8_t *dst = (int8_t *)pool + cell * width;
    for (int h = 0; h < kv_heads; h++) {
        const float *x = src + (int64_t)h * head_dim;
        float amax = 0.0f;
        for (int i = 0; i < head_dim; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float scale = amax / 127.0f, by = scale < FLT_MIN ? FLT_MIN : scale;
        for (int i = 0; i < head_dim; i++) {
            const float q = nearbyintf(x[i] / by);
            dst[(int64_t)h * head_dim + i] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
        }
        scales[cell * kv_heads + h] = scale;
    }
}

/* qkv_n: the fused qkv's rows, both parts (qkv.n + qkv_rest.n). */
int64_t strata_decode_layer_scratch(int64_t rows, int64_t hidden, int64_t qkv_n, int64_t q_width, int64_t gate_up_n) {
    return rows * (2 * hidden + 2 * qkv_n + 2 * q_width + gate_up_n + gate_up_n / 2);
}

int strata_decode_layer(const strata_layer *L, const strata_step *S, void *k_pool, void *v_pool, float *k_scale,
                        float *v_scale, const float *x, float *out) {
    const int64_t rows = S->rows, hidden = S->hidden, hd = S->head_dim;
    const int64_t q_width = (int64_t)S->heads * hd, kv_width = (int64_t)S->kv_heads * hd;
    const int64_t inter = L->gate_up.n / 2, qkv_n = L->qkv.n + L->qkv_rest.n;
    if (rows < 1 || rows > MAX_ROWS || S->kv_heads < 1 || S->heads % S->kv_heads || L->qkv.k != hidden ||
        (L->qkv_rest.n && L->qkv_rest.k != hidden) || qkv_n < q_width + 2 * kv_width || L->o.k != q_width ||
        L->o.n != hidden || L->gate_up.k != hidden || L->gate_up.n % 2 || L->down.k != inter || L->down.n != hidden ||
        S->scratch_floats < strata_decode_layer_scratch(rows, hidden, qkv_n, q_width, L->gate_up.n) ||
        (!k_scale) != (!v_scale) || (k_scale && kv_width > MAX_ROW))
        return -1;
    float *h = S->scratch, *mixed = h + rows * hidden, *qkv = mixed + rows * hidden, *q = qkv + rows * qkv_n;
    float *attn = q + rows * q_width, *gate_up = attn + rows * q_width, *mlp = gate_up + rows * L->gate_up.n;
    float *stage = mlp + rows * inter; /* [rows, qkv_n]: the parts of a qkv of two forms */
    const int threads = S->threads;
    int rc;
#define TRY(call)                                                                                                 \
    if ((rc = (call)) != 0) return rc
    TRY(strata_rms_norm(x, NULL, NULL, L->in_norm, h, rows, (int)hidden, S->eps, threads));
    TRY(product_parts(&L->qkv, &L->qkv_rest, h, rows, qkv, stage, threads));
    TRY(strata_qk_norm_rope(qkv, qkv_n, rows, S->heads, S->kv_heads, (int)hd, L->q_norm, L->k_norm, S->eps, S->cos,
                            S->sin, threads));
    for (int64_t t = 0; t < rows; t++) {
        const float *row = qkv + t * qkv_n;
        memcpy(q + t * q_width, row, sizeof(float) * q_width);
        put_row(row + q_width, k_pool, k_scale, S->cells[t], S->kv_heads, (int)hd);
        put_row(row + q_width + kv_width, v_pool, v_scale, S->cells[t], S->kv_heads, (int)hd);
    }
    TRY(strata_paged_decode(q, k_pool, v_pool, k_scale, v_scale, k_scale != NULL, S->tables, S->table_stride,
                            S->slots, S->lens, S->lo,
                            (int)rows, S->kv_heads, S->heads / S->kv_heads, (int)hd, S->chunk_cells, S->scale,
                            S->part_cells, S->part_first, S->work, attn, threads));
    TRY(product(&L->o, attn, rows, mixed, threads));
    TRY(strata_rms_norm(x, mixed, out, L->post_norm, h, rows, (int)hidden, S->eps, threads));
    TRY(product(&L->gate_up, h, rows, gate_up, threads));
    TRY(strata_silu_mul(gate_up, mlp, rows, (int)inter, threads));
    TRY(product(&L->down, mlp, rows, mixed, threads));
#undef TRY
    for (int64_t i = 0; i < rows * hidden; i++) out[i] += mixed[i];
    return 0;
}

/* A decode step's layers in one call (stages/decode_layer.py rule 5): layer i runs as strata_decode_layer(layers[i],
   steps[i], pools[4 i], pools[4 i + 1], pools[4 i + 2], pools[4 i + 3], in, out) (k, v, k_scale, v_scale), `in`
   being x for the first layer and `out` after it. Returns 0, or what the first layer that failed returned (the
   layers before it have run). */
int strata_decode_layers(const strata_layer *const *layers, const strata_step *const *steps, void *const *pools, int n,
                         const float *x, float *out) {
    if (n < 1) return -1;
    for (int i = 0; i < n; i++) {
        const int rc = strata_decode_layer(layers[i], steps[i], pools[4 * i], pools[4 * i + 1], (float *)pools[4 * i + 2],
                                           (float *)pools[4 * i + 3], i ? out : x, out);
        if (rc != 0) return rc;
    }
    return 0;
}

/* The last stage's final norm and head over a decode step's rows (stages/decode_layer.py rule 6): logits [rows,
   head.n] = (rms_norm(x) * norm) times the head, by the functions and arguments of the Python path. Scratch holds
   rows * hidden floats. Returns 0, -1 on arguments it refuses, or what the product returned. */
int strata_decode_head(const float *norm, const strata_weight *head, const float *x, int64_t rows, int hidden,
                       float eps, float *scratch, float *logits, int threads) {
    if (rows < 1 || rows > MAX_ROWS || hidden < 1 || head->k != hidden || threads < 1) return -1;
    const int rc = strata_rms_norm(x, NULL, NULL, norm, scratch, rows, hidden, eps, threads);
    return rc != 0 ? rc : product(head, scratch, rows, logits, threads);
}
