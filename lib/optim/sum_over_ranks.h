#pragma once
// f32 values summed over a communicator's ranks (internal; the step checks' agreement and votes,
// clipping's norm).

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/core/stream.h"

namespace swapopt {

/** Each of `values` summed over every rank of `group`, on `device`'s communicator memory.
 *  Collective; waits on the host.
 *
 *  On the CPU the collective reads host memory and the host waits for it: no stream at all. A
 *  shared stream would couple ranks that share a process (a task waiting for this rank's
 *  collective blocks every later user of that stream, another rank's staging included, until the
 *  timeout) and would keep a failed collective's error for an unrelated later caller.
 *
 *  On CUDA (NCCL needs device memory) the tensor is staged through the device's default stream,
 *  not a caller's: a stream holding an earlier failure would make this rank throw alone and leave
 *  the others waiting in the collective. It is allocated and freed in order on that stream (a free
 *  without a stream would synchronise the whole device). */
inline std::vector<float> sum_over_ranks(Communicator& group, Device device, const std::vector<float>& values) {
  const Tensor host = Tensor::from_floats(values, {int64_t(values.size())});
  if (device.is_cpu()) {
    group.all_reduce(host)->wait();
    const float* sums = host.data<float>();
    return std::vector<float>(sums, sums + values.size());
  }
  Stream& stream = default_stream(device);
  const Tensor total = Tensor::empty({int64_t(values.size())}, DType::f32, device, &stream);
  ops::copy(stream, host, total);
  stream.synchronize();  // the collective reads `total` now
  const WorkPtr work = group.all_reduce(total);
  // `total` is freed on `stream`: ordered after the collective's end, also when it failed (NCCL
  // then throws after ordering it), and waited for either way.
  std::exception_ptr ordering;
  try {
    work->finish_before(stream);
  } catch (...) {
    ordering = std::current_exception();
  }
  work->wait();
  if (ordering) std::rethrow_exception(ordering);
  return total.to_float_vector();  // a copy on the same stream, after the collective completed
}

/** The vote closing checks each rank ran on its own (`local_failure` holds this rank's error), so
 *  that a rank failing them does not leave the others waiting in the collectives that follow. A
 *  failure flag ahead of `values` is summed over the ranks by `sum` (one collective). This rank's
 *  own error is rethrown; another rank's failure throws "`what` failed its checks on another rank
 *  (that rank's error says why): `outcome`". Returns the sums of `values`, flag removed. */
template <class Sum>
std::vector<float> vote_on_checks(Sum&& sum, std::exception_ptr local_failure, const std::vector<float>& values,
                                  const std::string& what, const std::string& outcome) {
  std::vector<float> votes = {local_failure ? 1.f : 0.f};
  votes.insert(votes.end(), values.begin(), values.end());
  votes = std::forward<Sum>(sum)(std::move(votes));
  if (local_failure) std::rethrow_exception(local_failure);
  SWAPOPT_CHECK(votes[0] == 0.f,
                what << " failed its checks on another rank (that rank's error says why): " << outcome);
  return std::vector<float>(votes.begin() + 1, votes.end());
}

}  // namespace swapopt
