#pragma once
/** The backend-neutral swap pipeline: host mirrors, the partition into batches, and the
 *  H2D/D2H schedule with three batches in flight on two copy streams (one per direction, so that
 *  a load and an offload run at once on full-duplex links, both beside the math), ordered against
 *  the compute stream and each other with events only (no device-wide synchronisation on the hot
 *  path). */

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "swapopt/core/storage.h"
#include "swapopt/core/stream.h"
#include "swapopt/optim/optimizer.h"
#include "swapopt/swap/state_swap_adapter.h"
#include "swapopt/swap/swap_config.h"
#include "swapopt/swap/swap_slot.h"

namespace swapopt {

/** What one swapped step did; read through PipelineSwapRuntime::last_report(). */
struct SwapStepReport {
  int batches = 0;  ///< Batches the step ran (0 when skipped or when it had no units).
  /** Units whose state did not fit the device budget whole and streamed through in chunks (each
   *  also one of `batches`); their copies count in h2d_copies and d2h_copies, one per state per
   *  chunk. */
  int chunked_units = 0;
  /** Bytes copied host to device, an early prefetch's included (also one that was redone).
   *  Packed, a run of adjacent slots is one copy, the 64-byte alignment gaps between them
   *  included: the bytes may pass the slots' own (state_bytes) by a few per slot. */
  size_t h2d_bytes = 0;
  size_t d2h_bytes = 0;  ///< Bytes copied device to host.
  /** Copies issued each way: packed, one per run of adjacent slots per dtype in a batch (one per
   *  dtype and batch when every grad is present); unpacked, one per slot. */
  size_t h2d_copies = 0;
  size_t d2h_copies = 0;  ///< The same count for the device-to-host copies.
  /** Slots (state tensors) the step brought to the device and back. */
  size_t swapped_slots = 0;
  /** Bytes of all swapped state (the pinned mirrors' contents): device memory it would take
   *  resident; the saving is this minus peak_resident_bytes. */
  size_t state_bytes = 0;
  /** Time the compute stream spent blocked on copies (its waits on H2D and D2H events); -1 when
   *  not measured (the step had not completed when its timers were needed again, two steps on). */
  double exposed_wait_ms = 0.0;
  /** Peak bytes of swappable optimizer state resident on the device during the step (restored
   *  slot storage, or staging arenas in packed mode). */
  size_t peak_resident_bytes = 0;
  /** The largest workspace of a unit of the step (UpdateUnit::workspace_bytes): device bytes on
   *  top of the resident state while that unit runs. */
  size_t peak_workspace_bytes = 0;
  /** The first batches' H2D had been issued by prefetch_early() and was used as is. */
  bool early_prefetch_used = false;
  /** The step was skipped whole for a non-finite grad: nothing changed, and nothing was copied
   *  but what an early prefetch had loaded (in h2d_bytes and h2d_copies). */
  bool skipped_nonfinite = false;
};

/** Something that reads the host mirrors on another thread (an asynchronous checkpoint): every
 *  write into a mirror first waits until it has taken that mirror's bytes. */
class MirrorReader {
 public:
  virtual ~MirrorReader() = default;
  /** Blocks until the reader no longer needs the mirrors of `slots` (returns at once for slots
   *  it does not read, and once it has failed or finished). */
  virtual void wait_released(std::span<SwapSlot* const> slots) = 0;
  /** Blocks until the reader needs no mirror any more. */
  virtual void wait_all() = 0;
};

/** The swap machinery of one SwapOptimizer: owns the pinned mirrors and the slots, cuts each
 *  step's units into batches and brings each batch's state to the device for its run and back
 *  after it, three batches in flight on its two copy streams. */
class PipelineSwapRuntime {
 public:
  /** `compute` runs the optimizer math; the runtime creates its copy streams and events here,
   *  once, so that no step creates any. */
  PipelineSwapRuntime(Stream compute, SwapConfig config);
  ~PipelineSwapRuntime();
  PipelineSwapRuntime(const PipelineSwapRuntime&) = delete;
  PipelineSwapRuntime& operator=(const PipelineSwapRuntime&) = delete;

