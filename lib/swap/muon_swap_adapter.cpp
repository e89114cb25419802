#include "swapopt/swap/muon_swap_adapter.h"

#include "swapopt/core/error.h"

namespace swapopt {

void MuonSwapAdapter::validate(const SwapConfig&) const {
  SWAPOPT_CHECK(!muon_.hooks().momentum_update_fn,
                "[swap] Muon swap does not support momentum_update_fn: batching changes the boundary of its calls");
}

std::vector<SlotSpec> MuonSwapAdapter::slot_layout(const std::vector<std::string>& keys) const {
  std::vector<SlotSpec> layout;
  for (const UpdateUnit& unit : plan_units(true))
    for (Param* p : unit.params)
      for (const std::string& key : keys) layout.push_back({p, key, muon_.state_dtype(key, *p)});
  return layout;
}

std::vector<UpdateUnit> MuonSwapAdapter::plan_units(bool assume_all_grads) const {
  std::vector<UpdateUnit> units;
  for (size_t g = 0; g < muon_.param_groups().size(); ++g) {
    std::vector<Param*> params;
    if (assume_all_grads) {
      for (const ParamPtr& p : muon_.param_groups()[g].params) params.push_back(p.get());
    } else {
      params = muon_.params_with_grad(g);
    }
    const size_t first = units.size();
    for (const std::vector<Param*>& shape_group : muon_.group_by_shape(params))
      for (std::vector<Param*>& batch : muon_.split_into_memory_safe_batches(g, shape_group)) {
        UpdateUnit unit;
        unit.group = g;
        for (const Param* p : batch) unit.logical_bytes += shape_numel(p->logical_shape()) * int64_t(p->data.element_size());
        unit.params = std::move(batch);
        units.push_back(std::move(unit));
      }
    if (units.size() > first) units.back().post_update_params = params;
  }
  return units;
}

void MuonSwapAdapter::begin_step() {
  for (ParamGroup& g : muon_.param_groups()) g.step += 1;
}

void MuonSwapAdapter::step_batch(std::span<UpdateUnit> batch) {
  for (UpdateUnit& unit : batch) {
    muon_.process_unsharded_batch(unit.group, unit.params, muon_.update_momentum(unit.group, unit.params));
    unit.done = true;  // the state is updated; a throwing hook below no longer undoes it
    if (!unit.post_update_params.empty()) muon_.run_post_update(unit.group, unit.post_update_params);
  }
}

}  // namespace swapopt
