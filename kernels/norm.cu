// Per-matrix Frobenius norms (one block per matrix, f32 partial sums, tree reduction) and the
// Newton-Schulz normalisation x /= norm + eps.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 512;

__global__ void frobenius_norm_kernel(int64_t per, const void* x, int xd, float* norms) {
  __shared__ float partial[kThreads];
  const int64_t first = blockIdx.x * per;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < per; i += blockDim.x) {
    const float v = load_f32(x, first + i, xd);
    sum += v * v;
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) norms[blockIdx.x] = sqrtf(partial[0]);
}

__global__ void scale_by_inverse_norm_kernel(int64_t per, void* x, int xd, const float* norms, float eps) {
  const float denom = norms[blockIdx.y] + eps;
  const int64_t first = blockIdx.y * per;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < per; i += int64_t(gridDim.x) * blockDim.x)
    store_f32(x, first + i, xd, load_f32(x, first + i, xd) / denom);
}

}  // namespace

void frobenius_norm(cudaStream_t stream, int64_t count, int64_t per, const void* x, int xd, float* norms) {
  if (count == 0) return;
  frobenius_norm_kernel<<<unsigned(count), kThreads, 0, stream>>>(per, x, xd, norms);
}

void scale_by_inverse_norm(cudaStream_t stream, int64_t count, int64_t per, void* x, int xd, const float* norms, float eps) {
  if (count == 0 || per == 0) return;
  const dim3 grid(grid_for(per, kThreads), unsigned(count));
  scale_by_inverse_norm_kernel<<<grid, kThreads, 0, stream>>>(per, x, xd, norms, eps);
}

}  // namespace swapopt::kernels
