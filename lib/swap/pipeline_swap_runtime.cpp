#include "swapopt/swap/pipeline_swap_runtime.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "../core/ops_between_allocations.h"
#include "budget_miss.h"
#include "swapopt/core/allocator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/optim/hsdp.h"

namespace swapopt {

namespace {

constexpr size_t kSlotAlignment = 64;  // bytes; keeps every mirror and arena view vector-aligned

size_t align_up(size_t n) { return (n + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment; }

// Segments of at most this many units try every batch count (cheap, and exact where the packed
// need is not monotone in the count); larger ones search by doubling and bisection.
constexpr size_t kScanEveryCount = 64;

// Chunks are multiples of this many elements, so that every chunk of a 2-byte state starts
// 64-byte aligned in its mirror, as every arena piece does.
constexpr int64_t kChunkQuantum = 32;

size_t state_bytes(const UpdateUnit& unit) {
  size_t bytes = 0;
  for (const SwapSlot* s : unit.slots) bytes += s->nbytes();
  return bytes;
}

}  // namespace

/** H2D copies issued by prefetch_early() for the first `issued` batches of a planned step. */
struct PipelineSwapRuntime::EarlyPrefetch {
  std::vector<UpdateUnit> units;
  std::vector<Batch> batches;
  size_t issued = 0;
};

const char* slot_state_name(SlotState state) {
  switch (state) {
    case SlotState::device: return "device";
    case SlotState::d2h: return "d2h";
    case SlotState::host: return "host";
    case SlotState::h2d: return "h2d";
  }
  return "?";
}

PipelineSwapRuntime::PipelineSwapRuntime(Stream compute, SwapConfig config)
    : config_(std::move(config)),
      compute_(compute),
      h2d_(compute.device()),
      d2h_(compute.device()),
      ready_{Event(compute.device()), Event(compute.device()), Event(compute.device())},
      offloaded_{Event(compute.device()), Event(compute.device()), Event(compute.device())},
      compute_mark_(compute.device()),
      last_offload_(compute.device()),
      arenas_freed_(compute.device()),
      reports_{ReportInFlight(compute.device()), ReportInFlight(compute.device())} {
  config_.validate();
}

PipelineSwapRuntime::~PipelineSwapRuntime() {
  // The copies use the mirrors and arenas; the compute stream's reads of the arenas precede the
  // offloads' events, so it is not waited for (it is the caller's stream, with the caller's work).
  // Each stream on its own: a failed wait on one must not skip the other, whose copies may still
  // be writing the mirrors freed next. Destructors never throw; a stream error was already
  // reported by step().
  settle_copies();
}

void PipelineSwapRuntime::settle_copies() noexcept {
  for (Stream* copies : {&h2d_, &d2h_}) {
    try {
      copies->synchronize();
    } catch (...) {
    }
  }
}

void PipelineSwapRuntime::synchronize_copies() {
  h2d_.synchronize();
  d2h_.synchronize();
}

void PipelineSwapRuntime::build(const std::vector<SlotSpec>& layout, Optimizer& optimizer) {
  SWAPOPT_CHECK(slots_.empty(), "[swap] the runtime is already built");
  optimizer_ = &optimizer;
  std::array<size_t, 3> totals{0, 0, 0};
  std::array<bool, 3> used{false, false, false};  // a dtype with only empty slots still needs a (0-byte) buffer
  std::vector<const SlotSpec*> kept;
  std::vector<size_t> offsets;
  for (const SlotSpec& spec : layout) {
    if (spec.param->data.numel() < config_.min_numel) continue;  // tiny: stays ordinary device state
    const size_t d = size_t(spec.dtype);
    offsets.push_back(totals[d]);
    used[d] = true;
    totals[d] += align_up(size_t(spec.param->data.numel()) * dtype_size(spec.dtype));
    kept.push_back(&spec);
  }
  for (size_t d = 0; d < 3; ++d)
    if (used[d])  // pinned in the compute device's context (a CPU storage keeps no stream)
      host_buffers_[d] = std::make_shared<Storage>(totals[d], Device::cpu(), pinned_host_allocator(), &compute_);
  std::vector<SwapSlot*> adopted;
  for (size_t i = 0; i < kept.size(); ++i) {
    const SlotSpec& spec = *kept[i];
    auto slot = std::make_unique<SwapSlot>();
    slot->param = spec.param;
    slot->key = spec.key;
    slot->host_offset = offsets[i];
    const Shape& shape = spec.param->data.shape();
    slot->host = Tensor::on_storage(host_buffers_[size_t(spec.dtype)], int64_t(offsets[i] / dtype_size(spec.dtype)), shape,
                                    spec.dtype);
    auto& state = optimizer.state();
    const auto ps = state.find(spec.param);
    const bool exists = ps != state.end() && ps->second.tensors.count(spec.key) != 0;
    if (exists) {
      const Tensor& t = ps->second.tensors.at(spec.key);
      const std::string what = "[swap] state '" + spec.key + "' of '" + spec.param->name + "'";
      SWAPOPT_CHECK(t.is_contiguous() && t.offset() == 0 && t.storage()->owned() && t.storage()->nbytes() == t.nbytes(),
                    what << " must be dense, contiguous and own exactly its bytes to be swapped, got " << t.str());
      SWAPOPT_CHECK(t.shape() == shape && t.dtype() == spec.dtype,
                    what << " is " << t.str() << ", expected " << dtype_name(spec.dtype) << " " << shape_str(shape));
      slot->device = t;
      slot->created = true;
      adopted.push_back(slot.get());
    } else {
      slot->device = Tensor::empty(shape, spec.dtype, optimizer.device(), &compute_);  // stream-ordered: no sync
      slot->device.storage()->release();
    }
    slot->state = SlotState::host;
    slots_by_param_[slot->param].push_back(slot.get());
    slots_.push_back(std::move(slot));
  }
  // Initial offload: state that exists before the first swapped step leaves the device now, and
  // the copies complete before the trainer's next forward/backward needs that memory.
  if (!adopted.empty()) {
    compute_mark_.record(compute_);
    d2h_.wait(compute_mark_);
    for (SwapSlot* slot : adopted) ops::copy_between_allocations(d2h_, slot->device, slot->host);
    d2h_.synchronize();
    for (SwapSlot* slot : adopted) slot->device.storage()->release();
  }
}

SwapSlot* PipelineSwapRuntime::find_slot(const Param* param, const std::string& key) const {
  const auto it = slots_by_param_.find(param);
  if (it != slots_by_param_.end())
    for (SwapSlot* slot : it->second)
      if (slot->key == key) return slot;
  return nullptr;
}

void PipelineSwapRuntime::attach_slots(std::vector<UpdateUnit>& units, const Optimizer& optimizer, bool create) {
  if (create) created_this_step_.clear();
  std::unordered_set<const SwapSlot*> pending;
  std::vector<std::vector<std::string>> keys_by_group;  // what the bare step touches, per group
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) keys_by_group.push_back(optimizer.group_state_keys(g));
  for (UpdateUnit& unit : units) {
    unit.slots.clear();
    const std::vector<std::string>& keys = keys_by_group.at(unit.group);
    for (Param* p : unit.params) {
      const auto it = slots_by_param_.find(p);
      if (it == slots_by_param_.end()) continue;
      for (SwapSlot* slot : it->second) {
        if (std::find(keys.begin(), keys.end(), slot->key) == keys.end()) continue;
        if (!slot->created && !create) continue;
        if (!slot->created && pending.insert(slot).second) created_this_step_.push_back(slot);
        unit.slots.push_back(slot);
      }
    }
  }
}

void PipelineSwapRuntime::create_pending() {
  for (SwapSlot* slot : created_this_step_) {
    if (slot->nbytes() > 0) std::memset(slot->host.data_ptr(), 0, slot->nbytes());  // an empty mirror has no pointer
    optimizer_->state()[slot->param].tensors[slot->key] = slot->device;
    slot->created = true;
  }
}

std::vector<size_t> PipelineSwapRuntime::partition(const std::vector<int64_t>& costs, int swap_times) {
  const size_t n = costs.size();
  if (n == 0) return {};
  const size_t batches = std::max<size_t>(1, std::min<size_t>(size_t(std::max(swap_times, 1)), n));
  std::vector<int64_t> cost(n);
  int64_t remaining = 0;
  for (size_t i = 0; i < n; ++i) remaining += cost[i] = std::max<int64_t>(1, costs[i]);
  std::vector<size_t> sizes;
  size_t start = 0;
  for (size_t k = 0; k + 1 < batches; ++k) {
    const int64_t rb = int64_t(batches - k);  // batches left, this one included
    int64_t current = 0;
    size_t end = start;
    while (end < n) {
      if (n - end - 1 < size_t(rb - 1)) break;  // leave a unit for every later batch
      const int64_t next = cost[end];
      if (end > start && std::llabs(remaining - current * rb) <= std::llabs(remaining - (current + next) * rb)) break;
      current += next;
      ++end;
    }
    sizes.push_back(end - start);
    remaining -= current;
    start = end;
  }
  sizes.push_back(n - start);
  return sizes;
}

std::vector<PipelineSwapRuntime::Batch> PipelineSwapRuntime::make_batches(std::span<UpdateUnit> units,
                                                                          const std::vector<size_t>& batch_sizes) const {
  std::vector<Batch> batches;
  std::vector<SwapSlot*> sorted;
  size_t start = 0;
  size_t in_segment = 0;  // position among the whole-unit batches since the last chunked one
  for (size_t size : batch_sizes) {
    Batch b;
    b.units = units.subspan(start, size);
    start += size;
    for (UpdateUnit& u : b.units) b.slots.insert(b.slots.end(), u.slots.begin(), u.slots.end());
    // A slot listed twice is staged once. Sorting finds one (units seldom share a slot) without
    // the hashing a set would cost for every slot of every step.
    sorted = b.slots;
    std::sort(sorted.begin(), sorted.end(), std::less<>());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      std::unordered_set<const SwapSlot*> seen;
      std::erase_if(b.slots, [&](const SwapSlot* s) { return !seen.insert(s).second; });
    }
    if (size == 1 && b.units.front().chunk_elements > 0) {  // run_chunked stages it chunk by chunk
      b.chunked = true;
      in_segment = 0;
      batches.push_back(std::move(b));
      continue;
    }
    b.staged = config_.packed;
    b.parity = in_segment++ % kInFlight;
    if (!config_.packed) {
      for (SwapSlot* s : b.slots) b.resident += s->nbytes();
      batches.push_back(std::move(b));
      continue;
    }
    // Runs: the batch's slots of each dtype in mirror order, merged where the next one starts
    // where the mirror layout put the slot after the previous one (so no other slot lies between).
    std::vector<size_t> order(b.slots.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      const SwapSlot& a = *b.slots[x];
      const SwapSlot& c = *b.slots[y];
      return std::pair(a.host.dtype(), a.host_offset) < std::pair(c.host.dtype(), c.host_offset);
    });
    b.arena_offsets.assign(b.slots.size(), 0);
    for (size_t i : order) {
      const SwapSlot& s = *b.slots[i];
      const size_t d = size_t(s.host.dtype());
      std::vector<Run>& runs = b.runs[d];
      if (runs.empty() || s.host_offset != align_up(runs.back().host_end)) {
        runs.push_back({s.host_offset, s.host_offset, align_up(b.arena_bytes[d])});
      }
      Run& run = runs.back();
      run.host_end = s.host_offset + s.nbytes();
      b.arena_offsets[i] = run.arena_begin + (s.host_offset - run.host_begin);
      b.arena_bytes[d] = run.arena_begin + (run.host_end - run.host_begin);
    }
    for (size_t d = 0; d < 3; ++d) b.resident += b.arena_bytes[d];
    batches.push_back(std::move(b));
  }
  return batches;
}

