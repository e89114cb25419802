#include "golden.h"
#include "swapopt/optim/muon.h"

using namespace swapopt;
using test::compare;

namespace {

struct GoldenParam {
  std::string key;  // "g0.wide"
  ParamPtr param;
};

}  // namespace

TEST_CASE("Muon matches the numpy reference over 3 steps (f32 Newton-Schulz)") {
  auto golden = test::read_golden("muon.txt");
  Muon muon(Stream(Device::cpu()));
  std::vector<GoldenParam> params;
  const std::vector<std::vector<std::string>> names = {
      {"wide", "tall", "square", "experts", "single", "squeezed"}, {"legacy"}, {"nesterov_wide", "nesterov_tall"}};
  for (size_t g = 0; g < names.size(); ++g) {
    std::vector<ParamPtr> group;
    for (const std::string& n : names[g]) {
      const std::string key = "g" + std::to_string(g) + "." + n;
      params.push_back({key, make_param(n, golden.at(key + ".init").clone())});
      group.push_back(params.back().param);
    }
    MuonOptions o;
    if (g == 1) {
      o.lr = 5e-2;
      o.weight_decay = 0.0;
      o.momentum = 0.9;
      o.momentum2 = 0.8;
      o.nesterov = false;
      o.ns_variant = "legacy";
      o.ns_epsilon = 1e-7;
    }
    if (g == 2) {  // nesterov with momentum2 != momentum: the nesterov step must use momentum
      o.lr = 3e-2;
      o.weight_decay = 0.05;
      o.momentum = 0.9;
      o.momentum2 = 0.6;
      o.ns_epsilon = 1e-7;
    }
    muon.add_param_group(group, o);
  }
  for (int step = 1; step <= 3; ++step) {
    for (GoldenParam& gp : params) {
      const auto it = golden.find(gp.key + ".grad" + std::to_string(step));
      gp.param->grad = it == golden.end() ? Tensor() : it->second;
    }
    muon.step();
    muon.stream().synchronize();
    for (GoldenParam& gp : params) {
      const auto it = golden.find(gp.key + ".param" + std::to_string(step));
      if (it == golden.end()) continue;
      const auto r = compare(gp.key + " step " + std::to_string(step), gp.param->data.to_float_vector(), it->second.to_float_vector());
      CHECK(r.max_abs < 2e-5);
    }
  }
  for (GoldenParam& gp : params) {
    const Tensor& buf = muon.state().at(gp.param.get()).tensors.at("momentum_buffer");
    CHECK(compare(gp.key + " momentum", buf.to_float_vector(), golden.at(gp.key + ".momentum_buffer").to_float_vector()).max_abs <
          1e-5);
  }
  CHECK(muon.param_groups()[0].step == 3);
}

TEST_CASE("fused momentum: the nesterov step weighs the update by momentum, the buffer by momentum2 (exact, f32 and bf16)") {
  // g = 1, old buffer 2, m1 = 0.5, m2 = 0.25: u = g + m1 buf = 2; buf' = m2 buf + g = 1.5;
  // nesterov u' = m1 u + g = 2 (with m2 it would be 1.5). The second element (g = -1, buffer 4)
  // gives u = 1, buf' = 0, u' = -0.5 (with m2: -0.75). Every value is exact in bf16 too, so the
  // generic (non-f32) loop is held to the same bits as the vectorised one.
  for (DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    for (bool nesterov : {true, false}) {
      Stream s(Device::cpu());
      const Tensor grad = Tensor::from_floats({1.f, -1.f}, {2}, dtype);
      const Tensor buf = Tensor::from_floats({2.f, 4.f}, {2}, dtype);
      const Tensor update = Tensor::zeros({2}, dtype, Device::cpu());
      ops::muon_momentum(s, grad, buf, update, 0.5f, 0.25f, nesterov);
      s.synchronize();
      CHECK(buf.to_float_vector() == std::vector<float>{1.5f, 0.f});
      CHECK(update.to_float_vector() == (nesterov ? std::vector<float>{2.f, -0.5f} : std::vector<float>{2.f, 1.f}));
    }
  }
}

