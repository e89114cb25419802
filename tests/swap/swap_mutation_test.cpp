// Swap cases that plausible one-line bugs slipped through: the min_numel boundary, early prefetch
// whose arenas are too small for the real plan, loading a checkpoint that lacks some state (bare
// and swapped, with and without a pending prefetch), and per-param steps across a swapped resume.
#include "swap/swap_fixture.h"

using namespace swapopt;

namespace {

ParamPtr matrix(const std::string& name, int64_t rows, int64_t cols, uint32_t seed) {
  return make_param(name, test::random_tensor({rows, cols}, DType::f32, seed));
}

/** Three matrices of two core shapes (Muon: two NS units), the same values for the same seed. */
std::vector<ParamPtr> model(uint32_t seed) {
  return {matrix("a", 32, 40, seed), matrix("b", 24, 40, seed + 1), matrix("c", 40, 24, seed + 2)};
}

/** New params with the names and (current) values of `params`: a second trainer's copy. */
std::vector<ParamPtr> copies(const std::vector<ParamPtr>& params) {
  std::vector<ParamPtr> out;
  for (const ParamPtr& p : params) out.push_back(make_param(p->name, p->data.clone()));
  return out;
}

/** The grads of step `step` (the same values for every list of the same shapes); param `skip`
 *  gets none. */
void set_grads(const std::vector<ParamPtr>& params, int step, int skip = -1) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->grad = int(i) == skip ? Tensor()
                                     : test::random_tensor(params[i]->data.shape(), DType::f32, 700 + 13 * uint32_t(step) + uint32_t(i));
}

/** A Muon or AdamW with default options over `params`, on the CPU. */
template <typename Opt>
std::unique_ptr<Opt> make_optimizer(const std::vector<ParamPtr>& params) {
  auto opt = std::make_unique<Opt>(Stream(Device::cpu()));
  opt->add_param_group(params);
  return opt;
}

/** `got` (params, and the state dict of their optimizer, taken first: that synchronises it) equals
 *  `want` bitwise. */
void check_bitwise(Optimizer& want, const std::vector<ParamPtr>& want_params, const StateDict& got_state,
                   const std::vector<ParamPtr>& got_params) {
  const StateDict want_state = want.state_dict();  // synchronises
  CHECK(test::params_bitwise_equal(want_params, got_params));
  CHECK(serialize_state_dict(want_state) == serialize_state_dict(got_state));
}

std::unique_ptr<SwapOptimizer> wrap(Muon& muon, const SwapConfig& config) { return swap_muon(muon, config); }
std::unique_ptr<SwapOptimizer> wrap(AdamW& adamw, const SwapConfig& config) { return swap_adamw(adamw, config); }

/** How the optimizer that holds state before the load runs. */
enum class Holder { bare, packed, unpacked };

/** A checkpoint from a fresh optimizer stepped once (without param `skip`'s grad, so that param has
 *  no state and step 0) is loaded into an optimizer that already holds state for every param
 *  (after `prefetch`, a pending prefetch_early); the next two steps, its params and its state dict
 *  must equal bitwise those of a fresh bare optimizer that loaded the same checkpoint. */
template <typename Opt>
void check_load_replaces_all_state(Holder holder, int skip, bool prefetch) {
  const std::string holder_name = holder == Holder::bare ? "bare" : holder == Holder::packed ? "packed" : "unpacked";
  CAPTURE(holder_name);
  auto source_params = model(1);
  auto source = make_optimizer<Opt>(source_params);
  set_grads(source_params, 1, skip);
  source->step();
  const StateDict checkpoint = source->state_dict();

  auto params = model(2);
  auto inner = make_optimizer<Opt>(params);
  SwapConfig config;
  config.swap_times = 2;
  config.packed = holder == Holder::packed;
  config.min_numel = 1;
  std::unique_ptr<SwapOptimizer> swapped = holder == Holder::bare ? nullptr : wrap(*inner, config);
  for (int step = 1; step <= 2; ++step) {
    set_grads(params, 10 + step);
    swapped ? swapped->step() : inner->step();
  }
  if (prefetch) swapped->prefetch_early();  // stages the state about to be replaced
  swapped ? swapped->load_state_dict(checkpoint) : inner->load_state_dict(checkpoint);
  if (skip >= 0) CHECK(inner->state().count(params[size_t(skip)].get()) == 0);

  auto fresh_params = copies(params);
  auto fresh = make_optimizer<Opt>(fresh_params);
  fresh->load_state_dict(checkpoint);
  for (int step = 3; step <= 4; ++step) {
    CAPTURE(step);
    set_grads(params, 10 + step);
    set_grads(fresh_params, 10 + step);
    swapped ? swapped->step() : inner->step();
    fresh->step();
    check_bitwise(*fresh, fresh_params, swapped ? swapped->state_dict() : inner->state_dict(), params);
  }
}

}  // namespace