std::vector<PipelineSwapRuntime::Batch> PipelineSwapRuntime::make_chunks(const Batch& unit_batch) const {
  const UpdateUnit& unit = unit_batch.units.front();
  std::unordered_map<const Param*, std::vector<SwapSlot*>> slots_of;  // in the unit's order
  for (SwapSlot* s : unit_batch.slots)
    if (s->nbytes() > 0) slots_of[s->param].push_back(s);  // an empty state has no bytes to stage
  std::vector<Batch> chunks;
  for (Param* p : unit.params) {
    const std::vector<SwapSlot*>& slots = slots_of[p];
    const int64_t numel = p->data.numel();
    for (int64_t begin = 0; begin == 0 || begin < numel; begin += unit.chunk_elements) {
      Batch c;
      c.units = unit_batch.units;
      c.slots = slots;
      c.staged = true;
      c.chunk_param = p;
      c.chunk_begin = begin;
      c.chunk_end = std::min(numel, begin + unit.chunk_elements);
      c.arena_offsets.assign(slots.size(), 0);
      for (size_t i = 0; i < slots.size(); ++i) {
        const SwapSlot& s = *slots[i];
        const size_t d = size_t(s.host.dtype());
        const size_t size = dtype_size(s.host.dtype());
        c.arena_offsets[i] = align_up(c.arena_bytes[d]);
        c.runs[d].push_back({s.host_offset + size_t(c.chunk_begin) * size, s.host_offset + size_t(c.chunk_end) * size,
                             c.arena_offsets[i]});
        c.arena_bytes[d] = c.arena_offsets[i] + size_t(c.chunk_end - c.chunk_begin) * size;
      }
      chunks.push_back(std::move(c));
    }
  }
  return chunks;
}

