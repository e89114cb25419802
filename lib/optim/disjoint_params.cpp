#include "disjoint_params.h"

#include <algorithm>
#include <functional>

#include "swapopt/core/error.h"

namespace swapopt {

namespace {

/** The first two of `params` whose `field` tensors overlap (contiguous: a byte range each), or
 *  {null, null}. Of two starting at one address, the one listed first is first. */
std::pair<const Param*, const Param*> first_overlap(const std::vector<const Param*>& params, Tensor Param::*field) {
  struct Range {
    const char* begin;
    const char* end;
    const Param* param;
  };
  std::vector<Range> ranges;
  for (const Param* p : params) {
    const Tensor& t = p->*field;
    if (!t.defined() || t.nbytes() == 0 || t.is_released()) continue;  // no memory to share
    const char* begin = static_cast<const char*>(t.data_ptr());
    ranges.push_back({begin, begin + t.nbytes(), p});
  }
  std::stable_sort(ranges.begin(), ranges.end(),
                   [](const Range& a, const Range& b) { return std::less<>()(a.begin, b.begin); });
  // Sorted by start, any overlap includes one between neighbours.
  for (size_t i = 1; i < ranges.size(); ++i)
    if (std::less<>()(ranges[i].begin, ranges[i - 1].end)) return {ranges[i - 1].param, ranges[i].param};
  return {nullptr, nullptr};
}

}  // namespace

void check_disjoint_params(const std::vector<const Param*>& params, const std::string& who) {
  const auto [a, b] = first_overlap(params, &Param::data);
  SWAPOPT_CHECK(a == nullptr, "[" << who << "] parameters '" << a->name << "' and '" << b->name
                                  << "' share memory (an update of one would change the other)");
}

void check_disjoint_grads(const std::vector<const Param*>& params, const std::string& who) {
  const auto [a, b] = first_overlap(params, &Param::grad);
  SWAPOPT_CHECK(a == nullptr, "[" << who << "] the grads of '" << a->name << "' and '" << b->name
                                  << "' share memory (they would be counted and scaled twice)");
}

}  // namespace swapopt
