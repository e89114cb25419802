#pragma once
// Copies the library makes between buffers it allocated itself (internal).

#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"

namespace swapopt::ops {

/** ops::copy between two separate allocations (the swap runtime's host mirrors, staging arenas and
 *  device state): every check but that of shared memory, which they pass by construction and which
 *  would cost each of a step's thousands of copies its spans. */
void copy_between_allocations(Stream& stream, const Tensor& src, const Tensor& out_dst);

}  // namespace swapopt::ops
