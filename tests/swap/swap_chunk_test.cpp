// Chunked units: a unit whose state does not fit the device budget streams through the staging
// arenas in chunks, with the same bits as the bare step and the budget held.
#include "swap/swap_fixture.h"

using namespace swapopt;

namespace {

/** Large params: two Muon units of one matrix, a batch of experts (3-D), a bf16 matrix, and a
 *  small one that stays device-resident (min_numel). */
std::vector<ParamPtr> big_model(uint32_t seed) {
  return {make_param("embed", test::random_tensor({96, 80}, DType::f32, seed)),
          make_param("experts", test::random_tensor({4, 40, 48}, DType::f32, seed + 1)),
          make_param("proj", test::random_tensor({80, 96}, DType::bf16, seed + 2)),
          make_param("head", test::random_tensor({64, 72}, DType::f32, seed + 3)),
          make_param("gate", test::random_tensor({8, 16}, DType::f32, seed + 4))};
}

/** Grads for `step`; param i has none on some steps. */
void set_grads(const std::vector<ParamPtr>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    const bool skip = (i == 1 && step == 2) || (i == 3 && step % 3 == 0);
    params[i]->grad = skip ? Tensor() : test::random_tensor(params[i]->data.shape(), DType::f32, 900 + 17 * uint32_t(step) + uint32_t(i));
  }
}

std::unique_ptr<Optimizer> make_muon(const std::vector<ParamPtr>& params) {
  auto muon = std::make_unique<Muon>(Stream(Device::cpu()));
  muon->add_param_group({params[0], params[1], params[2]});
  MuonOptions second;
  second.nesterov = false;
  second.momentum2 = 0.8;
  muon->add_param_group({params[3], params[4]}, second);
  return muon;
}

std::unique_ptr<Optimizer> make_adamw(const std::vector<ParamPtr>& params) {
  auto adamw = std::make_unique<AdamW>(Stream(Device::cpu()));
  adamw->add_param_group({params[0], params[1], params[2]});
  AdamWOptions amsgrad;
  amsgrad.amsgrad = true;
  amsgrad.weight_decay = 0.05;
  adamw->add_param_group({params[3], params[4]}, amsgrad);
  return adamw;
}

std::unique_ptr<SwapOptimizer> wrap(Optimizer& optimizer, const SwapConfig& config) {
  if (auto* muon = dynamic_cast<Muon*>(&optimizer)) return swap_muon(*muon, config);
  return swap_adamw(dynamic_cast<AdamW&>(optimizer), config);
}

/** The largest unit's state bytes and the largest workspace of the first step's plan. */
std::pair<size_t, size_t> largest_unit(SwapOptimizer& swapped) {
  std::vector<UpdateUnit> units = swapped.adapter().plan_units(true);
  swapped.runtime().attach_slots(units, swapped.optimizer(), true);
  size_t state = 0, workspace = 0;
  for (const UpdateUnit& u : units) {
    size_t bytes = 0;
    for (const SwapSlot* s : u.slots) bytes += s->nbytes();
    state = std::max(state, bytes);
    workspace = std::max(workspace, size_t(u.workspace_bytes));
  }
  return {state, workspace};
}

/** Steps bare and swapped copies `steps` times under `budget` (below every unit's state when
 *  `divisor` is 10) and checks params and state bitwise and the budget after every step. */
