// AdamW against torch.optim.AdamW's own f32 results (scripts/reference/make_torch_adamw.py wrote
// them): bare and swapped, whole and chunked, and on CUDA where there is a GPU. The state is bitwise
// torch's; a param is within 1 ulp, only where torch's sqrt is not correctly rounded.

#include "golden.h"
#include "swapopt/optim/adamw.h"
#include "swapopt/swap/adamw_swap_adapter.h"
#include "swapopt/swap/swap_optimizer.h"

using namespace swapopt;

namespace {

constexpr int kSteps = 6;

/** The script's input_value: a multiple of 1/1024 that f32 holds exactly. */
float input_value(uint64_t index, uint64_t step, uint64_t salt, float scale) {
  const uint64_t h = (index * 2654435761ull + step * 40503ull + salt * 97ull) % (uint64_t(1) << 32);
  return float(double(int64_t(h % 2001) - 1000) / 1024.0) * scale;
}

Tensor input_tensor(const Shape& shape, int step, uint64_t salt, float scale, Device device) {
  std::vector<float> values(size_t(shape_numel(shape)));
  for (size_t i = 0; i < values.size(); ++i) values[i] = input_value(i, uint64_t(step), salt, scale);
  return Tensor::from_floats(values, shape).to(device);
}

struct Spec {
  const char* name;
  Shape shape;
  size_t group;
  uint64_t salt;  // 10 * group + index in the group, as the script draws it
  float grad_scale;
};

const std::vector<Spec> kSpecs = {{"w", {24, 40}, 0, 0, 1.f},
                                  {"b", {37}, 0, 1, 1.f},
                                  {"n", {500}, 1, 10, 1.f},
                                  {"s", {16, 31}, 2, 20, 1.f / 65536.f}};

AdamWOptions group_options(size_t group) {
  AdamWOptions o;
  if (group == 0) {
    o.lr = 1e-2;
    o.weight_decay = 1e-2;
  } else if (group == 1) {
    o.lr = 3e-3;
    o.beta1 = 0.8;
    o.beta2 = 0.99;
    o.eps = 1e-6;
    o.weight_decay = 0.1;
    o.amsgrad = true;
  } else {
    o.lr = 1e-3;
    o.beta1 = 0.95;
    o.beta2 = 0.9999;
    o.weight_decay = 0.0;
  }
  return o;
}

/** Elementwise distance of two f32 tensors in units in the last place: the largest, and how
 *  many elements differ at all. */
struct UlpDistance {
  int64_t largest = 0;
  size_t differing = 0;
};
UlpDistance ulp_distance(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_float_vector(), y = b.to_float_vector();
  UlpDistance d;
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t ulps = std::abs(int64_t(formula::float_bits(x[i])) - int64_t(formula::float_bits(y[i])));
    d.largest = std::max(d.largest, ulps);
    d.differing += ulps > 0 ? 1 : 0;
  }
  return d;
}

/** Runs the script's six steps, bare or swapped (`config`), on `device`, and checks every
 *  state tensor against torch's bits and every param against torch's within 1 ulp. */
void check_against_torch(Device device, const std::optional<SwapConfig>& config) {
  const auto golden = test::read_golden("adamw_torch.txt");
  std::vector<ParamPtr> params;
  std::vector<std::vector<ParamPtr>> groups(3);
  for (const Spec& s : kSpecs) {
    params.push_back(make_param(s.name, input_tensor(s.shape, 0, s.salt, 1.f, device)));
    groups[s.group].push_back(params.back());
  }
  AdamW bare{Stream(device)};
  for (size_t g = 0; g < groups.size(); ++g) bare.add_param_group(groups[g], group_options(g));
  std::unique_ptr<SwapOptimizer> swapped;
  if (config) swapped = std::make_unique<SwapOptimizer>(std::make_unique<AdamWSwapAdapter>(bare), *config);
  for (int step = 1; step <= kSteps; ++step) {
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const Spec& s = kSpecs[i];
      const bool has_grad = !(std::string(s.name) == "b" && step == 3);
      params[i]->grad = has_grad ? input_tensor(s.shape, step, s.salt, s.grad_scale, device) : Tensor();
    }
    swapped ? swapped->step() : bare.step();
  }
  if (swapped) {
    swapped->synchronize();
    CHECK(swapped->last_report().chunked_units == (config->device_budget_bytes ? 3 : 0));  // all but b
  }
  bare.stream().synchronize();
  const StateDict state =
      swapped ? swapped->state_dict() : bare.state_dict();  // "state.<param index>.<key>", on the host
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    const std::string name = kSpecs[i].name;
    CAPTURE(name);
    // torch's CPU sqrt is 1 ulp off in about 0.7% of elements (ours is correctly rounded): where
    // that moves the rounded update, the param is 1 ulp off (2 of w's 960 elements here).
    const UlpDistance d = ulp_distance(params[i]->data, golden.at(name + ".param"));
    CHECK(d.largest <= 1);
    CHECK(d.differing <= size_t(params[i]->data.numel()) / 100);
    CHECK(bare.state().at(params[i].get()).step == (name == "b" ? kSteps - 1 : kSteps));
    size_t keys = 0, ours = 0;
    for (const auto& [key, want] : golden) {
      if (key.rfind(name + ".", 0) != 0 || key == name + ".param") continue;
      ++keys;
      const std::string state_name = "state." + std::to_string(i) + "." + key.substr(name.size() + 1);
      CAPTURE(state_name);
      REQUIRE(state.tensors.count(state_name) == 1);
      CHECK(test::same_bits(state.tensors.at(state_name), want));
    }
    for (const auto& [key, tensor] : state.tensors)
      ours += key.rfind("state." + std::to_string(i) + ".", 0) == 0 ? 1 : 0;
    CHECK(keys == ours);  // torch's state keys, no more
  }
}

}  // namespace

TEST_CASE("AdamW equals torch.optim.AdamW in f32, state bitwise: three groups, amsgrad, a skipped grad, six steps") {
  check_against_torch(Device::cpu(), std::nullopt);
}

TEST_CASE("AdamW swapped equals torch.optim.AdamW in f32, state bitwise: whole units and chunked") {
  for (bool chunked : {false, true}) {
    CAPTURE(chunked);
    SwapConfig c;
    c.min_numel = 0;
    if (chunked) c.device_budget_bytes = 2048;  // below every state but b's: those stream in chunks
    check_against_torch(Device::cpu(), c);
  }
}

TEST_CASE("AdamW on CUDA equals torch.optim.AdamW's CPU results, state bitwise" * doctest::skip(test::no_gpu())) {
  check_against_torch(Device::cuda(0), std::nullopt);
  SwapConfig c;
  c.min_numel = 0;
  check_against_torch(Device::cuda(0), c);
}
