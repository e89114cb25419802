#include "swapopt/optim/hsdp_checkpoint.h"

#include "swapopt/core/error.h"

namespace swapopt {

StateDict broadcast_state_to_replicas(Muon& muon, StateDict state) {
  SWAPOPT_CHECK(muon.hsdp_enabled(), "[Muon] broadcast_state_to_replicas needs HSDP (call enable_hsdp)");
  const Device device = muon.device();  // where the communicators move data
  const std::string key = "momentum_buffer";
  for (const HsdpAssignment& a : muon.hsdp_schedule()) {
    if (!a.replicas) continue;
    const size_t n = a.params.size();
    std::vector<std::string> names(n);
    std::vector<float> present(n, 0.f);
    for (size_t i = 0; i < n; ++i) {
      names[i] = muon.state_name(a.params[i], key);
      if (a.owners[i] == a.local_coordinate && state.tensors.count(names[i]) != 0) present[i] = 1.f;
    }
    // Which owners have state (a param never stepped with a gradient has none).
    Tensor flags = Tensor::from_floats(present, {int64_t(n)}).to(device);
    a.replicas->all_reduce(flags)->wait();
    present = flags.to_float_vector();
    std::vector<Tensor> buffers(n);
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < n; ++i) {
      if (present[i] == 0.f) continue;
      const Param& p = *a.params[i];
      buffers[i] = a.owners[i] == a.local_coordinate
                       ? state.tensors.at(names[i]).to(device)
                       : Tensor::empty(p.data.shape(), muon.state_dtype(key, p), device);
      works.push_back(a.replicas->broadcast(buffers[i], int(a.owners[i])));
    }
    wait_every(works);
    for (size_t i = 0; i < n; ++i)
      if (present[i] != 0.f && a.owners[i] != a.local_coordinate) state.tensors[names[i]] = buffers[i].to(Device::cpu());
  }
  return state;
}

}  // namespace swapopt