  /** The config given at construction (validated there). */
  const SwapConfig& config() const { return config_; }
  /** The stream the optimizer math runs on (the optimizer's). */
  Stream& compute_stream() { return compute_; }
  /** The runtime's own stream for the host-to-device copies, on the compute stream's device. */
  Stream& h2d_stream() { return h2d_; }
  /** The runtime's own stream for the device-to-host copies, on the compute stream's device. */
  Stream& d2h_stream() { return d2h_; }
  /** Waits for both copy streams (not the compute stream). */
  void synchronize_copies();

  /** Allocates the pinned mirrors of `layout` (one buffer per dtype, slots 64-byte aligned, in
   *  layout order) and adopts the state `optimizer` already holds for them: copied to the mirrors,
   *  waited for, and released on the device before this returns. Only states of at least
   *  min_numel elements become slots; smaller ones stay ordinary device state. */
  void build(const std::vector<SlotSpec>& layout, Optimizer& optimizer);
  /** The slot of (param, key), or null when that state is not swapped. */
  SwapSlot* find_slot(const Param* param, const std::string& key) const;
  /** Every slot, in the order of build()'s layout (empty before build()). */
  const std::vector<std::unique_ptr<SwapSlot>>& slots() const { return slots_; }
  /** Fills each unit's slots with those of the keys its group uses (Optimizer::group_state_keys).
   *  With `create`, slots whose state does not exist yet are attached too and created host-side
   *  when run() starts (the mirror zeroed, the shell published to the optimizer), so new state is
   *  never device-resident outside its unit and nothing changes before run(); without, only slots
   *  whose state exists are attached (early prefetch). */
  void attach_slots(std::vector<UpdateUnit>& units, const Optimizer& optimizer, bool create = true);

  /** Cuts `costs` into T = max(1, min(swap_times, n)) contiguous batches (the reference's balanced
   *  greedy rule); returns the batch sizes. */
  static std::vector<size_t> partition(const std::vector<int64_t>& costs, int swap_times);
  /** Batch sizes for `units`: config.swap_times, or with a device budget the smallest count whose
   *  resident bytes plus the largest unit workspace fit (every count for up to 64 units; beyond,
   *  found by doubling and bisection, every count again before giving up, since the packed need
   *  is not monotone in the count). A unit too large for the budget, or for
   *  any plan of whole units, is chunked instead when it is chunkable (largest state first; its
   *  chunk_elements set here, as large as fits beside its workspace; its batch holds it alone);
   *  throws naming the budget, the sizes that do not fit and the least budget that runs the step
   *  (found by bisection: one byte less fails). */
  std::vector<size_t> plan_batches(std::vector<UpdateUnit>& units, const std::vector<int64_t>& costs) const;
  /** Batches of whole units in flight at once: one offloading, one computing, one loading, so
   *  that the H2D and D2H streams and the math all overlap. Packed, they are staging arenas used
   *  in turn (batch i in arena i % 3); unpacked, three consecutive batches' own storage. With two,
   *  an arena's offload and its reload for the next batch ran one after the other (on an H200 a
   *  swapped Muon step at width 2048 took 1.6x the bare one, docs/benchmarks.md). */
  static constexpr size_t kInFlight = 3;
  /** A chunked unit's chunks go through two arenas: it exists for a budget with no room. */
  static constexpr size_t kChunkArenas = 2;

  /** Device bytes the pipeline holds at once for these batches of whole units: the largest three
   *  consecutive batches (unpacked), or the three staging arenas (packed, each as large as the
   *  largest batch that uses it, counting only the bytes of that batch's own slots). A chunked
   *  unit's batch counts nothing here (its chunks' arenas are chunk_elements' business). */
  size_t resident_bytes_needed(const std::vector<UpdateUnit>& units, const std::vector<size_t>& batch_sizes) const;

