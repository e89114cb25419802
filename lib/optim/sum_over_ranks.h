#pragma once
// f32 values summed over a communicator's ranks (internal; the step checks' agreement and votes,
// clipping's norm).

#include <exception>
#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/ops.h"
#include "swapopt/core/stream.h"

namespace swapopt {

/** Each of `values` summed over every rank of `group` (one all-reduce of a tensor on `device`: NCCL
 *  needs device memory). The tensor is staged through the device's default stream, not a caller's:
 *  a stream holding an earlier failure would make this rank throw alone and leave the others
 *  waiting in the collective. Allocated and freed in order on that stream (a free without a stream
 *  would synchronise the whole device). Collective; waits on the host. */
inline std::vector<float> sum_over_ranks(Communicator& group, Device device, const std::vector<float>& values) {
  Stream& stream = default_stream(device);
  const Tensor total = Tensor::empty({int64_t(values.size())}, DType::f32, device, &stream);
  ops::copy(stream, Tensor::from_floats(values, {int64_t(values.size())}), total);
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

}  // namespace swapopt