TEST_CASE("a zero grad gives a zero update: the param only decays, exactly (Newton-Schulz's epsilon guards 0 / 0)") {
  for (DType ns_dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(ns_dtype));
    Muon muon(Stream(Device::cpu()));
    ParamPtr wide = make_param("wide", test::random_tensor({8, 12}, DType::f32, 51));
    ParamPtr tall = make_param("tall", test::random_tensor({12, 8}, DType::f32, 52));
    MuonOptions o;  // weight_decay 0.1, lr 2e-2
    o.ns_dtype = ns_dtype;
    muon.add_param_group({wide, tall}, o);
    const float decay = float(1.0 - o.lr * o.weight_decay);
    for (int step = 1; step <= 2; ++step) {
      std::vector<std::vector<float>> want;
      for (const ParamPtr& p : {wide, tall}) {
        want.push_back(p->data.to_float_vector());
        for (float& x : want.back()) x *= decay;
        p->grad = Tensor::zeros(p->data.shape(), DType::f32, Device::cpu());
      }
      muon.step();
      muon.stream().synchronize();
      CHECK(wide->data.to_float_vector() == want[0]);
      CHECK(tall->data.to_float_vector() == want[1]);
    }
    for (const ParamPtr& p : {wide, tall})
      CHECK(muon.state().at(p.get()).tensors.at("momentum_buffer").to_float_vector() ==
            std::vector<float>(size_t(p->data.numel()), 0.f));
  }
}

TEST_CASE("batched Newton-Schulz equals per-matrix Newton-Schulz bitwise on the CPU") {
  Stream s(Device::cpu());
  const auto schedule = ns_schedule("asym5", 5, {});
  for (const Shape& shape : {Shape{4, 24, 40}, Shape{3, 50, 20}}) {
    Tensor batch = test::random_tensor(shape, DType::f32, 21);
    std::vector<Tensor> singles;
    for (int64_t i = 0; i < shape[0]; ++i) singles.push_back(batch.narrow(0, i, 1).clone());
    newton_schulz(s, batch, schedule, 1e-7f);
    for (Tensor& single : singles) newton_schulz(s, single, schedule, 1e-7f);
    s.synchronize();
    for (int64_t i = 0; i < shape[0]; ++i) CHECK(test::same_bits(batch.narrow(0, i, 1).clone(), singles[size_t(i)]));
  }
}

TEST_CASE("Newton-Schulz orthogonalises: singular values land near 1 for every variant") {
  Stream s(Device::cpu());
  // Each variant pushes singular values into its own band around 1 (legacy's is widest, ~[0.7, 1.1]).
  const std::vector<std::pair<std::string, double>> variants = {{"asym5", 0.05}, {"legacy", 0.5}, {"polar_express", 0.2}};
  for (const auto& [variant, band] : variants) {
    for (const Shape& shape : {Shape{1, 32, 64}, Shape{1, 64, 32}}) {
      Tensor x = test::random_tensor(shape, DType::f32, 22);
      newton_schulz(s, x, ns_schedule(variant, 5, {}), 1e-7f, ns_norm_scale(variant));
      // X X^T (wide) or X^T X (tall) should be close to the identity.
      const int64_t k = std::min(shape[1], shape[2]);
      Tensor gram = Tensor::zeros({1, k, k}, DType::f32, Device::cpu());
      ops::syrk(s, x, shape[1] > shape[2], gram);
      s.synchronize();
      const auto g = gram.to_float_vector();
      double worst = 0;
      for (int64_t i = 0; i < k; ++i) worst = std::max(worst, std::fabs(double(g[size_t(i * k + i)]) - 1.0));
      MESSAGE(variant << " " << shape_str(shape) << ": max |diag(X X^T) - 1| = " << worst);
      CHECK(worst < band);
    }
  }
}

