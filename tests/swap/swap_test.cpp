#include <tuple>

#include "swap/swap_fixture.h"

using namespace swapopt;

namespace {

std::unique_ptr<Muon> make_muon(const std::vector<ParamPtr>& params, MuonHooks hooks = {}) {
  auto muon = std::make_unique<Muon>(Stream(Device::cpu()), std::move(hooks));
  muon->add_param_group({params[0], params[1], params[2], params[3], params[4]});
  MuonOptions second;
  second.lr = 0.05;
  second.ns_variant = "legacy";
  muon->add_param_group({params[5], params[6]}, second);
  return muon;
}

std::unique_ptr<AdamW> make_adamw(const std::vector<ParamPtr>& params) {
  auto adamw = std::make_unique<AdamW>(Stream(Device::cpu()));
  adamw->add_param_group({params[0], params[1], params[2], params[3]});
  AdamWOptions amsgrad;
  amsgrad.amsgrad = true;
  adamw->add_param_group({params[4], params[5], params[6]}, amsgrad);
  return adamw;
}

SwapConfig config_of(int swap_times, bool packed) {
  SwapConfig c;
  c.swap_times = swap_times;
  c.packed = packed;
  return c;
}

/** Steps bare and swapped copies of the model `steps` times; checks params and state bitwise. */
template <typename MakeOptimizer, typename Wrap>
void check_bitwise(MakeOptimizer make_optimizer, Wrap wrap, const SwapConfig& config, int steps = 5) {
  auto bare_params = test::swap_model(11), swap_params = test::swap_model(11);
  auto bare = make_optimizer(bare_params);
  auto inner = make_optimizer(swap_params);
  auto swapped = wrap(*inner, config);
  for (int step = 1; step <= steps; ++step) {
    test::set_swap_grads(bare_params, step);
    test::set_swap_grads(swap_params, step);
    bare->step();
    swapped->step();
    bare->stream().synchronize();
    inner->stream().synchronize();
    CHECK(test::params_bitwise_equal(bare_params, swap_params));
    for (const auto& slot : swapped->runtime().slots()) {
      CHECK(slot->state == SlotState::host);
      CHECK((slot->device.is_released() || !slot->created));
    }
  }
  CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
}

}  // namespace

