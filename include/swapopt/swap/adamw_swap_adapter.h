#pragma once
/** AdamW swap: exp_avg, exp_avg_sq and max_exp_avg_sq; one unit per parameter. */

#include "swapopt/optim/adamw.h"
#include "swapopt/swap/state_swap_adapter.h"

namespace swapopt {

/** The StateSwapAdapter of AdamW (see swap_adamw()). */
class AdamWSwapAdapter : public StateSwapAdapter {
 public:
  /** Adapts `adamw`, which must outlive the adapter. */
  explicit AdamWSwapAdapter(AdamW& adamw) : adamw_(adamw) {}
  /** The AdamW given at construction. */
  Optimizer& optimizer() override { return adamw_; }
  std::vector<std::string> family_state_keys() const override { return adamw_.state_keys(); }
  void validate(const SwapConfig&) const override {}
  std::vector<SlotSpec> slot_layout(const std::vector<std::string>& keys) const override;
  std::vector<UpdateUnit> plan_units(bool assume_all_grads) const override;
  void begin_step() override;
  /** AdamW::update_params over the batch's params, per run of one group: the bare step's call. */
  void step_batch(std::span<UpdateUnit> batch) override;
  /** Every unit is chunkable: its param's chunks run AdamW::update_param_chunk. */
  void step_chunked(UpdateUnit& unit, const StateStream& stream_state) override;

 private:
  AdamW& adamw_;
};

}  // namespace swapopt
