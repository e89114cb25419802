#include "swapopt/swap/muon_swap_adapter.h"

#include <algorithm>

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
    for (Param* p : muon_.local_params(g))
      if (assume_all_grads || p->has_grad()) params.push_back(p);
    const size_t first = units.size();
    for (const std::vector<Param*>& shape_group : muon_.group_by_shape(params))
      for (std::vector<Param*>& batch : muon_.split_into_memory_safe_batches(g, shape_group)) {
        UpdateUnit unit;
        unit.group = g;
        for (const Param* p : batch) unit.logical_bytes += shape_numel(p->logical_shape()) * int64_t(p->data.element_size());
        unit.workspace_bytes = muon_.workspace_bytes(g, batch);
        unit.chunkable = true;
        unit.params = std::move(batch);
        units.push_back(std::move(unit));
      }
    if (units.size() > first) units.back().post_update_params = params;
  }
  // HSDP: one unit per assignment (never split), in the bare step's order; its cost counts every
  // param of the assignment, so all ranks cut the same batches whatever they own.
  for (const HsdpAssignment& a : muon_.hsdp_schedule()) {
    UpdateUnit unit;
    unit.group = a.group;
    unit.assignment = &a;
    unit.logical_bytes = a.logical_bytes();
    unit.workspace_bytes = muon_.assignment_workspace_bytes(a);
    unit.chunkable = true;
    for (Param* p : a.owned())
      if (assume_all_grads || p->has_grad()) unit.params.push_back(p);
    units.push_back(std::move(unit));
  }
  return units;
}

void MuonSwapAdapter::begin_step() {
  for (ParamGroup& g : muon_.param_groups()) g.step += 1;
  if (muon_.hsdp_enabled()) broadcaster_ = std::make_unique<AsyncReplicateBroadcaster>(muon_.stream(), muon_.hsdp_options().broadcast_buffer_bytes);
}

void MuonSwapAdapter::abandon_step() noexcept {
  std::unique_ptr<AsyncReplicateBroadcaster> broadcaster = std::move(broadcaster_);
  if (broadcaster) muon_.abandon_hsdp_step(*broadcaster);
}

void MuonSwapAdapter::finish_step() {
  std::unique_ptr<AsyncReplicateBroadcaster> broadcaster = std::move(broadcaster_);
  if (broadcaster) muon_.finish_hsdp_step(*broadcaster);
}

void MuonSwapAdapter::step_batch(std::span<UpdateUnit> batch) {
  for (UpdateUnit& unit : batch) {
    if (unit.assignment != nullptr) {
      muon_.update_owned(*unit.assignment, unit.params, {});
      unit.done = true;
      muon_.finish_assignment(*unit.assignment, *broadcaster_, unit.params);
      continue;
    }
    // The step's checks covered the unit's params: the unchecked bodies of the public pieces.
    muon_.orthogonalize_and_apply(unit.group, unit.params, muon_.stacked_momentum(unit.group, unit.params));
    unit.done = true;  // the state is updated; a throwing hook below no longer undoes it
    if (!unit.post_update_params.empty()) muon_.run_post_update(unit.group, unit.post_update_params);
  }
}

void MuonSwapAdapter::step_chunked(UpdateUnit& unit, const StateStream& stream_state) {
  // Writes the NS inputs of some of the unit's params (one NS batch's, or all), chunk by chunk.
  const Muon::MomentumWriter write_momentum = [&](const std::vector<Param*>& params,
                                                  const std::vector<Tensor>& inputs) {
    stream_state(params, [&](const StateChunk& chunk) {
      const size_t i = size_t(std::find(params.begin(), params.end(), chunk.param) - params.begin());
      const Tensor& input = inputs[i];  // the runtime streams only the params given
      const auto staged = chunk.staged.find("momentum_buffer");
      muon_.chunk_momentum(unit.group, *chunk.param, chunk.begin, chunk.end,
                           staged != chunk.staged.end() ? staged->second : Tensor(),
                           input.view({input.numel()}).narrow(0, chunk.begin, chunk.end - chunk.begin));
    });
  };
  if (unit.assignment != nullptr) {
    muon_.update_owned(*unit.assignment, unit.params, write_momentum);
    unit.done = true;
    muon_.finish_assignment(*unit.assignment, *broadcaster_, unit.params);
    return;
  }
  const Tensor input = muon_.allocate_ns_input(unit.group, unit.params);
  write_momentum(unit.params, muon_.ns_input_parts(input, unit.params));
  muon_.orthogonalize_and_apply(unit.group, unit.params, input);  // the step's checks covered them
  unit.done = true;
  if (!unit.post_update_params.empty()) muon_.run_post_update(unit.group, unit.post_update_params);
}

}  // namespace swapopt