size_t PipelineSwapRuntime::chunk_arena_bytes(const UpdateUnit& unit, int64_t elements) const {
  std::array<size_t, 3> arena{0, 0, 0};  // per dtype: the most one param's chunk takes
  for (const Param* p : unit.params) {
    std::array<size_t, 3> mine{0, 0, 0};
    const size_t n = size_t(std::min(elements, p->data.numel()));
    for (const SwapSlot* s : unit.slots)
      if (s->param == p) mine[size_t(s->host.dtype())] += align_up(n * dtype_size(s->host.dtype()));
    for (size_t d = 0; d < 3; ++d) arena[d] = std::max(arena[d], mine[d]);
  }
  return kChunkArenas * (arena[0] + arena[1] + arena[2]);
}

int64_t PipelineSwapRuntime::largest_chunk(const UpdateUnit& unit, size_t budget) const {
  const auto fits = [&](int64_t elements) {
    return size_t(unit.workspace_bytes) <= budget && chunk_arena_bytes(unit, elements) <= budget - size_t(unit.workspace_bytes);
  };
  int64_t most = kChunkQuantum;  // no chunk larger than the largest param is needed
  for (const Param* p : unit.params) most = std::max(most, (p->data.numel() + kChunkQuantum - 1) / kChunkQuantum * kChunkQuantum);
  if (!fits(kChunkQuantum)) return 0;
  int64_t lo = 1, hi = most / kChunkQuantum;  // in quanta: lo fits; find the largest that does
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid * kChunkQuantum)) lo = mid;
    else hi = mid - 1;
  }
  return lo * kChunkQuantum;
}

std::array<size_t, 3> PipelineSwapRuntime::arena_needs(std::span<const Batch> batches, size_t parity) const {
  std::array<size_t, 3> need{0, 0, 0};
  for (const Batch& b : batches)
    if (b.parity == parity)
      for (size_t d = 0; d < 3; ++d) need[d] = std::max(need[d], b.arena_bytes[d]);
  return need;
}

size_t PipelineSwapRuntime::resident_bytes_needed(const std::vector<UpdateUnit>& units,
                                                  const std::vector<size_t>& batch_sizes) const {
  std::vector<UpdateUnit> copy = units;
  const std::vector<Batch> batches = make_batches(copy, batch_sizes);
  size_t need = 0;
  if (!config_.packed) {
    for (size_t i = 0; i < batches.size(); ++i) {
      size_t window = 0;
      for (size_t k = i; k < std::min(i + kInFlight, batches.size()); ++k) window += batches[k].resident;
      need = std::max(need, window);
    }
    return need;
  }
  for (size_t parity = 0; parity < kInFlight; ++parity)
    for (size_t bytes : arena_needs(batches, parity)) need += bytes;
  return need;
}

std::optional<std::vector<size_t>> PipelineSwapRuntime::fit_batches(std::vector<UpdateUnit>& units,
                                                                     const std::vector<int64_t>& costs, size_t budget,
                                                                     bool exhaustive, size_t& smallest_need,
                                                                     size_t& need_workspace) const {
  std::vector<size_t> sizes;
  for (size_t begin = 0; begin < units.size();) {
    if (units[begin].chunk_elements > 0) {
      sizes.push_back(1);
      ++begin;
      continue;
    }
    size_t end = begin;
    while (end < units.size() && units[end].chunk_elements == 0) ++end;
    const std::vector<UpdateUnit> segment(units.begin() + long(begin), units.begin() + long(end));
    const std::vector<int64_t> segment_costs(costs.begin() + long(begin), costs.begin() + long(end));
    size_t workspace = 0;  // units run one at a time: the largest workspace is there on top of the state
    for (const UpdateUnit& u : segment) workspace = std::max(workspace, size_t(u.workspace_bytes));
    const auto fits = [&](size_t t) {
      const size_t need = resident_bytes_needed(segment, partition(segment_costs, int(t))) + workspace;
      if (need > budget && need < smallest_need) {
        smallest_need = need;
        need_workspace = workspace;
      }
      return need <= budget;
    };
    if (exhaustive || segment.size() <= kScanEveryCount) {  // every count, the smallest that fits
      size_t t = 1;
      while (t <= segment.size() && !fits(t)) ++t;
      if (t > segment.size()) return std::nullopt;
      const std::vector<size_t> cut = partition(segment_costs, int(t));
      sizes.insert(sizes.end(), cut.begin(), cut.end());
      begin = end;
      continue;
    }
    // The need mostly falls as the count grows (smaller batches): counts 1, 2, 4, ... until one
    // fits, then bisection down to the smallest that fits; O(log n) plans, not one per count.
    // Packed, the need can rise again (the largest batch in each arena), so a miss here is
    // retried with every count before the plan gives up (plan_batches).
    size_t failing = 0, fitting = 1;
    while (!fits(fitting)) {
      if (fitting == segment.size()) return std::nullopt;
      failing = fitting;
      fitting = std::min(segment.size(), 2 * fitting);
    }
    while (fitting - failing > 1) {
      const size_t mid = failing + (fitting - failing) / 2;
      (fits(mid) ? fitting : failing) = mid;
    }
    const std::vector<size_t> cut = partition(segment_costs, int(fitting));
    sizes.insert(sizes.end(), cut.begin(), cut.end());
    begin = end;
  }
  return sizes;
}

