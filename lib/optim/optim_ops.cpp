// Argument checks for the fused optimizer ops, then dispatch on the stream's device.
#include "swapopt/optim/optim_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/operand_overlap.h"
#include "../cpu/cpu_ops.h"
#include "../cuda/cuda_backend.h"
#include "optim_ops_of_optimizer.h"
#include "swapopt/core/error.h"

namespace swapopt::ops {

namespace {
/** One AdamW update's writes apart from each other and from its grad (the same view in place). */
void check_own_operands_apart(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                              const Tensor& max_exp_avg_sq, const char* op) {
  check_operands_apart(
      op, {{param, "param"}, {exp_avg, "exp_avg"}, {exp_avg_sq, "exp_avg_sq"}, {max_exp_avg_sq, "max_exp_avg_sq"}},
      {{grad, "grad"}});
}

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
  if (check_apart) check_own_operands_apart(out_param, grad, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, op);
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
/** One tensor of an update in a list: its bytes, its update's index and its name. */
struct UpdateOperand {
  uintptr_t begin, end;
  size_t update;
  const char* name;
};

/** The updates of a list run concurrently: across updates, no two writes may overlap and no grad
 *  may overlap a write (each update's own operands were checked apart already). Sorted by
 *  address, so a list of thousands of tensors costs O(n log n). */
void check_updates_apart(std::span<const AdamWUpdate> updates, const char* op) {
  std::vector<UpdateOperand> writes, grads;
  auto add = [](std::vector<UpdateOperand>& to, const Tensor& t, size_t update, const char* name) {
    if (!t.defined()) return;
    const auto [begin, end] = byte_span(t);
    if (begin != nullptr)
      to.push_back({reinterpret_cast<uintptr_t>(begin), reinterpret_cast<uintptr_t>(end), update, name});
  };
  for (size_t i = 0; i < updates.size(); ++i) {
    const AdamWUpdate& u = updates[i];
    add(writes, u.param, i, "param");
    add(writes, u.exp_avg, i, "exp_avg");
    add(writes, u.exp_avg_sq, i, "exp_avg_sq");
    add(writes, u.max_exp_avg_sq, i, "max_exp_avg_sq");
    add(grads, u.grad, i, "grad");
  }
  auto check_apart = [op](bool apart, const UpdateOperand& x, const UpdateOperand& y) {
    SWAPOPT_CHECK(
        apart, "[" << op << "] update " << x.update << "'s " << x.name << " and update " << y.update << "'s " << y.name
                   << " share memory: the updates run concurrently, so none may write what another reads or writes");
  };
  if (const auto [x, y] = sort_and_find_overlap(writes); x != nullptr) check_apart(false, *x, *y);
  // The writes are now apart and sorted: the writes a grad overlaps are a run found by binary
  // search, and only its own update's may be among them.
  for (const UpdateOperand& grad : grads)
    for (auto w = first_overlapping(writes, grad.begin, grad.end); w != writes.end() && w->begin < grad.end; ++w)
      check_apart(w->update == grad.update, grad, *w);
}

void run_adamw_update_many(Stream& stream, std::span<const AdamWUpdate> updates, bool check_apart) {
  for (const AdamWUpdate& u : updates)
    check_adamw(stream, u.param, u.grad, u.exp_avg, u.exp_avg_sq, u.max_exp_avg_sq, "adamw_update_many", check_apart);
  if (check_apart) check_updates_apart(updates, "adamw_update_many");
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

void check_adamw_updates_apart(std::span<const AdamWUpdate> updates, const char* op) {
  for (const AdamWUpdate& u : updates)
    check_own_operands_apart(u.param, u.grad, u.exp_avg, u.exp_avg_sq, u.max_exp_avg_sq, op);
  check_updates_apart(updates, op);
}

}  // namespace swapopt::ops