TEST_CASE("Muon on bf16: NS in bf16 stays close to the f32 result") {
  Stream s(Device::cpu());
  Tensor x = test::random_tensor({2, 16, 48}, DType::f32, 23);
  Tensor x16 = Tensor::zeros({2, 16, 48}, DType::bf16, Device::cpu());
  ops::cast(s, x, x16);
  newton_schulz(s, x, ns_schedule("asym5", 5, {}), 1e-7f);
  newton_schulz(s, x16, ns_schedule("asym5", 5, {}), 1e-7f);
  s.synchronize();
  CHECK(compare("NS bf16 vs f32", x16.to_float_vector(), x.to_float_vector()).max_abs < 0.05);
}

TEST_CASE("newton_schulz refuses a dtype it cannot work in before it changes x") {
  Stream s(Device::cpu());
  const Tensor x = test::random_tensor({1, 4, 6}, DType::f16, 5);
  const std::vector<float> before = x.to_float_vector();
  CHECK_THROWS_WITH_AS(newton_schulz(s, x, ns_schedule("asym5", 5, {}), 1e-7f),
                       "[newton_schulz] works in f32 or bf16, got Tensor(f16, [1, 4, 6], cpu)", Error);
  s.synchronize();
  CHECK(x.to_float_vector() == before);
}

TEST_CASE("params without a grad are skipped and get no state; hooks see their context") {
  Muon muon(Stream(Device::cpu()), MuonHooks{nullptr, nullptr, [&](Stream&, Param& p, const Tensor& local, const PostUpdateContext& c) {
                                               CHECK(local.data_ptr() == p.data.data_ptr());
                                               CHECK(c.name == "a");
                                               CHECK(c.logical_shape == Shape{4, 6});
                                               CHECK(c.step == 1);
                                               CHECK(c.lr == doctest::Approx(2e-2));
                                             }});
  ParamPtr a = make_param("a", test::random_tensor({4, 6}, DType::f32, 1));
  ParamPtr b = make_param("b", test::random_tensor({4, 6}, DType::f32, 2));
  muon.add_param_group({a, b});
  a->grad = test::random_tensor({4, 6}, DType::f32, 3);
  const Tensor b_before = b->data.clone();
  muon.step();
  muon.stream().synchronize();
  CHECK(muon.state().count(a.get()) == 1);
  CHECK(muon.state().count(b.get()) == 0);
  CHECK(test::same_bits(b->data, b_before));
}

TEST_CASE("momentum_update_fn and zeropower_fn replace the built-in math") {
  int momentum_calls = 0, zeropower_calls = 0;
  MuonHooks hooks;
  hooks.momentum_update_fn = [&](Stream&, const std::vector<Tensor>& grads, const std::vector<Tensor>&, float, float, bool) {
    ++momentum_calls;
    return grads;  // plain gradient, no momentum
  };
  hooks.zeropower_fn = [&](Stream&, const Tensor&, int steps) {
    ++zeropower_calls;
    CHECK(steps == 5);
  };  // identity: the update is the gradient itself
  Muon muon(Stream(Device::cpu()), hooks);
  ParamPtr p = make_param("w", Tensor::zeros({3, 5}, DType::f32, Device::cpu()));
  MuonOptions o;
  o.weight_decay = 0;
  o.matched_adamw_rms = 0;
  o.zero_rms_scale_mode = "use_lr";
  o.lr = 0.5;
  muon.add_param_group({p}, o);
  p->grad = Tensor::from_floats(std::vector<float>(15, 2.f), {3, 5});
  muon.step();
  muon.stream().synchronize();
  CHECK(momentum_calls == 1);
  CHECK(zeropower_calls == 1);
  CHECK(p->data.to_float_vector() == std::vector<float>(15, -1.f));  // 0 - 0.5 * 1 * 2
  hooks.momentum_update_fn = [](Stream&, const std::vector<Tensor>&, const std::vector<Tensor>&, float, float, bool) {
    return std::vector<Tensor>{};
  };
  Muon bad(Stream(Device::cpu()), hooks);
  bad.add_param_group({p}, o);
  CHECK_THROWS_WITH_AS(bad.step(), "[Muon] momentum_update_fn returned 0 updates for 1 grads", Error);
}

