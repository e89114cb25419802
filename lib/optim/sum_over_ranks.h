#pragma once
// One f32 value summed over a communicator's ranks (internal; clipping's norm, the non-finite vote).

#include "swapopt/comm/communicator.h"
#include "swapopt/core/ops.h"

namespace swapopt {

/** `value` summed over every rank of `group`, through a stream-ordered one-element tensor on
 *  `stream`'s device (NCCL needs device memory). Collective; waits on the host. */
inline float sum_over_ranks(Communicator& group, Stream& stream, float value) {
  const Tensor total = Tensor::empty({1}, DType::f32, stream.device(), &stream);
  ops::copy(stream, Tensor::from_floats({value}, {1}), total);
  stream.synchronize();  // the collective reads `total` now
  group.all_reduce(total)->wait();
  return total.to_float_vector()[0];
}

}  // namespace swapopt
