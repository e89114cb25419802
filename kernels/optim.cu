// Fused optimizer updates: one pass over the elements, the math of swapopt/core/elementwise_formulas.h.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void muon_momentum_kernel(int64_t n, const void* grad, int gd, void* buf, int bd, void* update, int ud, float m1,
                                     float m2, bool nesterov) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const formula::MomentumOut out = formula::muon_momentum(load_f32(grad, i, gd), load_f32(buf, i, bd), m1, m2, nesterov);
    store_f32(buf, i, bd, out.buf);
    store_f32(update, i, ud, out.update);
  }
}

__global__ void adamw_kernel(int64_t n, void* param, int pd, const void* grad, int gd, float* m, float* v, float* vmax,
                             formula::AdamWScalars k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f32(param, i, pd, formula::adamw(load_f32(param, i, pd), load_f32(grad, i, gd), m[i], v[i], vmax ? vmax + i : nullptr, k));
}

}  // namespace

void muon_momentum(cudaStream_t stream, int64_t n, const void* grad, int gd, void* buf, int bd, void* update, int ud, float m1,
                   float m2, bool nesterov) {
  if (n == 0) return;
  muon_momentum_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, grad, gd, buf, bd, update, ud, m1, m2, nesterov);
}

void adamw_update(cudaStream_t stream, int64_t n, void* param, int pd, const void* grad, int gd, float* exp_avg,
                  float* exp_avg_sq, float* max_exp_avg_sq, formula::AdamWScalars args) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, param, pd, grad, gd, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                                               args);
}

}  // namespace swapopt::kernels
