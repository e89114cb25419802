// Per-matrix Frobenius norms (blocks loop over the matrices, f32 partial sums, tree reduction) and
// the Newton-Schulz normalisation x /= norm + eps. No grid dimension is the matrix count, so any
// number of matrices launches.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 512;

// Block b reduces matrices b, b + gridDim.x, ...; each sum in a fixed order (deterministic).
__global__ void frobenius_norm_kernel(int64_t count, int64_t per, const void* x, int xd, float* norms) {
  __shared__ float partial[kThreads];
  for (int64_t m = blockIdx.x; m < count; m += gridDim.x) {
    const int64_t first = m * per;
    float sum = 0.f;
    for (int64_t i = threadIdx.x; i < per; i += blockDim.x) {
      const float v = load_f32(x, first + i, xd);
      sum = __fadd_rn(sum, __fmul_rn(v, v));
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
      if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
      __syncthreads();
    }
    if (threadIdx.x == 0) norms[m] = __fsqrt_rn(partial[0]);
    __syncthreads();  // partial is reused for the next matrix
  }
}

__global__ void scale_by_inverse_norm_kernel(int64_t total, int64_t per, void* x, int xd, const float* norms, float eps) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    store_f32(x, i, xd, formula::scale_by_inverse_norm(load_f32(x, i, xd), norms[i / per], eps));
}

// Every thread that finds one writes the same value: no ordering needed.
__global__ void flag_nonfinite_kernel(int64_t n, const void* x, int xd, float* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (!isfinite(load_f32(x, i, xd))) *flag = 1.f;
}

}  // namespace

void flag_nonfinite(cudaStream_t stream, int64_t n, const void* x, int xd, float* flag) {
  if (n == 0) return;
  flag_nonfinite_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, x, xd, flag);
}

void frobenius_norm(cudaStream_t stream, int64_t count, int64_t per, const void* x, int xd, float* norms) {
  if (count == 0) return;
  const unsigned blocks = unsigned(count < 65535 * 16 ? count : 65535 * 16);
  frobenius_norm_kernel<<<blocks, kThreads, 0, stream>>>(count, per, x, xd, norms);
}

void scale_by_inverse_norm(cudaStream_t stream, int64_t count, int64_t per, void* x, int xd, const float* norms, float eps) {
  if (count == 0 || per == 0) return;
  scale_by_inverse_norm_kernel<<<grid_for(count * per, kThreads), kThreads, 0, stream>>>(count * per, per, x, xd, norms, eps);
}

}  // namespace swapopt::kernels
