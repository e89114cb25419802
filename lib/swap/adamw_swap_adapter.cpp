#include "swapopt/swap/adamw_swap_adapter.h"

#include <algorithm>

namespace swapopt {

std::vector<SlotSpec> AdamWSwapAdapter::slot_layout(const std::vector<std::string>& keys) const {
  std::vector<SlotSpec> layout;
  for (size_t g = 0; g < adamw_.param_groups().size(); ++g)
    for (const ParamPtr& p : adamw_.param_groups()[g].params)
      for (const std::string& key : adamw_.group_state_keys(g))
        if (std::find(keys.begin(), keys.end(), key) != keys.end()) layout.push_back({p.get(), key, DType::f32});
  return layout;
}

std::vector<UpdateUnit> AdamWSwapAdapter::plan_units(bool assume_all_grads) const {
  std::vector<UpdateUnit> units;
  for (size_t g = 0; g < adamw_.param_groups().size(); ++g) {
    const int64_t keys = int64_t(adamw_.group_state_keys(g).size());
    for (const ParamPtr& p : adamw_.param_groups()[g].params) {
      if (!assume_all_grads && !p->has_grad()) continue;
      UpdateUnit unit;
      unit.group = g;
      unit.params = {p.get()};
      unit.chunkable = true;
      unit.logical_bytes = shape_numel(p->logical_shape()) * int64_t(dtype_size(DType::f32)) * keys;
      units.push_back(std::move(unit));
    }
  }
  return units;
}

void AdamWSwapAdapter::begin_step() {
  for (ParamGroup& g : adamw_.param_groups()) g.step += 1;
}

void AdamWSwapAdapter::step_batch(std::span<UpdateUnit> batch) {
  // One fused update per run of units of the same group (a batch holds consecutive units).
  for (size_t first = 0; first < batch.size();) {
    size_t end = first;
    std::vector<Param*> params;
    while (end < batch.size() && batch[end].group == batch[first].group) params.push_back(batch[end++].params.front());
    adamw_.apply_updates(batch[first].group, params);  // the step's checks covered them
    for (size_t u = first; u < end; ++u) batch[u].done = true;
    first = end;
  }
}

void AdamWSwapAdapter::step_chunked(UpdateUnit& unit, const StateStream& stream_state) {
  stream_state(unit.params, [&](const StateChunk& chunk) {
    adamw_.apply_update_chunk(unit.group, *chunk.param, chunk.begin, chunk.end, chunk.staged);
  });
  unit.done = true;
}

}  // namespace swapopt