std::vector<size_t> PipelineSwapRuntime::plan_batches(std::vector<UpdateUnit>& units, const std::vector<int64_t>& costs) const {
  for (UpdateUnit& u : units) u.chunk_elements = 0;
  if (!config_.device_budget_bytes) return partition(costs, config_.swap_times);
  const size_t budget = *config_.device_budget_bytes;
  PlanMiss miss;
  if (std::optional<std::vector<size_t>> sizes = plan_within(units, costs, budget, miss)) return *sizes;
  for (UpdateUnit& u : units) u.chunk_elements = 0;
  const size_t least = least_budget(units, costs, budget);
  std::ostringstream what;
  what << "[swap] device_budget_bytes " << budget;
  if (miss.unit.empty()) {
    what << " cannot hold the batches in flight (the closest plan needs " << miss.smallest_need << " bytes, "
         << miss.need_workspace << " of them the largest unit workspace)";
  } else if (miss.state_bytes == 0) {
    what << " is below the workspace of an update unit that swaps no state: " << miss.workspace_bytes << " bytes ("
         << miss.unit << ")";
  } else if (!miss.chunkable) {
    what << " is below an update unit that cannot run in chunks: " << miss.state_bytes << " bytes of state + "
         << miss.workspace_bytes << " bytes of workspace (" << miss.unit << ")";
  } else if (miss.state_bytes <= miss.chunk_bytes) {  // whole, it needs less than in chunks
    what << " is below an update unit: " << miss.state_bytes << " bytes of state + " << miss.workspace_bytes
         << " bytes of workspace, less than its two chunks of " << kChunkQuantum << " elements would take ("
         << miss.unit << ")";
  } else {
    what << " is below an update unit even in chunks: " << miss.workspace_bytes << " bytes of workspace + "
         << miss.chunk_bytes << " bytes for two chunks of " << kChunkQuantum << " elements of its " << miss.state_bytes
         << " bytes of state (" << miss.unit << ")";
  }
  throw BudgetMiss(what.str(), least);
}

std::optional<std::vector<size_t>> PipelineSwapRuntime::plan_within(std::vector<UpdateUnit>& units,
                                                                    const std::vector<int64_t>& costs, size_t budget,
                                                                    PlanMiss& miss, bool thorough) const {
  // A unit that does not fit whole is chunked; the others may be, largest state first, when no
  // plan of whole units fits between the chunked ones.
  std::vector<size_t> candidates;
  // A unit no plan can run: the miss names the one needing the largest budget, with its first param.
  const UpdateUnit* too_large = nullptr;
  size_t too_large_needs = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    UpdateUnit& u = units[i];
    const size_t bytes = state_bytes(u);
    if (bytes + size_t(u.workspace_bytes) <= budget) {
      if (u.chunkable && bytes > 0) candidates.push_back(i);
      continue;
    }
    if (u.chunkable) u.chunk_elements = largest_chunk(u, budget);
    if (u.chunk_elements > 0) continue;
    // Whole, or (chunkable) in the smallest chunks, whichever takes less.
    const size_t needs =
        size_t(u.workspace_bytes) + (u.chunkable ? std::min(bytes, chunk_arena_bytes(u, kChunkQuantum)) : bytes);
    if (too_large == nullptr || needs > too_large_needs) {
      too_large = &u;
      too_large_needs = needs;
    }
  }
  if (too_large != nullptr) {
    const UpdateUnit& u = *too_large;
    std::ostringstream which;
    const auto first_and_more = [&](const std::vector<Param*>& params) {
      which << "'" << params.front()->name << "'";
      if (params.size() > 1) which << " and " << (params.size() - 1) << " more param" << (params.size() > 2 ? "s" : "");
    };
    if (!u.params.empty()) {
      which << "the unit of ";
      first_and_more(u.params);
    } else if (u.assignment != nullptr && !u.assignment->params.empty()) {
      // This rank updates none of the assignment's params; its unit still holds the buffers of
      // the assignment's collectives.
      which << "the HSDP assignment of ";
      first_and_more(u.assignment->params);
      which << ", none of whose params this rank updates";
    } else {
      which << "a unit without params";
    }
    miss.unit = which.str();
    miss.chunkable = u.chunkable;
    miss.state_bytes = state_bytes(u);
    miss.workspace_bytes = size_t(u.workspace_bytes);
    miss.chunk_bytes = u.chunkable ? chunk_arena_bytes(u, kChunkQuantum) : 0;
    return std::nullopt;
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](size_t a, size_t b) { return state_bytes(units[a]) > state_bytes(units[b]); });
  // Each round chunks as many more candidates as are chunked already (1, 2, 4, ...): O(log n)
  // plans. A candidate whose chunks do not fit beside its workspace stays whole.
  for (size_t chunked = 0;;) {
    if (std::optional<std::vector<size_t>> sizes =
            fit_batches(units, costs, budget, false, miss.smallest_need, miss.need_workspace))
      return sizes;
    if (chunked == candidates.size()) break;
    for (const size_t end = std::min(candidates.size(), chunked + std::max<size_t>(1, chunked)); chunked < end; ++chunked)
      units[candidates[chunked]].chunk_elements = largest_chunk(units[candidates[chunked]], budget);
  }
  // Every count of every segment before giving up (the bisection may have missed one).
  if (!thorough) return std::nullopt;
  return fit_batches(units, costs, budget, true, miss.smallest_need, miss.need_workspace);
}

