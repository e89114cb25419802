// The step contract: step() is asynchronous on the optimizer's stream, and a trainer working on
// its own stream orders itself after the step with grads_read() and params_updated(), no host
// sync. A gate holds the optimizer's stream until well after step() returned, so an event that
// completed too early would let the trainer's writes and reads overtake the step: caught here.
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "test_util.h"

using namespace swapopt;

namespace {

enum class Kind { muon, adamw, swapped_muon, swapped_adamw, muon_with_adamw };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::muon: return "Muon";
    case Kind::adamw: return "AdamW";
    case Kind::swapped_muon: return "swapped Muon";
    case Kind::swapped_adamw: return "swapped AdamW";
    case Kind::muon_with_adamw: return "MuonWithAdamW";
  }
  return "?";
}

struct Run {
  std::vector<Tensor> params;    // after the last step, read by the host after synchronising
  std::vector<Tensor> snapshot;  // copied on the trainer's stream after waiting for params_updated()
};

/** Three steps. Each step's grads are written into the same buffers on the trainer's stream, which
 *  the optimizer's stream waits for; after step() the trainer overwrites them with NaN as soon as
 *  grads_read() allows. With `gated`, the optimizer's stream is held for 30 ms after step(). */
Run train(Kind kind, bool gated) {
  const Device cpu = Device::cpu();
  Stream opt_stream(cpu), trainer(cpu);
  std::vector<ParamPtr> params = {make_param("blocks.0.w", test::random_tensor({24, 16}, DType::f32, 1)),
                                  make_param("blocks.1.w", test::random_tensor({16, 16}, DType::f32, 2))};
  if (kind == Kind::adamw || kind == Kind::swapped_adamw || kind == Kind::muon_with_adamw)
    params.push_back(make_param("norm.weight", test::random_tensor({16}, DType::f32, 3)));
  for (const ParamPtr& p : params) p->grad = Tensor::zeros(p->data.shape(), DType::f32, cpu);

  std::unique_ptr<Muon> muon;
  std::unique_ptr<AdamW> adamw;
  std::unique_ptr<MuonWithAdamW> both;
  std::unique_ptr<SwapOptimizer> swapped;
  SwapConfig config;
  config.min_numel = 1;
  config.swap_times = 2;
  std::function<void()> step;
  std::function<const Event&()> grads_read, params_updated;
  if (kind == Kind::muon_with_adamw) {
    both = std::make_unique<MuonWithAdamW>(opt_stream, params);
    step = [&] { both->step(); };
    grads_read = [&]() -> const Event& { return both->grads_read(); };
    params_updated = [&]() -> const Event& { return both->params_updated(); };
  } else {
    Optimizer* opt = nullptr;
    if (kind == Kind::muon || kind == Kind::swapped_muon) {
      muon = std::make_unique<Muon>(opt_stream);
      muon->add_param_group(params);
      opt = muon.get();
      if (kind == Kind::swapped_muon) swapped = swap_muon(*muon, config);
    } else {
      adamw = std::make_unique<AdamW>(opt_stream);
      adamw->add_param_group(params);
      opt = adamw.get();
      if (kind == Kind::swapped_adamw) swapped = swap_adamw(*adamw, config);
    }
    if (swapped) {
      step = [&] { swapped->step(); };
      grads_read = [&]() -> const Event& { return swapped->grads_read(); };
      params_updated = [&]() -> const Event& { return swapped->params_updated(); };
    } else {
      step = [opt] { opt->step(); };
      grads_read = [opt]() -> const Event& { return opt->grads_read(); };
      params_updated = [opt]() -> const Event& { return opt->params_updated(); };
    }
  }

  Run out;
  for (uint32_t s = 1; s <= 3; ++s) {
    for (size_t i = 0; i < params.size(); ++i) {  // the backward writes this step's grads
      Tensor grad = params[i]->grad;
      std::vector<float> values = test::random_values(size_t(grad.numel()), 100 * s + uint32_t(i));
      trainer.enqueue([grad, values] { std::memcpy(grad.data_ptr(), values.data(), values.size() * sizeof(float)); });
    }
    Event backward_done(cpu);
    backward_done.record(trainer);
    opt_stream.wait(backward_done);

    Stream gate(cpu);
    std::promise<void> open;
    std::thread opener;
    if (gated) {
      std::shared_future<void> opened = open.get_future().share();
      gate.enqueue([opened] { opened.wait(); });
      Event gate_open(cpu);
      gate_open.record(gate);
      opt_stream.wait(gate_open);
      opener = std::thread([&open] {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        open.set_value();
      });
    }
    step();
    trainer.wait(grads_read());  // then the next backward may write the grad buffers
    for (const ParamPtr& p : params) {
      Tensor grad = p->grad;
      trainer.enqueue([grad] {
        float* g = grad.data<float>();
        for (int64_t k = 0; k < grad.numel(); ++k) g[k] = std::nanf("");
      });
    }
    if (s == 3) {  // the next forward reads the params
      trainer.wait(params_updated());
      for (const ParamPtr& p : params) {
        Tensor copy = Tensor::empty(p->data.shape(), p->data.dtype(), cpu);
        out.snapshot.push_back(copy);
        Tensor data = p->data;
        trainer.enqueue([data, copy] { std::memcpy(copy.data_ptr(), data.data_ptr(), data.nbytes()); });
      }
    }
    if (opener.joinable()) opener.join();
  }
  trainer.synchronize();
  opt_stream.synchronize();
  if (swapped) swapped->synchronize();
  for (const ParamPtr& p : params) out.params.push_back(p->data.clone());
  return out;
}

}  // namespace

TEST_CASE("step contract: grads may be overwritten once grads_read() completes, params read once params_updated() does") {
  for (Kind kind : {Kind::muon, Kind::adamw, Kind::swapped_muon, Kind::swapped_adamw, Kind::muon_with_adamw}) {
    const std::string name = kind_name(kind);
    CAPTURE(name);
    const Run free_running = train(kind, false), gated = train(kind, true);
    REQUIRE(gated.params.size() == free_running.params.size());
    for (size_t i = 0; i < gated.params.size(); ++i) {
      CAPTURE(i);
      CHECK(test::same_bits(gated.params[i], free_running.params[i]));
      CHECK(test::same_bits(gated.snapshot[i], gated.params[i]));
      bool finite = true;
      for (float x : gated.params[i].to_float_vector()) finite = finite && std::isfinite(x);
      CHECK(finite);  // no NaN grad reached a step
    }
  }
}

TEST_CASE("step() returns before its work runs (asynchronous), and synchronize() waits for it") {
  const Device cpu = Device::cpu();
  Stream s(cpu);
  auto params = std::vector<ParamPtr>{make_param("w", test::random_tensor({16, 8}, DType::f32, 5))};
  params[0]->grad = test::random_tensor({16, 8}, DType::f32, 6);
  AdamW adamw(s);
  adamw.add_param_group(params);
  const Tensor before = params[0]->data.clone();
  std::promise<void> open;
  std::shared_future<void> opened = open.get_future().share();
  s.enqueue([opened] { opened.wait(); });  // holds the optimizer's stream
  adamw.step();
  CHECK_FALSE(adamw.params_updated().query());
  CHECK(test::same_bits(params[0]->data, before));  // not yet updated
  open.set_value();
  adamw.synchronize();
  CHECK(adamw.grads_read().query());
  CHECK(adamw.params_updated().query());
  CHECK_FALSE(test::same_bits(params[0]->data, before));
}
