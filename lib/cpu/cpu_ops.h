#pragma once
// The CPU backend's ops (internal): each enqueues its work on the CPU stream. Arguments were
// checked by lib/core/ops.cpp.

#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"

namespace swapopt::cpu {

void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha,
          float beta);
void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& c, float alpha, float beta);
void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& y);
void lerp(Stream& stream, const Tensor& a, const Tensor& b, float weight);
void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& norms);
void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps);
void flag_nonfinite(Stream& stream, const Tensor& x, const Tensor& flag);
void cast(Stream& stream, const Tensor& src, const Tensor& dst);
void copy(Stream& stream, const Tensor& src, const Tensor& dst);
void fill_zero(Stream& stream, const Tensor& x);

}  // namespace swapopt::cpu

#include "swapopt/optim/optim_ops.h"

namespace swapopt::cpu {

void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& buf, const Tensor& update, float m1, float m2,
                   bool nesterov);
void adamw_update_many(Stream& stream, std::span<const ops::AdamWUpdate> updates);

}  // namespace swapopt::cpu
