#pragma once
// A model of mixed parameters, run bare and swapped with the same gradients, for bitwise checks.

#include <functional>

#include "test_util.h"

namespace swapopt::test {

/** Large (swapped) and tiny (device-resident) matrices, a batch of experts, two equal shapes. */
inline std::vector<ParamPtr> swap_model(uint32_t seed) {
  return {make_param("attn.q", random_tensor({64, 48}, DType::f32, seed)),
          make_param("attn.o", random_tensor({48, 64}, DType::f32, seed + 1)),
          make_param("experts", random_tensor({3, 32, 40}, DType::f32, seed + 2)),
          make_param("mlp.up", random_tensor({32, 40}, DType::f32, seed + 3)),
          make_param("gate", random_tensor({4, 8}, DType::f32, seed + 4)),
          make_param("mlp.down", random_tensor({40, 32}, DType::f32, seed + 5)),
          make_param("proj", random_tensor({96, 40}, DType::f32, seed + 6))};
}

/** Gradients for `step`; some params get none on some steps. */
inline void set_swap_grads(const std::vector<ParamPtr>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    const bool skip = (i == 1 && step == 2) || (i == 5 && step % 2 == 1) || (i == 3 && step == 4);
    params[i]->grad = skip ? Tensor() : random_tensor(params[i]->data.shape(), DType::f32, 5000 + 31 * uint32_t(step) + uint32_t(i));
  }
}

inline bool params_bitwise_equal(const std::vector<ParamPtr>& a, const std::vector<ParamPtr>& b) {
  bool same = true;
  for (size_t i = 0; i < a.size(); ++i) same = same && same_bits(a[i]->data, b[i]->data);
  return same;
}

}  // namespace swapopt::test