  /** Runs the step: each batch's slots are device-resident exactly while `adapter.step_batch`
   *  runs it; a chunked unit's state streams through two staging arenas, one chunk at a time,
   *  inside `adapter.step_chunked`. On an exception every transfer is drained, every slot is left
   *  host-resident (units that ran hold their new state, the others their old; state created this
   *  step is removed again for each param the optimizer never counted, step 0, as the bare step
   *  would never have made it) and the exception is rethrown. */
  void run(std::span<UpdateUnit> units, const std::vector<size_t>& batch_sizes, StateSwapAdapter& adapter);
  /** Issues the H2D of the first batches of a planned step now; run() continues from there when
   *  its first batches are the same, and otherwise waits for these copies and starts afresh. */
  void prefetch_early(std::span<UpdateUnit> units, const std::vector<size_t>& batch_sizes);
  /** Undoes a pending prefetch_early() (waits for its copies, frees their device memory). */
  void discard_early_prefetch();
  /** Hands the state back to the optimizer: every existing slot's mirror is copied into device
   *  memory of its own, and the optimizer holds ordinary device state again (the wrapper is going
   *  away; nothing is lost). Waits for the runtime's own copies, not for the compute stream: its
   *  later work is ordered after the state's copies by an event. */
  void return_state();
  /** A step that was skipped whole: drops a pending prefetch_early() (waiting for its copies),
   *  and the report says skipped_nonfinite. */
  void record_skipped_step();
  /** The report of the last step that has completed (never waits: after a synchronize of both
   *  streams, the last step's). Before any step completed, an empty report. */
  const SwapStepReport& last_report();

  /** From now on, each batch's D2H into the mirrors first waits until `reader` has released them.
   *  A different reader installed before is waited for first (one reader at a time). */
  void set_mirror_reader(std::shared_ptr<MirrorReader> reader);
  /** Forgets `reader` if it is the one installed (another one stays). */
  void clear_mirror_reader(const MirrorReader* reader);
  /** Waits until the mirror reader, if any, needs no mirror: before the host writes mirrors
   *  (loading a checkpoint) or writes a checkpoint file itself. */
  void wait_mirror_reader();

  /** Test hook: receives "h2d N", "wait_ready N", "step N", "d2h N", "wait_offload N" (N: the
   *  batch or chunk in its segment or part), and "allocate_arenas K", "free_arenas K" (K: how many
   *  staging storages, one per arena and dtype), in order. */
  void set_trace(std::function<void(const std::string&)> trace) { trace_ = std::move(trace); }

  /** Pinned bytes held for mirrors (slots' bytes plus their 64-byte alignment padding). */
  size_t pinned_bytes() const;
  /** The bytes of every slot (created or not), without padding. */
  size_t slot_bytes() const;

 private:
  /** Packed: host bytes [host_begin, host_end) of slots adjacent in the mirror (nothing else lies
   *  between them), staged at arena_begin. A transfer touches no byte of a slot outside its batch. */
  struct Run {
    size_t host_begin = 0;
    size_t host_end = 0;
    size_t arena_begin = 0;
    bool operator==(const Run&) const = default;
  };
  enum class Phase { idle, loading, loaded, stepped, offloading, done };
  struct Batch {
    std::span<UpdateUnit> units;           // a chunk: its unit
    bool staged = false;                   // copies go through the arenas (packed, or a chunk)
    size_t parity = 0;                     // its arena and events: position in its segment % kInFlight (a chunk: % kChunkArenas)
    bool chunked = false;                  // a chunked unit, alone: run_chunked cuts it into chunks
    Param* chunk_param = nullptr;          // a chunk: its param and element range
    int64_t chunk_begin = 0;
    int64_t chunk_end = 0;
    std::vector<SwapSlot*> slots;          // unique, in unit order
    std::array<std::vector<Run>, 3> runs;  // packed: per dtype, in mirror order
    std::array<size_t, 3> arena_bytes{};   // packed: staging bytes per dtype
    std::vector<size_t> arena_offsets;     // packed: slots[i]'s byte offset in its dtype's arena
    Phase phase = Phase::idle;
    size_t resident = 0;                   // bytes this batch holds on the device while loaded
  };
  struct EarlyPrefetch;

