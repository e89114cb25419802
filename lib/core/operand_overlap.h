#pragma once
// Whether an op's operands share memory (internal; used by the ops' argument checks).

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "swapopt/core/tensor.h"

namespace swapopt {

/** The bytes from x's first to one past its last addressed element; {null, null} for no elements. */
std::pair<const char*, const char*> byte_span(const Tensor& x);

/** Whether x and y address a byte in common (by their spans; a view of no elements shares none). */
bool spans_overlap(const Tensor& x, const Tensor& y);

/** One operand of an op, with the name its errors give it. */
struct NamedOperand {
  const Tensor& tensor;
  const char* name;
};

/** An elementwise op reads element i of each input and writes element i of each output, on
 *  threads or in vectors: an output may be the very same view as an input (in place), and must
 *  otherwise share no memory with any other operand, nor address an element twice itself (a dim
 *  of stride 0: "[op] y Tensor(...) has a dim of stride 0: ...", or strides that fold its dims
 *  onto each other: "... has strides [1, 1] that reach one element twice: ..."). Throws "[op] y
 *  and x share memory without being the same view ..." or "[op] exp_avg and exp_avg_sq share
 *  memory: ...". Undefined tensors are skipped. */
void check_operands_apart(const char* op, std::initializer_list<NamedOperand> outputs,
                          std::initializer_list<NamedOperand> inputs);

/** Sorts `spans` by start, stably, and returns the first two neighbours that overlap, or {null,
 *  null}. A span is anything with `uintptr_t begin, end` (the bytes [begin, end)) and whatever
 *  names it in an error. Sorted by start, any overlap includes one between neighbours, so a list
 *  of thousands costs O(n log n). Of two spans starting at one address, the one listed first
 *  comes first. */
template <class Span>
std::pair<const Span*, const Span*> sort_and_find_overlap(std::vector<Span>& spans) {
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < spans.size(); ++k)
    if (spans[k].begin < spans[k - 1].end) return {&spans[k - 1], &spans[k]};
  return {nullptr, nullptr};
}

/** In `sorted`, sorted by start and pairwise apart (as sort_and_find_overlap leaves spans it found
 *  apart), the first span that overlaps the bytes [begin, end), or sorted.end(); any others that
 *  overlap them follow it. Apart and sorted by start, the spans are sorted by end too, so this is
 *  a binary search. */
template <class Span>
typename std::vector<Span>::const_iterator first_overlapping(const std::vector<Span>& sorted, uintptr_t begin,
                                                             uintptr_t end) {
  const auto it = std::partition_point(sorted.begin(), sorted.end(), [&](const Span& s) { return s.end <= begin; });
  return it != sorted.end() && it->begin < end ? it : sorted.end();
}

}  // namespace swapopt
