#pragma once
/** One swappable state tensor of one parameter, and the unit of work that reads it. */

#include <map>
#include <string>
#include <vector>

#include "swapopt/core/tensor.h"
#include "swapopt/optim/param.h"

namespace swapopt {

struct HsdpAssignment;

/** Where a slot's authoritative bytes are: device -> d2h -> host -> h2d -> device. */
enum class SlotState { device, d2h, host, h2d };
/** "device", "d2h", "host" or "h2d". */
const char* slot_state_name(SlotState state);

/** One swapped (param, key) state, owned by the PipelineSwapRuntime: its pinned host mirror and
 *  the device tensor the optimizer holds as that state. */
struct SwapSlot {
  Param* param = nullptr;  ///< The param the state belongs to (not owned).
  std::string key;       ///< e.g. "momentum_buffer"
  Tensor device;         ///< the optimizer's state tensor: released (a shell) unless on the device
  Tensor host;           ///< pinned mirror: a view of the host buffer of its dtype
  size_t host_offset = 0;  ///< bytes into that host buffer (a multiple of 64)
  SlotState state = SlotState::host;  ///< Where the authoritative bytes are now.
  /** The optimizer holds this state. Until then the mirror is reserved, not yet zeroed. */
  bool created = false;

  /** Bytes of the state (its mirror's, without alignment padding). */
  size_t nbytes() const { return host.nbytes(); }
};

/** What an adapter asks for: a (param, key) state of a dtype, in the order its schedule visits it. */
struct SlotSpec {
  Param* param = nullptr;    ///< The param whose state it is.
  std::string key;           ///< The state key, e.g. "exp_avg".
  DType dtype = DType::f32;  ///< The state's dtype (the optimizer's state_dtype()).
};

/** A piece of an optimizer step: the pipeline never splits it across batches. A unit whose state
 *  does not fit the device budget may instead run in element chunks (chunk_elements). */
struct UpdateUnit {
  size_t group = 0;  ///< The optimizer's param group of every param of the unit.
  std::vector<Param*> params;               ///< updated by this unit, in schedule order
  std::vector<Param*> post_update_params;   ///< post_update_fn runs for these after the unit (Muon)
  int64_t logical_bytes = 0;                ///< partition cost: state bytes, independent of rank
  /** Device bytes the unit allocates besides its state while it runs (Muon: the stacked NS input
   *  and the NS workspaces; HSDP: the gather and broadcast buffers too), freed before the next
   *  unit runs; the device budget and the report count the largest. */
  int64_t workspace_bytes = 0;
  std::vector<SwapSlot*> slots;             ///< filled by the runtime: swappable state the unit reads
  bool done = false;                        ///< set by the adapter once the unit's state is updated
  /** The adapter can run the unit chunk by chunk (StateSwapAdapter::step_chunked): its swapped
   *  state is read and written element by element (AdamW, Muon's momentum). */
  bool chunkable = false;
  /** Set by the plan: 0, the unit runs whole; > 0, its state is too large for the device budget
   *  and streams through two staging arenas this many elements of a param at a time. */
  int64_t chunk_elements = 0;
  const HsdpAssignment* assignment = nullptr;  ///< Muon HSDP: the assignment this unit runs and flushes
};

/** One chunk of a chunked unit: elements [begin, end) of one param, flattened. */
struct StateChunk {
  Param* param = nullptr;  ///< The param of the chunk (one of the unit's).
  int64_t begin = 0;       ///< First element of the range.
  int64_t end = 0;         ///< One past the last element.
  /** The range of each swapped state of the param on the device (1-D, end - begin elements), by
   *  key. A key the group uses but does not swap (state_keys, min_numel) is absent: that state is
   *  the optimizer's own device tensor. */
  std::map<std::string, Tensor> staged;
};

}  // namespace swapopt