size_t PipelineSwapRuntime::least_budget(const std::vector<UpdateUnit>& units, const std::vector<int64_t>& costs,
                                         size_t failing) const {
  const auto runs = [&](size_t budget, bool thorough) {
    std::vector<UpdateUnit> trial = units;
    PlanMiss ignored;
    return plan_within(trial, costs, budget, ignored, thorough).has_value();
  };
  // Bisection between a budget that fails and one that runs, `thorough` as plan_batches plans or
  // without its last scan of every count (O(n^2): a probe that fails costs what a step of many
  // params costs, and most probes fail), which finds fewer plans, never more.
  const auto bisect = [&](size_t lo, size_t hi, bool thorough) {
    while (hi - lo > 1) {
      const size_t mid = lo + (hi - lo) / 2;
      (runs(mid, thorough) ? hi : lo) = mid;
    }
    return hi;
  };
  // Every unit in one batch, beside the largest workspace, fits any pipeline, at the first count
  // a plan tries.
  size_t workspace = 0;
  for (const UpdateUnit& u : units) workspace = std::max(workspace, size_t(u.workspace_bytes));
  size_t lo = failing, hi = std::max(failing + 1, resident_bytes_needed(units, {units.size()}) + workspace);
  while (!runs(hi, false)) {  // not expected; doubling keeps the answer true if it happens
    lo = hi;
    hi = hi > SIZE_MAX / 2 ? SIZE_MAX : 2 * hi;
  }
  const size_t quick = bisect(lo, hi, false);  // runs as plan_batches plans too
  // One byte less failing the quick search may still hold a plan the full one finds: then the full
  // search below it.
  if (quick - 1 == failing || !runs(quick - 1, true)) return quick;
  return bisect(failing, quick - 1, true);
}

void PipelineSwapRuntime::trace(const char* what, size_t index) {
  if (trace_) trace_(std::string(what) + " " + std::to_string(index));
}

void PipelineSwapRuntime::track_resident(long long delta) {
  resident_now_ = size_t((long long)resident_now_ + delta);
  report_.peak_resident_bytes = std::max(report_.peak_resident_bytes, resident_now_);
}

void PipelineSwapRuntime::timed_wait(Event& event) {
  // Timing events come from pools that grow only when a step waits more often than any before
  // (both sets at once, so that no step after the first creates any).
  ReportInFlight& set = reports_[report_set_];
  for (ReportInFlight& each : reports_)
    while (each.wait_timers.size() < set.timers_used + 2) each.wait_timers.emplace_back(compute_.device(), true);
  set.wait_timers[set.timers_used].record(compute_);
  compute_.wait(event);
  set.wait_timers[set.timers_used + 1].record(compute_);
  set.timers_used += 2;
}

void PipelineSwapRuntime::begin_report() {
  report_set_ = 1 - report_set_;
  ReportInFlight& set = reports_[report_set_];
  if (set.pending) retire(set, true);  // its timers are about to be recorded again
  set.timers_used = 0;
  report_ = {};
  resident_now_ = 0;
}

void PipelineSwapRuntime::end_report() {
  ReportInFlight& set = reports_[report_set_];
  for (const auto& slot : slots_)
    if (slot->created) report_.state_bytes += slot->host.nbytes();
  set.report = report_;
  set.compute_done.record(compute_);
  set.h2d_done.record(h2d_);
  set.d2h_done.record(d2h_);
  set.pending = true;
  set.step = ++steps_reported_;
}

void PipelineSwapRuntime::retire(ReportInFlight& set, bool force) {
  const bool done = set.compute_done.query() && set.h2d_done.query() && set.d2h_done.query();
  if (!done && !force) return;
  set.report.exposed_wait_ms = done ? 0.0 : -1.0;
  for (size_t i = 0; done && i + 1 < set.timers_used; i += 2)
    set.report.exposed_wait_ms += set.wait_timers[i + 1].elapsed_ms(set.wait_timers[i]);
  completed_ = set.report;
  set.pending = false;
}

void PipelineSwapRuntime::allocate_arenas(std::span<const Batch> batches) {
  ArenaSizes sizes{};
  for (size_t parity = 0; parity < kInFlight; ++parity) sizes[parity] = arena_needs(batches, parity);
  allocate_arenas(sizes);
}

void PipelineSwapRuntime::allocate_arenas(const ArenaSizes& sizes) {
  size_t count = 0;
  h2d_.wait(arenas_freed_);  // the last arenas' frees, on the compute stream
  if (config_.retain_arenas) {
    // Each arena's bytes, plus what an allocator rounds a block up to (a CUDA pool maps 2 MiB
    // pages; the CPU backend rounds large blocks to 1 MiB).
    size_t bytes = 0;
    for (const std::array<size_t, 3>& need : sizes)
      for (size_t d = 0; d < 3; ++d)
        if (need[d] > 0) bytes += need[d] + (size_t(2) << 20);
    device_allocator(compute_.device()).retain_freed(bytes);
  }
  for (size_t parity = 0; parity < kInFlight; ++parity)
    for (size_t d = 0; d < 3; ++d) {
      const size_t need = sizes[parity][d];
      if (need == 0) continue;
      arenas_[parity][d] =
          std::make_shared<Storage>(need, compute_.device(), device_allocator(compute_.device()), &h2d_);
      track_resident((long long)need);
      ++count;
    }
  if (count > 0) trace("allocate_arenas", count);
}

void PipelineSwapRuntime::free_arenas() {
  size_t count = 0;
  for (auto& by_dtype : arenas_)
    for (auto& arena : by_dtype) {
      if (!arena) continue;
      track_resident(-(long long)arena->nbytes());
      arena->release(&compute_);  // after the compute stream's waits on the last offloads
      arena.reset();
      ++count;
    }
  if (count == 0) return;
  arenas_freed_.record(compute_);
  trace("free_arenas", count);
}

