#pragma once
// Device-side load/store of swapopt dtypes as f32 (round to nearest even on store).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace swapopt::kernels {

enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };  // matches swapopt::DType

__device__ __forceinline__ float load_f32(const void* base, int64_t i, int dtype) {
  if (dtype == kF32) return static_cast<const float*>(base)[i];
  if (dtype == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return __half2float(static_cast<const __half*>(base)[i]);
}

__device__ __forceinline__ void store_f32(void* base, int64_t i, int dtype, float v) {
  if (dtype == kF32) {
    static_cast<float*>(base)[i] = v;
  } else if (dtype == kBF16) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  }
}

inline unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

}  // namespace swapopt::kernels
