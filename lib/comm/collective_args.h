#pragma once
// Argument checks shared by the communicators (internal): what every backend refuses before it
// issues a collective, so that a bad call throws on the calling rank instead of failing inside the
// collective (where the other ranks then wait for it until the timeout).

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "../core/operand_overlap.h"
#include "swapopt/core/error.h"
#include "swapopt/core/tensor.h"

namespace swapopt::comm_args {

/** A tensor a collective can read and write: defined, its storage not released. */
inline void check_usable(const Tensor& t, const char* op) {
  SWAPOPT_CHECK(t.defined(), "[comm] " << op << ": undefined tensor");
  SWAPOPT_CHECK(!t.is_released(), "[comm] " << op << ": released storage: " << t.str());
}

/** broadcast_many's tensors share no byte (empty ones share none). Sorted by address, so
 *  O(n log n) for a list of thousands. */
inline void check_apart(const std::vector<Tensor>& tensors, const char* op) {
  std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> spans;  // (first byte, one past the last, index)
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [begin, end] = byte_span(tensors[i]);
    if (begin != nullptr) spans.emplace_back(reinterpret_cast<uintptr_t>(begin), reinterpret_cast<uintptr_t>(end), i);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    const size_t i = std::get<2>(spans[k - 1]), j = std::get<2>(spans[k]);
    SWAPOPT_CHECK(std::get<1>(spans[k - 1]) <= std::get<0>(spans[k]),
                  "[comm] " << op << ": tensor " << i << " " << tensors[i].str() << " and tensor " << j << " "
                            << tensors[j].str() << " share memory");
  }
}

/** all_gather's and reduce_scatter's input and output share no byte (NCCL's in-place forms are
 *  not taken: Gloo has none). */
inline void check_in_out_apart(const Tensor& in, const Tensor& out, const char* op) {
  SWAPOPT_CHECK(!spans_overlap(in, out),
                "[comm] " << op << ": in " << in.str() << " and out " << out.str() << " share memory");
}

}  // namespace swapopt::comm_args
