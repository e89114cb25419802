#pragma once
// Device-side load/store of swapopt dtypes as f32 (the shared formulas of
// swapopt/core/elementwise_formulas.h), and grid sizing.

#include <cstdint>

#include "swapopt/core/elementwise_formulas.h"

namespace swapopt::kernels {

using formula::kBF16;
using formula::kF16;
using formula::kF32;

__device__ __forceinline__ float load_f32(const void* base, int64_t i, int dtype) { return formula::load(base, size_t(i), dtype); }

__device__ __forceinline__ void store_f32(void* base, int64_t i, int dtype, float v) { formula::store(base, size_t(i), dtype, v); }

/** Blocks for a grid-stride loop over n items: enough to fill the device, never above the x-limit
 *  of 2^31 - 1 (the loops index in 64 bits, so any n works). */
inline unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

}  // namespace swapopt::kernels
