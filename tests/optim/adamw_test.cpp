#include "golden.h"
#include "swapopt/optim/adamw.h"

using namespace swapopt;
using test::compare;

TEST_CASE("AdamW matches the numpy reference (torch.optim.AdamW's algorithm), amsgrad included") {
  auto golden = test::read_golden("adamw.txt");
  AdamW adamw(Stream(Device::cpu()));
  std::vector<std::pair<std::string, ParamPtr>> params;
  AdamWOptions o0;
  o0.lr = 1e-2;
  AdamWOptions o1;
  o1.lr = 3e-3;
  o1.beta1 = 0.8;
  o1.beta2 = 0.99;
  o1.eps = 1e-6;
  o1.weight_decay = 0.1;
  o1.amsgrad = true;
  std::vector<ParamPtr> g0, g1;
  for (const char* n : {"bias", "embed"}) {
    params.emplace_back(std::string("g0.") + n, make_param(n, golden.at(std::string("g0.") + n + ".init").clone()));
    g0.push_back(params.back().second);
  }
  params.emplace_back("g1.norm", make_param("norm", golden.at("g1.norm.init").clone()));
  g1.push_back(params.back().second);
  adamw.add_param_group(g0, o0);
  adamw.add_param_group(g1, o1);
  for (int t = 1; t <= 3; ++t) {
    for (auto& [key, p] : params) p->grad = golden.at(key + ".grad" + std::to_string(t));
    adamw.step();
    adamw.stream().synchronize();
    for (auto& [key, p] : params)
      CHECK(compare(key + " step " + std::to_string(t), p->data.to_float_vector(), golden.at(key + ".param" + std::to_string(t)).to_float_vector())
                .max_abs < 2e-6);
  }
  for (auto& [key, p] : params) {
    const ParamState& ps = adamw.state().at(p.get());
    CHECK(ps.step == 3);
    for (const auto& [name, tensor] : ps.tensors)
      CHECK(compare(key + " " + name, tensor.to_float_vector(), golden.at(key + "." + name).to_float_vector()).max_rel < 1e-5);
  }
  CHECK(adamw.state().at(params[2].second.get()).tensors.count("max_exp_avg_sq") == 1);
  CHECK(adamw.state().at(params[0].second.get()).tensors.count("max_exp_avg_sq") == 0);
}

TEST_CASE("AdamW on bf16 params keeps f32 state") {
  AdamW adamw(Stream(Device::cpu()));
  ParamPtr p = make_param("w", test::random_tensor({8, 3}, DType::bf16, 1));
  adamw.add_param_group({p});
  p->grad = test::random_tensor({8, 3}, DType::bf16, 2);
  adamw.step();
  adamw.stream().synchronize();
  CHECK(adamw.state().at(p.get()).tensors.at("exp_avg").dtype() == DType::f32);
  CHECK(p->data.dtype() == DType::bf16);
}

TEST_CASE("AdamW rejects invalid options by name") {
  AdamW adamw(Stream(Device::cpu()));
  ParamPtr p = make_param("w", Tensor::zeros({3}, DType::f32, Device::cpu()));
  AdamWOptions o;
  o.lr = -0.1;
  CHECK_THROWS_WITH_AS(adamw.add_param_group({p}, o), "[AdamW] lr must be finite and >= 0, got -0.1", Error);
  o = {};
  o.beta1 = 1.0;
  CHECK_THROWS_WITH_AS(adamw.add_param_group({p}, o), "[AdamW] beta1 must be in [0, 1), got 1", Error);
  o = {};
  o.eps = -1;
  CHECK_THROWS_WITH_AS(adamw.add_param_group({p}, o), "[AdamW] eps must be finite and >= 0, got -1", Error);
}
