// Element types shared by the kernels, with no CUDA header included.
//
// The sources are compiled at run time by NVRTC (through cupy), which has no host headers and, with cupy's
// wheels, no promise of cuda_fp16.h / cuda_bf16.h on its include path. So the 16-bit types are plain storage
// structs converted with PTX `cvt`, which rounds to nearest even exactly as torch's `.to(dtype)` does.
//
//   type     torch dtype      size   to_float                 from_float
//   float    torch.float32    4      itself                   itself
//   f16_t    torch.float16    2      cvt.f32.f16 (exact)      cvt.rn.f16.f32
//   bf16_t   torch.bfloat16   2      bits << 16 (exact)       cvt.rn.bf16.f32 (sm_80 and later)
//   i8_t     torch.int8       1      the integer, exactly     (quantised by the kernels, never converted)
//
// kv_write.cu and paged_decode.cu include this file; stages/kernels.py pastes it in place of the #include
// before compiling, so the source cupy hashes for its kernel cache is the whole program.
#ifndef STRATA_DTYPES_CUH
#define STRATA_DTYPES_CUH

struct f16_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};
typedef signed char i8_t;

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(f16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

__device__ __forceinline__ float to_float(bf16_t x) {
  return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

__device__ __forceinline__ float to_float(i8_t x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}

template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float x) {
  f16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

template <typename T>
struct is_int8 {
  static constexpr bool value = false;
};
template <>
struct is_int8<i8_t> {
  static constexpr bool value = true;
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

#endif  // STRATA_DTYPES_CUH
