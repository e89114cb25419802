#pragma once
/** Momentum-only swap for Muon: units are Muon's own NS batches (a matrix is never split). */

#include "swapopt/optim/muon.h"
#include "swapopt/swap/state_swap_adapter.h"

namespace swapopt {

/** The StateSwapAdapter of Muon (see swap_muon()). */
class MuonSwapAdapter : public StateSwapAdapter {
 public:
  /** Adapts `muon`, which must outlive the adapter. */
  explicit MuonSwapAdapter(Muon& muon) : muon_(muon) {}
  /** The Muon given at construction. */
  Optimizer& optimizer() override { return muon_; }
  std::vector<std::string> family_state_keys() const override { return {"momentum_buffer"}; }
  /** Rejects momentum_update_fn: batching would change the boundary of its calls. */
  void validate(const SwapConfig& config) const override;
  std::vector<SlotSpec> slot_layout(const std::vector<std::string>& keys) const override;
  /** Per group: Muon's shape groups split into memory-safe batches, one unit each, in the order
   *  Muon::step() runs them; the group's post_update_fn runs after its last unit. */
  std::vector<UpdateUnit> plan_units(bool assume_all_grads) const override;
  void begin_step() override;
  /** Muon::update_momentum, process_unsharded_batch and run_post_update: the bare step's calls;
   *  an HSDP unit is one whole assignment (update_assignment, then finish_assignment:
   *  post_update_fn and the broadcast). */
  void step_batch(std::span<UpdateUnit> batch) override;
  /** Chunked: each NS input is allocated whole (a batch's, or a sharded assignment's all-gather
   *  chunk) and each chunk's momentum is written into its range (Muon::momentum_chunk);
   *  Newton-Schulz, the update and, for an HSDP assignment, its collectives then run on the whole
   *  inputs as in step_batch (Muon::update_assignment with a MomentumWriter). A replicated
   *  assignment of several NS batches streams each batch's momentum just before its
   *  Newton-Schulz, as the bare step makes it. */
  void step_chunked(UpdateUnit& unit, const StateStream& stream_state) override;
  /** Waits for the step's broadcasts. */
  void finish_step() override;
  /** Waits for the step's collectives (Muon::abandon_hsdp_step) when it threw. */
  void abandon_step() noexcept override;

 private:
  Muon& muon_;
  std::unique_ptr<AsyncReplicateBroadcaster> broadcaster_;  // per step, with HSDP
};

}  // namespace swapopt
