// CPU fused optimizer updates (enqueued on the CPU stream).
#include <algorithm>
#include <array>
#include <memory>
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace swapopt::cpu {

// Addresses are read at enqueue time and storages held until the work has run, as in cpu_ops.cpp.
// The f32 loops are split over the OpenMP threads when large: every element is independent, so
// the bits do not depend on the split.

namespace {
[[maybe_unused]] constexpr size_t kParallelElements = size_t(1) << 16;  // unread without OpenMP

// The loops' arguments are the functions' own: scalars read through a lambda's closure keep GCC
// from vectorising a loop (as in cpu_ops.cpp).

void momentum_f32(const float* g, float* buf, float* update, size_t n, float m1, float m2, bool nesterov) {
#pragma omp parallel for simd if (n >= kParallelElements)
  for (size_t i = 0; i < n; ++i) {
    const formula::MomentumOut out = formula::muon_momentum(g[i], buf[i], m1, m2, nesterov);
    buf[i] = out.buf;
    update[i] = out.update;
  }
}

void adamw_f32(float* p, const float* g, float* m, float* v, size_t n, ops::AdamWScalars k) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) p[i] = formula::adamw(p[i], g[i], m[i], v[i], nullptr, k);
}

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
      momentum_f32(static_cast<const float*>(gb), static_cast<float*>(bb), static_cast<float*>(ub), n, m1, m2, nesterov);
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

namespace {

/** One tensor's AdamW arguments, as raw pointers taken when the op is enqueued. */
struct AdamWJob {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null without amsgrad
  DType param_dtype, grad_dtype;
  ops::AdamWScalars scalars;
};

/** Elements [begin, end) of one job. */
struct AdamWPiece {
  size_t job, begin, end;
};

/** Pieces of at most this many elements are the units of work handed to the OpenMP threads:
 *  small enough that a list of small params spreads over the threads, large enough that each
 *  piece is a long vector loop. */
constexpr size_t kAdamWPiece = size_t(1) << 14;

void run_piece(const AdamWJob& j, size_t begin, size_t end) {
  if (j.param_dtype == DType::f32 && j.grad_dtype == DType::f32 && j.max_exp_avg_sq == nullptr) {  // the common case
    adamw_f32(static_cast<float*>(j.param) + begin, static_cast<const float*>(j.grad) + begin, j.exp_avg + begin,
              j.exp_avg_sq + begin, end - begin, j.scalars);
    return;
  }
  for (size_t i = begin; i < end; ++i)
    store_from_float(j.param, i, j.param_dtype,
                     formula::adamw(load_as_float(j.param, i, j.param_dtype), load_as_float(j.grad, i, j.grad_dtype),
                                    j.exp_avg[i], j.exp_avg_sq[i], j.max_exp_avg_sq ? j.max_exp_avg_sq + i : nullptr,
                                    j.scalars));
}

}  // namespace

void adamw_update_many(Stream& stream, std::span<const ops::AdamWUpdate> updates) {
  std::vector<AdamWJob> jobs;
  std::vector<AdamWPiece> pieces;
  std::vector<std::shared_ptr<Storage>> keep;
  size_t total = 0;
  for (const ops::AdamWUpdate& u : updates) {
    const size_t n = size_t(u.param.numel());
    if (n == 0) continue;
    jobs.push_back({u.param.data_ptr(), u.grad.data_ptr(), u.exp_avg.data<float>(), u.exp_avg_sq.data<float>(),
                    u.max_exp_avg_sq.defined() ? u.max_exp_avg_sq.data<float>() : nullptr, u.param.dtype(), u.grad.dtype(),
                    u.scalars});
    for (size_t begin = 0; begin < n; begin += kAdamWPiece) pieces.push_back({jobs.size() - 1, begin, std::min(n, begin + kAdamWPiece)});
    for (const Tensor* t : {&u.param, &u.grad, &u.exp_avg, &u.exp_avg_sq, &u.max_exp_avg_sq})
      if (t->defined()) keep.push_back(t->storage());
    total += n;
  }
  if (jobs.empty()) return;
  stream.enqueue([jobs = std::move(jobs), pieces = std::move(pieces), keep = std::move(keep), total] {
    const auto count = std::ptrdiff_t(pieces.size());
    (void)total;  // unread without OpenMP
#pragma omp parallel for schedule(dynamic, 1) if (total >= kParallelElements)
    for (std::ptrdiff_t i = 0; i < count; ++i) run_piece(jobs[pieces[size_t(i)].job], pieces[size_t(i)].begin, pieces[size_t(i)].end);
  });
}

}  // namespace swapopt::cpu
