#pragma once
// Device-side access to swapopt dtypes as f32 (the shared formulas of
// swapopt/core/elementwise_formulas.h): the dtype is a template parameter, so no kernel branches on
// it per element; vector access of kVec elements (16-byte loads and stores); grid sizing; and the
// host-side dispatch from a runtime dtype code to those templates.

#include <cstdint>
#include <type_traits>

#include "swapopt/core/elementwise_formulas.h"

namespace swapopt::kernels {

using formula::kBF16;
using formula::kF16;
using formula::kF32;

/** Element i of a buffer of dtype D, as float. */
template <int D>
__device__ __forceinline__ float load_f32(const void* __restrict__ base, int64_t i) {
  return formula::load(base, size_t(i), D);
}

/** Writes v, rounded to dtype D, into element i. */
template <int D>
__device__ __forceinline__ void store_f32(void* __restrict__ base, int64_t i, float v) {
  formula::store(base, size_t(i), D, v);
}

/** Elements per vector access: one 16-byte access of a 16-bit dtype, two of f32. */
constexpr int kVec = 8;

/** Whether a buffer can be accessed kVec elements at a time: vector accesses need 16-byte alignment. */
inline bool vector_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int D>
__device__ __forceinline__ float from_bits16(uint32_t h) {
  return D == kBF16 ? formula::bf16_to_float(uint16_t(h)) : formula::f16_to_float(uint16_t(h));
}

template <int D>
__device__ __forceinline__ uint32_t to_bits16(float v) {
  return D == kBF16 ? formula::float_to_bf16(v) : formula::float_to_f16(v);
}

/** Elements [v * kVec, v * kVec + kVec) of a 16-byte aligned buffer of dtype D, as floats. */
template <int D>
__device__ __forceinline__ void load_vec(const void* __restrict__ base, int64_t v, float (&out)[kVec]) {
  if constexpr (D == kF32) {
    const float4* p = static_cast<const float4*>(base) + 2 * v;
    const float4 a = p[0], b = p[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const uint4 raw = static_cast<const uint4*>(base)[v];
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // little endian: the lower half is the earlier element
      out[2 * k] = from_bits16<D>(words[k] & 0xffffu);
      out[2 * k + 1] = from_bits16<D>(words[k] >> 16);
    }
  }
}

/** Writes `in`, rounded to dtype D, into elements [v * kVec, v * kVec + kVec). */
template <int D>
__device__ __forceinline__ void store_vec(void* __restrict__ base, int64_t v, const float (&in)[kVec]) {
  if constexpr (D == kF32) {
    float4* p = static_cast<float4*>(base) + 2 * v;
    p[0] = make_float4(in[0], in[1], in[2], in[3]);
    p[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
    uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) words[k] = to_bits16<D>(in[2 * k]) | (to_bits16<D>(in[2 * k + 1]) << 16);
    static_cast<uint4*>(base)[v] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

/** Blocks for a grid-stride loop over n items of `threads` threads each: enough to fill the
 *  current device (its multiprocessors times the blocks each can hold), fewer when n is small. */
unsigned grid_for(int64_t n, int threads);

/** Blocks for n elements taken kVec at a time when `vectors`, else one at a time. */
inline unsigned blocks_for(int64_t n, bool vectors, int threads) { return grid_for(vectors ? n / kVec + 1 : n, threads); }

__device__ __forceinline__ int64_t first_index() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

/** Elements a grid-stride loop takes kVec at a time: a multiple of kVec when `vectors`, else none;
 *  the rest [vector_part, n) one at a time. */
__device__ __forceinline__ int64_t vector_part(int64_t n, bool vectors) { return vectors ? n / kVec * kVec : 0; }

/** Calls f(std::integral_constant<int, D>{}) for the runtime dtype code d (kF32, kBF16 or kF16). */
template <typename F>
void with_dtype(int d, F&& f) {
  switch (d) {
    case kF32: f(std::integral_constant<int, kF32>{}); break;
    case kBF16: f(std::integral_constant<int, kBF16>{}); break;
    default: f(std::integral_constant<int, kF16>{}); break;
  }
}

}  // namespace swapopt::kernels
