// Argument checks for the fused optimizer ops, then dispatch on the stream's device.
#include "swapopt/optim/optim_ops.h"

#include "../core/operand_overlap.h"
#include "../cpu/cpu_ops.h"
#include "../cuda/cuda_backend.h"
#include "optim_ops_of_optimizer.h"
#include "swapopt/core/error.h"

namespace swapopt::ops {

namespace {
void check_same(const Stream& stream, const Tensor& ref, const Tensor& t, const char* op, const char* name) {
  SWAPOPT_CHECK(t.defined() && !t.is_released(), "[" << op << "] " << name << " is undefined or released");
  SWAPOPT_CHECK(t.device() == stream.device(),
                "[" << op << "] " << name << " is on " << t.device().str() << " but the stream is on " << stream.device().str());
  SWAPOPT_CHECK(t.shape() == ref.shape() && t.is_contiguous(),
                "[" << op << "] " << name << " " << t.str() << " must be contiguous with shape " << shape_str(ref.shape()));
}

void check_adamw(const Stream& stream, const Tensor& out_param, const Tensor& grad, const Tensor& out_exp_avg,
                 const Tensor& out_exp_avg_sq, const Tensor& out_max_exp_avg_sq, const char* op,
                 bool check_apart = true) {
  check_same(stream, out_param, out_param, op, "param");
  check_same(stream, out_param, grad, op, "grad");
  check_same(stream, out_param, out_exp_avg, op, "exp_avg");
  check_same(stream, out_param, out_exp_avg_sq, op, "exp_avg_sq");
  if (out_max_exp_avg_sq.defined()) check_same(stream, out_param, out_max_exp_avg_sq, op, "max_exp_avg_sq");
  for (const Tensor* t : {&out_exp_avg, &out_exp_avg_sq, &out_max_exp_avg_sq})
    SWAPOPT_CHECK(!t->defined() || t->dtype() == DType::f32, "[" << op << "] state must be f32, got " << t->str());
  if (!check_apart) return;
  check_operands_apart(op,
                       {{out_param, "param"},
                        {out_exp_avg, "exp_avg"},
                        {out_exp_avg_sq, "exp_avg_sq"},
                        {out_max_exp_avg_sq, "max_exp_avg_sq"}},
                       {{grad, "grad"}});
}
}  // namespace

void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& out_buf, const Tensor& out_update, float m1, float m2,
                   bool nesterov) {
  const char* op = "muon_momentum";
  check_same(stream, grad, grad, op, "grad");
  check_same(stream, grad, out_buf, op, "momentum_buffer");
  check_same(stream, grad, out_update, op, "update");
  check_operands_apart(op, {{out_buf, "momentum_buffer"}, {out_update, "update"}}, {{grad, "grad"}});
  if (stream.device().is_cpu()) {
    cpu::muon_momentum(stream, grad, out_buf, out_update, m1, m2, nesterov);
  } else {
    cuda::muon_momentum(stream, grad, out_buf, out_update, m1, m2, nesterov);
  }
}

void adamw_update(Stream& stream, const Tensor& out_param, const Tensor& grad, const Tensor& out_exp_avg,
                  const Tensor& out_exp_avg_sq, const Tensor& out_max_exp_avg_sq, const AdamWScalars& scalars) {
  check_adamw(stream, out_param, grad, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, "adamw_update");
  if (stream.device().is_cpu()) {
    const AdamWUpdate update{out_param, grad, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, scalars};
    cpu::adamw_update_many(stream, {&update, 1});
  } else {
    cuda::adamw_update(stream, out_param, grad, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, scalars);
  }
}

namespace {
void run_adamw_update_many(Stream& stream, std::span<const AdamWUpdate> updates, bool check_apart) {
  for (const AdamWUpdate& u : updates)
    check_adamw(stream, u.param, u.grad, u.exp_avg, u.exp_avg_sq, u.max_exp_avg_sq, "adamw_update_many", check_apart);
  if (stream.device().is_cpu()) {
    cpu::adamw_update_many(stream, updates);
  } else {
    cuda::adamw_update_many(stream, updates);
  }
}
}  // namespace

void adamw_update_many(Stream& stream, std::span<const AdamWUpdate> updates) {
  run_adamw_update_many(stream, updates, true);
}

void adamw_update_many_of_optimizer(Stream& stream, std::span<const AdamWUpdate> updates) {
  run_adamw_update_many(stream, updates, false);
}

}  // namespace swapopt::ops