TEST_SUITE("swap") {
  TEST_CASE("Muon swapped equals bare bitwise: swap_times 1, 2, 3, 7, > units; packed and not") {
    for (bool packed : {true, false})
      for (int t : {1, 2, 3, 7, 100}) {
        CAPTURE(packed);
        CAPTURE(t);
        check_bitwise([](const std::vector<ParamPtr>& p) { return make_muon(p); }, [](Muon& m, const SwapConfig& c) { return swap_muon(m, c); }, config_of(t, packed));
      }
  }

  TEST_CASE("AdamW swapped equals bare bitwise, amsgrad included") {
    for (bool packed : {true, false})
      for (int t : {1, 2, 3, 7, 100}) {
        CAPTURE(packed);
        CAPTURE(t);
        check_bitwise(make_adamw, [](AdamW& a, const SwapConfig& c) { return swap_adamw(a, c); }, config_of(t, packed));
      }
  }

  TEST_CASE("retain_arenas: staging memory kept between steps, results bitwise as without") {
    SwapConfig retain = config_of(3, true);
    retain.retain_arenas = true;
    check_bitwise([](const std::vector<ParamPtr>& p) { return make_muon(p); }, [](Muon& m, const SwapConfig& c) { return swap_muon(m, c); }, retain);
    check_bitwise(make_adamw, [](AdamW& a, const SwapConfig& c) { return swap_adamw(a, c); }, retain);
  }

  TEST_CASE("only the configured state keys are swapped") {
    auto params = test::swap_model(3);
    auto adamw = make_adamw(params);
    SwapConfig c;
    c.state_keys = std::vector<std::string>{"exp_avg"};
    auto swapped = swap_adamw(*adamw, c);
    for (const auto& slot : swapped->runtime().slots()) CHECK(slot->key == "exp_avg");
    auto bare_params = test::swap_model(3);
    auto bare = make_adamw(bare_params);
    for (int step = 1; step <= 3; ++step) {
      test::set_swap_grads(params, step);
      test::set_swap_grads(bare_params, step);
      swapped->step();
      bare->step();
    }
    CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
  }

  TEST_CASE("a SwapOptimizer without an adapter is a named error") {
    CHECK(test::error_of([] { SwapOptimizer(nullptr, SwapConfig{}); }) ==
          "[swap] SwapOptimizer needs a state adapter, got null");
  }

  TEST_CASE("state restored from a checkpoint: bare -> swapped and swapped -> bare stay bitwise") {
    auto straight_params = test::swap_model(5);
    auto straight = make_muon(straight_params);
    for (int step = 1; step <= 5; ++step) {
      test::set_swap_grads(straight_params, step);
      straight->step();
    }
    // Bare for 2 steps, saved; a swapped optimizer loads it and runs steps 3-4; saved; a bare one
    // loads that and runs step 5.
    auto params = test::swap_model(5);
    auto first = make_muon(params);
    for (int step = 1; step <= 2; ++step) {
      test::set_swap_grads(params, step);
      first->step();
    }
    const StateDict after_two = first->state_dict();
    auto second = make_muon(params);
    auto swapped = swap_muon(*second, config_of(3, true));
    swapped->load_state_dict(after_two);
    CHECK(second->param_groups()[1].step == 2);
    for (const auto& slot : swapped->runtime().slots()) CHECK(slot->device.is_released());
    for (int step = 3; step <= 4; ++step) {
      test::set_swap_grads(params, step);
      swapped->step();
    }
    const std::string path = test::temp_file("swap_checkpoint.safetensors");
    save_state_dict(swapped->state_dict(), path);
    auto third = make_muon(params);
    third->load_state_dict(load_state_dict(path));
    test::set_swap_grads(params, 5);
    third->step();
    third->stream().synchronize();
    straight->stream().synchronize();
    CHECK(test::params_bitwise_equal(straight_params, params));
    CHECK(serialize_state_dict(straight->state_dict()) == serialize_state_dict(third->state_dict()));
    std::remove(path.c_str());
  }

  TEST_CASE("state that exists before wrapping is offloaded at wrap time and kept bitwise") {
    auto bare_params = test::swap_model(8), params = test::swap_model(8);
    auto bare = make_muon(bare_params);
    auto inner = make_muon(params);
    test::set_swap_grads(bare_params, 1);
    test::set_swap_grads(params, 1);
    bare->step();
    inner->step();  // momentum now lives on the device
    inner->stream().synchronize();
    bare->stream().synchronize();  // the allocator counts every stream's memory
    const MemoryStats before = memory_stats(Device::cpu());
    auto swapped = swap_muon(*inner, config_of(2, false));
    size_t offloaded = 0;
    for (const auto& slot : swapped->runtime().slots()) {
      CHECK(slot->device.is_released());
      offloaded += slot->created ? slot->nbytes() : 0;
    }
    CHECK(offloaded > 0);
    CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes - offloaded);
    for (int step = 2; step <= 4; ++step) {
      test::set_swap_grads(bare_params, step);
      test::set_swap_grads(params, step);
      bare->step();
      swapped->step();
    }
    CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
    CHECK(test::params_bitwise_equal(bare_params, params));
  }

  TEST_CASE("resident optimizer bytes: none between steps, at most three batches in flight during a step") {
    for (bool packed : {false, true}) {
      CAPTURE(packed);
      auto params = test::swap_model(9);
      auto muon = make_muon(params);
      auto swapped = swap_muon(*muon, config_of(4, packed));
      // Device bytes between steps, less the gradients (which differ from step to step).
      auto state_and_params = [&] {
        size_t grads = 0;
        for (const ParamPtr& p : params) grads += p->grad.defined() ? p->grad.nbytes() : 0;
        return memory_stats(Device::cpu()).current_bytes - grads;
      };
      test::set_swap_grads(params, 1);
      swapped->step();
      muon->stream().synchronize();
      const size_t between_steps = state_and_params();
      for (int step = 2; step <= 4; ++step) {
        test::set_swap_grads(params, step);
        swapped->step();
        swapped->synchronize();
        const SwapStepReport report = swapped->last_report();
        // The bound, from the slots themselves: the largest three consecutive batches (unpacked), or
        // the largest batch in each of the three staging arenas (packed: batch i in arena i % 3).
        // Taken after the step, which made the state of params with their first grad (so every
        // slot has its size); the plan is the same.
        std::vector<UpdateUnit> units = swapped->adapter().plan_units(false);
        swapped->runtime().attach_slots(units, *muon, false);
        const std::vector<size_t> sizes =
            PipelineSwapRuntime::partition(swapped->adapter().partition_costs(units), swapped->runtime().config().swap_times);
        std::vector<size_t> batch_bytes;
        size_t at = 0;
        for (size_t n : sizes) {
          size_t bytes = 0;
          for (size_t u = at; u < at + n; ++u)
            for (const SwapSlot* s : units[u].slots) bytes += s->nbytes();
          batch_bytes.push_back(bytes);
          at += n;
        }
        size_t bound = 0;
        if (!packed) {
          for (size_t i = 0; i < batch_bytes.size(); ++i) {
            size_t window = 0;
            for (size_t k = i; k < std::min(i + 3, batch_bytes.size()); ++k) window += batch_bytes[k];
            bound = std::max(bound, window);
          }
        } else {
          bound = swapped->runtime().resident_bytes_needed(units, sizes);
          size_t largest[3] = {0, 0, 0};
          for (size_t i = 0; i < batch_bytes.size(); ++i) largest[i % 3] = std::max(largest[i % 3], batch_bytes[i]);
          CHECK(bound <= largest[0] + largest[1] + largest[2] + 3 * 64 * 8);  // ranges add at most alignment padding
        }
        CHECK(report.batches == int(sizes.size()));
        CHECK(report.peak_resident_bytes > 0);
        CHECK(report.peak_resident_bytes <= bound);
        CHECK(state_and_params() == between_steps);
        for (const auto& slot : swapped->runtime().slots()) CHECK((slot->device.is_released() || !slot->created));
      }
    }
  }

  TEST_CASE("host side: pinned mirrors allocated once, no stream or event creation after the first step") {
    auto params = test::swap_model(10);
    auto muon = make_muon(params);
    auto swapped = swap_muon(*muon, config_of(3, true));
    const MemoryStats pinned_after_wrap = pinned_host_allocator().stats();
    CHECK(swapped->runtime().pinned_bytes() <= size_t(1.05 * double(swapped->runtime().slot_bytes())));
    test::set_swap_grads(params, 1);
    swapped->step();
    const HandleStats handles = handle_stats();
    for (int step = 2; step <= 5; ++step) {
      test::set_swap_grads(params, step);
      swapped->step();
    }
    muon->stream().synchronize();
    CHECK(pinned_host_allocator().stats().allocations == pinned_after_wrap.allocations);
    CHECK(handle_stats().streams_created == handles.streams_created);
    CHECK(handle_stats().events_created == handles.events_created);
    swapped->synchronize();
    const SwapStepReport report = swapped->last_report();
    CHECK(report.h2d_bytes > 0);
    CHECK(report.h2d_bytes == report.d2h_bytes);
    CHECK(report.exposed_wait_ms >= 0.0);
  }

  TEST_CASE("partition follows the reference's balanced rule") {
    CHECK(PipelineSwapRuntime::partition({0, 0, 0, 0}, 2) == std::vector<size_t>{2, 2});
    CHECK(PipelineSwapRuntime::partition({512, 16, 16}, 2) == std::vector<size_t>{1, 2});
    CHECK(PipelineSwapRuntime::partition({1, 1, 1}, 16) == std::vector<size_t>{1, 1, 1});
    CHECK(PipelineSwapRuntime::partition({5, 5, 5, 5, 5, 5}, 3) == std::vector<size_t>{2, 2, 2});
    CHECK(PipelineSwapRuntime::partition({100, 1, 1, 1, 1}, 4) == std::vector<size_t>{1, 1, 1, 2});
    CHECK(PipelineSwapRuntime::partition({}, 4).empty());
  }

  TEST_CASE("partition: a table of cost vectors and their exact batch sizes, edge cases included") {
    // The balanced greedy rule: each batch takes units while that brings its cost closer to
    // remaining / batches_left (a tie stops it), leaves a unit for every later batch, and costs
    // below 1 count as 1.
    const std::vector<std::tuple<std::vector<int64_t>, int, std::vector<size_t>>> table = {
        {{3, 1, 2}, 10, {1, 1, 1}},                  // swap_times > n: one unit each
        {{4, 4}, 0, {2}},                            // swap_times < 1: one batch
        {{1, 1, 1, 1}, -2, {4}},
        {{7}, 3, {1}},
        {{2, 2, 2}, 2, {1, 2}},                      // a tie stops the batch
        {{5, 5, 5, 5, 5, 5, 5}, 3, {2, 2, 3}},       // ... at every batch
        {{5, 5, 5, 5, 5}, 4, {1, 1, 1, 2}},
        {{3, 3, 3, 3}, 2, {2, 2}},
        {{1000, 1, 1, 1}, 2, {1, 3}},                // one huge cost first, last, in the middle
        {{1, 1, 1, 1000}, 2, {3, 1}},
        {{1, 1, 1, 1000}, 3, {2, 1, 1}},             // stops to leave a unit for every later batch
        {{1000, 1, 1, 1}, 4, {1, 1, 1, 1}},
        {{1, 1, 1000, 1, 1}, 3, {2, 1, 2}},
        {{6, 1, 1, 1, 1, 1, 1}, 3, {1, 3, 3}},
        {{0, 0, 0, 10}, 2, {3, 1}},                  // zeros count as 1
        {{0, 0, 4, 0, 0}, 2, {2, 3}},
        {{1, 2, 3, 4, 5, 6, 7, 8}, 3, {4, 2, 2}},
        {{8, 7, 6, 5, 4, 3, 2, 1}, 3, {2, 2, 4}},
    };
    for (size_t row = 0; row < table.size(); ++row) {
      CAPTURE(row);
      const auto& [costs, swap_times, sizes] = table[row];
      CHECK(PipelineSwapRuntime::partition(costs, swap_times) == sizes);
    }
  }

  TEST_CASE("the exact copy/compute call sequence for 1, 2 and 5 batches, packed and not") {
    const std::map<std::pair<int, bool>, std::vector<std::string>> expected = {
        {{1, false}, {"h2d 0", "wait_ready 0", "step 0", "d2h 0", "wait_offload 0"}},
        {{1, true},
         {"allocate_arenas 1", "h2d 0", "wait_ready 0", "step 0", "d2h 0", "wait_offload 0", "free_arenas 1"}},
        {{2, false},
         {"h2d 0", "wait_ready 0", "h2d 1", "step 0", "d2h 0", "wait_ready 1", "step 1", "d2h 1", "wait_offload 0",
          "wait_offload 1"}},
        {{2, true},
         {"allocate_arenas 2", "h2d 0", "h2d 1", "wait_ready 0", "step 0", "d2h 0", "wait_ready 1", "step 1", "d2h 1",
          "wait_offload 0", "wait_offload 1", "free_arenas 2"}},
        // Three batches in flight: the load of batch n + 1 (unpacked) or n + 3 (packed) follows the
        // offload of batch n - 2 (n), so that batch n - 1's offload overlaps it.
        {{5, false}, {"h2d 0",          "wait_ready 0", "h2d 1",  "step 0",         "d2h 0",
                      "wait_ready 1",   "h2d 2",        "step 1", "d2h 1",          "wait_ready 2",
                      "wait_offload 0", "h2d 3",        "step 2", "d2h 2",          "wait_ready 3",
                      "wait_offload 1", "h2d 4",        "step 3", "d2h 3",          "wait_ready 4",
                      "wait_offload 2", "step 4",       "d2h 4",  "wait_offload 3", "wait_offload 4"}},
        {{5, true}, {"allocate_arenas 3", "h2d 0",          "h2d 1",        "h2d 2",
                     "wait_ready 0",      "step 0",         "d2h 0",        "h2d 3",
                     "wait_ready 1",      "step 1",         "d2h 1",        "h2d 4",
                     "wait_ready 2",      "step 2",         "d2h 2",        "wait_ready 3",
                     "wait_offload 0",    "step 3",         "d2h 3",        "wait_ready 4",
                     "wait_offload 1",    "step 4",         "d2h 4",        "wait_offload 2",
                     "wait_offload 3",    "wait_offload 4", "free_arenas 3"}},
    };
    for (const auto& [key, want] : expected) {
      CAPTURE(key.first);
      CAPTURE(key.second);
      auto params = test::swap_model(12);
      auto adamw = make_adamw(params);
      auto swapped = swap_adamw(*adamw, config_of(key.first, key.second));
      std::vector<std::string> seen;
      swapped->runtime().set_trace([&](const std::string& e) { seen.push_back(e); });
      test::set_swap_grads(params, 2);  // 6 params with grads: 6 units
      swapped->step();
      CHECK(seen == want);
    }
  }

  TEST_CASE("packed mode drains batch 0 before batch 3 runs in its arena, and loads batch 2 before it") {
    auto params = test::swap_model(13);
    auto adamw = make_adamw(params);
    auto swapped = swap_adamw(*adamw, config_of(5, true));
    std::vector<std::string> seen;
    swapped->runtime().set_trace([&](const std::string& e) { seen.push_back(e); });
    test::set_swap_grads(params, 2);
    swapped->step();
    const auto at = [&](const std::string& e) { return std::find(seen.begin(), seen.end(), e) - seen.begin(); };
    CHECK(at("d2h 0") < at("h2d 3"));
    CHECK(at("wait_offload 0") < at("step 3"));
    CHECK(at("h2d 2") < at("d2h 0"));  // arena 2's load does not wait for arena 0's offload
  }

  // Not a swapopt::Error nor a std::exception: a callback's exception reaches the caller as thrown.
  struct HookFailure {
    int code;
  };

  TEST_CASE("a throwing post_update_fn: every transfer drained, slots host-resident and consistent, next step works") {
    for (bool packed : {true, false}) {
      CAPTURE(packed);
      int calls = 0;
      auto thrower = [&calls](Stream&, Param&, const Tensor&, const PostUpdateContext& c) {
        if (c.step == 2 && c.name == "attn.q" && calls++ == 0) throw HookFailure{7};
      };
      int bare_calls = 0;
      auto bare_thrower = [&bare_calls](Stream&, Param&, const Tensor&, const PostUpdateContext& c) {
        if (c.step == 2 && c.name == "attn.q" && bare_calls++ == 0) throw HookFailure{7};
      };
      auto bare_params = test::swap_model(14), params = test::swap_model(14);
      auto bare = make_muon(bare_params, MuonHooks{nullptr, nullptr, bare_thrower});
      auto inner = make_muon(params, MuonHooks{nullptr, nullptr, thrower});
      auto swapped = swap_muon(*inner, config_of(4, packed));
      for (int step = 1; step <= 4; ++step) {
        test::set_swap_grads(bare_params, step);
        test::set_swap_grads(params, step);
        if (step == 2) {
          CHECK_THROWS_AS(bare->step(), HookFailure);
          CHECK_THROWS_AS(swapped->step(), HookFailure);
          for (const auto& slot : swapped->runtime().slots()) {
            CHECK(slot->state == SlotState::host);
            CHECK((slot->device.is_released() || !slot->created));
          }
          // Group 0 ran before the throw (new state), group 1 never did (old state): as bare.
          CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
        } else {
          bare->step();
          swapped->step();
        }
      }
      bare->stream().synchronize();
      inner->stream().synchronize();
      CHECK(test::params_bitwise_equal(bare_params, params));
      CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
    }
  }

  TEST_CASE("prefetch_early: used when the plan holds, redone when a gradient is missing; bitwise either way") {
    for (bool packed : {true, false}) {
      CAPTURE(packed);
      auto bare_params = test::swap_model(15), params = test::swap_model(15);
      auto bare = make_muon(bare_params);
      auto inner = make_muon(params);
      auto swapped = swap_muon(*inner, config_of(3, packed));
      for (int step = 1; step <= 6; ++step) {
        if (step > 1) swapped->prefetch_early();  // before the gradients exist
        // Steps 5 and 6 give every param a gradient, so the early plan holds.
        if (step >= 5) {
          for (size_t i = 0; i < params.size(); ++i) {
            params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 900 + uint32_t(step * 10 + i));
            bare_params[i]->grad = params[i]->grad.clone();
          }
        } else {
          test::set_swap_grads(bare_params, step);
          test::set_swap_grads(params, step);
        }
        bare->step();
        swapped->step();
        swapped->synchronize();
        const SwapStepReport report = swapped->last_report();
        if (step == 6) CHECK(report.early_prefetch_used);
        if (step == 2) CHECK_FALSE(report.early_prefetch_used);  // attn.o has no gradient at step 2
        bare->stream().synchronize();
        CHECK(test::params_bitwise_equal(bare_params, params));
      }
      CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
    }
  }

  TEST_CASE("prefetch_early: a step that fails its checks keeps it for the retry; calling it again adds nothing") {
    auto bare_params = test::swap_model(15), params = test::swap_model(15);
    auto bare = make_muon(bare_params);
    auto inner = make_muon(params);
    auto swapped = swap_muon(*inner, config_of(3, true));
    const auto every_grad = [&](int step) {  // every param a gradient: the early plan holds
      for (size_t i = 0; i < params.size(); ++i) {
        params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 900 + uint32_t(step * 10 + int(i)));
        bare_params[i]->grad = params[i]->grad.clone();
      }
    };
    every_grad(1);
    bare->step();
    swapped->step();
    swapped->prefetch_early();
    every_grad(2);
    const Tensor good = params[0]->grad;
    params[0]->grad = Tensor::zeros({1}, DType::f32, Device::cpu());  // the trainer's bug: the step throws
    CHECK_THROWS_AS(swapped->step(), Error);
    params[0]->grad = good;
    swapped->prefetch_early();  // the trainer's loop comes round again: its loads are in flight already
    swapped->prefetch_early();
    bare->step();
    swapped->step();
    swapped->synchronize();
    const SwapStepReport report = swapped->last_report();
    CHECK(report.early_prefetch_used);
    bare->stream().synchronize();
    CHECK(test::params_bitwise_equal(bare_params, params));
    CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
    // The loads were issued once: the next step, without a prefetch, moves as many bytes.
    every_grad(3);
    bare->step();
    swapped->step();
    swapped->synchronize();
    CHECK(swapped->last_report().h2d_bytes == report.h2d_bytes);
    CHECK(swapped->last_report().h2d_copies == report.h2d_copies);
    bare->stream().synchronize();
    CHECK(test::params_bitwise_equal(bare_params, params));
  }

  TEST_CASE("device budget chooses swap_times counting unit workspaces; impossible budgets name the sizes") {
    auto params = test::swap_model(16);
    auto muon = make_muon(params);
    SwapConfig c;
    c.packed = false;
    // The plan's units: their state bytes and workspaces (the NS input and workspaces).
    auto plan = [&](SwapOptimizer& s) {
      std::vector<UpdateUnit> units = s.adapter().plan_units(false);
      s.runtime().attach_slots(units, s.optimizer());
      return units;
    };
    auto state_of = [](const UpdateUnit& u) {
      size_t bytes = 0;
      for (const SwapSlot* slot : u.slots) bytes += slot->nbytes();
      return bytes;
    };
    test::set_swap_grads(params, 1);
    size_t workspace = 0;
    for (const UpdateUnit& u : MuonSwapAdapter(*muon).plan_units(false)) workspace = std::max(workspace, size_t(u.workspace_bytes));
    c.device_budget_bytes = 64 * 48 * 4 * 2 + 96 * 40 * 4 + workspace;  // roughly two of the largest units and a workspace
    auto swapped = swap_muon(*muon, c);
    const std::vector<UpdateUnit> units = plan(*swapped);
    swapped->step();
    swapped->synchronize();
    const SwapStepReport report = swapped->last_report();
    CHECK(report.peak_workspace_bytes == workspace);
    CHECK(report.peak_resident_bytes + report.peak_workspace_bytes <= *c.device_budget_bytes);
    CHECK(report.batches > 1);

    auto params2 = test::swap_model(16);
    auto muon2 = make_muon(params2);
    c.device_budget_bytes = 1000;
    auto tiny = swap_muon(*muon2, c);
    test::set_swap_grads(params2, 1);
    // Named: the unit needing the largest budget (its workspace; two chunks take 256 bytes in each).
    const std::vector<UpdateUnit> tiny_units = plan(*tiny);
    const UpdateUnit worst = *std::max_element(
        tiny_units.begin(), tiny_units.end(),
        [](const UpdateUnit& a, const UpdateUnit& b) { return a.workspace_bytes < b.workspace_bytes; });
    const std::string more = worst.params.size() == 1 ? ""
                             : worst.params.size() == 2
                                 ? " and 1 more param"
                                 : " and " + std::to_string(worst.params.size() - 1) + " more params";
    CHECK_THROWS_WITH_AS(
        tiny->step(),
        ("[swap] device_budget_bytes 1000 is below an update unit even in chunks: " +
         std::to_string(worst.workspace_bytes) + " bytes of workspace + 256 bytes for two chunks of 32 " +
         "elements of its " + std::to_string(state_of(worst)) + " bytes of state (the unit of '" +
         worst.params.front()->name + "'" + more + "); the least budget that runs this step is " +
         std::to_string(worst.workspace_bytes + 256) + " bytes")
            .c_str(),
        Error);
    // Every unit fits alone, but the batches in flight with the largest workspace do not: the
    // largest units are chunked until the rest fits, and the budget holds.
    auto params3 = test::swap_model(16);
    auto muon3 = make_muon(params3);
    auto bare_params = test::swap_model(16);
    auto bare = make_muon(bare_params);
    size_t largest = 0;
    for (const UpdateUnit& u : units) largest = std::max(largest, state_of(u) + size_t(u.workspace_bytes));
    c.device_budget_bytes = largest;
    auto tight = swap_muon(*muon3, c);
    test::set_swap_grads(params3, 1);
    test::set_swap_grads(bare_params, 1);
    std::vector<UpdateUnit> units3 = plan(*tight);
    const std::vector<int64_t> costs = tight->adapter().partition_costs(units3);
    size_t need = SIZE_MAX;
    for (size_t t = 1; t <= units3.size(); ++t)
      need = std::min(need, tight->runtime().resident_bytes_needed(units3, PipelineSwapRuntime::partition(costs, int(t))) + workspace);
    REQUIRE(need > largest);
    tight->runtime().plan_batches(units3, costs);
    CHECK(std::any_of(units3.begin(), units3.end(), [](const UpdateUnit& u) { return u.chunk_elements > 0; }));
    tight->step();
    bare->step();
    tight->synchronize();
    bare->synchronize();
    CHECK(test::params_bitwise_equal(bare_params, params3));
    CHECK(tight->last_report().peak_resident_bytes <= largest);
  }

  TEST_CASE("Muon::workspace_bytes is what a unit's update allocates on the device") {
    std::vector<ParamPtr> params = {make_param("a", test::random_tensor({3, 24, 40}, DType::f32, 1)),
                                    make_param("b", test::random_tensor({24, 40}, DType::f32, 2))};
    for (DType ns : {DType::f32, DType::bf16}) {
      CAPTURE(dtype_name(ns));
      Muon muon(Stream(Device::cpu()));
      MuonOptions o;
      o.ns_dtype = ns;
      muon.add_param_group(params, o);
      for (const ParamPtr& p : params) p->grad = test::random_tensor(p->data.shape(), DType::f32, 3);
      std::vector<Param*> batch = {params[0].get(), params[1].get()};
      muon.update_params(0, batch);  // creates the momentum, which is state, not workspace
      muon.stream().synchronize();
      const size_t before = memory_stats(Device::cpu()).current_bytes;
      reset_peak_memory(Device::cpu());
      muon.update_params(0, batch);
      muon.stream().synchronize();
      CHECK(memory_stats(Device::cpu()).peak_bytes - before == size_t(muon.workspace_bytes(0, batch)));
    }
  }

  TEST_CASE("swap configuration errors are named") {
    auto params = test::swap_model(17);
    auto muon = make_muon(params);
    SwapConfig c;
    c.swap_times = 0;
    CHECK_THROWS_WITH_AS(swap_muon(*muon, c), "[swap] swap_times must be positive, got 0", Error);
    c = {};
    c.min_numel = -1;
    CHECK_THROWS_WITH_AS(swap_muon(*muon, c), "[swap] min_numel must be non-negative, got -1", Error);
    c = {};
    c.state_keys = std::vector<std::string>{"momentum_buffer", "momentum_buffer"};
    CHECK_THROWS_WITH_AS(swap_muon(*muon, c), "[swap] state key 'momentum_buffer' is listed twice in state_keys", Error);
    c = {};
    c.state_keys = std::vector<std::string>{"momentum_buffer", ""};
    CHECK_THROWS_WITH_AS(swap_muon(*muon, c), "[swap] state_keys holds an empty key (entry 1)", Error);
    std::vector<ParamPtr> both_params = test::muon_adamw_model();
    MuonWithAdamW both(Stream(Device::cpu()), both_params);
    CHECK_THROWS_WITH_AS(swap_muon_with_adamw(both, c), "[swap] state_keys holds an empty key (entry 1)", Error);
    c = {};
    c.state_keys = std::vector<std::string>{"momentum_buffer", "exp_avg"};
    CHECK_THROWS_WITH_AS(swap_muon(*muon, c), "[swap] state keys [exp_avg] are not Muon state; Muon swaps only [momentum_buffer]",
                         Error);
    MuonHooks hooks;
    hooks.momentum_update_fn = [](Stream&, const std::vector<Tensor>& g, const std::vector<Tensor>&, float, float, bool) { return g; };
    auto custom = make_muon(params, hooks);
    CHECK_THROWS_WITH_AS(swap_muon(*custom, {}),
                         "[swap] Muon swap does not support momentum_update_fn: batching changes the boundary of its calls", Error);
    auto strided = make_muon(params);
    test::set_swap_grads(params, 1);
    strided->step();
    strided->stream().synchronize();
    Tensor& buf = strided->state().at(params[0].get()).tensors.at("momentum_buffer");
    buf = Tensor::zeros({48, 64}, DType::f32, Device::cpu()).transpose(0, 1);
    CHECK_THROWS_WITH_AS(swap_muon(*strided, {}),
                         "[swap] state 'momentum_buffer' of 'attn.q' must be dense, contiguous and own exactly its bytes to be "
                         "swapped, got Tensor(f32, [64, 48], cpu)",
                         Error);
  }

  TEST_CASE("packed, a grad missing: a batch's transfers touch only its own slots (regression)") {
    // The mirrors are laid out in all-grads order (a, d | b | c). Without a's grad the step visits
    // b, c, d; batch 1 = [c, d] must not carry b's bytes (between them in the mirror) back to host.
    auto make = [] {
      return std::vector<ParamPtr>{make_param("a", test::random_tensor({16, 64}, DType::f32, 1)),
                                   make_param("b", test::random_tensor({64, 64}, DType::f32, 2)),
                                   make_param("c", test::random_tensor({32, 32}, DType::f32, 3)),
                                   make_param("d", test::random_tensor({16, 64}, DType::f32, 4))};
    };
    auto bare_params = make(), swap_params = make();
    Muon bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
    bare.add_param_group(bare_params);
    inner.add_param_group(swap_params);
    SwapConfig config;
    config.swap_times = 2;
    config.min_numel = 1;
    auto swapped = swap_muon(inner, config);
    for (int step = 1; step <= 3; ++step) {
      for (size_t i = 0; i < 4; ++i) {
        const bool grad = !(step == 2 && i == 0);
        const uint32_t seed = uint32_t(100 * step) + uint32_t(i);
        bare_params[i]->grad = grad ? test::random_tensor(bare_params[i]->data.shape(), DType::f32, seed) : Tensor();
        swap_params[i]->grad = grad ? test::random_tensor(swap_params[i]->data.shape(), DType::f32, seed) : Tensor();
      }
      bare.step();
      swapped->step();
      bare.stream().synchronize();
      swapped->synchronize();
      const SwapStepReport report = swapped->last_report();
      CAPTURE(step);
      CHECK(report.batches == 2);
      // Every grad present: one copy per batch each way. Without a's: c and d are not adjacent.
      CHECK(report.h2d_copies == (step == 2 ? 3u : 2u));
      CHECK(report.d2h_copies == report.h2d_copies);
      CHECK(test::params_bitwise_equal(bare_params, swap_params));
      CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()));
    }
  }
}
