// Elementwise kernels: grid-stride loops over n values (64-bit indices, 1-D grids), the math of
// swapopt/core/elementwise_formulas.h in f32.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t first_index() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

__global__ void axpby_kernel(int64_t n, float alpha, const void* x, int xd, float beta, void* y, int yd) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    store_f32(y, i, yd, formula::axpby(alpha, load_f32(x, i, xd), beta, beta == 0.f ? 0.f : load_f32(y, i, yd)));
}

__global__ void lerp_kernel(int64_t n, void* a, int ad, const void* b, int bd, float w) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) store_f32(a, i, ad, formula::lerp(load_f32(a, i, ad), load_f32(b, i, bd), w));
}

__global__ void cast_kernel(int64_t n, const void* src, int sd, void* dst, int dd) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) store_f32(dst, i, dd, load_f32(src, i, sd));
}

// One item per element of every matrix: item = (matrix, row, col); the matrix count has no limit.
__global__ void mirror_lower_kernel(int64_t count, int64_t n, int64_t batch_stride, void* c, int cd) {
  const int64_t per = n * n;
  for (int64_t item = first_index(); item < count * per; item += grid_stride()) {
    const int64_t b = item / per, idx = item % per, i = idx / n, j = idx % n;
    if (j <= i) continue;
    const int64_t base = b * batch_stride;
    store_f32(c, base + i * n + j, cd, load_f32(c, base + j * n + i, cd));
  }
}

}  // namespace

void axpby(cudaStream_t stream, int64_t n, float alpha, const void* x, int xd, float beta, void* y, int yd) {
  if (n == 0) return;
  axpby_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, alpha, x, xd, beta, y, yd);
}

void lerp(cudaStream_t stream, int64_t n, void* a, int ad, const void* b, int bd, float w) {
  if (n == 0) return;
  lerp_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, a, ad, b, bd, w);
}

void cast(cudaStream_t stream, int64_t n, const void* src, int sd, void* dst, int dd) {
  if (n == 0) return;
  cast_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, src, sd, dst, dd);
}

void mirror_lower(cudaStream_t stream, int64_t count, int64_t n, int64_t batch_stride, void* c, int cd) {
  if (count == 0 || n == 0) return;
  mirror_lower_kernel<<<grid_for(count * n * n, kThreads), kThreads, 0, stream>>>(count, n, batch_stride, c, cd);
}

}  // namespace swapopt::kernels
