#include "swapopt/optim/hsdp.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "swapopt/core/error.h"

namespace swapopt {

void HsdpOptions::validate() const {
  SWAPOPT_CHECK(cap_bytes >= 1, "[Muon] HSDP cap_bytes must be >= 1, got " << cap_bytes);
  SWAPOPT_CHECK(broadcast_buffer_bytes >= 1, "[Muon] HSDP broadcast_buffer_bytes must be >= 1, got " << broadcast_buffer_bytes);
  SWAPOPT_CHECK(!replica_count || *replica_count >= 1,
                "[Muon] HsdpOptions::replica_count must be >= 1, got " << *replica_count);
}

int64_t align_to_512_bytes(int64_t elements, DType dtype) {
  const int64_t unit = 512 / int64_t(dtype_size(dtype));
  SWAPOPT_CHECK(elements >= 0 && elements <= std::numeric_limits<int64_t>::max() - (unit - 1),
                "[Muon] cannot align " << elements << " elements to 512 bytes");
  return (elements + unit - 1) / unit * unit;
}

std::vector<Param*> HsdpAssignment::owned() const {
  std::vector<Param*> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (owners[i] == local_coordinate) out.push_back(params[i]);
  return out;
}

bool HsdpAssignment::owns(const Param* param) const {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i] == param) return owners[i] == local_coordinate;
  return false;
}

int64_t HsdpAssignment::logical_bytes() const {
  int64_t bytes = 0;
  for (const Param* p : params) bytes += shape_numel(p->logical_shape()) * int64_t(p->data.element_size());
  return bytes;
}

namespace {

/** Greedy balance: `items` (indices into `numel`) by (-numel, position) each to the bin with the
 *  smallest (load, bin). */
void assign_greedily(const std::vector<size_t>& items, const std::vector<int64_t>& numel, int64_t bins,
                     std::vector<int64_t>& out_bin) {
  std::vector<size_t> order = items;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numel[a] > numel[b]; });
  // Ties go to the lowest bin, so bins past the item count would stay empty: not allocated.
  std::vector<int64_t> load(size_t(std::min<int64_t>(bins, int64_t(items.size()))), 0);
  for (size_t i : order) {
    const int64_t bin = int64_t(std::min_element(load.begin(), load.end()) - load.begin());  // ties: lowest
    out_bin[i] = bin;
    load[size_t(bin)] += numel[i];
  }
}

}  // namespace

std::vector<HsdpAssignment> make_hsdp_assignments(size_t group, const std::vector<Param*>& params, int64_t replicas,
                                                  int64_t local_coordinate, int64_t cap_bytes, int64_t shard_ranks) {
  SWAPOPT_CHECK(replicas >= 1 && local_coordinate >= 0 && local_coordinate < replicas,
                "[Muon] replicate coordinate " << local_coordinate << " outside " << replicas << " replicas");
  SWAPOPT_CHECK(shard_ranks >= 1, "[Muon] shard group of " << shard_ranks << " ranks");
  SWAPOPT_CHECK(cap_bytes >= 1, "[Muon] HSDP cap_bytes must be >= 1, got " << cap_bytes);
  for (size_t i = 0; i < params.size(); ++i)
    SWAPOPT_CHECK(params[i] != nullptr, "[Muon] HSDP param " << i << " is null");
  // Largest first (stable, so equal sizes keep their order): every rank sorts the same way.
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  auto numel = [&](size_t i) { return shape_numel(params[i]->logical_shape()); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numel(a) > numel(b); });
  std::vector<HsdpAssignment> out;
  int64_t cap = 0;
  if (__builtin_mul_overflow(cap_bytes, replicas, &cap)) cap = std::numeric_limits<int64_t>::max();
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
    std::vector<int64_t> sizes;
    for (const Param* p : a.params) sizes.push_back(shape_numel(p->logical_shape()));
    std::vector<size_t> all(a.params.size());
    std::iota(all.begin(), all.end(), 0);
    a.owners.assign(a.params.size(), 0);
    assign_greedily(all, sizes, replicas, a.owners);
    a.ns_ranks.assign(a.params.size(), 0);
    for (int64_t owner = 0; owner < std::min<int64_t>(replicas, int64_t(a.params.size())); ++owner) {
      std::vector<size_t> mine;
      for (size_t i = 0; i < a.params.size(); ++i)
        if (a.owners[i] == owner) mine.push_back(i);
      assign_greedily(mine, sizes, shard_ranks, a.ns_ranks);
    }
  }
  return out;
}

}  // namespace swapopt