  std::vector<Batch> make_batches(std::span<UpdateUnit> units, const std::vector<size_t>& batch_sizes) const;
  /** The chunks of a chunked unit's batch, in order: each param's [0, numel) cut every
   *  chunk_elements, each slot's piece 64-byte aligned in the arena (its arena, `parity`, is
   *  chosen when it streams). */
  std::vector<Batch> make_chunks(const Batch& unit_batch) const;
  /** Staging bytes (its kChunkArenas arenas) a unit needs in chunks of `elements`. */
  size_t chunk_arena_bytes(const UpdateUnit& unit, int64_t elements) const;
  /** The largest chunk (a multiple of kChunkQuantum elements) whose arenas fit beside the unit's
   *  workspace in `budget`; 0 when none does. */
  int64_t largest_chunk(const UpdateUnit& unit, size_t budget) const;
  /** Batch sizes of every segment of whole units between chunked ones (each the smallest count
   *  that fits `budget`: every count when `exhaustive` or the segment is small, else a doubling
   *  and bisection search), a chunked unit one batch; empty when a segment fits in no count tried
   *  (then `smallest_need` is lowered to the least that segment needed). */
  std::optional<std::vector<size_t>> fit_batches(std::vector<UpdateUnit>& units, const std::vector<int64_t>& costs,
                                                 size_t budget, bool exhaustive, size_t& smallest_need,
                                                 size_t& need_workspace) const;
  /** Why a budget holds no plan: a unit too large even in chunks (`unit` names it), or no count
   *  of batches fits (`smallest_need`: the least a plan tried needed). */
  struct PlanMiss {
    std::string unit;  // "the unit of 'w' and 2 more params"; empty: every unit fits alone
    bool chunkable = false;
    size_t state_bytes = 0, workspace_bytes = 0, chunk_bytes = 0;
    size_t smallest_need = SIZE_MAX, need_workspace = 0;
  };
  /** plan_batches' plan for `budget`, or empty with `miss` saying why; not `thorough`, without the
   *  final scan of every count (fewer plans found, never more). */
  std::optional<std::vector<size_t>> plan_within(std::vector<UpdateUnit>& units, const std::vector<int64_t>& costs,
                                                 size_t budget, PlanMiss& miss, bool thorough = true) const;
  /** The least budget above `failing` whose plan_within() holds a plan (one byte less does not). */
  size_t least_budget(const std::vector<UpdateUnit>& units, const std::vector<int64_t>& costs, size_t failing) const;
  /** Per arena (parity) and dtype: the staging bytes to allocate. */
  using ArenaSizes = std::array<std::array<size_t, 3>, kInFlight>;
  /** Packed: the arenas `batches` need (arena_needs of each parity). */
  void allocate_arenas(std::span<const Batch> batches);
  void allocate_arenas(const ArenaSizes& sizes);
  void free_arenas();
  /** Packed: one copy per run between the host mirror and arena `parity`; returns bytes. */
  size_t copy_runs(const Batch& batch, size_t parity, bool to_device);
  /** Packed: the staging bytes per dtype that arena `parity` needs for `batches`. */
  std::array<size_t, 3> arena_needs(std::span<const Batch> batches, size_t parity) const;
  void issue_h2d(Batch& batch, size_t index);
  void wait_ready(Batch& batch, size_t index);
  void issue_d2h(Batch& batch, size_t index);
  void wait_offload(Batch& batch, size_t index);
  void drain(std::span<Batch> batches);
  /** Waits for each copy stream, the second also when the first's wait fails; never throws (for
   *  the clean-up after a failed step and the destructor). */
  void settle_copies() noexcept;
  /** Runs batches that are not chunked (their arenas allocated, packed); `step` runs batch i. */
  using BatchStep = std::function<void(Batch& batch, size_t index)>;
  void run_unpacked(std::span<Batch> batches, const BatchStep& step);
  /** Packed: batch i in arena i % `ring`; its reload waits for the offload of batch i - ring.
   *  The arenas, allocated by the caller, stay allocated. */
  void run_packed(std::span<Batch> batches, const BatchStep& step, size_t ring);
  /** A chunked unit: the adapter's step_chunked, whose state stream (once, or in parts of the
   *  unit's params) runs their chunks through kChunkArenas arenas on run_packed's schedule. */
  void run_chunked(Batch& unit_batch, StateSwapAdapter& adapter);
  /** True when the early prefetch covers `batches`' first batches (then adopted), else it is undone. */
  bool adopt_early_prefetch(std::vector<Batch>& batches);
  void timed_wait(Event& event);
  /** Creates the state attach_slots() found missing (zeroed mirrors, shells in the optimizer). */
  void create_pending();
  void trace(const char* what, size_t index);
  void track_resident(long long delta);

