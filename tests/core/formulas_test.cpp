// The shared elementwise formulas (core/elementwise_formulas.h) on the CPU: NaN handling that the
// CUDA kernels must reproduce, and the CPU ops computing exactly these functions.
#include <limits>

#include "test_util.h"

using namespace swapopt;

namespace {

/** The bits element i of `t` holds. */
uint32_t stored_bits(const Tensor& t, size_t i) {
  if (t.dtype() == DType::f32) return formula::float_bits(static_cast<const float*>(t.data_ptr())[i]);
  return static_cast<const uint16_t*>(t.data_ptr())[i];
}

/** The bits `v` has once stored as `dtype`. */
uint32_t bits_in(float v, DType dtype) {
  uint32_t out = 0;
  store_from_float(&out, 0, dtype, v);
  return dtype == DType::f32 ? out : (out & 0xffffu);
}

}  // namespace

TEST_CASE("formulas: NaN propagates through max from either side, and payloads survive bf16 and f16") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(formula::propagating_max(nan, 1.f)));
  CHECK(std::isnan(formula::propagating_max(1.f, nan)));
  CHECK(formula::propagating_max(1.f, 2.f) == 2.f);
  CHECK(formula::propagating_max(3.f, 2.f) == 3.f);
  // A NaN keeps its sign and top payload bits and becomes quiet, on both backends alike.
  CHECK(formula::float_to_bf16(formula::bits_float(0x7fc12345u)) == 0x7fc1);
  CHECK(formula::float_to_bf16(formula::bits_float(0xff812345u)) == 0xffc1);  // signalling -> quiet
  CHECK(formula::float_to_f16(formula::bits_float(0x7fc12345u)) == 0x7e09);
  CHECK(formula::float_to_f16(-std::numeric_limits<float>::infinity()) == 0xfc00);
}

TEST_CASE("formulas: the CPU ops compute exactly the shared functions (every dtype, special values)") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = test::random_values(300, 1), y = test::random_values(300, 2);
  const float special[] = {nan, inf, -inf, 0.f, -0.f, 1e-40f, -1e-40f, 65504.f, 70000.f, 3.3895e38f};
  for (size_t i = 0; i < 10; ++i) x[i] = special[i], y[i * 3] = special[i];
  Stream s(Device::cpu());
  for (DType xd : {DType::f32, DType::bf16, DType::f16})
    for (DType yd : {DType::f32, DType::bf16, DType::f16}) {
      CAPTURE(dtype_name(xd));
      CAPTURE(dtype_name(yd));
      const Tensor xt = Tensor::from_floats(x, {300}, xd);
      Tensor axpby = Tensor::from_floats(y, {300}, yd), lerp = axpby.clone(), cast = Tensor::zeros({300}, yd, Device::cpu());
      Tensor zero_beta = Tensor::from_floats(std::vector<float>(300, nan), {300}, yd);
      ops::axpby(s, 0.75f, xt, -1.5f, axpby);
      ops::axpby(s, 0.75f, xt, 0.f, zero_beta);  // y not read: its NaNs do not propagate
      ops::lerp(s, lerp, xt, 0.3f);
      ops::cast(s, xt, cast);
      s.synchronize();
      size_t mismatches = 0;
      for (size_t i = 0; i < 300; ++i) {
        const float xi = load_as_float(xt.data_ptr(), i, xd), yi = test::round_to(y[i], yd);
        mismatches += stored_bits(axpby, i) != bits_in(formula::axpby(0.75f, xi, -1.5f, yi), yd);
        mismatches += stored_bits(zero_beta, i) != bits_in(formula::axpby(0.75f, xi, 0.f, 0.f), yd);
        mismatches += stored_bits(lerp, i) != bits_in(formula::lerp(yi, xi, 0.3f), yd);
        mismatches += stored_bits(cast, i) != bits_in(xi, yd);
      }
      CHECK(mismatches == 0);
    }
}

