// Fused optimizer updates: one pass over the elements, math as in swapopt/optim/optim_ops.h.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void muon_momentum_kernel(int64_t n, const void* grad, int gd, void* buf, int bd, void* update, int ud, float m1,
                                     float m2, bool nesterov) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = load_f32(grad, i, gd), b = load_f32(buf, i, bd);
    float u = __fadd_rn(g, __fmul_rn(m1, b));
    store_f32(buf, i, bd, __fadd_rn(__fmul_rn(m2, b), g));
    if (nesterov) u = __fadd_rn(__fmul_rn(m1, u), g);
    store_f32(update, i, ud, u);
  }
}

__global__ void adamw_kernel(int64_t n, void* param, int pd, const void* grad, int gd, float* m, float* v, float* vmax,
                             AdamWArgs k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = load_f32(grad, i, gd);
    float p = __fmul_rn(load_f32(param, i, pd), k.decay);
    const float w = k.one_minus_beta1;
    const float mi = m[i];
    m[i] = w < 0.5f ? __fadd_rn(mi, __fmul_rn(w, __fsub_rn(g, mi))) : __fsub_rn(g, __fmul_rn(__fsub_rn(g, mi), 1.f - w));
    v[i] = __fadd_rn(__fmul_rn(v[i], k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    float second = v[i];
    if (vmax != nullptr) second = vmax[i] = fmaxf(vmax[i], v[i]);
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(second), k.bias_correction2_sqrt), k.eps);
    p = __fadd_rn(p, __fmul_rn(k.neg_step_size, __fdiv_rn(m[i], denom)));
    store_f32(param, i, pd, p);
  }
}

}  // namespace

void muon_momentum(cudaStream_t stream, int64_t n, const void* grad, int gd, void* buf, int bd, void* update, int ud, float m1,
                   float m2, bool nesterov) {
  if (n == 0) return;
  muon_momentum_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, grad, gd, buf, bd, update, ud, m1, m2, nesterov);
}

void adamw_update(cudaStream_t stream, int64_t n, void* param, int pd, const void* grad, int gd, float* exp_avg,
                  float* exp_avg_sq, float* max_exp_avg_sq, AdamWArgs args) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, param, pd, grad, gd, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                                               args);
}

}  // namespace swapopt::kernels
