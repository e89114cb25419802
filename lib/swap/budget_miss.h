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
  /** `what`: the miss without its last clause; `least`: the least budget that runs the step or,
   *  `rank_local` (an optimizer spanning ranks, each planning its own units), this rank's part. */
  BudgetMiss(const std::string& what, size_t least, bool rank_local = false)
      : Error(what + clause(least, rank_local)), what_(what), least_(least), rank_local_(rank_local) {}
  size_t least() const { return least_; }
  bool rank_local() const { return rank_local_; }
  /** The same miss naming another least budget (a set's: the largest of its members'). */
  BudgetMiss naming(size_t least, bool rank_local) const { return BudgetMiss(what_, least, rank_local); }

 private:
  static std::string clause(size_t least, bool rank_local) {
    return rank_local ? "; the least budget that runs this rank's part of the step is " + std::to_string(least) +
                            " bytes (another rank's part may need more)"
                      : "; the least budget that runs this step is " + std::to_string(least) + " bytes";
  }
  std::string what_;
  size_t least_;
  bool rank_local_;
};

}  // namespace swapopt
