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
