#include "disjoint_params.h"

#include "../core/operand_overlap.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

/** The bytes of `params`' `field` tensors (contiguous: one range each), sorted by address, and the
 *  first two that overlap, or {null, null}. Of two starting at one address, the one listed first
 *  is first. Tensors without memory (undefined, empty or released) are left out. */
std::pair<const Param*, const Param*> field_bytes_overlap(const std::vector<const Param*>& params, Tensor Param::*field,
                                                          std::vector<detail::ParamBytes>& spans) {
  for (const Param* p : params) {
    const Tensor& t = p->*field;
    if (!t.defined() || t.nbytes() == 0 || t.is_released()) continue;  // no memory to share
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({begin, begin + t.nbytes(), p});
  }
  const auto [a, b] = sort_and_find_overlap(spans);
  if (a == nullptr) return {nullptr, nullptr};
  return {a->param, b->param};
}

}  // namespace

std::vector<detail::ParamBytes> sorted_disjoint_data(const std::vector<const Param*>& params, const std::string& who) {
  std::vector<detail::ParamBytes> spans;
  const auto [a, b] = field_bytes_overlap(params, &Param::data, spans);
  SWAPOPT_CHECK(a == nullptr, "[" << who << "] parameters '" << a->name << "' and '" << b->name
                                  << "' share memory (an update of one would change the other)");
  return spans;
}

void check_disjoint_grads(const std::vector<const Param*>& params, const std::string& who) {
  std::vector<detail::ParamBytes> spans;
  const auto [a, b] = field_bytes_overlap(params, &Param::grad, spans);
  SWAPOPT_CHECK(a == nullptr, "[" << who << "] the grads of '" << a->name << "' and '" << b->name
                                  << "' share memory (they would be counted and scaled twice)");
}

}  // namespace swapopt
