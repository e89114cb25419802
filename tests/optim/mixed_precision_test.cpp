// Mixed precision: bf16 and f16 grads on f32 params, in Muon and AdamW, bare and swapped, give the
// bits of passing the same grads converted to f32 (the fused updates read them exactly).
#include "test_util.h"

using namespace swapopt;

namespace {

/** Three steps with grads of `dtype`, or (`as_f32`) the same values converted to f32. */
std::vector<ParamPtr> train(DType dtype, bool as_f32, bool swapped) {
  auto params = test::muon_adamw_model();
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  SwapConfig config;
  config.min_numel = 1;
  std::unique_ptr<SwapOptimizerSet> set = swapped ? swap_muon_with_adamw(opt, config) : nullptr;
  for (uint32_t step = 1; step <= 3; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor low = test::random_tensor(params[i]->data.shape(), dtype, 100 * step + uint32_t(i));
      params[i]->grad = as_f32 ? Tensor::from_floats(low.to_float_vector(), low.shape()) : low;
    }
    if (set) {
      set->step();
    } else {
      opt.step();
    }
  }
  if (set) set->synchronize();
  opt.synchronize();
  return params;
}

}  // namespace

TEST_CASE("bf16 and f16 grads on f32 params: bitwise the converted f32 grads, Muon and AdamW, bare and swapped") {
  for (DType dtype : {DType::bf16, DType::f16})
    for (bool swapped : {false, true}) {
      CAPTURE(dtype_name(dtype));
      CAPTURE(swapped);
      const auto low = train(dtype, false, swapped), converted = train(dtype, true, swapped);
      for (size_t i = 0; i < low.size(); ++i) {
        CAPTURE(low[i]->name);
        CHECK(test::same_bits(low[i]->data, converted[i]->data));
      }
    }
}