size_t PipelineSwapRuntime::copy_runs(const Batch& batch, size_t parity, bool to_device) {
  size_t bytes = 0;
  for (size_t d = 0; d < 3; ++d)
    for (const Run& r : batch.runs[d]) {
      if (r.host_end == r.host_begin) continue;
      const DType dtype = DType(d);
      const size_t size = dtype_size(dtype);
      const int64_t elements = int64_t((r.host_end - r.host_begin) / size);
      const Tensor host = Tensor::on_storage(host_buffers_[d], int64_t(r.host_begin / size), {elements}, dtype);
      const Tensor arena = Tensor::on_storage(arenas_[parity][d], int64_t(r.arena_begin / size), {elements}, dtype);
      ops::copy_between_allocations(to_device ? h2d_ : d2h_, to_device ? host : arena, to_device ? arena : host);
      bytes += r.host_end - r.host_begin;
      ++(to_device ? report_.h2d_copies : report_.d2h_copies);
    }
  return bytes;
}

void PipelineSwapRuntime::issue_h2d(Batch& batch, size_t index) {
  trace("h2d", index);
  const size_t parity = batch.parity;
  if (!batch.staged) {
    // The copy stream restores and fills device memory only after the compute stream's work so far
    // (including the frees of the batch before), so the stream-ordered allocator can reuse it.
    compute_mark_.record(compute_);
    h2d_.wait(compute_mark_);
    for (SwapSlot* s : batch.slots) {
      s->device.storage()->restore(&h2d_);
      ops::copy_between_allocations(h2d_, s->host, s->device);
      report_.h2d_bytes += s->nbytes();
      ++report_.h2d_copies;
    }
    track_resident((long long)batch.resident);
  } else {
    // After the latest offload (on the D2H stream): for batch index >= ring that is
    // D2H(index - ring), which must have read this arena first; for the first ones, the previous
    // step's last one, after which the mirrors they read hold that step's state.
    h2d_.wait(last_offload_);
    report_.h2d_bytes += copy_runs(batch, parity, true);
  }
  for (SwapSlot* s : batch.slots) s->state = SlotState::h2d;
  ready_[parity].record(h2d_);
  batch.phase = Phase::loading;
}

void PipelineSwapRuntime::wait_ready(Batch& batch, size_t index) {
  trace("wait_ready", index);
  timed_wait(ready_[batch.parity]);
  if (batch.staged && batch.chunk_param == nullptr)  // a chunk's views are made by run_chunked
    for (size_t i = 0; i < batch.slots.size(); ++i) {
      SwapSlot* s = batch.slots[i];
      if (s->nbytes() == 0) continue;  // a 0-byte storage is never released, and its dtype may have no arena
      s->device.storage()->bind(static_cast<char*>(arenas_[batch.parity][size_t(s->host.dtype())]->data()) + batch.arena_offsets[i]);
    }
  for (SwapSlot* s : batch.slots) s->state = SlotState::device;
  batch.phase = Phase::loaded;
}

void PipelineSwapRuntime::set_mirror_reader(std::shared_ptr<MirrorReader> reader) {
  if (mirror_reader_ && mirror_reader_ != reader) mirror_reader_->wait_all();
  mirror_reader_ = std::move(reader);
}

void PipelineSwapRuntime::clear_mirror_reader(const MirrorReader* reader) {
  if (mirror_reader_.get() == reader) mirror_reader_.reset();
}

void PipelineSwapRuntime::wait_mirror_reader() {
  if (mirror_reader_) mirror_reader_->wait_all();
}

void PipelineSwapRuntime::issue_d2h(Batch& batch, size_t index) {
  trace("d2h", index);
  // An asynchronous checkpoint may still be reading these mirrors: the copy overwrites them.
  if (mirror_reader_) mirror_reader_->wait_released(batch.slots);
  compute_mark_.record(compute_);
  d2h_.wait(compute_mark_);
  if (!batch.staged) {
    for (SwapSlot* s : batch.slots) {
      ops::copy_between_allocations(d2h_, s->device, s->host);
      report_.d2h_bytes += s->nbytes();
      ++report_.d2h_copies;
    }
  } else {
    report_.d2h_bytes += copy_runs(batch, batch.parity, false);
  }
  for (SwapSlot* s : batch.slots) s->state = SlotState::d2h;
  offloaded_[batch.parity].record(d2h_);
  last_offload_.record(d2h_);
  batch.phase = Phase::offloading;
}

void PipelineSwapRuntime::wait_offload(Batch& batch, size_t index) {
  trace("wait_offload", index);
  timed_wait(offloaded_[batch.parity]);
  // Released only now: the compute stream has waited for the D2H, so the free (stream-ordered on
  // the compute stream) cannot overtake the copy that reads the memory.
  for (SwapSlot* s : batch.slots) {
    s->device.storage()->release(&compute_);
    s->state = SlotState::host;
  }
  if (!batch.staged) track_resident(-(long long)batch.resident);
  batch.phase = Phase::done;
}

void PipelineSwapRuntime::run_unpacked(std::span<Batch> batches, const BatchStep& step) {
  if (batches[0].phase == Phase::idle) issue_h2d(batches[0], 0);
  for (size_t n = 0; n < batches.size(); ++n) {
    wait_ready(batches[n], n);
    // The load of batch n + 1 is ordered after the compute stream's work so far: after the
    // offload of batch n + 1 - kInFlight, so that batch n - 1's offload overlaps it.
    if (n + 1 >= kInFlight) wait_offload(batches[n + 1 - kInFlight], n + 1 - kInFlight);
    if (n + 1 < batches.size()) issue_h2d(batches[n + 1], n + 1);
    trace("step", n);
    batches[n].phase = Phase::stepped;  // an exception inside counts as (partly) stepped
    step(batches[n], n);
    issue_d2h(batches[n], n);
  }
  for (size_t i = batches.size() >= kInFlight - 1 ? batches.size() - (kInFlight - 1) : 0; i < batches.size(); ++i)
    wait_offload(batches[i], i);
}

