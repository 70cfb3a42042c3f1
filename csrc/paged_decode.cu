// paged_decode: attention of one query row per entry over its slot's context, read through the slot's table.
//
// Torch reference: stages/attention.py `paged_attention` for a step whose entries all read one new token (the
// decode case: T == B, token b is entry b). Same layout and rules:
//
//   q             [B, heads, HEAD_DIM]               Q_T (float, f16_t, bf16_t), contiguous; heads = kv_heads * GROUP
//   slot_ids      [B] int64                          slot of entry b
//   context_lens  [B] int64                          ctx = start + 1; the query sits at position p = ctx - 1
//   tables        [n_slots, table_chunks] int32
//   k_pool, v_pool [N + 1, C, kv_heads, HEAD_DIM]    KV_T (float, f16_t, bf16_t, i8_t)
//   k_scale, v_scale [N + 1, C, kv_heads] float      i8_t pools only: value = int8 * scale (dequantised on load)
//   out           [B, heads * HEAD_DIM]              Q_T
//
//   cell j of entry b  ->  flat cell tables[slot_ids[b], j / C] * C + j % C
//   entry b sees cells [lo, ctx), lo = max(0, ctx - window) with a sliding window (0 = none): j <= p and
//   j > p - window, exactly the reference's mask. GQA: query head h reads kv head h / GROUP.
//
// Split-K (flash-decoding). Grid (B, kv_heads, S): block (b, g, s) reads the partition
// [lo + s * P, min(lo + (s + 1) * P, ctx)) for the GROUP query heads sharing kv head g, so each K/V row is loaded
// once per group. Inside a block each warp takes every kDecodeWarps-th cell; its lanes split HEAD_DIM (lane l
// holds l, l + 32, ...), a score is one warp sum, and the warp keeps an online softmax (running max m, sum l,
// accumulator) in float32, in base 2 (q is pre-scaled by scale * log2 e). The warps merge through shared
// memory. With S == 1 the block writes `out`; otherwise it writes its partial (max, sum, accumulator) and
// paged_decode_reduce merges the S partials of each (b, head). A partition with no cells (a short entry in a
// long step) writes max -inf, sum 0; partition 0 always holds the query's own cell, so every merge has a
// finite max.
#include "dtypes.cuh"

constexpr int kDecodeWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

