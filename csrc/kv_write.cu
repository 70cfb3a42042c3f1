// kv_write: store a step's new K/V rows in the pool, each in the cell its slot's table names.
//
// Torch reference: stages/attention.py `write_kv` (with `quantize_int8` for int8 pools). Same layout:
//
//   k_new, v_new      [T, kv_heads, HEAD_DIM]          IN_T (float, f16_t, bf16_t), contiguous
//   token_slot        [T] int64                        slot of token t
//   positions         [T] int64                        its position p
//   tables            [n_slots, table_chunks] int32    logical chunk j of slot s lives in pool chunk tables[s, j]
//   k_pool, v_pool    [N + 1, C, kv_heads, HEAD_DIM]   KV_T; chunk N is the trash chunk
//   k_scale, v_scale  [N + 1, C, kv_heads] float       int8 pools only (null otherwise)
//
//   token t  ->  cell = tables[token_slot[t], p / C] * C + p % C   (flat cell number, as in the reference)
//
// A logical chunk past the table (p / C >= table_chunks) goes to the trash chunk: the host refuses such a step
// before launching (as the reference does); this only keeps a bad launch from reading past the table row.
//
// Grid: one warp per (token, kv head) row, kWriteWarps rows per block; blockIdx.y is 0 for K and 1 for V.
// Lane l holds elements l, l + 32, ... of its row, so each load and store of a warp is one contiguous run.
//
// Float pools: value = KV_T(float(x)), round to nearest even, which is torch's `.to(kv dtype)`.
// int8 pools, per (cell, head): scale = absmax over HEAD_DIM * (1/127) (torch CUDA's rounding of `/ 127`, see
// dtypes.cuh), value = rint(x / max(scale, tiny)) clamped to [-127, 127] (rint rounds half to even, as
// torch.round); the scale is stored unclamped. A NaN in a row is not propagated to its scale (fmaxf drops it).
#include "dtypes.cuh"

constexpr int kWriteWarps = 4;
// Smallest normal float (torch.finfo(torch.float32).tiny): the reference clamps a scale to it before dividing.
constexpr float kFloatTiny = 1.17549435e-38f;
constexpr float kInt8Max = 127.0f;
// torch on CUDA divides by the Python scalar 127.0 as a multiply by this float reciprocal (its div kernel turns a
// CPU-scalar divisor b into `a * (1 / b)`), so a cell's scale is absmax * kInvInt8Max, not absmax / 127. (On
// the CPU torch divides; the two differ in the last bit for a few percent of values.)
constexpr float kInvInt8Max = 1.0f / 127.0f;

template <typename IN_T, typename KV_T, int HEAD_DIM>
__global__ void __launch_bounds__(kWriteWarps * 32)
    kv_write(const IN_T* __restrict__ k_new, const IN_T* __restrict__ v_new, KV_T* __restrict__ k_pool,
             KV_T* __restrict__ v_pool, float* __restrict__ k_scale, float* __restrict__ v_scale,
             const int* __restrict__ tables, const long long* __restrict__ token_slot,
             const long long* __restrict__ positions, int num_tokens, int kv_heads, int chunk_cells,
             int table_chunks, int trash_chunk) {
  static_assert(HEAD_DIM > 0 && HEAD_DIM <= 256, "head_dim must lie in [1, 256]");
  constexpr int kPerLane = (HEAD_DIM + 31) / 32;
  const int lane = threadIdx.x % 32;
  const long long row = static_cast<long long>(blockIdx.x) * kWriteWarps + threadIdx.x / 32;
  if (row >= static_cast<long long>(num_tokens) * kv_heads) return;  // the whole warp leaves together
  const long long token = row / kv_heads;
  const long long head = row % kv_heads;

  const long long pos = positions[token];
  const long long logical = pos / chunk_cells;
  const long long chunk = logical < table_chunks ? tables[token_slot[token] * table_chunks + logical] : trash_chunk;
  const long long cell = chunk * chunk_cells + pos % chunk_cells;
  const long long dst = (cell * kv_heads + head) * HEAD_DIM;
  const bool is_k = blockIdx.y == 0;
  const IN_T* src = (is_k ? k_new : v_new) + row * HEAD_DIM;
  KV_T* pool = is_k ? k_pool : v_pool;

  float x[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < HEAD_DIM ? to_float(src[d]) : 0.0f;
  }

  if constexpr (is_int8<KV_T>::value) {
    float absmax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) absmax = fmaxf(absmax, fabsf(x[i]));
    absmax = warp_max(absmax);
    const float scale = absmax * kInvInt8Max;
    const float denom = scale < kFloatTiny ? kFloatTiny : scale;  // clamp_min(tiny); a NaN scale stays NaN
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < HEAD_DIM) {
        const float q = fminf(fmaxf(rintf(x[i] / denom), -kInt8Max), kInt8Max);
        pool[dst + d] = static_cast<i8_t>(q);
      }
    }
    if (lane == 0) (is_k ? k_scale : v_scale)[cell * kv_heads + head] = scale;
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < HEAD_DIM) pool[dst + d] = from_float<KV_T>(x[i]);
    }
  }
}
