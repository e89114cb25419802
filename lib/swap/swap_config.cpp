#include "swapopt/swap/swap_config.h"

#include "swapopt/core/error.h"

namespace swapopt {

void SwapConfig::validate() const {
  SWAPOPT_CHECK(swap_times > 0, "[swap] swap_times must be positive, got " << swap_times);
  SWAPOPT_CHECK(min_numel >= 0, "[swap] min_numel must be non-negative, got " << min_numel);
  SWAPOPT_CHECK(!device_budget_bytes || *device_budget_bytes > 0, "[swap] device_budget_bytes must be positive");
  if (state_keys)
    for (size_t i = 0; i < state_keys->size(); ++i) {
      SWAPOPT_CHECK(!(*state_keys)[i].empty(), "[swap] state_keys holds an empty key (entry " << i << ")");
      for (size_t j = 0; j < i; ++j)
        SWAPOPT_CHECK((*state_keys)[i] != (*state_keys)[j],
                      "[swap] state key '" << (*state_keys)[i] << "' is listed twice in state_keys");
    }
}

}  // namespace swapopt
