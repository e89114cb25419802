// Schedules and option setters: a schedule runs before each step's checks with the step's number;
// setters validate at once and change nothing on a bad value.
#include <cmath>

#include "test_util.h"

using namespace swapopt;
using test::error_of;

namespace {

std::vector<ParamPtr> model() {
  return {make_param("blocks.0.w", test::random_tensor({24, 16}, DType::f32, 1)),
          make_param("blocks.0.b", test::random_tensor({24}, DType::f32, 2)),
          make_param("blocks.1.w", test::random_tensor({16, 24}, DType::f32, 3))};
}

void set_grads(const std::vector<ParamPtr>& params, uint32_t step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 100 * step + uint32_t(i));
}

double warmup(int64_t step, double base) { return base * std::min(1.0, double(step) / 3.0); }

}  // namespace

TEST_CASE("a schedule sees steps 1, 2, 3 and gives the same bits as setting lr by hand (bare, swapped, MuonWithAdamW)") {
  for (bool swapped : {false, true}) {
    CAPTURE(swapped);
    auto by_hand = model(), scheduled = model();
    MuonWithAdamW a(Stream(Device::cpu()), by_hand), b(Stream(Device::cpu()), scheduled);
    std::vector<int64_t> seen;
    b.muon().set_schedule([&](int64_t step) {
      seen.push_back(step);
      b.muon().set_lr(warmup(step, 0.02));
    });
    b.adamw().set_schedule([&](int64_t step) { b.adamw().set_lr(warmup(step, 1e-3)); });
    SwapConfig config;
    config.min_numel = 1;
    std::unique_ptr<SwapOptimizerSet> set = swapped ? swap_muon_with_adamw(b, config) : nullptr;
    for (uint32_t step = 1; step <= 3; ++step) {
      set_grads(by_hand, step);
      set_grads(scheduled, step);
      a.muon().set_lr(warmup(step, 0.02));
      a.adamw().set_lr(warmup(step, 1e-3));
      a.step();
      if (set) {
        set->step();
      } else {
        b.step();
      }
    }
    a.synchronize();
    if (set) set->synchronize();
    b.synchronize();
    CHECK(seen == std::vector<int64_t>{1, 2, 3});
    for (size_t i = 0; i < by_hand.size(); ++i) CHECK(test::same_bits(by_hand[i]->data, scheduled[i]->data));
  }
}

TEST_CASE("a schedule that sets a bad value fails the step with the option's error, before anything changes") {
  auto params = model();
  AdamW adamw(Stream(Device::cpu()));
  adamw.add_param_group(params);
  set_grads(params, 1);
  adamw.step();
  adamw.synchronize();
  const Tensor before = params[0]->data.clone();
  adamw.set_schedule([&](int64_t) { adamw.mutable_options(0).lr = -1.0; });
  set_grads(params, 2);
  CHECK(error_of([&] { adamw.step(); }) == "[AdamW] group 0: lr must be finite and >= 0, got -1");
  CHECK(test::same_bits(params[0]->data, before));
  CHECK(adamw.param_groups()[0].step == 1);
}

TEST_CASE("a step that fails its checks calls the schedule again with the same number") {
  auto params = model();
  params.erase(params.begin() + 1);  // matrices only: Muon
  Muon muon(Stream(Device::cpu()));
  muon.add_param_group(params);
  std::vector<int64_t> seen;
  muon.set_schedule([&](int64_t step) { seen.push_back(step); });
  set_grads(params, 1);
  params[1]->grad = Tensor::zeros({3, 3}, DType::f32, Device::cpu());
  CHECK_FALSE(error_of([&] { muon.step(); }).empty());
  set_grads(params, 1);
  muon.step();
  CHECK(seen == std::vector<int64_t>{1, 1});
}

TEST_CASE("set_lr and set_options validate at once and change nothing on a bad value") {
  auto params = model();
  AdamW adamw(Stream(Device::cpu()));
  adamw.add_param_group({params[0]});
  adamw.add_param_group({params[1]}, [] {
    AdamWOptions o;
    o.lr = 5e-4;
    return o;
  }());
  CHECK(error_of([&] { adamw.set_lr(std::nan("")); }) == "[AdamW] lr must be finite and >= 0, got nan");
  CHECK(adamw.lr(0) == 1e-3);
  CHECK(adamw.lr(1) == 5e-4);
  adamw.set_lr(2e-3);
  CHECK(adamw.lr(0) == 2e-3);
  CHECK(adamw.lr(1) == 2e-3);
  AdamWOptions bad;
  bad.beta2 = 1.5;
  const std::string want_beta = error_of([&] { bad.validate(); });
  REQUIRE_FALSE(want_beta.empty());
  CHECK(error_of([&] { adamw.set_options(0, bad); }) == want_beta);
  CHECK(adamw.options(0).beta2 == AdamWOptions().beta2);
  CHECK(error_of([&] { adamw.set_options(2, AdamWOptions()); }) == "[AdamW] no param group 2 (2 groups)");

  Muon muon(Stream(Device::cpu()));
  muon.add_param_group({params[0]});
  MuonOptions wrong;
  wrong.momentum = 1.5;
  CHECK(error_of([&] { muon.set_options(0, wrong); }) == "[Muon] momentum must be in [0, 1), got 1.5");
  CHECK(muon.options(0).momentum == MuonOptions().momentum);

  // A good lr meeting another bad option (set through mutable_options) names that option's group.
  muon.add_param_group({params[2]});
  muon.mutable_options(1).ns_steps = 0;
  CHECK(error_of([&] { muon.set_lr(0.01); }) == "[Muon] group 1: ns_steps must be >= 1, got 0");
  CHECK(error_of([&] { muon.set_lr(-1.0); }) == "[Muon] lr must be finite and >= 0, got -1");
  CHECK(muon.lr(0) == MuonOptions().lr);
  CHECK(muon.lr(1) == MuonOptions().lr);
  adamw.mutable_options(1).beta1 = 1.5;
  CHECK(error_of([&] { adamw.set_lr(0.01); }) == "[AdamW] group 1: beta1 must be in [0, 1), got 1.5");
  CHECK(adamw.lr(0) == 2e-3);
}
