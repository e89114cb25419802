// Fused optimizer updates: one pass over the elements, the math of swapopt/core/elementwise_formulas.h.
// Dtypes are template parameters; with every buffer 16-byte aligned a thread takes kVec elements
// at a time (each state element is read once and written once), the remainder one at a time.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

template <int GD, int BD, int UD>
__global__ void muon_momentum_kernel(int64_t n, const void* __restrict__ grad, void* __restrict__ buf, void* __restrict__ update,
                                     float m1, float m2, bool nesterov, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    float g[kVec], b[kVec], u[kVec];
    load_vec<GD>(grad, v, g);
    load_vec<BD>(buf, v, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const formula::MomentumOut out = formula::muon_momentum(g[k], b[k], m1, m2, nesterov);
      b[k] = out.buf;
      u[k] = out.update;
    }
    store_vec<BD>(buf, v, b);
    store_vec<UD>(update, v, u);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride()) {
    const formula::MomentumOut out = formula::muon_momentum(load_f32<GD>(grad, i), load_f32<BD>(buf, i), m1, m2, nesterov);
    store_f32<BD>(buf, i, out.buf);
    store_f32<UD>(update, i, out.update);
  }
}

// exp_avg, exp_avg_sq and max_exp_avg_sq are f32 (the state dtype); AMSGrad is a template
// parameter so that the plain update carries no null checks.
template <int PD, int GD, bool kAmsgrad>
__global__ void adamw_kernel(int64_t n, void* __restrict__ param, const void* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, float* __restrict__ vmax, formula::AdamWScalars k, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t w = first_index(); w < head / kVec; w += grid_stride()) {
    float p[kVec], g[kVec], mm[kVec], vv[kVec], vm[kVec];
    load_vec<PD>(param, w, p);
    load_vec<GD>(grad, w, g);
    load_vec<kF32>(m, w, mm);
    load_vec<kF32>(v, w, vv);
    if constexpr (kAmsgrad) load_vec<kF32>(vmax, w, vm);
#pragma unroll
    for (int e = 0; e < kVec; ++e) p[e] = formula::adamw(p[e], g[e], mm[e], vv[e], kAmsgrad ? &vm[e] : nullptr, k);
    store_vec<PD>(param, w, p);
    store_vec<kF32>(m, w, mm);
    store_vec<kF32>(v, w, vv);
    if constexpr (kAmsgrad) store_vec<kF32>(vmax, w, vm);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride())
    store_f32<PD>(param, i, formula::adamw(load_f32<PD>(param, i), load_f32<GD>(grad, i), m[i], v[i], kAmsgrad ? vmax + i : nullptr, k));
}

}  // namespace

void muon_momentum(cudaStream_t stream, int64_t n, const void* grad, int gd, void* buf, int bd, void* update, int ud, float m1,
                   float m2, bool nesterov) {
  if (n == 0) return;
  const bool vectors = vector_aligned(grad) && vector_aligned(buf) && vector_aligned(update);
  with_dtype(gd, [&](auto G) {
    with_dtype(bd, [&](auto B) {
      with_dtype(ud, [&](auto U) {
        muon_momentum_kernel<decltype(G)::value, decltype(B)::value, decltype(U)::value>
            <<<blocks_for(n, vectors, kThreads), kThreads, 0, stream>>>(n, grad, buf, update, m1, m2, nesterov, vectors);
      });
    });
  });
}

void adamw_update(cudaStream_t stream, int64_t n, void* param, int pd, const void* grad, int gd, float* exp_avg,
                  float* exp_avg_sq, float* max_exp_avg_sq, formula::AdamWScalars args) {
  if (n == 0) return;
  const bool vectors = vector_aligned(param) && vector_aligned(grad) && vector_aligned(exp_avg) && vector_aligned(exp_avg_sq) &&
                       (max_exp_avg_sq == nullptr || vector_aligned(max_exp_avg_sq));
  const unsigned blocks = blocks_for(n, vectors, kThreads);
  with_dtype(pd, [&](auto P) {
    with_dtype(gd, [&](auto G) {
      constexpr int kP = decltype(P)::value, kG = decltype(G)::value;
      if (max_exp_avg_sq != nullptr) {
        adamw_kernel<kP, kG, true><<<blocks, kThreads, 0, stream>>>(n, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, args, vectors);
      } else {
        adamw_kernel<kP, kG, false><<<blocks, kThreads, 0, stream>>>(n, param, grad, exp_avg, exp_avg_sq, nullptr, args, vectors);
      }
    });
  });
}

}  // namespace swapopt::kernels
