#pragma once
// Argument checks shared by the communicators (internal): what every backend refuses before it
// issues a collective, so that a bad call throws on the calling rank instead of failing inside the
// collective (where the other ranks then wait for it until the timeout).

#include <cstdint>
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
  struct Bytes {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<Bytes> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [begin, end] = byte_span(tensors[i]);
    if (begin != nullptr) spans.push_back({reinterpret_cast<uintptr_t>(begin), reinterpret_cast<uintptr_t>(end), i});
  }
  const auto [x, y] = sort_and_find_overlap(spans);
  SWAPOPT_CHECK(x == nullptr, "[comm] " << op << ": tensor " << x->index << " " << tensors[x->index].str()
                                        << " and tensor " << y->index << " " << tensors[y->index].str()
                                        << " share memory");
}

/** all_gather's and reduce_scatter's input and output share no byte (NCCL's in-place forms are
 *  not taken: Gloo has none). */
inline void check_in_out_apart(const Tensor& in, const Tensor& out, const char* op) {
  SWAPOPT_CHECK(!spans_overlap(in, out),
                "[comm] " << op << ": in " << in.str() << " and out " << out.str() << " share memory");
}

}  // namespace swapopt::comm_args
