#pragma once
// f32 values summed over a communicator's ranks (internal; the step checks' agreement, clipping's
// norm, the non-finite vote).

#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/tensor.h"

namespace swapopt {

/** Each of `values` summed over every rank of `group` (one all-reduce of a tensor on `device`: NCCL
 *  needs device memory). The tensor is staged through the device's default stream, not a caller's:
 *  a stream holding an earlier failure would make this rank throw alone and leave the others
 *  waiting in the collective. Collective; waits on the host. */
inline std::vector<float> sum_over_ranks(Communicator& group, Device device, const std::vector<float>& values) {
  const Tensor total = Tensor::from_floats(values, {int64_t(values.size())}, DType::f32, device);
  group.all_reduce(total)->wait();
  return total.to_float_vector();
}

/** One value summed over every rank of `group`, as above. */
inline float sum_over_ranks(Communicator& group, Device device, float value) {
  return sum_over_ranks(group, device, std::vector<float>{value})[0];
}

}  // namespace swapopt