TEST_CASE("formulas: the fused updates compute exactly the shared functions, one list of many sizes") {
  // Sizes around the CPU's work piece (16384 elements) and the threshold for threads (65536 in
  // all), so that every piece boundary and the split over threads are crossed; dtypes, amsgrad
  // and scalars differ per tensor, and one list mixes them all.
  const int64_t sizes[] = {0, 1, 300, 16383, 16384, 16385, 70001};
  Stream s(Device::cpu());
  std::vector<ops::AdamWUpdate> updates;
  std::vector<std::vector<float>> p0, g0, m0, v0, vmax0;
  uint64_t seed = 10;
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (int64_t n : sizes)
    for (DType pd : dtypes)
      for (bool amsgrad : {false, true}) {
        const DType gd = dtypes[updates.size() % 3];
        const size_t count = size_t(n);
        p0.push_back(test::random_values(count, ++seed));
        g0.push_back(test::random_values(count, ++seed));
        m0.push_back(test::random_values(count, ++seed));
        v0.push_back(test::random_values(count, ++seed));
        vmax0.push_back(test::random_values(count, ++seed));
        for (float& v : v0.back()) v = v * v;
        for (float& v : vmax0.back()) v = v * v;
        ops::AdamWUpdate u;
        u.param = Tensor::from_floats(p0.back(), {n}, pd);
        u.grad = Tensor::from_floats(g0.back(), {n}, gd);
        u.exp_avg = Tensor::from_floats(m0.back(), {n}, DType::f32);
        u.exp_avg_sq = Tensor::from_floats(v0.back(), {n}, DType::f32);
        if (amsgrad) u.max_exp_avg_sq = Tensor::from_floats(vmax0.back(), {n}, DType::f32);
        u.scalars.decay = 1.f - 1e-3f * float(updates.size());
        u.scalars.neg_step_size = -1e-2f / float(1 + updates.size());
        u.scalars.bias_correction2_sqrt = 0.3f + 0.01f * float(updates.size());
        updates.push_back(u);
      }
  ops::adamw_update_many(s, updates);
  s.synchronize();
  size_t mismatches = 0, checked = 0;
  for (size_t t = 0; t < updates.size(); ++t) {
    const ops::AdamWUpdate& u = updates[t];
    const DType pd = u.param.dtype(), gd = u.grad.dtype();
    const float* m = u.exp_avg.data<float>();
    const float* v = u.exp_avg_sq.data<float>();
    const float* vmax = u.max_exp_avg_sq.defined() ? u.max_exp_avg_sq.data<float>() : nullptr;
    for (size_t i = 0; i < p0[t].size(); ++i) {
      float want_m = m0[t][i], want_v = v0[t][i], want_vmax = vmax0[t][i];
      const float want_p = formula::adamw(test::round_to(p0[t][i], pd), test::round_to(g0[t][i], gd), want_m, want_v,
                                          vmax ? &want_vmax : nullptr, u.scalars);
      mismatches += stored_bits(u.param, i) != bits_in(want_p, pd);
      mismatches += formula::float_bits(m[i]) != formula::float_bits(want_m);
      mismatches += formula::float_bits(v[i]) != formula::float_bits(want_v);
      if (vmax) mismatches += formula::float_bits(vmax[i]) != formula::float_bits(want_vmax);
      ++checked;
    }
  }
  CHECK(checked == 3 * 2 * size_t(1 + 300 + 16383 + 16384 + 16385 + 70001));
  CHECK(mismatches == 0);

  // The other loops split over threads past 65536 elements: momentum, lerp, cast, scaling.
  const int64_t n = 70001;
  const std::vector<float> g = test::random_values(size_t(n), 1), b = test::random_values(size_t(n), 2);
  const Tensor grad = Tensor::from_floats(g, {n}, DType::f32), buf = Tensor::from_floats(b, {n}, DType::f32);
  const Tensor update = Tensor::zeros({n}, DType::f32, Device::cpu());
  ops::muon_momentum(s, grad, buf, update, 0.95f, 0.9f, true);
  const Tensor lerp = Tensor::from_floats(b, {n}, DType::bf16), cast = Tensor::zeros({n}, DType::bf16, Device::cpu());
  ops::lerp(s, lerp, grad, 0.3f);
  ops::cast(s, grad, cast);
  const Tensor scaled = Tensor::from_floats(g, {n}, DType::f32), norm = Tensor::from_floats({3.f}, {1}, DType::f32);
  ops::scale_by_inverse_norm(s, scaled, norm, 1e-7f);
  s.synchronize();
  mismatches = 0;
  for (size_t i = 0; i < size_t(n); ++i) {
    const formula::MomentumOut out = formula::muon_momentum(g[i], b[i], 0.95f, 0.9f, true);
    mismatches += stored_bits(buf, i) != formula::float_bits(out.buf);
    mismatches += stored_bits(update, i) != formula::float_bits(out.update);
    mismatches += stored_bits(lerp, i) != bits_in(formula::lerp(test::round_to(b[i], DType::bf16), g[i], 0.3f), DType::bf16);
    mismatches += stored_bits(cast, i) != bits_in(g[i], DType::bf16);
    mismatches += stored_bits(scaled, i) != formula::float_bits(formula::scale_by_inverse_norm(g[i], 3.f, 1e-7f));
  }
  CHECK(mismatches == 0);
}
