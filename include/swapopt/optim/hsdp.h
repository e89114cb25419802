#pragma once
/** HSDP Muon across replicas: each replicated matrix is updated by one owner, chosen greedily by
 *  load, and broadcast to the other replicas. (Sharded parameters are not supported yet.) */

#include <cstdint>
#include <memory>
#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/optim/param.h"

namespace swapopt {

/** A batch of one group's replicated params, with the replicate coordinate owning each. The same on
 *  every rank: built from logical shapes only. */
struct HsdpAssignment {
  size_t group = 0;
  std::vector<Param*> params;    // in schedule order
  std::vector<int64_t> owners;   // owner coordinate of params[i]
  int64_t local_coordinate = 0;  // this rank's replicate coordinate

  /** The params this rank updates. */
  std::vector<Param*> owned() const;
  /** Logical bytes of every param (rank-independent partition cost). */
  int64_t logical_bytes() const;
};

/** Splits `params` (one group) into assignments of at most `cap_bytes` x replicas (soft cap: a
 *  param is appended, then the batch closes once it reaches the cap), largest first, and picks
 *  owners: params by (-numel, index) to the coordinate with the smallest (load, coordinate). */
std::vector<HsdpAssignment> make_hsdp_assignments(size_t group, const std::vector<Param*>& params, int64_t replicas,
                                                  int64_t local_coordinate, int64_t cap_bytes);

/** Broadcasts owners' updated params to the replicas: flush() per assignment (at most one
 *  assignment in flight), wait_all() at the end of the step. */
class AsyncReplicateBroadcaster {
 public:
  explicit AsyncReplicateBroadcaster(std::shared_ptr<Communicator> replicas) : comm_(std::move(replicas)) {}
  /** `compute` must be synchronised by the caller: the broadcasts read the params now. */
  void flush(const HsdpAssignment& assignment);
  void wait_all();

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<WorkPtr> in_flight_;
};

}  // namespace swapopt