TEST_SUITE("swap") {
  TEST_CASE("min_numel: a state of exactly min_numel elements is swapped, one element fewer stays device state") {
    std::vector<ParamPtr> params = {matrix("at", 8, 8, 1), matrix("below", 7, 9, 2), matrix("above", 5, 13, 3)};
    Muon muon(Stream(Device::cpu()));
    muon.add_param_group(params);
    SwapConfig config;
    config.min_numel = 64;
    auto swapped = swap_muon(muon, config);
    const PipelineSwapRuntime& runtime = swapped->runtime();
    CHECK(runtime.slots().size() == 2);
    CHECK(runtime.find_slot(params[0].get(), "momentum_buffer") != nullptr);  // 64 elements
    CHECK(runtime.find_slot(params[1].get(), "momentum_buffer") == nullptr);  // 63
    CHECK(runtime.find_slot(params[2].get(), "momentum_buffer") != nullptr);  // 65
  }

  TEST_CASE("packed prefetch_early is not adopted when the real plan needs larger arenas (a grad missing shifts a batch's arena)") {
    // AdamW, one unit per param: a, b, c, d of 1024 elements (8 KiB of moments), e of 4096 (32 KiB);
    // swap_times 5. prefetch_early plans [a] [b] [c] [d] [e] in arenas 0 1 2 0 1: arena 0 holds a
    // or d (8 KiB). Without d's grad the step runs [a] [b] [c] [e]: its first three batches are the
    // early ones, but e now runs in arena 0, which is 24 KiB too small; the step must start afresh.
    auto make = [] {
      return std::vector<ParamPtr>{matrix("a", 32, 32, 1), matrix("b", 32, 32, 2), matrix("c", 32, 32, 3),
                                   matrix("d", 32, 32, 5), matrix("e", 64, 64, 4)};
    };
    auto bare_params = make(), swap_params = make();
    auto bare = make_optimizer<AdamW>(bare_params), inner = make_optimizer<AdamW>(swap_params);
    SwapConfig config;
    config.swap_times = 5;
    auto swapped = swap_adamw(*inner, config);
    for (int step = 1; step <= 3; ++step) {
      CAPTURE(step);
      const int skip = step == 2 ? 3 : -1;  // d has no grad at step 2
      if (step > 1) swapped->prefetch_early();
      set_grads(bare_params, step, skip);
      set_grads(swap_params, step, skip);
      bare->step();
      swapped->step();
      swapped->synchronize();
      const SwapStepReport report = swapped->last_report();
      CHECK(report.batches == (step == 2 ? 4 : 5));
      if (step > 1) CHECK(report.early_prefetch_used == (step == 3));
      check_bitwise(*bare, bare_params, swapped->state_dict(), swap_params);
    }
  }

  TEST_CASE("loading a checkpoint that lacks a param's state drops the state held for it (bare and swapped; Muon, AdamW)") {
    for (Holder holder : {Holder::bare, Holder::packed, Holder::unpacked}) {
      check_load_replaces_all_state<Muon>(holder, 1, false);
      check_load_replaces_all_state<AdamW>(holder, 1, false);
    }
  }

  TEST_CASE("load_state_dict after prefetch_early: the early copies of the replaced state are not used") {
    for (Holder holder : {Holder::packed, Holder::unpacked}) {
      check_load_replaces_all_state<Muon>(holder, -1, true);
      check_load_replaces_all_state<AdamW>(holder, -1, true);
    }
  }

  TEST_CASE("swapped resume restores per-param steps: AdamW params that missed grads continue bitwise") {
    // Uninterrupted bare run of 4 steps; a swapped run saved after 3 and resumed in a fresh swapped
    // wrapper. a misses step 2, b has a grad at step 2 only: after step 3 the per-param steps are
    // 2, 1, 3 and the group step is 3.
    auto grads_at = [](const std::vector<ParamPtr>& params, int step) {
      set_grads(params, step);
      if (step == 2) params[0]->grad = Tensor();
      if (step != 2) params[1]->grad = Tensor();
    };
    SwapConfig config;
    config.swap_times = 2;
    config.min_numel = 1;
    auto straight_params = model(5), params = model(5);
    auto straight = make_optimizer<AdamW>(straight_params), first = make_optimizer<AdamW>(params);
    auto first_swapped = swap_adamw(*first, config);
    for (int step = 1; step <= 3; ++step) {
      grads_at(straight_params, step);
      grads_at(params, step);
      straight->step();
      first_swapped->step();
    }
    const StateDict saved = first_swapped->state_dict();
    CHECK(saved.metadata.find("\"param_steps\":[2,1,3]") != std::string::npos);

    auto resumed_params = copies(params);
    auto resumed = make_optimizer<AdamW>(resumed_params);
    auto resumed_swapped = swap_adamw(*resumed, config);
    resumed_swapped->load_state_dict(saved);
    CHECK(resumed->state().at(resumed_params[0].get()).step == 2);
    CHECK(resumed->state().at(resumed_params[1].get()).step == 1);
    CHECK(resumed->state().at(resumed_params[2].get()).step == 3);
    set_grads(straight_params, 4);
    set_grads(resumed_params, 4);
    straight->step();
    resumed_swapped->step();
    check_bitwise(*straight, straight_params, resumed_swapped->state_dict(), resumed_params);
  }
}
