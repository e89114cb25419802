#pragma once
// The optimizer the checkpoint fuzzer loads into, and the valid files that seed it.

#include <memory>
#include <vector>

#include "swapopt/swapopt.h"

namespace swapopt::fuzz {

/** A Muon + AdamW pair on a tiny model, stepped twice so that every state key exists. */
struct CheckpointFixture {
  std::vector<ParamPtr> params;
  std::unique_ptr<MuonWithAdamW> optimizer;

  CheckpointFixture() {
    params = {make_param("w", Tensor::from_floats(std::vector<float>(12, 0.5f), {3, 4})),
              make_param("experts", Tensor::from_floats(std::vector<float>(16, -0.25f), {2, 2, 4})),
              make_param("norm.weight", Tensor::from_floats(std::vector<float>(4, 1.f), {4}))};
    AdamWOptions adamw;
    adamw.amsgrad = true;
    optimizer = std::make_unique<MuonWithAdamW>(Stream(Device::cpu()), params, MuonOptions{}, adamw);
    for (int step = 0; step < 2; ++step) {
      for (const ParamPtr& p : params) {
        std::vector<float> g(size_t(p->data.numel()));
        for (size_t i = 0; i < g.size(); ++i) g[i] = float(i % 5) * 0.1f - 0.2f + float(step);
        p->grad = Tensor::from_floats(g, p->data.shape());
      }
      optimizer->step();
    }
    optimizer->muon().stream().synchronize();
  }
};

}  // namespace swapopt::fuzz
