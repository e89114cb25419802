#include "swapopt/optim/hsdp_checkpoint.h"

#include <exception>

#include "json.h"
#include "sum_over_ranks.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

// A param's step crosses the all-reduce as three f32 of 21 bits each (exact: below 2^24, and only
// the owner adds a non-zero part): any non-negative int64.
constexpr int kPartBits = 21, kParts = 3;
constexpr int64_t kPartMask = (int64_t(1) << kPartBits) - 1;

}  // namespace

StateDict broadcast_state_to_replicas(Muon& muon, StateDict state) {
  SWAPOPT_CHECK(muon.hsdp_enabled(), "[Muon] broadcast_state_to_replicas needs HSDP (call enable_hsdp)");
  const Device device = muon.device();  // where the communicators move data
  const std::string key = "momentum_buffer";
  // Checked on every rank, then voted on before the first broadcast: a rank throwing alone among
  // the collectives would leave its replicas waiting in them.
  json::Value meta;
  std::exception_ptr refused;
  try {
    meta = json::parse(state.metadata);
    json::check_optimizer_metadata_keys(meta);
    // This rank's own state: its optimizer, params, shards and kept state (another rank's, of the
    // same shapes, would send that rank's momentum to this rank's replicas).
    const json::Value own = json::parse(muon.metadata_json());
    for (const char* key : {"optimizer", "param_names", "param_shards", "param_kept"}) {
      const bool has = meta.contains(key);
      // (a full copy, without param_kept, may be completed again)
      const bool fits = has ? own.contains(key) && meta.at(key) == own.at(key)
                            : !own.contains(key) || std::string(key) == "param_kept";
      SWAPOPT_CHECK(fits, "[Muon] broadcast_state_to_replicas: the state's '"
                              << key << "' is not this rank's: pass this rank's own state_dict()");
    }
    size_t params = 0;
    for (const ParamGroup& g : muon.param_groups()) params += g.params.size();
    const auto& steps = json::get_array(json::member(meta, "param_steps", "metadata"), "param_steps");
    SWAPOPT_CHECK(steps.size() == params, "[Muon] broadcast_state_to_replicas: the state has "
                                              << steps.size() << " param steps for " << params << " params");
    for (const json::Value& recorded : steps) {
      const int64_t step = json::get_int(recorded, "param_steps");
      SWAPOPT_CHECK(step >= 0, "[Muon] broadcast_state_to_replicas: negative param step " << step);
    }
    for (const HsdpAssignment& a : muon.hsdp_schedule())
      for (size_t i = 0; i < a.params.size(); ++i) {
        const auto it = state.tensors.find(muon.state_name(a.params[i], key));
        if (!a.replicas || a.owners[i] != a.local_coordinate || it == state.tensors.end()) continue;
        const Param& p = *a.params[i];
        const Tensor& t = it->second;
        SWAPOPT_CHECK(
            t.defined() && !t.is_released() && t.shape() == p.data.shape() && t.dtype() == muon.state_dtype(key, p),
            "[Muon] broadcast_state_to_replicas: '" << it->first << "' is " << t.str() << ", '" << p.name << "' needs "
                                                    << dtype_name(muon.state_dtype(key, p)) << " "
                                                    << shape_str(p.data.shape()));
      }
  } catch (...) {
    refused = std::current_exception();
  }
  vote_on_checks([&](std::vector<float> values) { return muon.sum_over_step_ranks(std::move(values)); }, refused, {},
                 "[Muon] broadcast_state_to_replicas", "nothing was broadcast");
  json::Value& param_steps = meta.at("param_steps");
  for (const HsdpAssignment& a : muon.hsdp_schedule()) {
    if (!a.replicas) continue;
    const size_t n = a.params.size();
    std::vector<std::string> names(n);
    std::vector<float> steps(kParts * n, 0.f);  // each owner's step of its params (0: never stepped, no state)
    for (size_t i = 0; i < n; ++i) {
      names[i] = muon.state_name(a.params[i], key);
      // An owner sends nothing for a tensor missing from `state` (no rank throws alone inside
      // collectives): its own copy then fails to load, naming the param.
      if (a.owners[i] != a.local_coordinate || state.tensors.count(names[i]) == 0) continue;
      // The step `state`'s metadata records (checked above).
      const int64_t step = param_steps.at(size_t(muon.param_index(a.params[i]))).get<int64_t>();
      for (int k = 0; k < kParts; ++k) steps[kParts * i + k] = float((step >> (kPartBits * k)) & kPartMask);
    }
    Tensor flags = Tensor::from_floats(steps, {int64_t(kParts * n)}).to(device);
    a.replicas->all_reduce(flags)->wait();
    steps = flags.to_float_vector();
    std::vector<int64_t> step_of(n, 0);
    for (size_t i = 0; i < n; ++i)
      for (int k = 0; k < kParts; ++k) step_of[i] |= int64_t(steps[kParts * i + k]) << (kPartBits * k);
    std::vector<Tensor> buffers(n);
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < n; ++i) {
      if (step_of[i] == 0) continue;
      const Param& p = *a.params[i];
      buffers[i] = a.owners[i] == a.local_coordinate
                       ? state.tensors.at(names[i]).to(device)
                       : Tensor::empty(p.data.shape(), muon.state_dtype(key, p), device);
      works.push_back(a.replicas->broadcast(buffers[i], int(a.owners[i])));
    }
    wait_every(works);
    for (size_t i = 0; i < n; ++i) {
      if (step_of[i] == 0 || a.owners[i] == a.local_coordinate) continue;
      state.tensors[names[i]] = buffers[i].to(Device::cpu());
      param_steps.at(size_t(muon.param_index(a.params[i]))) = step_of[i];
    }
  }
  meta.erase("param_kept");  // a full copy: every param's state that any owner kept
  state.metadata = json::dump(meta, "the metadata");
  return state;
}

}  // namespace swapopt