void PipelineSwapRuntime::run_packed(std::span<Batch> batches, const BatchStep& step, size_t ring) {
  for (size_t i = 0; i < std::min(ring, batches.size()); ++i)
    if (batches[i].phase == Phase::idle) issue_h2d(batches[i], i);
  for (size_t i = 0; i < batches.size(); ++i) {
    wait_ready(batches[i], i);
    if (i >= ring) wait_offload(batches[i - ring], i - ring);
    trace("step", i);
    batches[i].phase = Phase::stepped;
    step(batches[i], i);
    issue_d2h(batches[i], i);  // D2H(i), then H2D(i + ring) into the same arena once D2H(i) has read it
    if (i + ring < batches.size()) issue_h2d(batches[i + ring], i + ring);
  }
  for (size_t i = batches.size() >= ring ? batches.size() - ring : 0; i < batches.size(); ++i)
    wait_offload(batches[i], i);
}

void PipelineSwapRuntime::run_chunked(Batch& unit_batch, StateSwapAdapter& adapter) {
  UpdateUnit& unit = unit_batch.units.front();
  unit_batch.phase = Phase::done;  // its transfers are the chunks', drained here on an exception
  std::vector<Batch> chunks = make_chunks(unit_batch);                    // per param, in the unit's order
  std::unordered_map<const Param*, std::pair<size_t, size_t>> chunks_of;  // [begin, end) in `chunks`
  for (size_t i = 0; i < chunks.size(); ++i)
    chunks_of.try_emplace(chunks[i].chunk_param, i, i).first->second.second = i + 1;
  // The unit's two arenas, each sized for its largest chunk, allocated at its first part and kept
  // for the next ones (an HSDP assignment streams one Newton-Schulz batch's state at a time), so
  // that its parts neither free and allocate again nor hold two parts' arenas at once; freed
  // after the last part, before the update's Newton-Schulz that follows it.
  ArenaSizes sizes{};
  for (const Batch& c : chunks)
    for (size_t d = 0; d < 3; ++d) sizes[0][d] = std::max(sizes[0][d], c.arena_bytes[d]);
  if (chunks.size() > 1) sizes[1] = sizes[0];
  bool arenas_held = false;  // a drain after a failed part frees them
  adapter.step_chunked(unit, [&](const std::vector<Param*>& params, const StateSwapAdapter::ChunkStep& step) {
    std::vector<Batch> part;  // the chunks of `params`, in that order, each param's taken once
    for (const Param* p : params) {
      const auto it = chunks_of.find(p);
      SWAPOPT_CHECK(it != chunks_of.end(), "[swap] a chunked unit streams the state of '"
                                               << p->name
                                               << "', which is not its own or was streamed already this step");
      for (size_t i = it->second.first; i < it->second.second; ++i) part.push_back(std::move(chunks[i]));
      chunks_of.erase(it);
    }
    for (size_t i = 0; i < part.size(); ++i) part[i].parity = i % kChunkArenas;
    if (part.empty()) return;
    if (!arenas_held) allocate_arenas(sizes);
    arenas_held = true;
    const BatchStep step_chunk = [&](Batch& c, size_t) {
      StateChunk chunk;
      chunk.param = c.chunk_param;
      chunk.begin = c.chunk_begin;
      chunk.end = c.chunk_end;
      for (size_t i = 0; i < c.slots.size(); ++i) {
        const SwapSlot& s = *c.slots[i];
        const DType dtype = s.host.dtype();
        chunk.staged.emplace(s.key, Tensor::on_storage(arenas_[c.parity][size_t(dtype)],
                                                       int64_t(c.arena_offsets[i] / dtype_size(dtype)),
                                                       {c.chunk_end - c.chunk_begin}, dtype));
      }
      step(chunk);
    };
    try {
      run_packed(part, step_chunk, kChunkArenas);
    } catch (...) {
      drain(part);  // frees the arenas; where it throws they stay held, and run()'s drain frees them
      arenas_held = false;
      throw;
    }
    if (chunks_of.empty()) {  // the unit's last part
      free_arenas();
      arenas_held = false;
    }
  });
  free_arenas();                      // still held only where the adapter left params unstreamed (the error below)
  for (const Param* p : unit.params)  // in the unit's order, so the error names the first one missed
    SWAPOPT_CHECK(!chunks_of.contains(p),
                  "[swap] a chunked unit's update did not stream the state of '" << p->name << "'");
}

void PipelineSwapRuntime::drain(std::span<Batch> batches) {
  for (size_t i = 0; i < batches.size(); ++i) {
    Batch& b = batches[i];
    switch (b.phase) {
      case Phase::loading:
        wait_ready(b, i);
        [[fallthrough]];
      case Phase::loaded:  // never stepped: the host mirror still holds its state
        for (SwapSlot* s : b.slots) {
          s->device.storage()->release(&compute_);
          s->state = SlotState::host;
        }
        if (!b.staged) track_resident(-(long long)b.resident);
        b.phase = Phase::done;
        break;
      case Phase::stepped:  // units that ran hold new state, the rest the state they were loaded with
        issue_d2h(b, i);
        wait_offload(b, i);
        break;
      case Phase::offloading:
        wait_offload(b, i);
        break;
      case Phase::idle:
      case Phase::done:
        break;
    }
    // State created this step stays where the bare step made it too: for a unit whose update ran
    // (`done`), and per param for one whose update began (the optimizer counted the param, step >
    // 0, then a hook threw: an HSDP assignment's later NS batch). The rest is removed.
    for (UpdateUnit& unit : b.units) {
      if (unit.done) continue;
      for (SwapSlot* s : unit.slots) {
        if (std::find(created_this_step_.begin(), created_this_step_.end(), s) == created_this_step_.end()) continue;
        const auto state = optimizer_->state().find(s->param);
        if (state == optimizer_->state().end() || state->second.step > 0) continue;
        state->second.tensors.erase(s->key);
        if (state->second.tensors.empty()) optimizer_->state().erase(state);
        s->created = false;
      }
    }
  }
  free_arenas();
}

