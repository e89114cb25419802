// Routing by explicit rules on whole name components and shapes, with a report of each decision.
#include "test_util.h"

using namespace swapopt;
using test::error_of;

namespace {

ParamPtr param(const std::string& name, const Shape& shape) { return make_param(name, Tensor::zeros(shape, DType::f32, Device::cpu())); }

Route route_of(const std::string& name, const Shape& shape, const RoutingRules& rules = {}) {
  return route_params({param(name, shape)}, rules).decisions.front().route;
}

}  // namespace

TEST_CASE("default routing: whole name components, never substrings (the reference trainer's rules)") {
  const Shape m = {8, 4};
  CHECK(route_of("blocks.0.attn.multihead_proj.weight", m) == Route::muon);  // "head" inside a component
  CHECK(route_of("blocks.0.mlp.output_gate.weight", m) == Route::muon);      // "output" inside a component
  CHECK(route_of("layers.0.attention.output.dense.weight", m) == Route::muon);  // "output" not first
  CHECK(route_of("blocks.0.experts.w1", {4, 8, 4}) == Route::muon);
  CHECK(route_of("model.embed_tokens.weight", m) == Route::adamw_decay);
  CHECK(route_of("transformer.wte.weight", m) == Route::adamw_decay);
  CHECK(route_of("embed.weight", m) == Route::adamw_decay);
  CHECK(route_of("lm_head.weight", m) == Route::adamw_decay);
  CHECK(route_of("model.lm_head.weight", m) == Route::adamw_decay);
  CHECK(route_of("output.weight", m) == Route::adamw_decay);
  CHECK(route_of("head.weight", m) == Route::adamw_decay);
  CHECK(route_of("blocks.0.norm.weight", {8}) == Route::adamw_no_decay);
  CHECK(route_of("conv.bias", {8, 1}) == Route::adamw_no_decay);  // a bias by name, whatever its shape
}

TEST_CASE("the routing report: every param, its route and the rule that sent it") {
  const RoutedParams r = route_params({param("embed.weight", {10, 4}), param("blocks.0.attn.multihead_proj.weight", {4, 4}),
                                       param("blocks.0.norm.weight", {4}), param("blocks.0.attn.bias", {4, 1})});
  CHECK(r.report() ==
        "embed.weight                         adamw             an embedding\n"
        "blocks.0.attn.multihead_proj.weight  muon              no rule matched\n"
        "blocks.0.norm.weight                 adamw (no decay)  fewer than 2 dims (norm scales, biases)\n"
        "blocks.0.attn.bias                   adamw (no decay)  a bias\n");
  CHECK(r.muon.size() == 1);
  CHECK(r.adamw_decay.size() == 1);
  CHECK(r.adamw_no_decay.size() == 2);
  auto params = std::vector<ParamPtr>{param("embed.weight", {10, 4}), param("blocks.0.w", {4, 4}), param("blocks.0.b", {4})};
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  REQUIRE(opt.routing().size() == 3);
  CHECK(opt.routing()[1].route == Route::muon);
  CHECK(opt.routing()[2].why == "fewer than 2 dims (norm scales, biases)");
}

TEST_CASE("custom rules: checked first to last, on names and shapes; a 1-D param sent to Muon is a named error") {
  RoutingRules rules;
  rules.rules.insert(rules.rules.begin(), RoutingRule{"a router gate", has_name_component({"router"}), Route::adamw_no_decay});
  rules.rules.push_back(RoutingRule{"a very wide matrix",
                                    [](const Param& p) { return p.data.dim() == 2 && p.data.shape()[1] > 64 * p.data.shape()[0]; },
                                    Route::adamw_decay});
  CHECK(route_of("blocks.0.moe.router.weight", {8, 4}, rules) == Route::adamw_no_decay);
  CHECK(route_of("blocks.0.proj", {2, 256}, rules) == Route::adamw_decay);
  CHECK(route_of("blocks.0.proj", {4, 256}, rules) == Route::muon);

  RoutingRules everything_to_muon;
  everything_to_muon.rules = {RoutingRule{"everything", [](const Param&) { return true; }, Route::muon}};
  CHECK(error_of([&] { route_params({param("ln.weight", {768})}, everything_to_muon); }) ==
        "[routing] 'ln.weight' (shape [768]) would go to Muon (everything), which needs 2 or more dims: route it with a rule");
  CHECK(error_of([&] { route_params({param("w", {4, 4}), nullptr}); }) == "[routing] null parameter");
}

TEST_CASE("MuonWithAdamW refuses across its halves what each optimizer refuses within itself") {
  // A [5, 5] matrix (Muon) and a [25] view of the same memory (AdamW): both would update it.
  std::vector<float> memory(25, 0.5f);
  const ParamPtr matrix = make_param("blocks.0.w", Tensor::from_blob(memory.data(), {5, 5}, DType::f32, Device::cpu()));
  const ParamPtr flat =
      make_param("blocks.0.w_flat", Tensor::from_blob(memory.data(), {25}, DType::f32, Device::cpu()));
  const Stream stream(Device::cpu());
  CHECK(error_of([&] {
          MuonWithAdamW(stream, {matrix, flat});
        }) ==
        "[MuonWithAdamW] parameters 'blocks.0.w' and 'blocks.0.w_flat' share memory (an update of one would change the "
        "other)");
  // One name in both halves: one checkpoint names every param's state.
  CHECK(error_of([&] {
          MuonWithAdamW(stream, {param("x", {4, 4}), param("x", {4})});
        }) == "[MuonWithAdamW] two parameters are named 'x' (checkpoints name each param's state)");
  CHECK(error_of([&] { MuonWithAdamW(stream, {param("w", {4, 4}), nullptr}); }) == "[MuonWithAdamW] null parameter");
  const ParamPtr twice = param("w", {4, 4});
  CHECK(error_of([&] {
          MuonWithAdamW(stream, {twice, param("b", {4}), twice});
        }) == "[MuonWithAdamW] parameter 'w' is listed twice");
  CHECK(error_of([&] { MuonWithAdamW(stream, {make_param("w", Tensor())}); }) ==
        "[MuonWithAdamW] parameter 'w' must be a defined contiguous tensor");
  Tensor released = Tensor::zeros({4, 4}, DType::f32, Device::cpu());
  released.storage()->release();
  CHECK(error_of([&] { MuonWithAdamW(stream, {make_param("w", released)}); }) ==
        "[MuonWithAdamW] parameter 'w' has no data (its storage is released)");
  // No name (the default rules read its components: there are none).
  CHECK(error_of([&] {
          MuonWithAdamW(stream, {param("", {4, 4})});
        }) == "[MuonWithAdamW] a parameter has no name (checkpoints name each param's state)");
  CHECK(error_of([&] {
          route_params({param("", {4, 4})});
        }) == "[routing] a parameter has no name (the rules read names, checkpoints name each param's state)");
  CHECK(route_params({param(".", {4, 4})}).decisions.at(0).route == Route::muon);  // one empty component
  // Disjoint views of one buffer are fine, as in one optimizer.
  std::vector<float> two(50, 0.5f);
  CHECK(error_of([&] {
          MuonWithAdamW(stream,
                        {make_param("a.w", Tensor::from_blob(two.data(), {5, 5}, DType::f32, Device::cpu())),
                         make_param("a.norm", Tensor::from_blob(two.data() + 25, {25}, DType::f32, Device::cpu()))});
        }).empty());
}
