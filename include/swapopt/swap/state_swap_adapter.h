#pragma once
/** What the swap runtime needs from one optimizer family. The adapter coordinates; the math stays
 *  in the optimizer's own methods (the swapped step calls exactly the functions the bare step does). */

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "swapopt/optim/optimizer.h"
#include "swapopt/swap/swap_config.h"
#include "swapopt/swap/swap_slot.h"

namespace swapopt {

/** The interface a SwapOptimizer drives; MuonSwapAdapter and AdamWSwapAdapter implement it. */
class StateSwapAdapter {
 public:
  virtual ~StateSwapAdapter() = default;
  /** The optimizer whose state is swapped (not owned: it outlives the adapter). */
  virtual Optimizer& optimizer() = 0;
  /** Every state key of the family, e.g. {"momentum_buffer"}. */
  virtual std::vector<std::string> family_state_keys() const = 0;
  /** Rejects what the swapped step could not reproduce exactly (throws a named error). Called at
   *  wrap time, after the config itself was validated. */
  virtual void validate(const SwapConfig& config) const = 0;
  /** Every (param, key) state of `keys` the optimizer may hold, in the order the schedule visits
   *  them with every param holding a gradient: the layout of the host mirrors. */
  virtual std::vector<SlotSpec> slot_layout(const std::vector<std::string>& keys) const = 0;
  /** The units of one step in schedule order, without side effects. With `assume_all_grads`, as if
   *  every param had a gradient (to plan an early prefetch before backward has finished). */
  virtual std::vector<UpdateUnit> plan_units(bool assume_all_grads) const = 0;
  /** Advances the step counters as the bare step() does, before any unit runs. */
  virtual void begin_step() = 0;
  /** Partition cost of each unit (default: its logical bytes). */
  virtual std::vector<int64_t> partition_costs(const std::vector<UpdateUnit>& units) const;
  /** Runs one batch of units, setting each unit's `done` once its state is updated; every slot
   *  they read is device-resident. */
  virtual void step_batch(std::span<UpdateUnit> batch) = 0;
  /** Updates one chunk of a chunked unit's state. */
  using ChunkStep = std::function<void(const StateChunk& chunk)>;
  /** Streams the state of `params` (params of the unit) through the device, calling `step` for
   *  every chunk: the params in the order given, each param's chunks covering [0, numel) in order
   *  (at least one, also for an empty param), each chunk's `staged` state device-resident while
   *  the call runs. */
  using StateStream = std::function<void(const std::vector<Param*>& params, const ChunkStep& step)>;
  /** Runs a chunked unit (UpdateUnit::chunk_elements > 0; only units planned chunkable): the
   *  unit's update, calling `stream_state` where it reads and writes the state, once or in parts
   *  (each param of the unit streamed once, e.g. each Newton-Schulz batch's params just before it
   *  runs), and setting `done`. The default throws: an adapter that marks no unit chunkable needs
   *  none. */
  virtual void step_chunked(UpdateUnit& unit, const StateStream& stream_state);
  /** After the last batch (e.g. waits for broadcasts). */
  virtual void finish_step() {}
  /** When the step threw: settles what it left in flight (e.g. waits for its collectives, each
   *  within its timeout) before the runtime synchronises its streams; never throws. */
  virtual void abandon_step() noexcept {}
};

}  // namespace swapopt