void check_chunked(std::unique_ptr<Optimizer> (*make)(const std::vector<ParamPtr>&), SwapConfig config, size_t divisor,
                   bool prefetch, int steps = 5) {
  auto bare_params = big_model(3), swap_params = big_model(3);
  auto bare = make(bare_params);
  auto inner = make(swap_params);
  // The budget: the largest unit's state / divisor beside the largest workspace.
  const auto [state, workspace] = largest_unit(*wrap(*make(big_model(3)), config));
  config.device_budget_bytes = workspace + state / divisor;
  auto swapped = wrap(*inner, config);
  for (int step = 1; step <= steps; ++step) {
    CAPTURE(step);
    if (prefetch && step > 1) swapped->prefetch_early();
    set_grads(bare_params, step);
    set_grads(swap_params, step);
    bare->step();
    bare->stream().synchronize();
    const size_t before = memory_stats(Device::cpu()).current_bytes;
    reset_peak_memory(Device::cpu());
    swapped->step();
    swapped->synchronize();
    const SwapStepReport report = swapped->last_report();
    // Resident state and a unit's workspace are never both at their step maxima at once (a unit
    // of a smaller workspace may run beside more state), so the report bounds each by the budget.
    CHECK(report.peak_resident_bytes <= *config.device_budget_bytes);
    if (divisor >= 10) CHECK(report.chunked_units > 0);  // a tenth of a unit: the largest are chunked
    // The allocator's peak: AdamW allocates nothing else once its state exists (unswapped keys
    // are created at the first step). Muon's NS workspaces are counted until the CPU stream has
    // run the ops holding them, however far the host has run ahead, so its peak says nothing here.
    if (workspace == 0 && step > 1) CHECK(memory_stats(Device::cpu()).peak_bytes - before <= *config.device_budget_bytes);
    CHECK(test::params_bitwise_equal(bare_params, swap_params));
    CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
    for (const auto& slot : swapped->runtime().slots()) CHECK(slot->state == SlotState::host);
  }
}

/** AdamW's adapter whose chunk step throws at the `fail_at`-th chunk of the step it is armed for. */
class FailingChunks : public AdamWSwapAdapter {
 public:
  FailingChunks(AdamW& adamw, int* fail_at) : AdamWSwapAdapter(adamw), adamw_(adamw), fail_at_(fail_at) {}
  void step_chunked(UpdateUnit& unit, const StateStream& stream_state) override {
    stream_state(unit.params, [&](const StateChunk& chunk) {
      if (*fail_at_ > 0 && --*fail_at_ == 0) throw Error("injected chunk failure");
      adamw_.update_param_chunk(unit.group, *chunk.param, chunk.begin, chunk.end, chunk.staged);
    });
    unit.done = true;
  }

 private:
  AdamW& adamw_;
  int* fail_at_;
};

/** AdamW's adapter with a bug in how it streams a chunked unit's state: once too often, not at
 *  all, or another unit's param. */
class MisstreamingChunks : public AdamWSwapAdapter {
 public:
  enum class Bug { twice, never, foreign };
  MisstreamingChunks(AdamW& adamw, Bug bug, Param* foreign)
      : AdamWSwapAdapter(adamw), adamw_(adamw), bug_(bug), foreign_(foreign) {}
  void step_chunked(UpdateUnit& unit, const StateStream& stream_state) override {
    const auto update = [&](const StateChunk& chunk) {
      adamw_.update_param_chunk(unit.group, *chunk.param, chunk.begin, chunk.end, chunk.staged);
    };
    if (bug_ == Bug::foreign) stream_state({foreign_}, update);
    if (bug_ != Bug::never) stream_state(unit.params, update);
    if (bug_ == Bug::twice) stream_state(unit.params, update);
    unit.done = true;
  }

 private:
  AdamW& adamw_;
  Bug bug_;
  Param* foreign_;
};

/** AdamW's adapter whose units are one unit of all a group's params, streamed one param per part;
 *  the first part's step throws, and the adapter catches it and streams the rest. */
class RecoveringParts : public AdamWSwapAdapter {
 public:
  explicit RecoveringParts(AdamW& adamw) : AdamWSwapAdapter(adamw), adamw_(adamw) {}
  std::vector<UpdateUnit> plan_units(bool assume_all_grads) const override {
    std::vector<UpdateUnit> units;
    for (const UpdateUnit& u : AdamWSwapAdapter::plan_units(assume_all_grads)) {
      if (units.empty() || units.back().group != u.group) {
        units.push_back(u);
        continue;
      }
      units.back().params.insert(units.back().params.end(), u.params.begin(), u.params.end());
      units.back().logical_bytes += u.logical_bytes;
    }
    return units;
  }
  void step_chunked(UpdateUnit& unit, const StateStream& stream_state) override {
    for (size_t i = 0; i < unit.params.size(); ++i) {
      try {
        stream_state({unit.params[i]}, [&](const StateChunk& chunk) {
          if (i == 0) throw Error("the first part fails");
          adamw_.update_param_chunk(unit.group, *chunk.param, chunk.begin, chunk.end, chunk.staged);
        });
      } catch (const Error&) {
        ++caught;
      }
    }
    unit.done = true;
  }
  int caught = 0;

