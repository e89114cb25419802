#include "swapopt/optim/grad_clipping.h"

#include <cmath>
#include <exception>
#include <iomanip>
#include <unordered_set>

#include "disjoint_params.h"
#include "sum_over_ranks.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"

namespace swapopt {

namespace {

/** The checks of clip_grad_norm's arguments; returns the params with a grad. */
std::vector<const Param*> checked_grads(const std::vector<ParamPtr>& params, double max_norm, const Stream& stream) {
  SWAPOPT_CHECK(std::isfinite(max_norm) && max_norm > 0, "[clip_grad_norm] max_norm must be finite and > 0, got " << max_norm);
  std::vector<const Param*> with_grad;
  std::unordered_set<const Param*> seen;
  for (const ParamPtr& p : params) {
    SWAPOPT_CHECK(p != nullptr, "[clip_grad_norm] null parameter");
    SWAPOPT_CHECK(seen.insert(p.get()).second, "[clip_grad_norm] parameter '"
                                                   << p->name
                                                   << "' is listed twice (its grad would be counted and scaled twice)");
    if (!p->has_grad()) continue;
    const Tensor& g = p->grad;
    SWAPOPT_CHECK(!g.is_released(), "[clip_grad_norm] grad of '" << p->name << "' has released storage");
    // A grad of another shape (the full tensor beside a shard, say) would be counted as it is.
    SWAPOPT_CHECK(g.shape() == p->data.shape(),
                  "[clip_grad_norm] grad of '" << p->name << "' is " << g.str() << ", the param " << p->data.str());
    SWAPOPT_CHECK(g.device() == stream.device() && g.is_contiguous(),
                  "[clip_grad_norm] grad of '" << p->name << "' must be contiguous on " << stream.device().str()
                                               << ", got " << g.str());
    with_grad.push_back(p.get());
  }
  check_disjoint_grads(with_grad, "clip_grad_norm");
  return with_grad;
}

/** This rank's weighted sum of the squares of its grads' elements (f64, on the host). */
double sum_of_squares(const std::vector<const Param*>& with_grad, Stream& stream, const Communicator* world) {
  // One Frobenius norm per grad, on the stream, then the weighted sum of their squares on the host.
  const Tensor norms = Tensor::empty({int64_t(with_grad.size())}, DType::f32, stream.device(), &stream);
  for (size_t i = 0; i < with_grad.size(); ++i) {
    const Tensor& g = with_grad[i]->grad;
    ops::frobenius_norm(stream, g.view({1, g.numel()}), norms.narrow(0, int64_t(i), 1));
  }
  stream.synchronize();
  const std::vector<float> each = with_grad.empty() ? std::vector<float>() : norms.to_float_vector();
  double sum = 0.0;
  for (size_t i = 0; i < with_grad.size(); ++i) {
    double weight = 1.0;
    if (world != nullptr) {  // 1 / the ranks holding the same elements: every rank, or the param's replicas
      const Param& p = *with_grad[i];
      double holders = double(world->size());
      if (p.layout) {
        holders = 1.0;
        for (int64_t dim : p.layout->replicate_dims()) holders *= double(p.layout->mesh().size(dim));
      }
      weight = 1.0 / holders;
    }
    sum += weight * double(each[i]) * double(each[i]);
  }
  return sum;
}

/** A double in four f32 slots, exactly: its binary exponent e (an integer, exact in f32), then
 *  x * 2^-e, in [1, 2), as three f32 parts, which hold its 53 bits. Zero, inf and NaN go as they
 *  are, with e = 0. */
void encode_exactly(double x, float* slots) {
  const int e = std::isfinite(x) && x != 0.0 ? std::ilogb(x) : 0;
  const double scaled = std::ldexp(x, -e);
  slots[0] = float(e);
  slots[1] = float(scaled);
  if (std::isfinite(scaled)) {
    const double rest = scaled - double(slots[1]);  // exact, as is the next one
    slots[2] = float(rest);
    slots[3] = float(rest - double(slots[2]));
  }
}

double decode_exactly(const float* slots) {
  return std::ldexp(double(slots[1]) + double(slots[2]) + double(slots[3]), int(slots[0]));
}

}  // namespace

double clip_grad_norm(const std::vector<ParamPtr>& params, double max_norm, Stream& stream, Communicator* world) {
  // With `world`, a rank whose checks (or norms) fail still joins the exchange below, and every
  // rank learns of it there: a rank throwing alone would leave the others waiting in it.
  std::exception_ptr failure;
  std::vector<const Param*> with_grad;
  double sum = 0.0;
  try {
    with_grad = checked_grads(params, max_norm, stream);
    sum = sum_of_squares(with_grad, stream, world);
  } catch (...) {
    if (world == nullptr) throw;
    failure = std::current_exception();
  }
  if (world != nullptr) {
    // Every rank's f64 sum and max_norm, exchanged exactly: every rank adds the sums in rank
    // order, so all get the same total, without an f32 rounding or overflow, and sees every
    // rank's max_norm. After a count of the ranks that failed, each rank's own eight slots (the
    // other ranks add zeros): its sum, then its max_norm, four slots each.
    constexpr size_t kSlots = 8;
    std::vector<float> parts(1 + kSlots * size_t(world->size()), 0.f);
    parts[0] = failure ? 1.f : 0.f;
    float* mine = &parts[1 + kSlots * size_t(world->rank())];
    encode_exactly(sum, mine);
    encode_exactly(max_norm, mine + 4);
    parts = sum_over_ranks(*world, stream.device(), parts);
    if (failure) std::rethrow_exception(failure);
    SWAPOPT_CHECK(parts[0] == 0.f, "[clip_grad_norm] failed its checks on "
                                       << parts[0] << " of " << world->size()
                                       << " ranks (their errors say why): no grad was scaled");
    sum = 0.0;
    for (size_t r = 1; r < parts.size(); r += kSlots) {
      sum += decode_exactly(&parts[r]);
      const double theirs = decode_exactly(&parts[r + 4]);
      // Every rank sees the same values, so every rank throws here or none does.
      SWAPOPT_CHECK(theirs == decode_exactly(&parts[1 + 4]),
                    "[clip_grad_norm] ranks pass different max_norm (rank 0: "
                        << std::setprecision(17) << decode_exactly(&parts[1 + 4]) << ", rank " << (r - 1) / kSlots
                        << ": " << theirs << "): every rank must clip alike, no grad was scaled");
    }
  }
  const double norm = std::sqrt(sum);
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0)
    for (const Param* p : with_grad) ops::scale(stream, p->grad, float(coef));
  return norm;
}

}  // namespace swapopt
