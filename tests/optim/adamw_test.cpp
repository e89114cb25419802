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

TEST_CASE("zero_grad drops every grad: the next step skips the params, bare and swapped alike") {
  auto make = [] {
    return std::vector<ParamPtr>{make_param("a", test::random_tensor({40, 40}, DType::f32, 1)),
                                 make_param("b", test::random_tensor({64}, DType::f32, 2))};
  };
  auto bare_params = make(), swap_params = make();
  AdamW bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
  bare.add_param_group(bare_params);
  inner.add_param_group(swap_params);
  SwapConfig config;
  config.min_numel = 1;
  auto swapped = swap_adamw(inner, config);
  for (auto* list : {&bare_params, &swap_params})
    for (const ParamPtr& p : *list) p->grad = test::random_tensor(p->data.shape(), DType::f32, 3);
  bare.step();
  swapped->step();
  bare.zero_grad();
  swapped->zero_grad();
  for (auto* list : {&bare_params, &swap_params})
    for (const ParamPtr& p : *list) CHECK_FALSE(p->has_grad());
  bare_params[1]->grad = test::random_tensor({64}, DType::f32, 4);
  swap_params[1]->grad = test::random_tensor({64}, DType::f32, 4);
  bare.step();  // only b steps: a keeps its value, its per-param step stays 1
  swapped->step();
  CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()));
  CHECK(bare.state().at(bare_params[0].get()).step == 1);
  CHECK(bare.state().at(bare_params[1].get()).step == 2);
  bare.stream().synchronize();
  inner.stream().synchronize();
  CHECK(test::same_bits(bare_params[0]->data, swap_params[0]->data));
  CHECK(test::same_bits(bare_params[1]->data, swap_params[1]->data));
}

TEST_CASE("AdamW::update_params: one op over the list, bitwise the per-param updates; a param listed twice changes nothing") {
  Stream s(Device::cpu());
  AdamW list(s), single(s);
  std::vector<ParamPtr> a, b;
  for (int i = 0; i < 5; ++i) {
    const Tensor w = test::random_tensor({int64_t(1000 + 7000 * i)}, i % 2 ? DType::bf16 : DType::f32, uint32_t(i + 1));
    std::string name = "p";  // built in two steps: GCC 12 warns (-Wrestrict) on "p" + to_string
    name += std::to_string(i);
    a.push_back(make_param(name, w.clone()));
    b.push_back(make_param(name, w.clone()));
    a.back()->grad = test::random_tensor(w.shape(), DType::f32, uint32_t(i + 10));
    b.back()->grad = a.back()->grad;
  }
  list.add_param_group(a);
  single.add_param_group(b);
  for (int step = 0; step < 2; ++step) {
    std::vector<Param*> all;
    for (const ParamPtr& p : a) all.push_back(p.get());
    list.update_params(0, all);
    for (const ParamPtr& p : b) single.update_param(0, *p);
  }
  s.synchronize();
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(test::same_bits(a[i]->data, b[i]->data));
    CHECK(list.state().at(a[i].get()).step == 2);
    for (const char* key : {"exp_avg", "exp_avg_sq"})
      CHECK(test::same_bits(list.state().at(a[i].get()).tensors.at(key), single.state().at(b[i].get()).tensors.at(key)));
  }
  const std::string before = serialize_state_dict(list.state_dict());
  const Tensor data_before = a[1]->data.clone();
  Param* twice[] = {a[0].get(), a[1].get(), a[1].get()};
  CHECK_THROWS_WITH_AS(list.update_params(0, twice), "[AdamW] update_params: parameter 'p1' is listed twice", Error);
  s.synchronize();
  CHECK(serialize_state_dict(list.state_dict()) == before);
  CHECK(test::same_bits(a[1]->data, data_before));
}

TEST_CASE("params that share memory are refused by name; disjoint views of one buffer are fine") {
  const Tensor flat = Tensor::zeros({100}, DType::f32, Device::cpu());
  AdamW adamw(Stream(Device::cpu()));
  // Disjoint views of one buffer (a flat parameter buffer): accepted, in one group or several.
  adamw.add_param_group({make_param("a", flat.narrow(0, 0, 40)), make_param("b", flat.narrow(0, 40, 30))});
  adamw.add_param_group({make_param("c", flat.narrow(0, 70, 30))});
  // The same bytes twice, or a view overlapping an earlier group's: named, and nothing added.
  CHECK_THROWS_WITH_AS(adamw.add_param_group({make_param("d", flat.narrow(0, 39, 2))}),
                       "[AdamW] parameters 'a' and 'd' share memory (an update of one would change the other)", Error);
  const Tensor w = Tensor::zeros({8}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(adamw.add_param_group({make_param("w", w), make_param("tied", w)}),
                       "[AdamW] parameters 'w' and 'tied' share memory (an update of one would change the other)", Error);
  CHECK(adamw.param_groups().size() == 2);
  adamw.add_param_group({make_param("d", flat.narrow(0, 0, 0)), make_param("w", w)});  // empty: no memory to share
  CHECK(adamw.param_groups().size() == 3);
}
