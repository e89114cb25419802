#pragma once
// The error of a device budget that holds no plan (internal): a swapopt::Error whose message ends
// with the least budget that runs the step, kept apart so that a SwapOptimizerSet can name the
// least budget that runs every member.

#include <cstddef>
#include <string>

#include "swapopt/core/error.h"

namespace swapopt {

class BudgetMiss final : public Error {
 public:
  /** `what`: the miss without its last clause; `least`: the least budget that runs the step. */
  BudgetMiss(const std::string& what, size_t least)
      : Error(what + "; the least budget that runs this step is " + std::to_string(least) + " bytes"),
        what_(what),
        least_(least) {}
  size_t least() const { return least_; }
  /** The same miss naming another least budget (a set's: the largest of its members'). */
  BudgetMiss naming(size_t least) const { return BudgetMiss(what_, least); }

 private:
  std::string what_;
  size_t least_;
};

}  // namespace swapopt
