#include "swapopt/swap/state_swap_adapter.h"

#include "swapopt/core/error.h"

namespace swapopt {

std::vector<int64_t> StateSwapAdapter::partition_costs(const std::vector<UpdateUnit>& units) const {
  std::vector<int64_t> costs;
  costs.reserve(units.size());
  for (const UpdateUnit& u : units) costs.push_back(u.logical_bytes);
  return costs;
}

void StateSwapAdapter::step_chunked(UpdateUnit&, const StateStream&) {
  SWAPOPT_FAIL("[swap] this adapter cannot run a unit in chunks");
}

}  // namespace swapopt