 private:
  AdamW& adamw_;
};

/** AdamW's adapter, but no unit may run in chunks. */
class WholeUnitsAdamW : public AdamWSwapAdapter {
 public:
  using AdamWSwapAdapter::AdamWSwapAdapter;
  std::vector<UpdateUnit> plan_units(bool assume_all_grads) const override {
    std::vector<UpdateUnit> units = AdamWSwapAdapter::plan_units(assume_all_grads);
    for (UpdateUnit& u : units) u.chunkable = false;
    return units;
  }
};

}  // namespace

TEST_SUITE("swap") {
  TEST_CASE("chunked units: AdamW and Muon swapped under a budget of a tenth of a unit equal bare bitwise") {
    for (auto make : {&make_adamw, &make_muon})
      for (bool packed : {true, false})
        for (bool prefetch : {false, true}) {
          CAPTURE(make == &make_muon);
          CAPTURE(packed);
          CAPTURE(prefetch);
          SwapConfig c;
          c.packed = packed;
          c.min_numel = 256;
          check_chunked(make, c, 10, prefetch);
        }
  }

  TEST_CASE("chunked units: a budget between chunked and whole units, and swapped keys that are a subset") {
    for (size_t divisor : {2, 3})
      for (bool packed : {true, false}) {
        CAPTURE(divisor);
        CAPTURE(packed);
        SwapConfig c;
        c.packed = packed;
        c.min_numel = 256;
        check_chunked(&make_muon, c, divisor, true);
        c.state_keys = std::vector<std::string>{"exp_avg_sq"};  // exp_avg stays ordinary device state
        check_chunked(&make_adamw, c, divisor * 4, false);
      }
  }

  TEST_CASE("chunked units: the plan chunks only what does not fit, each chunked unit alone in its batch") {
    auto params = big_model(5);
    auto adamw = make_adamw(params);
    SwapConfig c;
    c.min_numel = 256;
    c.device_budget_bytes = 48 * 1024;  // the largest unit has 96*80*4*2 = 61440 bytes of state
    auto swapped = wrap(*adamw, c);
    std::vector<UpdateUnit> units = swapped->adapter().plan_units(true);
    swapped->runtime().attach_slots(units, swapped->optimizer(), true);
    const std::vector<int64_t> costs = swapped->adapter().partition_costs(units);
    const std::vector<size_t> sizes = swapped->runtime().plan_batches(units, costs);
    size_t first = 0;
    for (size_t size : sizes) {
      const UpdateUnit& u = units[first];
      size_t bytes = 0;
      for (const SwapSlot* s : u.slots) bytes += s->nbytes();
      if (bytes > *c.device_budget_bytes) {  // cannot run whole: chunked, alone
        CHECK(u.chunk_elements > 0);
        CHECK(size == 1);
      }
      if (u.chunk_elements > 0) {
        CHECK(u.chunk_elements % 32 == 0);
        CHECK(size_t(u.chunk_elements) * 4 * u.slots.size() * 2 <= *c.device_budget_bytes);  // two arenas
      }
      first += size;
    }
    CHECK(first == units.size());
    // Without a budget nothing is chunked.
    SwapConfig plain;
    plain.min_numel = 256;
    auto params2 = big_model(5);
    auto adamw2 = make_adamw(params2);
    auto unbounded = wrap(*adamw2, plain);
    std::vector<UpdateUnit> units2 = unbounded->adapter().plan_units(true);
    unbounded->runtime().attach_slots(units2, unbounded->optimizer(), true);
    unbounded->runtime().plan_batches(units2, unbounded->adapter().partition_costs(units2));
    for (const UpdateUnit& u : units2) CHECK(u.chunk_elements == 0);
  }

  TEST_CASE("chunked units: a budget too small even for chunks, or for units that cannot be chunked, names the sizes and changes nothing") {
    auto params = big_model(7);
    auto muon = make_muon(params);
    SwapConfig c;
    c.min_numel = 256;
    c.device_budget_bytes = 2000;  // below every Muon unit's workspace
    auto swapped = wrap(*muon, c);
    set_grads(params, 1);
    std::vector<UpdateUnit> units = swapped->adapter().plan_units(false);
    swapped->runtime().attach_slots(units, swapped->optimizer(), true);
    // Named: the unit needing the largest budget (the largest workspace here: every unit's two
    // chunks of 32 elements take at most 256 bytes), "experts", a param alone in its unit.
    const UpdateUnit& worst = *std::max_element(
        units.begin(), units.end(),
        [](const UpdateUnit& a, const UpdateUnit& b) { return a.workspace_bytes < b.workspace_bytes; });
    REQUIRE(worst.params.size() == 1);
    size_t bytes = 0;
    for (const SwapSlot* s : worst.slots) bytes += s->nbytes();
    const std::string before = serialize_state_dict(swapped->state_dict());
    std::vector<Tensor> data;
    for (const ParamPtr& p : params) data.push_back(p->data.clone());
    CHECK_THROWS_WITH_AS(
        swapped->step(),
        ("[swap] device_budget_bytes 2000 is below an update unit even in chunks: " +
         std::to_string(worst.workspace_bytes) + " bytes of workspace + 256 bytes for two chunks of 32 " +
         "elements of its " + std::to_string(bytes) + " bytes of state (the unit of '" + worst.params.front()->name +
         "'); the least budget that runs this step is " + std::to_string(worst.workspace_bytes + 256) + " bytes")
            .c_str(),
        Error);
    CHECK(serialize_state_dict(swapped->state_dict()) == before);
    for (size_t i = 0; i < params.size(); ++i) CHECK(test::same_bits(params[i]->data, data[i]));

    // Units that cannot be chunked keep the whole-unit rules.
    auto params2 = big_model(7);
    AdamW adamw{Stream(Device::cpu())};
    adamw.add_param_group({params2[0], params2[1]});
    SwapConfig whole;
    whole.min_numel = 256;
    whole.device_budget_bytes = 30000;  // below embed's 61440 bytes of state
    SwapOptimizer unchunkable(std::make_unique<WholeUnitsAdamW>(adamw), whole);
    set_grads(params2, 1);
    CHECK_THROWS_WITH_AS(
        unchunkable.step(),
        "[swap] device_budget_bytes 30000 is below an update unit that cannot run in chunks: 61440 bytes "
        "of state + 0 bytes of workspace (the unit of 'embed'); the least budget that runs this step is 122880 bytes",
        Error);
    CHECK(adamw.state().empty());
  }

  TEST_CASE(
      "a budget that holds no plan names the least one that does: it runs, one byte less does not (random models, "
      "one optimizer or a set)") {
    std::mt19937 rng(20261206);
    int named = 0;
    for (int trial = 0; trial < 120; ++trial) {
      CAPTURE(trial);
      // Muon, AdamW, or a set of both (its members plan apart; the least budget runs every one).
      const int mode = int(rng() % 3);
      CAPTURE(mode);
      SwapConfig config;
      config.packed = rng() % 2 == 0;
      config.min_numel = std::vector<int64_t>{0, 1, 64}[rng() % 3];
      config.swap_times = 1 + int(rng() % 4);
      std::vector<Shape> shapes;
      std::vector<DType> dtypes;
      for (size_t i = 0, n = 1 + rng() % 5; i < n; ++i) {
        shapes.push_back({int64_t(1 + rng() % 40), int64_t(1 + rng() % 40)});
        dtypes.push_back(rng() % 3 == 0 ? DType::bf16 : DType::f32);
      }
      if (mode == 2) {  // vectors for the set's AdamW
        for (size_t i = 0, n = 1 + rng() % 3; i < n; ++i) {
          shapes.push_back({int64_t(1 + rng() % 1500)});
          dtypes.push_back(DType::f32);
        }
      }
      // A fresh model and wrapper stepped once under `budget`: the step's error, "" when it ran.
      size_t peak = 0;
      const auto step_under = [&](size_t budget) {
        std::vector<ParamPtr> params;
        for (size_t i = 0; i < shapes.size(); ++i)
          params.push_back(make_param(std::string(1, char('a' + i)),
                                      test::random_tensor(shapes[i], dtypes[i], uint32_t(trial * 10 + i))));
        for (size_t i = 0; i < params.size(); ++i)
          params[i]->grad = test::random_tensor(shapes[i], DType::f32, uint32_t(700 + i));
        SwapConfig c = config;
        c.device_budget_bytes = budget;
        Muon muon_opt{Stream(Device::cpu())};
        AdamW adamw_opt{Stream(Device::cpu())};
        if (mode == 2) {
          MuonWithAdamW both(Stream(Device::cpu()), params, MuonOptions{}, AdamWOptions{.amsgrad = trial % 2 == 0});
          const std::unique_ptr<SwapOptimizerSet> set = swap_muon_with_adamw(both, c);
          const std::string error = test::error_of([&] { set->step(); });
          if (error.empty()) peak = set->last_report().peak_resident_bytes;
          return error;
        }
        std::unique_ptr<SwapOptimizer> swapped;
        if (mode == 0) {
          muon_opt.add_param_group(params);
          swapped = swap_muon(muon_opt, c);
        } else {
          adamw_opt.add_param_group(params, AdamWOptions{.amsgrad = trial % 3 == 0});
          swapped = swap_adamw(adamw_opt, c);
        }
        const std::string error = test::error_of([&] { swapped->step(); });
        if (error.empty()) peak = swapped->last_report().peak_resident_bytes;
        return error;
      };
      const size_t budget = rng() % 6000;
      const std::string error = step_under(budget);
      if (error.empty()) continue;
      CAPTURE(error);
      const std::string says = "; the least budget that runs this step is ";
      const size_t at = error.rfind(says);
      REQUIRE(at != std::string::npos);
      const size_t least = std::stoull(error.substr(at + says.size()));
      CHECK(error.substr(at + says.size()) == std::to_string(least) + " bytes");
      CHECK(least > budget);
      CHECK(step_under(least) == "");
      CHECK(peak <= least);
      const std::string below = step_under(least - 1), tail = says + std::to_string(least) + " bytes";
      CAPTURE(below);
      CHECK((below.size() > tail.size() && below.compare(below.size() - tail.size(), tail.size(), tail) == 0));
      ++named;
    }
    CHECK(named >= 35);  // most trials name one
  }

  TEST_CASE("a set's budget error names the least budget that runs every member, not the first one to miss") {
    // Muon's 2x3 matrix misses 64 bytes and needs 108; AdamW's 4000-element vector needs 768.
    const auto step_under = [](size_t budget) {
      std::vector<ParamPtr> params = {make_param("layer.weight", test::random_tensor({2, 3}, DType::f32, 1)),
                                      make_param("layer.bias", test::random_tensor({4000}, DType::f32, 2))};
      for (const ParamPtr& p : params) p->grad = test::random_tensor(p->data.shape(), DType::f32, 3);
      MuonWithAdamW both(Stream(Device::cpu()), params, MuonOptions{}, AdamWOptions{.amsgrad = true});
      const std::unique_ptr<SwapOptimizerSet> set =
          swap_muon_with_adamw(both, SwapConfig{.min_numel = 0, .device_budget_bytes = budget});
      return test::error_of([&] { set->step(); });
    };
    CHECK(step_under(64) ==
          "[swap] device_budget_bytes 64 is below an update unit: 24 bytes of state + 84 bytes of workspace, less than "
          "its two chunks of 32 elements would take (the unit of 'layer.weight'); the least budget that runs this step "
          "is 768 bytes");
    CHECK(step_under(768) == "");
    CHECK(step_under(767).ends_with("; the least budget that runs this step is 768 bytes"));
  }

  TEST_CASE("a budget below the workspace of a unit whose state stays on the device says it swaps no state") {
    // A 30x30 matrix's momentum is below min_numel: no state to chunk, only its Newton-Schulz
    // workspace. Its message compared 0 bytes of state with two chunks.
    const auto step_under = [](size_t budget) {
      const ParamPtr w = make_param("w", test::random_tensor({30, 30}, DType::f32, 1));
      w->grad = test::random_tensor({30, 30}, DType::f32, 2);
      Muon muon(Stream(Device::cpu()));
      muon.add_param_group({w});
      auto swapped = swap_muon(muon, SwapConfig{.device_budget_bytes = budget});
      return test::error_of([&] { swapped->step(); });
    };
    CHECK(step_under(100) ==
          "[swap] device_budget_bytes 100 is below the workspace of an update unit that swaps no state: 14404 bytes "
          "(the unit of 'w'); the least budget that runs this step is 14404 bytes");
    CHECK(step_under(14403).ends_with("; the least budget that runs this step is 14404 bytes"));
    CHECK(step_under(14404) == "");
  }

  TEST_CASE("chunked units: empty params and empty states of any dtype, whole or chunked") {
    // Muon groups {4, 40, 48} f32 and {0, 40, 48} bf16 into one unit (one core shape); with
    // min_numel 0 the empty one has a 0-byte slot of a dtype no other slot of its chunk uses.
    const auto model = [](uint32_t seed) {
      return std::vector<ParamPtr>{make_param("a", test::random_tensor({4, 40, 48}, DType::f32, seed)),
                                   make_param("e", Tensor::zeros({0, 40, 48}, DType::bf16, Device::cpu())),
                                   make_param("b", test::random_tensor({32, 32}, DType::bf16, seed + 1)),
                                   make_param("z", Tensor::zeros({3, 0}, DType::f32, Device::cpu()))};
    };
    for (bool packed : {true, false})
      for (bool budget : {false, true})
        for (bool adamw : {false, true}) {
          CAPTURE(packed);
          CAPTURE(budget);
          CAPTURE(adamw);
          auto bare_params = model(3), swap_params = model(3);
          std::unique_ptr<Optimizer> bare, inner;
          if (adamw) {
            auto make = [](const std::vector<ParamPtr>& params) {
              auto o = std::make_unique<AdamW>(Stream(Device::cpu()));
              o->add_param_group(params);
              return o;
            };
            bare = make(bare_params);
            inner = make(swap_params);
          } else {
            auto make = [](const std::vector<ParamPtr>& params) {
              auto o = std::make_unique<Muon>(Stream(Device::cpu()));
              o->add_param_group(params);
              return o;
            };
            bare = make(bare_params);
            inner = make(swap_params);
          }
          SwapConfig c;
          c.packed = packed;
          c.min_numel = 0;
          c.swap_times = 2;
          if (budget) {
            const size_t workspace = largest_unit(*wrap(*inner, c)).second;
            c.device_budget_bytes = workspace + 4096;  // below the state of "a": chunked
          }
          auto swapped = wrap(*inner, c);
          for (int step = 1; step <= 3; ++step) {
            for (size_t i = 0; i < bare_params.size(); ++i) {
              bare_params[i]->grad = test::random_tensor(bare_params[i]->data.shape(), DType::f32, 70 + uint32_t(step * 5 + i));
              swap_params[i]->grad = bare_params[i]->grad;
            }
            bare->step();
            swapped->step();
            swapped->synchronize();
            bare->stream().synchronize();
            CHECK(test::params_bitwise_equal(bare_params, swap_params));
          }
          CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
        }
  }

  TEST_CASE("a zeropower_fn throwing at a param's first update keeps the momentum it made, as the bare step does") {
    // The momentum update ran (state created, step counted) before Newton-Schulz threw: the
    // swapped step removed that state as if the unit never ran, and the runs parted (found by a
    // hunting helper). Whole units, packed or not, and chunked ones; the k-th NS call throws.
    for (const std::string mode : {"unpacked", "packed", "chunked"})
      for (int throw_at = 0; throw_at < 5; ++throw_at) {
        CAPTURE(mode);
        CAPTURE(throw_at);
        const auto make = [throw_at](int* calls) {
          MuonHooks hooks;
          hooks.zeropower_fn = [calls, throw_at](Stream&, const Tensor&, int) {
            if ((*calls)++ == throw_at) throw Error("zeropower_fn failed");
          };
          return std::make_unique<Muon>(Stream(Device::cpu()), hooks);
        };
        int bare_calls = 0, swap_calls = 0, sizing_calls = -1;
        auto bare_params = big_model(4), swap_params = big_model(4), sizing_params = big_model(4);
        auto bare = make(&bare_calls), inner = make(&swap_calls), sizing = make(&sizing_calls);
        bare->add_param_group({bare_params[0], bare_params[1], bare_params[2], bare_params[3]});
        inner->add_param_group({swap_params[0], swap_params[1], swap_params[2], swap_params[3]});
        sizing->add_param_group({sizing_params[0], sizing_params[1], sizing_params[2], sizing_params[3]});
        SwapConfig config;
        config.packed = mode == "packed";
        config.min_numel = 256;
        if (mode == "chunked") {
          const auto [state, workspace] = largest_unit(*swap_muon(*sizing, config));
          config.device_budget_bytes = workspace + state / 10;
        }
        auto swapped = swap_muon(*inner, config);
        int threw = 0;
        for (int step = 1; step <= 3; ++step) {
          CAPTURE(step);
          set_grads(bare_params, step);
          set_grads(swap_params, step);
          const std::string bare_error = test::error_of([&] { bare->step(); });
          const std::string swap_error = test::error_of([&] { swapped->step(); });
          bare->stream().synchronize();
          swapped->synchronize();
          CHECK(bare_error == swap_error);
          threw += bare_error.empty() ? 0 : 1;
          CHECK(test::params_bitwise_equal(bare_params, swap_params));
          CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
        }
        CHECK(threw == 1);
        if (mode == "chunked") CHECK(swapped->last_report().chunked_units > 0);
      }
  }

  TEST_CASE("chunked units: a failure at a chunk drains every transfer, frees the arenas, and the next step runs") {
    for (bool packed : {true, false})
      for (int fail_at : {1, 2, 5}) {
        CAPTURE(packed);
        CAPTURE(fail_at);
        auto params = big_model(9);
        AdamW adamw{Stream(Device::cpu())};
        adamw.add_param_group({params[0], params[1], params[2], params[3]});
        SwapConfig c;
        c.packed = packed;
        c.min_numel = 256;
        c.device_budget_bytes = 16 * 1024;  // every unit chunked, several chunks each
        int armed = 0;
        SwapOptimizer swapped(std::make_unique<FailingChunks>(adamw, &armed), c);
        set_grads(params, 1);
        swapped.step();
        swapped.synchronize();
        armed = fail_at;
        set_grads(params, 2);
        const size_t device_bytes = memory_stats(Device::cpu()).current_bytes;
        CHECK_THROWS_WITH_AS(swapped.step(), "injected chunk failure", Error);
        swapped.synchronize();
        for (const auto& slot : swapped.runtime().slots()) {
          CHECK(slot->state == SlotState::host);
          CHECK(slot->device.is_released());
        }
        CHECK(memory_stats(Device::cpu()).current_bytes == device_bytes);  // no arena left behind
        swapped.step();  // the next step runs
        swapped.synchronize();
        CHECK(memory_stats(Device::cpu()).current_bytes == device_bytes);
      }
  }

  TEST_CASE("chunked units: an adapter streaming a param twice, never, or not its own gets the runtime's error") {
    using Bug = MisstreamingChunks::Bug;
    for (Bug bug : {Bug::twice, Bug::never, Bug::foreign}) {
      CAPTURE(int(bug));
      auto params = big_model(9);
      AdamW adamw{Stream(Device::cpu())};
      adamw.add_param_group({params[0], params[1]});
      SwapConfig c;
      c.min_numel = 256;
      c.device_budget_bytes = 16 * 1024;  // every unit chunked
      SwapOptimizer swapped(std::make_unique<MisstreamingChunks>(adamw, bug, params[1].get()), c);
      set_grads(params, 1);
      const std::string expected =
          bug == Bug::never   ? "[swap] a chunked unit's update did not stream the state of '" + params[0]->name + "'"
          : bug == Bug::twice ? "[swap] a chunked unit streams the state of '" + params[0]->name +
                                    "', which is not its own or was streamed already this step"
                              : "[swap] a chunked unit streams the state of '" + params[1]->name +
                                    "', which is not its own or was streamed already this step";
      CHECK(test::error_of([&] { swapped.step(); }) == expected);
    }
  }

  TEST_CASE("chunked units: a part after a failed one that the adapter caught gets its arenas again") {
    // The unit's arenas are kept across its parts; the drain after a failed part frees them, so a
    // later part must allocate them again rather than copy into none.
    auto params = big_model(12), bare_params = big_model(12);
    AdamW adamw{Stream(Device::cpu())}, bare{Stream(Device::cpu())};
    adamw.add_param_group({params[0], params[3]});
    bare.add_param_group({bare_params[0], bare_params[3]});
    auto adapter = std::make_unique<RecoveringParts>(adamw);
    RecoveringParts& recovering = *adapter;
    SwapOptimizer swapped(std::move(adapter), SwapConfig{.min_numel = 256, .device_budget_bytes = 16 * 1024});
    std::vector<std::string> seen;
    swapped.runtime().set_trace([&](const std::string& e) { seen.push_back(e); });
    set_grads(params, 1);
    set_grads(bare_params, 1);
    swapped.step();
    bare.step();
    swapped.synchronize();
    bare.stream().synchronize();
    CHECK(recovering.caught == 1);
    CHECK(std::count(seen.begin(), seen.end(), "allocate_arenas 2") == 2);
    CHECK(swapped.last_report().chunked_units == 1);
    // The second param was updated as the bare step updates it, the first not at all.
    CHECK(test::same_bits(params[3]->data, bare_params[3]->data));
    CHECK(test::same_bits(params[0]->data, big_model(12)[0]->data));
  }

  TEST_CASE("plans: the packed need can rise with the batch count, and the plan still finds the count that fits") {
    // Packed, the need is the largest batch in each of the three arenas (batch i in arena i % 3):
    // 1 to 3 batches need 29440 bytes, 4 ([big0] [s0 s1] [s2] [big1]) 16640, 5 26880. Units that
    // cannot be chunked must get the 4.
    const auto model = [] {
      return std::vector<ParamPtr>{make_param("big0", test::random_tensor({40, 40}, DType::f32, 1)),
                                   make_param("s0", test::random_tensor({16, 10}, DType::f32, 2)),
                                   make_param("s1", test::random_tensor({16, 10}, DType::f32, 3)),
                                   make_param("s2", test::random_tensor({16, 10}, DType::f32, 5)),
                                   make_param("big1", test::random_tensor({40, 40}, DType::f32, 4))};
    };
    auto params = model(), bare_params = model();
    AdamW adamw{Stream(Device::cpu())}, bare{Stream(Device::cpu())};
    adamw.add_param_group(params);
    bare.add_param_group(bare_params);
    SwapConfig c;
    c.min_numel = 0;
    c.device_budget_bytes = 16640;
    SwapOptimizer swapped(std::make_unique<WholeUnitsAdamW>(adamw), c);
    for (int step = 1; step <= 2; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 30 + uint32_t(step * 7 + i));
        bare_params[i]->grad = params[i]->grad;
      }
      swapped.step();
      bare.step();
      swapped.synchronize();
      bare.synchronize();
      CHECK(swapped.last_report().batches == 4);
      CHECK(swapped.last_report().peak_resident_bytes <= 16640);
      CHECK(test::params_bitwise_equal(params, bare_params));
    }
  }
}