  SwapConfig config_;
  Stream compute_;
  Stream h2d_;
  Stream d2h_;
  // Created once: ready/offloaded by batch parity; compute_mark_ orders a copy stream after the
  // compute stream's work so far, last_offload_ the next step's loads after this step's offloads
  // (the mirrors they read), which ran on the other copy stream.
  std::array<Event, kInFlight> ready_;
  std::array<Event, kInFlight> offloaded_;
  Event compute_mark_;
  Event last_offload_;
  /** Recorded on the compute stream after free_arenas' frees; the next arenas are allocated on the
   *  H2D stream after it, so that a stream-ordered pool may reuse the freed memory (a pool reuses
   *  another stream's free only once the allocating stream waits for it). */
  Event arenas_freed_;
  /** A step's report until all three streams have passed its end; its timers stay untouched until then
   *  (two sets, alternating by step, so one step may run while the previous one's is read). */
  struct ReportInFlight {
    SwapStepReport report;
    std::vector<Event> wait_timers;  // pairs around each compute-stream wait; grows only when a step needs more
    size_t timers_used = 0;
    Event compute_done, h2d_done, d2h_done;
    bool pending = false;
    uint64_t step = 0;  // order of the steps, to retire the older first
    explicit ReportInFlight(Device device) : compute_done(device), h2d_done(device), d2h_done(device) {}
  };
  /** Starts the report of a new step, in the next timer set (retiring what it held). */
  void begin_report();
  /** Ends the current step's report: marks the end of all three streams. */
  void end_report();
  /** Moves the set's report into completed_ if its step has completed, or `force`d (then without
   *  its wait time). */
  void retire(ReportInFlight& set, bool force);
  std::array<ReportInFlight, 2> reports_;
  size_t report_set_ = 0;
  uint64_t steps_reported_ = 0;
  SwapStepReport completed_;

  std::vector<std::unique_ptr<SwapSlot>> slots_;
  /** The slots of each param (one per swapped state key), filled by build(): lookups by param cost
   *  the same at any param count. */
  std::unordered_map<const Param*, std::vector<SwapSlot*>> slots_by_param_;
  std::array<std::shared_ptr<Storage>, 3> host_buffers_;   // pinned, one per dtype
  std::array<std::array<std::shared_ptr<Storage>, 3>, kInFlight> arenas_;  // packed staging, [parity][dtype]
  std::unique_ptr<EarlyPrefetch> early_;
  Optimizer* optimizer_ = nullptr;             // whose state the slots are (set by build)
  std::vector<SwapSlot*> created_this_step_;   // found by attach_slots, made by run(); undone if never counted

  SwapStepReport report_;
  size_t resident_now_ = 0;
  std::function<void(const std::string&)> trace_;
  std::shared_ptr<MirrorReader> mirror_reader_;
};

}  // namespace swapopt
