#pragma once
// How far a strided view reaches into its storage (internal; used by Tensor and the ops' checks).

#include <cstddef>
#include <cstdint>
#include <optional>

#include "swapopt/core/tensor.h"

namespace swapopt {

/** Elements from a view's first to one past its last addressed element (0 for a view of no
 *  elements), or nullopt when that span, counted in bytes of `element_size`, overflows int64.
 *  Strides must be non-negative. */
std::optional<int64_t> view_span(const Shape& shape, const Shape& strides, size_t element_size);

}  // namespace swapopt
