#include "disjoint_params.h"

#include "../core/operand_overlap.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

/** The bytes of one param's `field` tensor (contiguous: one range). */
struct FieldBytes {
  uintptr_t begin, end;
  const Param* param;
};

/** The first two of `params` whose `field` tensors overlap, or {null, null}. Of two starting at
 *  one address, the one listed first is first. */
std::pair<const Param*, const Param*> first_overlap(const std::vector<const Param*>& params, Tensor Param::*field) {
  std::vector<FieldBytes> spans;
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

void fail_params_share_memory(const Param& a, const Param& b, const std::string& who) {
  SWAPOPT_FAIL("[" << who << "] parameters '" << a.name << "' and '" << b.name
                   << "' share memory (an update of one would change the other)");
}

void check_disjoint_params(const std::vector<const Param*>& params, const std::string& who) {
  const auto [a, b] = first_overlap(params, &Param::data);
  if (a != nullptr) fail_params_share_memory(*a, *b, who);
}

void check_disjoint_grads(const std::vector<const Param*>& params, const std::string& who) {
  const auto [a, b] = first_overlap(params, &Param::grad);
  SWAPOPT_CHECK(a == nullptr, "[" << who << "] the grads of '" << a->name << "' and '" << b->name
                                  << "' share memory (they would be counted and scaled twice)");
}

}  // namespace swapopt
