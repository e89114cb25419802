// A trainer-side program built outside swapopt's tree: two Muon steps with swapped momentum.
#include <cstdio>

#include "swapopt/swapopt.h"

int main() {
  using namespace swapopt;
  Stream stream(Device::cpu());
  std::vector<float> values(64 * 48, 0.01f);
  ParamPtr w = make_param("w", Tensor::from_floats(values, {64, 48}));
  Muon muon(stream);
  muon.add_param_group({w});
  SwapConfig config;
  config.swap_times = 2;
  auto swapped = swap_muon(muon, config);
  for (int step = 0; step < 2; ++step) {
    w->grad = Tensor::from_floats(std::vector<float>(64 * 48, 0.5f + float(step)), {64, 48});
    swapped->step();
  }
  swapped->synchronize();
  const SwapStepReport report = swapped->last_report();
  const bool ok = report.h2d_bytes == 64 * 48 * 4 && swapped->runtime().slots().front()->device.is_released();
  std::printf("consumer: 2 Muon swap steps, %zu bytes each way: %s\n", report.h2d_bytes, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