TEST_CASE("apply_lr_in_update: bitwise the default in f32 NS, one extra bf16 rounding in bf16 NS") {
  auto run = [](bool fold, DType ns_dtype) {
    Muon muon(Stream(Device::cpu()));
    ParamPtr p = make_param("w", test::random_tensor({24, 40}, DType::f32, 31));
    MuonOptions o;
    o.apply_lr_in_update = fold;
    o.ns_dtype = ns_dtype;
    muon.add_param_group({p}, o);
    for (int step = 0; step < 3; ++step) {
      p->grad = test::random_tensor({24, 40}, DType::f32, 40 + uint32_t(step));
      muon.step();
    }
    muon.stream().synchronize();
    return p->data.clone();
  };
  // In f32 the folded update rounds alpha * u to f32 exactly as the unfolded axpby does.
  CHECK(test::same_bits(run(true, DType::f32), run(false, DType::f32)));
  const Tensor folded = run(true, DType::bf16), plain = run(false, DType::bf16);
  CHECK_FALSE(test::same_bits(folded, plain));  // the bf16 update is rounded once more when folded
  CHECK(compare("apply_lr_in_update bf16", folded.to_float_vector(), plain.to_float_vector()).max_abs < 1e-3);
}

TEST_CASE("Muon rejects invalid options and 1-D params by name") {
  Muon muon(Stream(Device::cpu()));
  auto with = [](auto change) {
    MuonOptions o;
    change(o);
    return o;
  };
  ParamPtr w = make_param("w", Tensor::zeros({4, 4}, DType::f32, Device::cpu()));
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.lr = -1; })),
                       "[Muon] lr must be finite and >= 0, got -1", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.momentum = 1.0; })),
                       "[Muon] momentum must be in [0, 1), got 1", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.momentum2 = -0.5; })),
                       "[Muon] momentum2 must be in [0, 1), got -0.5", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.ns_steps = 0; })),
                       "[Muon] ns_steps must be >= 1, got 0", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.ns_steps = 6; })),
                       "[Muon] ns_steps 6 exceeds the 5 steps of ns_variant 'asym5'", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.ns_variant = "cubic"; })),
                       "[Muon] unknown ns_variant 'cubic' (expected legacy, asym5, polar_express or custom)", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.ns_coefficients = {{1, 2, 3}}; })),
                       "[Muon] ns_coefficients are given but ns_variant is 'asym5' (use 'custom')", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.ns_variant = "custom"; })),
                       "[Muon] ns_variant 'custom' needs ns_coefficients", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) {
                         o.ns_variant = "custom";
                         o.ns_coefficients = {{1, NAN, 3}};
                       })),
                       "[Muon] ns_coefficients must be finite, got nan", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.ns_epsilon = -1; })),
                       "[Muon] ns_epsilon must be finite and >= 0, got -1", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}, with([](MuonOptions& o) { o.zero_rms_scale_mode = "x"; })),
                       "[Muon] zero_rms_scale_mode must be 'zero' or 'use_lr', got 'x'", Error);
  ParamPtr bias = make_param("ln.bias", Tensor::zeros({768}, DType::f32, Device::cpu()));
  CHECK_THROWS_WITH_AS(muon.add_param_group({bias}), "[Muon] 1-D parameter 'ln.bias' (shape [768]) cannot use Muon", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({make_param("x", Tensor())}),
                       "[Muon] parameter 'x' must be a defined contiguous tensor", Error);
  Tensor released = Tensor::zeros({4, 4}, DType::f32, Device::cpu());
  released.storage()->release();
  CHECK_THROWS_WITH_AS(muon.add_param_group({make_param("r", released)}),
                       "[Muon] parameter 'r' has no data (its storage is released)", Error);
  ParamPtr twice = make_param("twice", Tensor::zeros({4, 4}, DType::f32, Device::cpu()));
  CHECK_THROWS_WITH_AS(muon.add_param_group({twice, twice}), "[Muon] parameter 'twice' is listed twice in the group",
                       Error);
  muon.add_param_group({w});
  CHECK_THROWS_WITH_AS(muon.add_param_group({w}), "[Muon] parameter 'w' is in more than one group", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({make_param("w", Tensor::zeros({4, 4}, DType::f32, Device::cpu()))}),
                       "[Muon] two parameters are named 'w' (checkpoints name each param's state)", Error);
  CHECK_THROWS_WITH_AS(muon.add_param_group({make_param("", Tensor::zeros({4, 4}, DType::f32, Device::cpu()))}),
                       "[Muon] a parameter has no name (checkpoints name each param's state)", Error);
  MuonOptions custom;
  custom.ns_variant = "custom";
  custom.ns_steps = 2;
  custom.ns_coefficients = {{3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f}};
  CHECK_NOTHROW(custom.validate());
}