template <typename Q_T, typename KV_T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    paged_decode_partial(const Q_T* __restrict__ q, const KV_T* __restrict__ k_pool,
                         const KV_T* __restrict__ v_pool, const float* __restrict__ k_scale,
                         const float* __restrict__ v_scale, const int* __restrict__ tables,
                         const long long* __restrict__ slot_ids, const long long* __restrict__ context_lens,
                         Q_T* __restrict__ out, float* __restrict__ part_max, float* __restrict__ part_sum,
                         float* __restrict__ part_acc, int kv_heads, int chunk_cells, int table_chunks, int window,
                         int partition_cells, float scale) {
  static_assert(HEAD_DIM > 0 && HEAD_DIM <= 256, "head_dim must lie in [1, 256]");
  static_assert(GROUP >= 1, "GROUP is heads / kv_heads");
  static_assert(kDecodeWarps * GROUP * (HEAD_DIM + 2) * sizeof(float) <= 48 * 1024,
                "the warps' partials must fit 48 KiB of static shared memory");
  constexpr int kPerLane = (HEAD_DIM + 31) / 32;
  constexpr bool kInt8 = is_int8<KV_T>::value;
  const int entry = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int splits = gridDim.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int heads = kv_heads * GROUP;

  const long long ctx = context_lens[entry];
  const long long lo = window > 0 && ctx > window ? ctx - window : 0;
  const long long begin = lo + static_cast<long long>(split) * partition_cells;
  const long long end = begin + partition_cells < ctx ? begin + partition_cells : ctx;
  const int* table = tables + slot_ids[entry] * table_chunks;

  float q_reg[GROUP][kPerLane];
  const float q_mul = scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const Q_T* q_row = q + (static_cast<long long>(entry) * heads + kv_head * GROUP + g) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      q_reg[g][i] = d < HEAD_DIM ? to_float(q_row[d]) * q_mul : 0.0f;
    }
  }

  float run_max[GROUP], run_sum[GROUP], acc[GROUP][kPerLane];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    run_max[g] = kNegInf;
    run_sum[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[g][i] = 0.0f;
  }

  for (long long j = begin + warp; j < end; j += kDecodeWarps) {
    const long long cell = static_cast<long long>(table[j / chunk_cells]) * chunk_cells + j % chunk_cells;
    const long long row = (cell * kv_heads + kv_head) * HEAD_DIM;
    float k_mul = 1.0f, v_mul = 1.0f;
    if constexpr (kInt8) {
      k_mul = k_scale[cell * kv_heads + kv_head];
      v_mul = v_scale[cell * kv_heads + kv_head];
    }
    float k_reg[kPerLane], v_reg[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      k_reg[i] = d < HEAD_DIM ? to_float(k_pool[row + d]) * k_mul : 0.0f;
      v_reg[i] = d < HEAD_DIM ? to_float(v_pool[row + d]) * v_mul : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dot += q_reg[g][i] * k_reg[i];
      const float score = warp_sum(dot);
      const float new_max = fmaxf(run_max[g], score);
      const float correction = exp2f(run_max[g] - new_max);  // 0 on the warp's first cell
      const float weight = exp2f(score - new_max);
      run_sum[g] = run_sum[g] * correction + weight;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[g][i] = acc[g][i] * correction + weight * v_reg[i];
      run_max[g] = new_max;
    }
  }

  __shared__ float warp_max_s[kDecodeWarps][GROUP];
  __shared__ float warp_sum_s[kDecodeWarps][GROUP];
  __shared__ float warp_acc_s[kDecodeWarps][GROUP][HEAD_DIM];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (lane == 0) {
      warp_max_s[warp][g] = run_max[g];
      warp_sum_s[warp][g] = run_sum[g];
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < HEAD_DIM) warp_acc_s[warp][g][d] = acc[g][i];
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float block_max = kNegInf;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) block_max = fmaxf(block_max, warp_max_s[w][g]);
    float block_sum = 0.0f, block_acc = 0.0f;
    if (block_max != kNegInf) {  // else no warp saw a cell: the partition is empty
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float weight = exp2f(warp_max_s[w][g] - block_max);
        block_sum += warp_sum_s[w][g] * weight;
        block_acc += warp_acc_s[w][g][d] * weight;
      }
    }
    const long long head_row = static_cast<long long>(entry) * heads + kv_head * GROUP + g;
    if (splits == 1) {
      out[head_row * HEAD_DIM + d] = from_float<Q_T>(block_acc / block_sum);
    } else {
      const long long part = head_row * splits + split;
      part_acc[part * HEAD_DIM + d] = block_acc;
      if (d == 0) {
        part_max[part] = block_max;
        part_sum[part] = block_sum;
      }
    }
  }
}

// Merge the S partials of each (entry, head) row: out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M),
// M = max_s m_s. Grid: one block per row (B * heads), threads over HEAD_DIM.
template <typename Q_T, int HEAD_DIM>
__global__ void paged_decode_reduce(const float* __restrict__ part_max, const float* __restrict__ part_sum,
                                    const float* __restrict__ part_acc, Q_T* __restrict__ out, int splits) {
  const long long head_row = blockIdx.x;
  const float* row_max = part_max + head_row * splits;
  const float* row_sum = part_sum + head_row * splits;
  float total_max = kNegInf;
  for (int s = 0; s < splits; ++s) total_max = fmaxf(total_max, row_max[s]);
  float total_sum = 0.0f;
  for (int s = 0; s < splits; ++s) total_sum += row_sum[s] * exp2f(row_max[s] - total_max);
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float total_acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
      total_acc += part_acc[(head_row * splits + s) * HEAD_DIM + d] * exp2f(row_max[s] - total_max);
    }
    out[head_row * HEAD_DIM + d] = from_float<Q_T>(total_acc / total_sum);
  }
}
