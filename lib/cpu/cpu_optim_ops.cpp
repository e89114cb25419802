// CPU fused optimizer updates (enqueued on the CPU stream).
#include <algorithm>
#include <array>
#include <memory>
#include <cmath>

#include "cpu_ops.h"

namespace swapopt::cpu {

// Addresses are read at enqueue time and storages held until the work has run, as in cpu_ops.cpp.
// The f32 loops are split over the OpenMP threads when large: every element is independent, so
// the bits do not depend on the split.

namespace {
[[maybe_unused]] constexpr size_t kParallelElements = size_t(1) << 16;  // unread without OpenMP
}  // namespace

void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& buf, const Tensor& update, float m1, float m2,
                   bool nesterov) {
  const size_t n = size_t(grad.numel());
  if (n == 0) return;
  const void* gb = grad.data_ptr();
  void* bb = buf.data_ptr();
  void* ub = update.data_ptr();
  const DType gd = grad.dtype(), bd = buf.dtype(), ud = update.dtype();
  stream.enqueue([=, keep = std::array<std::shared_ptr<Storage>, 3>{grad.storage(), buf.storage(), update.storage()}] {
    if (gd == DType::f32 && bd == DType::f32 && ud == DType::f32) {  // the common case, vectorised
      const float* gv = static_cast<const float*>(gb);
      float* bv = static_cast<float*>(bb);
      float* uv = static_cast<float*>(ub);
      // The scalars as locals: read through the closure, GCC would not vectorise the loop.
      const float a = m1, b = m2;
      const bool nest = nesterov;
#pragma omp parallel for simd if (n >= kParallelElements)
      for (size_t i = 0; i < n; ++i) {
        const formula::MomentumOut out = formula::muon_momentum(gv[i], bv[i], a, b, nest);
        bv[i] = out.buf;
        uv[i] = out.update;
      }
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      const formula::MomentumOut out =
          formula::muon_momentum(load_as_float(gb, i, gd), load_as_float(bb, i, bd), m1, m2, nesterov);
      store_from_float(bb, i, bd, out.buf);
      store_from_float(ub, i, ud, out.update);
    }
  });
}

void adamw_update(Stream& stream, const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const Tensor& max_exp_avg_sq, const ops::AdamWScalars& k) {
  const size_t n = size_t(param.numel());
  if (n == 0) return;
  void* pb = param.data_ptr();
  const void* gb = grad.data_ptr();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  float* vmax = max_exp_avg_sq.defined() ? max_exp_avg_sq.data<float>() : nullptr;
  const DType pd = param.dtype(), gd = grad.dtype();
  stream.enqueue([=, keep = std::array<std::shared_ptr<Storage>, 5>{param.storage(), grad.storage(), exp_avg.storage(),
                                                             exp_avg_sq.storage(), max_exp_avg_sq.storage()}] {
    if (pd == DType::f32 && gd == DType::f32 && vmax == nullptr) {  // the common case, vectorised
      float* pv = static_cast<float*>(pb);
      const float* gv = static_cast<const float*>(gb);
#pragma omp parallel for simd if (n >= kParallelElements)
      for (size_t i = 0; i < n; ++i) pv[i] = formula::adamw(pv[i], gv[i], m[i], v[i], nullptr, k);
      return;
    }
    for (size_t i = 0; i < n; ++i)
      store_from_float(pb, i, pd,
                       formula::adamw(load_as_float(pb, i, pd), load_as_float(gb, i, gd), m[i], v[i], vmax ? vmax + i : nullptr, k));
  });
}

}  // namespace swapopt::cpu
