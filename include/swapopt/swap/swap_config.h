#pragma once
/** How optimizer state is swapped between device and pinned host memory. */

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace swapopt {

/** Defaults are the reference system's. */
struct SwapConfig {
  /** Batches the update units are cut into; each batch's state is on the device only from its load
   *  to its offload, with at most three batches there at once (so swap_times <= 3 keeps all of
   *  it on the device during the step; between steps none is). */
  int swap_times = 16;
  /** State keys to swap (a subset of the family's); unset: all of them. */
  std::optional<std::vector<std::string>> state_keys{};
  /** Coalesce each batch's transfers into one copy per dtype through three staging arenas used in
   *  turn (a batch's load, the math of the one before and the offload of the one before that
   *  overlap). */
  bool packed = true;
  /** States with fewer elements stay device-resident (tiny states are not worth a transfer). */
  int64_t min_numel = 1024;
  /** If set, swap_times is chosen per step as the smallest count whose batches in flight (three
   *  consecutive ones, or the three staging arenas) plus the largest unit's workspace (Muon's NS
   *  input and workspaces) fit in this many device bytes. A unit too large for that (its state
   *  alone, or in any cut into batches) runs in chunks instead: its state streams through two
   *  staging arenas, a range of elements at a time, beside its workspace (AdamW's and Muon's
   *  units, HSDP assignments included; Muon's NS inputs stay whole). A budget no plan fits (below
   *  a unit's workspace plus two chunks of 32 elements, or the batches in flight) is a named
   *  error naming the least budget that runs the step. */
  std::optional<size_t> device_budget_bytes{};
  /** Keep the staging arenas' memory for the next step instead of giving it back after each one
   *  (Allocator::retain_freed with their bytes: on CUDA the release threshold of the device's
   *  current pool, raised to what is in use plus the arenas, never lowered). Each step then reuses memory already
   * mapped; but the pool keeps it reserved while the trainer runs forward and backward, where only allocations from the
   * same pool can use it. Off by default: the point of swapping is to leave that memory to the trainer. */
  bool retain_arenas = false;

  /** Throws "[swap] swap_times must be positive, got 0", "[swap] state key 'exp_avg' is listed
   *  twice in state_keys", etc. */
  void validate() const;
};

}  // namespace swapopt
