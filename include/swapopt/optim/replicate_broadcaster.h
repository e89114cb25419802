#pragma once
/** Broadcasts HSDP owners' updated params to the other replicas of their block, asynchronously. */

#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/optim/hsdp.h"

namespace swapopt {

/** One per step: flush() at the end of each assignment (at most one assignment in flight: it waits
 *  for the previous one first), wait_all() at the end of the step. */
class AsyncReplicateBroadcaster {
 public:
  /** Every param of `assignment` (its local shard) from its owner to the replicas. The caller has
   *  synchronised the compute stream: the broadcasts read the params now. */
  void flush(const HsdpAssignment& assignment);
  void wait_all();

 private:
  std::vector<WorkPtr> in_flight_;
};

}  // namespace swapopt
