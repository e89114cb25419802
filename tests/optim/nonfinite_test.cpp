// Non-finite grads: flag_nonfinite finds every NaN and infinity in every dtype; with
// set_skip_nonfinite the whole step is skipped exactly (nothing changes, counters included), in
// bare, swapped and combined optimizers, and every HSDP rank agrees.
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include "optim/thread_communicator.h"
#include "test_util.h"

using namespace swapopt;

namespace {

void set_grads(const std::vector<ParamPtr>& params, uint32_t step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 100 * step + uint32_t(i));
}

float bad_value(int which) {
  if (which == 0) return std::nanf("");
  return which == 1 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
}

/** Stepping one of the kinds of optimizer over the model, with skip_nonfinite on. */
struct Subject {
  std::vector<ParamPtr> params = test::muon_adamw_model();
  std::unique_ptr<MuonWithAdamW> opt = std::make_unique<MuonWithAdamW>(Stream(Device::cpu()), params);
  std::unique_ptr<SwapOptimizerSet> set;
  explicit Subject(bool swapped) {
    opt->set_skip_nonfinite(true);  // both halves'
    SwapConfig config;
    config.min_numel = 1;
    if (swapped) set = swap_muon_with_adamw(*opt, config);
  }
  void step() { set ? set->step() : opt->step(); }
  std::string snapshot() {
    if (set) set->synchronize();
    opt->synchronize();
    std::string out;
    for (const ParamPtr& p : params) out += std::string(static_cast<const char*>(p->data.data_ptr()), p->data.nbytes());
    if (set) return out + serialize_state_dict(set->state_dict());
    return out + serialize_state_dict(opt->muon().state_dict()) + serialize_state_dict(opt->adamw().state_dict());
  }
};

}  // namespace

TEST_CASE("flag_nonfinite finds NaN, +inf and -inf at any position in f32, bf16 and f16, and nothing else") {
  Stream s(Device::cpu());
  std::mt19937 gen(7);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16})
    for (int64_t n : {1, 7, 1000, 4099}) {
      CAPTURE(dtype_name(dtype));
      CAPTURE(n);
      std::vector<float> values = test::random_values(size_t(n), uint32_t(n));
      values[0] = dtype == DType::f16 ? 65504.f : 3e38f;  // the largest finite values stay finite
      const Tensor flag = Tensor::zeros({1}, DType::f32, Device::cpu());
      ops::flag_nonfinite(s, Tensor::from_floats(values, {n}, dtype), flag);
      s.synchronize();
      CHECK(flag.to_float_vector()[0] == 0.f);
      for (int which = 0; which < 3; ++which) {
        std::vector<float> bad = values;
        bad[std::uniform_int_distribution<size_t>(0, bad.size() - 1)(gen)] = bad_value(which);
        ops::fill_zero(s, flag);
        ops::flag_nonfinite(s, Tensor::from_floats(bad, {n}, dtype), flag);
        ops::flag_nonfinite(s, Tensor::from_floats(values, {n}, dtype), flag);  // a finite one after does not clear it
        s.synchronize();
        CHECK(flag.to_float_vector()[0] == 1.f);
      }
    }
}

TEST_CASE("skip_nonfinite: a NaN or inf in any grad skips the whole step exactly; the run goes on as if it never came") {
  for (bool swapped : {false, true})
    for (size_t bad_param : {0, 1}) {  // AdamW's embedding, Muon's matrix
      CAPTURE(swapped);
      CAPTURE(bad_param);
      Subject s(swapped), reference(swapped);
      set_grads(s.params, 1);
      set_grads(reference.params, 1);
      s.step();
      reference.step();
      const std::string before = s.snapshot();
      set_grads(s.params, 2);
      std::vector<float> g = s.params[bad_param]->grad.to_float_vector();
      g[g.size() / 2] = bad_value(int(bad_param));
      s.params[bad_param]->grad = Tensor::from_floats(g, s.params[bad_param]->data.shape());
      s.step();
      CHECK(s.opt->last_step_skipped());
      CHECK(s.opt->muon().last_step_skipped());
      CHECK(s.opt->adamw().last_step_skipped());
      CHECK(s.snapshot() == before);
      if (swapped) CHECK(s.set->member("muon").last_report().skipped_nonfinite);  // snapshot() synchronised
      set_grads(s.params, 3);
      set_grads(reference.params, 3);
      s.step();
      reference.step();
      CHECK_FALSE(s.opt->last_step_skipped());
      CHECK_FALSE(s.opt->adamw().last_step_skipped());
      if (swapped) {
        s.set->synchronize();
        CHECK_FALSE(s.set->member("adamw").last_report().skipped_nonfinite);
      }
      CHECK(s.snapshot() == reference.snapshot());
    }
}

TEST_CASE("without skip_nonfinite a NaN grad is not looked for (the default, as torch)") {
  auto params = test::muon_adamw_model();
  AdamW adamw(Stream(Device::cpu()));
  adamw.add_param_group(params);
  set_grads(params, 1);
  std::vector<float> g = params[0]->grad.to_float_vector();
  g[3] = std::nanf("");
  params[0]->grad = Tensor::from_floats(g, params[0]->data.shape());
  CHECK(adamw.grads_nonfinite());
  adamw.step();
  adamw.synchronize();
  CHECK_FALSE(adamw.last_step_skipped());
  CHECK(std::isnan(params[0]->data.to_float_vector()[3]));
}

TEST_CASE("skip_nonfinite under HSDP: a NaN on one rank skips the step on every rank") {
  const int n = 4;
  auto world = std::make_shared<test::ThreadWorld>();
  std::vector<int> skipped(n, -1);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < n; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", rank, n);
        auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 2}, std::vector<std::string>{"replicate", "shard"}, rank);
        const Tensor full = test::random_tensor({16, 12}, DType::f32, 5);
        Shape offset;
        const std::vector<Placement> placements = {Placement::Replicate(), Placement::Shard(0)};
        const Shape local = DTensor::local_shape_at({16, 12}, *mesh, placements, mesh->coordinate(), &offset);
        ParamPtr p = make_param("w", full.block(offset, local).to(Device::cpu()));
        p->layout = DTensor(p->data, {16, 12}, mesh, placements);
        Muon muon(Stream(Device::cpu()));
        muon.add_param_group({p});
        HsdpOptions hsdp;
        hsdp.name = "nonfinite";  // thread ranks share the process's counter of unnamed instances
        muon.enable_hsdp(comm, hsdp);
        muon.set_skip_nonfinite(true);
        const Tensor before = p->data.clone();
        std::vector<float> g = test::random_values(size_t(shape_numel(local)), 9);
        if (rank == 3) g[1] = std::nanf("");
        p->grad = Tensor::from_floats(g, local);
        muon.step();
        muon.synchronize();
        skipped[size_t(rank)] = muon.last_step_skipped() && test::same_bits(p->data, before) && muon.param_groups()[0].step == 0;
      } catch (const std::exception& e) {
        errors[size_t(rank)] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  for (int rank = 0; rank < n; ++rank) {
    CAPTURE(rank);
    CHECK(errors[size_t(rank)] == "");
    CHECK(skipped[size_t(rank)] == 1);
  }
}