bool PipelineSwapRuntime::adopt_early_prefetch(std::vector<Batch>& batches) {
  if (!early_) return false;
  bool same = batches.size() >= early_->issued;
  for (size_t k = 0; same && k < early_->issued; ++k)
    same = !batches[k].chunked && batches[k].slots == early_->batches[k].slots && batches[k].runs == early_->batches[k].runs;
  if (same && config_.packed) {  // the early arenas must be large enough for every batch of the real plan's first segment
    size_t first = 0;
    while (first < batches.size() && !batches[first].chunked) ++first;
    for (size_t parity = 0; same && parity < kInFlight; ++parity) {
      const std::array<size_t, 3> need = arena_needs(std::span<const Batch>(batches.data(), first), parity);
      for (size_t d = 0; same && d < 3; ++d)
        same = need[d] == 0 || (arenas_[parity][d] && arenas_[parity][d]->nbytes() >= need[d]);
    }
  }
  if (!same) {  // the plan changed (a gradient appeared or vanished): undo the early copies
    discard_early_prefetch();
    return false;
  }
  for (size_t k = 0; k < early_->issued; ++k) batches[k].phase = Phase::loading;
  report_.early_prefetch_used = true;
  early_.reset();
  return true;
}

void PipelineSwapRuntime::discard_early_prefetch() {
  if (!early_) return;
  h2d_.synchronize();
  for (size_t k = 0; k < early_->issued; ++k) {
    for (SwapSlot* s : early_->batches[k].slots) {
      s->device.storage()->release(&compute_);
      s->state = SlotState::host;
    }
    if (!early_->batches[k].staged) track_resident(-(long long)early_->batches[k].resident);
  }
  free_arenas();
  early_.reset();
}

void PipelineSwapRuntime::prefetch_early(std::span<UpdateUnit> units, const std::vector<size_t>& batch_sizes) {
  if (early_) return;  // already loading for the next step (say one whose step() failed its checks)
  auto early = std::make_unique<EarlyPrefetch>();
  early->units.assign(units.begin(), units.end());
  early->batches = make_batches(early->units, batch_sizes);
  // Only the batches before the first chunked unit (whose chunks run_chunked stages).
  size_t first = 0;
  while (first < early->batches.size() && !early->batches[first].chunked) ++first;
  if (first == 0) return;
  early->batches.resize(first);
  begin_report();
  if (config_.packed) allocate_arenas(early->batches);
  early->issued = config_.packed ? std::min(kInFlight, first) : 1;
  for (size_t k = 0; k < early->issued; ++k) issue_h2d(early->batches[k], k);
  early_ = std::move(early);
}

void PipelineSwapRuntime::record_skipped_step() {
  // An early prefetch began this step's report and counted its loads: they did happen.
  const bool prefetched = early_ != nullptr;
  discard_early_prefetch();
  if (!prefetched) begin_report();
  report_.skipped_nonfinite = true;
  end_report();
}

void PipelineSwapRuntime::run(std::span<UpdateUnit> units, const std::vector<size_t>& batch_sizes, StateSwapAdapter& adapter) {
  std::vector<Batch> batches = make_batches(units, batch_sizes);
  if (!early_) begin_report();
  const bool adopted = adopt_early_prefetch(batches);
  report_.batches = int(batches.size());
  for (const Batch& b : batches) {
    report_.swapped_slots += b.slots.size();
    report_.chunked_units += b.chunked ? 1 : 0;
  }
  for (const UpdateUnit& u : units) report_.peak_workspace_bytes = std::max(report_.peak_workspace_bytes, size_t(u.workspace_bytes));
  create_pending();
  if (batches.empty()) {
    end_report();
    return;
  }
  const BatchStep step_whole = [&](Batch& batch, size_t) { adapter.step_batch(batch.units); };
  try {
    // Segments of whole units, each with its own batches in flight, between chunked units.
    for (size_t begin = 0; begin < batches.size();) {
      if (batches[begin].chunked) {
        run_chunked(batches[begin++], adapter);
        continue;
      }
      size_t end = begin;
      while (end < batches.size() && !batches[end].chunked) ++end;
      const std::span<Batch> segment(batches.data() + begin, end - begin);
      if (config_.packed) {
        if (!(adopted && begin == 0)) allocate_arenas(segment);
        run_packed(segment, step_whole, kInFlight);
        free_arenas();
      } else {
        run_unpacked(segment, step_whole);
      }
      begin = end;
    }
  } catch (...) {
    adapter.abandon_step();  // e.g. collectives the compute stream waits on, before it is synchronised
    // Each clean-up runs even where the one before it failed (a CUDA error inside the drain), so
    // that no copy is left in flight into memory the drain released; the first error is the one
    // to report. A drain that throws stops at that batch: the later ones keep their state as
    // loaded or stepped (the step was partly applied; the contract says reload a checkpoint).
    try {
      drain(batches);
    } catch (...) {
    }
    settle_copies();
    try {
      compute_.synchronize();
    } catch (...) {
    }
    throw;
  }
  end_report();
}

void PipelineSwapRuntime::return_state() {
  discard_early_prefetch();
  // The last step's offloads wait for its math: once they are done the mirrors hold the final
  // state. What the caller queued on the compute stream since is not waited for.
  synchronize_copies();
  for (const auto& slot : slots_) {
    if (!slot->created) continue;
    slot->device.storage()->restore(&h2d_);
    ops::copy_between_allocations(h2d_, slot->host, slot->device);
    slot->state = SlotState::device;
  }
  // The compute stream uses the state after these copies; the host waits for the copies alone
  // (the mirrors are freed with the runtime).
  Event restored(h2d_.device());
  restored.record(h2d_);
  compute_.wait(restored);
  h2d_.synchronize();
}

const SwapStepReport& PipelineSwapRuntime::last_report() {
  ReportInFlight* older = &reports_[0];
  ReportInFlight* newer = &reports_[1];
  if (older->step > newer->step) std::swap(older, newer);
  for (ReportInFlight* set : {older, newer})
    if (set->pending) retire(*set, false);
  return completed_;
}

size_t PipelineSwapRuntime::pinned_bytes() const {
  size_t total = 0;
  for (const auto& b : host_buffers_)
    if (b) total += b->nbytes();
  return total;
}

size_t PipelineSwapRuntime::slot_bytes() const {
  size_t total = 0;
  for (const auto& s : slots_) total += s->nbytes();
  return total;
}

}  // namespace swapopt