TEST_CASE("memory-safe batches follow the reference's greedy rule") {
  Muon muon(Stream(Device::cpu()));
  std::vector<ParamPtr> owned;
  std::vector<Param*> params;
  for (int64_t rows : {4, 4, 4, 20, 4}) {
    std::string name = "p";
    name += std::to_string(owned.size());
    owned.push_back(make_param(name, Tensor::zeros({rows, 4}, DType::f32, Device::cpu())));
    params.push_back(owned.back().get());
  }
  MuonOptions o;
  o.max_batch_elements = 40;  // two 16-element params fit, a third does not; the 80-element one is oversized
  muon.add_param_group(owned, o);
  auto sizes = [](const std::vector<std::vector<Param*>>& batches) {
    std::vector<size_t> out;
    for (const auto& b : batches) out.push_back(b.size());
    return out;
  };
  CHECK(sizes(muon.split_into_memory_safe_batches(0, params)) == std::vector<size_t>{2, 1, 1, 1});
  CHECK(sizes(muon.split_into_memory_safe_batches(0, params, 2)) == std::vector<size_t>{1, 1, 1, 1, 1});
  muon.mutable_options(0).min_batch_size = 3;
  CHECK(sizes(muon.split_into_memory_safe_batches(0, params)) == std::vector<size_t>{3, 2});
  CHECK(core_shape({5, 1, 9}) == CoreShape{5, 9, 1});
  CHECK(core_shape({3, 6, 10}) == CoreShape{6, 10, 3});
  CHECK(muon.group_by_shape(params).size() == 2);
}

TEST_CASE("core_shape and ns_workspace_bytes: empty shapes, negative dims and int64 overflow") {
  const int64_t big = int64_t(1) << 32;
  CHECK(core_shape({0, big, big}) == CoreShape{big, big, 0});  // no product of rows and cols needed
  CHECK(core_shape({3, 0, 5}) == CoreShape{0, 5, 0});
  CHECK(test::error_of([] { core_shape({2, -3}); }) == "[Muon] core shape of [2, -3]: a dim is negative");
  CHECK(test::error_of([&] {
          core_shape({big, big, 2});
        }) == "[shape] [4294967296, 4294967296, 2] has more elements than an int64 counts");
  // 2 B m n + 2 B k^2 + 4 bytes per matrix on the CPU: 2*4*6*10 + 2*4*36 + 4 = 772.
  CHECK(ns_workspace_bytes(CoreShape{6, 10, 3}, 4) == 3 * 772);
  CHECK(ns_workspace_bytes(CoreShape{6, 10, 0}, 4) == 0);
  CHECK(test::error_of([] {
          ns_workspace_bytes(CoreShape{int64_t(1) << 40, int64_t(1) << 40, 1}, 4);
        }) ==
        "[Muon] the Newton-Schulz workspace of 1 matrices of 1099511627776 x 1099511627776 has more bytes than an "
        "int64 counts");
  CHECK(test::error_of([] {
          ns_workspace_bytes(CoreShape{-5, 3, 2}, 4);
        }) == "[Muon] no Newton-Schulz workspace for 2 matrices of -5 x 3 with 4-byte elements");
}
