// Elementwise kernels: grid-stride loops over n values, math in f32.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void axpby_kernel(int64_t n, float alpha, const void* x, int xd, float beta, void* y, int yd) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float xv = load_f32(x, i, xd);
    store_f32(y, i, yd, beta == 0.f ? alpha * xv : alpha * xv + beta * load_f32(y, i, yd));
  }
}

__global__ void lerp_kernel(int64_t n, void* a, int ad, const void* b, int bd, float w) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float av = load_f32(a, i, ad), bv = load_f32(b, i, bd);
    store_f32(a, i, ad, w < 0.5f ? av + w * (bv - av) : bv - (bv - av) * (1.f - w));
  }
}

__global__ void cast_kernel(int64_t n, const void* src, int sd, void* dst, int dd) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f32(dst, i, dd, load_f32(src, i, sd));
}

__global__ void mirror_lower_kernel(int64_t n, int64_t batch_stride, void* c, int cd) {
  char* base = static_cast<char*>(c);
  const int64_t esize = cd == kF32 ? 4 : 2;
  void* m = base + blockIdx.y * batch_stride * esize;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n * n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / n, j = idx % n;
    if (j > i) store_f32(m, i * n + j, cd, load_f32(m, j * n + i, cd));
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
  const dim3 grid(grid_for(n * n, kThreads), unsigned(count));
  mirror_lower_kernel<<<grid, kThreads, 0, stream>>>(n, batch_stride, c, cd);
}

}  // namespace swapopt::kernels
