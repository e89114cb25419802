// CPU fused optimizer updates (enqueued on the CPU stream).
#include <algorithm>
#include <cmath>

#include "cpu_ops.h"

namespace swapopt::cpu {

void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& buf, const Tensor& update, float m1, float m2,
                   bool nesterov) {
  stream.enqueue([=] {
    const size_t n = size_t(grad.numel());
    if (n == 0) return;
    const void* gb = grad.data_ptr();
    void* bb = buf.data_ptr();
    void* ub = update.data_ptr();
    for (size_t i = 0; i < n; ++i) {
      const float g = load_as_float(gb, i, grad.dtype());
      const float b = load_as_float(bb, i, buf.dtype());
      float u = g + m1 * b;
      store_from_float(bb, i, buf.dtype(), m2 * b + g);
      if (nesterov) u = m1 * u + g;
      store_from_float(ub, i, update.dtype(), u);
    }
  });
}

void adamw_update(Stream& stream, const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const Tensor& max_exp_avg_sq, const ops::AdamWScalars& k) {
  stream.enqueue([=] {
    const size_t n = size_t(param.numel());
    if (n == 0) return;
    void* pb = param.data_ptr();
    const void* gb = grad.data_ptr();
    float* m = exp_avg.data<float>();
    float* v = exp_avg_sq.data<float>();
    float* vmax = max_exp_avg_sq.defined() ? max_exp_avg_sq.data<float>() : nullptr;
    for (size_t i = 0; i < n; ++i) {
      const float g = load_as_float(gb, i, grad.dtype());
      float p = load_as_float(pb, i, param.dtype()) * k.decay;
      const float w = k.one_minus_beta1;
      m[i] = w < 0.5f ? m[i] + w * (g - m[i]) : g - (g - m[i]) * (1.f - w);
      v[i] = v[i] * k.beta2 + (k.one_minus_beta2 * g) * g;
      float second = v[i];
      if (vmax != nullptr) second = vmax[i] = std::max(vmax[i], v[i]);
      const float denom = std::sqrt(second) / k.bias_correction2_sqrt + k.eps;
      p = p + k.neg_step_size * (m[i] / denom);
      store_from_float(pb, i, param.dtype(), p);
    }
  });
}

}  // namespace swapopt::cpu
