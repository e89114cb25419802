#include "swapopt/optim/hsdp.h"

#include <algorithm>
#include <numeric>

#include "swapopt/core/error.h"

namespace swapopt {

std::vector<Param*> HsdpAssignment::owned() const {
  std::vector<Param*> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (owners[i] == local_coordinate) out.push_back(params[i]);
  return out;
}

int64_t HsdpAssignment::logical_bytes() const {
  int64_t bytes = 0;
  for (const Param* p : params) bytes += shape_numel(p->logical_shape()) * int64_t(p->data.element_size());
  return bytes;
}

std::vector<HsdpAssignment> make_hsdp_assignments(size_t group, const std::vector<Param*>& params, int64_t replicas,
                                                  int64_t local_coordinate, int64_t cap_bytes) {
  SWAPOPT_CHECK(replicas >= 1 && local_coordinate >= 0 && local_coordinate < replicas,
                "[Muon] replicate coordinate " << local_coordinate << " outside " << replicas << " replicas");
  // Largest first (stable, so equal sizes keep their order): every rank sorts the same way.
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  auto numel = [&](size_t i) { return shape_numel(params[i]->logical_shape()); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numel(a) > numel(b); });
  std::vector<HsdpAssignment> out;
  const int64_t cap = cap_bytes * replicas;
  int64_t bytes = 0;
  for (size_t i : order) {
    if (out.empty() || bytes >= cap) {
      out.emplace_back();
      out.back().group = group;
      out.back().local_coordinate = local_coordinate;
      bytes = 0;
    }
    out.back().params.push_back(params[i]);
    bytes += numel(i) * int64_t(params[i]->data.element_size());
  }
  for (HsdpAssignment& a : out) {
    std::vector<size_t> by_size(a.params.size());
    std::iota(by_size.begin(), by_size.end(), 0);
    std::stable_sort(by_size.begin(), by_size.end(), [&](size_t x, size_t y) {
      return shape_numel(a.params[x]->logical_shape()) > shape_numel(a.params[y]->logical_shape());
    });
    std::vector<int64_t> load(size_t(replicas), 0);
    a.owners.assign(a.params.size(), 0);
    for (size_t i : by_size) {
      const int64_t owner = int64_t(std::min_element(load.begin(), load.end()) - load.begin());  // ties: lowest coordinate
      a.owners[i] = owner;
      load[size_t(owner)] += shape_numel(a.params[i]->logical_shape());
    }
  }
  return out;
}

void AsyncReplicateBroadcaster::flush(const HsdpAssignment& assignment) {
  for (WorkPtr& w : in_flight_) w->wait();  // at most one assignment in flight
  in_flight_.clear();
  for (size_t i = 0; i < assignment.params.size(); ++i)
    in_flight_.push_back(comm_->broadcast(assignment.params[i]->data, int(assignment.owners[i])));
}

void AsyncReplicateBroadcaster::wait_all() {
  for (WorkPtr& w : in_flight_) w->wait();
  in_flight_.clear();
}

}  // namespace swapopt
