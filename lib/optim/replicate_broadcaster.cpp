#include "swapopt/optim/replicate_broadcaster.h"

namespace swapopt {

void AsyncReplicateBroadcaster::flush(const HsdpAssignment& assignment) {
  wait_all();  // at most one assignment in flight
  if (!assignment.replicas) return;
  for (size_t i = 0; i < assignment.params.size(); ++i)
    in_flight_.push_back(assignment.replicas->broadcast(assignment.params[i]->data, int(assignment.owners[i])));
}

void AsyncReplicateBroadcaster::wait_all() {
  std::vector<WorkPtr> pending = std::move(in_flight_);
  in_flight_.clear();
  for (WorkPtr& w : pending) w->wait();
}

}  // namespace swapopt
