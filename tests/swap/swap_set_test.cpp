// SwapOptimizerSet: Muon and AdamW swapped as one optimizer: one step (all members checked and
// planned before any changes), one state dict and checkpoint file, resume bitwise.
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "swap_fixture.h"
#include "test_util.h"

using namespace swapopt;
using test::error_of;

namespace {

/** Muon gets the matrices, AdamW the embedding and the vectors. */
std::vector<ParamPtr> model() {
  return {make_param("embed.weight", test::random_tensor({40, 16}, DType::f32, 1)),
          make_param("blocks.0.attn.weight", test::random_tensor({48, 32}, DType::f32, 2)),
          make_param("blocks.0.attn.bias", test::random_tensor({48}, DType::f32, 3)),
          make_param("blocks.0.mlp.weight", test::random_tensor({32, 48}, DType::f32, 4)),
          make_param("final_norm.weight", test::random_tensor({32}, DType::f32, 5))};
}

void set_grads(const std::vector<ParamPtr>& params, uint32_t step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 1000 * step + uint32_t(i));
}

SwapConfig small_config() {
  SwapConfig c;
  c.min_numel = 1;
  c.swap_times = 2;
  return c;
}

/** Every byte a step or a load may change: params, then the whole state dict. */
std::string snapshot(SwapOptimizerSet& set, const std::vector<ParamPtr>& params) {
  set.synchronize();
  std::string out;
  for (const ParamPtr& p : params) out += std::string(static_cast<const char*>(p->data.data_ptr()), p->data.nbytes());
  return out + serialize_state_dict(set.state_dict());
}

struct Trained {
  std::vector<ParamPtr> params = model();
  MuonWithAdamW opt{Stream(Device::cpu()), params};
  std::unique_ptr<SwapOptimizerSet> set = swap_muon_with_adamw(opt, small_config());
};

}  // namespace

TEST_SUITE("swap") {
  TEST_CASE("SwapOptimizerSet's stream, skip switch and report: one for all members") {
    Trained t;
    CHECK(t.set->stream() == t.opt.muon().stream());
    CHECK(t.set->member("adamw").stream() == t.opt.adamw().stream());
    // The report sums the members' (they run one after another) and takes the larger peak.
    set_grads(t.params, 1);
    t.set->step();
    t.set->synchronize();
    const SwapStepReport total = t.set->last_report(), muon = t.set->member("muon").last_report(),
                         adamw = t.set->member("adamw").last_report();
    CHECK(muon.h2d_bytes > 0);
    CHECK(adamw.h2d_bytes > 0);
    CHECK(total.batches == muon.batches + adamw.batches);
    CHECK(total.h2d_bytes == muon.h2d_bytes + adamw.h2d_bytes);
    CHECK(total.d2h_bytes == muon.d2h_bytes + adamw.d2h_bytes);
    CHECK(total.swapped_slots == muon.swapped_slots + adamw.swapped_slots);
    CHECK(total.state_bytes == muon.state_bytes + adamw.state_bytes);
    CHECK(total.peak_resident_bytes == std::max(muon.peak_resident_bytes, adamw.peak_resident_bytes));
    CHECK(total.peak_workspace_bytes == muon.peak_workspace_bytes);  // AdamW has none
    // A NaN in one AdamW grad skips every member's step; nothing changes.
    t.set->set_skip_nonfinite(true);
    CHECK(t.opt.muon().skip_nonfinite());
    CHECK(t.opt.adamw().skip_nonfinite());
    set_grads(t.params, 2);
    t.params.back()->grad.data<float>()[3] = std::nanf("");
    const std::string before = snapshot(*t.set, t.params);
    t.set->step();
    CHECK(t.set->last_step_skipped());
    CHECK(snapshot(*t.set, t.params) == before);
    CHECK(t.set->last_report().skipped_nonfinite);
    set_grads(t.params, 3);
    t.set->step();
    CHECK_FALSE(t.set->last_step_skipped());
    CHECK(snapshot(*t.set, t.params) != before);
  }

  TEST_CASE("SwapOptimizerSet over MuonWithAdamW: one step equals the bare MuonWithAdamW bitwise, one checkpoint resumes bitwise") {
    auto bare_params = model();
    MuonWithAdamW bare(Stream(Device::cpu()), bare_params);
    Trained swapped;
    const std::string path = (std::filesystem::temp_directory_path() / "swapopt_set_test.safetensors").string();
    for (uint32_t step = 1; step <= 4; ++step) {
      set_grads(bare_params, step);
      set_grads(swapped.params, step);
      bare.step();
      swapped.set->step();
      if (step == 2) save_state_dict(swapped.set->state_dict(), path);
    }
    bare.synchronize();
    swapped.set->synchronize();
    for (size_t i = 0; i < bare_params.size(); ++i) CHECK(test::same_bits(bare_params[i]->data, swapped.params[i]->data));

    // Resume from step 2's file into a fresh set (params as they were at step 2), two more steps.
    // Resume from step 2's file into a fresh set whose params are step 2's (from a bare replay).
    auto replay_params = model();
    MuonWithAdamW replay(Stream(Device::cpu()), replay_params);
    for (uint32_t step = 1; step <= 2; ++step) {
      set_grads(replay_params, step);
      replay.step();
    }
    replay.synchronize();
    Trained resumed;
    for (size_t i = 0; i < replay_params.size(); ++i)
      std::memcpy(resumed.params[i]->data.data_ptr(), replay_params[i]->data.data_ptr(), replay_params[i]->data.nbytes());
    resumed.set->load_state_dict(load_state_dict(path));
    for (uint32_t step = 3; step <= 4; ++step) {
      set_grads(resumed.params, step);
      resumed.set->step();
    }
    resumed.set->synchronize();
    for (size_t i = 0; i < bare_params.size(); ++i) CHECK(test::same_bits(bare_params[i]->data, resumed.params[i]->data));
    CHECK(serialize_state_dict(resumed.set->state_dict()) == serialize_state_dict(swapped.set->state_dict()));
    std::remove(path.c_str());
  }

  TEST_CASE(
      "swap_muon_with_adamw splits state_keys by family: each half swaps its listed keys, bitwise the bare step") {
    const std::vector<std::vector<std::string>> choices = {
        {"momentum_buffer"}, {"exp_avg_sq"}, {"momentum_buffer", "exp_avg"}, {}};
    for (const std::vector<std::string>& keys : choices) {
      CAPTURE(keys.size());
      auto bare_params = model(), swap_params = model();
      MuonWithAdamW bare(Stream(Device::cpu()), bare_params), inner(Stream(Device::cpu()), swap_params);
      SwapConfig config = small_config();
      config.state_keys = keys;
      auto set = swap_muon_with_adamw(inner, config);
      for (uint32_t step = 1; step <= 3; ++step) {
        set_grads(bare_params, step);
        set_grads(swap_params, step);
        bare.step();
        set->step();
      }
      bare.synchronize();
      set->synchronize();
      for (size_t i = 0; i < bare_params.size(); ++i)
        CHECK(test::same_bits(bare_params[i]->data, swap_params[i]->data));
      CHECK(serialize_state_dict(set->state_dict()) == serialize_state_dict(bare.state_dict()));
      // A half none of whose keys is listed swaps nothing; the other swaps its listed keys only.
      const bool muon_listed = std::find(keys.begin(), keys.end(), "momentum_buffer") != keys.end();
      const int64_t adamw_listed = int64_t(keys.size()) - (muon_listed ? 1 : 0);
      CHECK(set->member("muon").last_report().swapped_slots == (muon_listed ? 2 : 0));  // two matrices
      CHECK(set->member("adamw").last_report().swapped_slots == 3 * adamw_listed);      // the embedding, two vectors
    }
    auto params = model();
    MuonWithAdamW opt(Stream(Device::cpu()), params);
    SwapConfig config;
    config.state_keys = std::vector<std::string>{"exp_avg", "velocity"};
    CHECK(
        error_of([&] { swap_muon_with_adamw(opt, config); }) ==
        "[swap] state keys [velocity] are neither Muon nor AdamW state; Muon swaps [momentum_buffer], AdamW [exp_avg, "
        "exp_avg_sq, max_exp_avg_sq]");
    config.state_keys = std::vector<std::string>{"exp_avg", "exp_avg"};
    CHECK(error_of([&] { swap_muon_with_adamw(opt, config); }) ==
          "[swap] state key 'exp_avg' is listed twice in state_keys");
    CHECK_FALSE(opt.muon().wrapped());
    CHECK_FALSE(opt.adamw().wrapped());
  }

  TEST_CASE("SwapOptimizerSet: the state dict names each member's tensors, and its metadata lists the members") {
    Trained t;
    set_grads(t.params, 1);
    t.set->step();
    const StateDict sd = t.set->state_dict();
    CHECK(sd.tensors.count("muon/state.0.momentum_buffer") == 1);  // blocks.0.attn.weight, Muon's first param
    CHECK(sd.tensors.count("adamw/state.0.exp_avg") == 1);
    for (const auto& [name, tensor] : sd.tensors) CHECK((name.rfind("muon/", 0) == 0 || name.rfind("adamw/", 0) == 0));
    CHECK(sd.metadata.find("\"optimizer\":\"Muon+AdamW\"") != std::string::npos);
  }

  TEST_CASE("SwapOptimizerSet: a bad grad or a budget error in one member changes no member") {
    {
      Trained t;
      set_grads(t.params, 1);
      t.set->step();
      set_grads(t.params, 2);
      t.params[4]->grad = Tensor::zeros({31}, DType::f32, Device::cpu());  // AdamW's
      const std::string before = snapshot(*t.set, t.params);
      CHECK(error_of([&] { t.set->step(); }) ==
            "[AdamW] grad of 'final_norm.weight' is Tensor(f32, [31], cpu), the param Tensor(f32, [32], cpu)");
      CHECK(snapshot(*t.set, t.params) == before);
    }
    {
      auto params = model();
      MuonWithAdamW opt(Stream(Device::cpu()), params);
      SwapConfig tiny = small_config();
      tiny.device_budget_bytes = 100;
      std::vector<SwapOptimizerSet::Member> members;
      members.emplace_back("muon", swap_muon(opt.muon(), small_config()));
      members.emplace_back("adamw", swap_adamw(opt.adamw(), tiny));
      SwapOptimizerSet set(std::move(members));
      set_grads(params, 1);
      const std::string before = snapshot(set, params);
      CHECK(error_of([&] { set.step(); }).rfind("[swap] device_budget_bytes 100 is below an update unit", 0) == 0);
      CHECK(snapshot(set, params) == before);
    }
  }

  TEST_CASE(
      "SwapOptimizerSet: a step that fails its checks leaves every member's options and skip flag as the bare step "
      "does") {
    // Each member's schedule runs before any member's checks, and no skip flag moves until all
    // pass, as in MuonWithAdamW::step(): after the failed step the two agree member by member.
    auto bare_params = model();
    MuonWithAdamW bare(Stream(Device::cpu()), bare_params);
    Trained t;
    for (MuonWithAdamW* o : {&bare, &t.opt}) {
      o->muon().set_schedule([o](int64_t step) { o->muon().set_lr(0.01 * double(step)); });
      o->adamw().set_schedule([o](int64_t step) { o->adamw().set_lr(0.001 * double(step)); });
      o->muon().set_skip_nonfinite(true);
      o->adamw().set_skip_nonfinite(true);
    }
    const auto both = [&](uint32_t step, auto edit) {
      set_grads(bare_params, step);
      set_grads(t.params, step);
      edit(bare_params);
      edit(t.params);
    };
    const auto bad_muon_grad = [](const std::vector<ParamPtr>& p) {  // the member the set checks first
      p[1]->grad = Tensor::zeros({48, 31}, DType::f32, Device::cpu());
    };
    const auto bad_adamw_grad = [](const std::vector<ParamPtr>& p) {  // the member it checks last
      p[4]->grad = Tensor::zeros({31}, DType::f32, Device::cpu());
    };
    const auto fails_alike = [&](const std::string& prefix) {
      const std::string message = error_of([&] { bare.step(); });
      CHECK(message.rfind(prefix, 0) == 0);
      CHECK(error_of([&] { t.set->step(); }) == message);
      for (const auto& [bare_half, swapped_half] :
           {std::pair<Optimizer*, Optimizer*>{&bare.muon(), &t.opt.muon()}, {&bare.adamw(), &t.opt.adamw()}}) {
        CAPTURE(bare_half->name());
        CHECK(swapped_half->metadata_json() == bare_half->metadata_json());  // the schedules' lr
        CHECK(swapped_half->last_step_skipped() == bare_half->last_step_skipped());
      }
    };
    both(1, [](const std::vector<ParamPtr>&) {});
    bare.step();
    t.set->step();
    both(2, bad_muon_grad);  // after a step: the schedules set the next step's lr
    fails_alike("[Muon] grad of 'blocks.0.attn.weight'");
    both(2, [](const std::vector<ParamPtr>& p) { static_cast<float*>(p[4]->grad.data_ptr())[0] = NAN; });
    bare.step();  // AdamW's grad: the whole step skips
    t.set->step();
    REQUIRE(t.set->last_step_skipped());
    both(3, bad_muon_grad);  // after a skipped step: the flags stay up
    fails_alike("[Muon] grad of 'blocks.0.attn.weight'");
    both(3, bad_adamw_grad);  // Muon's member passes its checks first: its flag stays up too
    fails_alike("[AdamW] grad of 'final_norm.weight'");
    CHECK(t.set->last_step_skipped());
  }

  TEST_CASE("SwapOptimizerSet: checkpoints of other optimizers or members are named errors that change nothing") {
    Trained t;
    set_grads(t.params, 1);
    t.set->step();
    const StateDict good = t.set->state_dict();
    set_grads(t.params, 2);
    t.set->step();  // now unlike `good`: a partial load would show
    const std::string before = snapshot(*t.set, t.params);

    auto bare_params = model();
    MuonWithAdamW bare(Stream(Device::cpu()), bare_params);
    set_grads(bare_params, 1);
    bare.step();
    CHECK(error_of([&] { t.set->load_state_dict(bare.muon().state_dict()); }) ==
          "[checkpoint] holds the state of one Muon optimizer, not of a set of optimizers (2 members)");
    CHECK(error_of([&] { bare.muon().load_state_dict(good); }) == "[checkpoint] holds Muon+AdamW state, this optimizer is Muon");

    std::vector<SwapOptimizerSet::Member> only_muon;
    auto other_params = model();
    MuonWithAdamW other(Stream(Device::cpu()), other_params);
    only_muon.emplace_back("matrices", swap_muon(other.muon(), small_config()));
    SwapOptimizerSet renamed(std::move(only_muon));
    CHECK(error_of([&] { renamed.load_state_dict(good); }) == "[checkpoint] holds members [muon, adamw], this set has [matrices]");

    StateDict foreign = good;
    foreign.tensors.emplace("sgd/state.0.momentum", Tensor::zeros({1}, DType::f32, Device::cpu()));
    CHECK(error_of([&] { t.set->load_state_dict(foreign); }) ==
          "[checkpoint] tensor 'sgd/state.0.momentum' belongs to no member of the set (muon, adamw)");

    StateDict broken_adamw = good;  // Muon's part is fine: it must not be loaded either
    broken_adamw.tensors.erase("adamw/state.0.exp_avg");
    const std::string error = error_of([&] { t.set->load_state_dict(broken_adamw); });
    CHECK(error.rfind("[checkpoint] member 'adamw': ", 0) == 0);
    CHECK(error.find("[checkpoint]", 1) == std::string::npos);  // said once
    CHECK(snapshot(*t.set, t.params) == before);

    StateDict swapped_names = good;  // the members as they are, the set's "optimizer" not
    const size_t at = swapped_names.metadata.find("\"optimizer\":\"Muon+AdamW\"");
    REQUIRE(at != std::string::npos);
    swapped_names.metadata.replace(at, 24, "\"optimizer\":\"AdamW+Muon\"");
    CHECK(error_of([&] { t.set->load_state_dict(swapped_names); }) ==
          "[checkpoint] names its members' optimizers 'AdamW+Muon', this set's are 'Muon+AdamW'");
    CHECK(snapshot(*t.set, t.params) == before);

    // A key the format does not have (misspelt, or from a newer writer) is refused, not ignored:
    // in the set's metadata, in a member's entry, in a member's own metadata.
    auto with_key = [&](const std::string& after, const std::string& key) {
      StateDict edited = good;
      const size_t at = edited.metadata.find(after);
      REQUIRE(at != std::string::npos);
      edited.metadata.insert(at + after.size(), key);
      return edited;
    };
    CHECK(error_of([&] { t.set->load_state_dict(with_key("{", "\"version\":2,")); }) ==
          "[checkpoint] metadata has unknown key 'version' (expected optimizer, members)");
    CHECK(error_of([&] { t.set->load_state_dict(with_key("\"members\":[{", "\"weight\":1,")); }) ==
          "[checkpoint] metadata: members[0] has unknown key 'weight' (expected name, metadata)");
    // A member entry's own fields are named with its index too.
    auto with_text = [&](const std::string& from, const std::string& to) {
      StateDict edited = good;
      const size_t at = edited.metadata.find(from);
      REQUIRE(at != std::string::npos);
      edited.metadata.replace(at, from.size(), to);
      return edited;
    };
    CHECK(error_of([&] { t.set->load_state_dict(with_text(",\"name\":\"adamw\"}", "}")); }) ==
          "[checkpoint] metadata: members[1] has no 'name'");
    CHECK(error_of([&] { t.set->load_state_dict(with_text("\"name\":\"adamw\"", "\"name\":7")); }) ==
          "[checkpoint] metadata: members[1].name must be a string");
    CHECK(error_of([&] { t.set->load_state_dict(with_text("[{\"metadata\":", "[{\"data\":")); }) ==
          "[checkpoint] metadata: members[0] has unknown key 'data' (expected name, metadata)");
    CHECK(error_of([&] {
            StateDict edited = with_text("[{\"metadata\":\"", "[{\"metadata\":[\"");
            const size_t end = edited.metadata.find("\",\"name\":\"muon\"");
            REQUIRE(end != std::string::npos);
            edited.metadata.replace(end, 1, "\"]");
            t.set->load_state_dict(edited);
          }) == "[checkpoint] metadata: members[0].metadata must be a string");
    CHECK(error_of([&] {
            StateDict edited = good;
            const size_t begin = edited.metadata.find("[{\"metadata\":\"") + 2;
            const size_t end = edited.metadata.find("\",\"name\":\"muon\"");
            REQUIRE(end != std::string::npos);
            edited.metadata.erase(begin, end + 2 - begin);  // the member entry is {"name":"muon"}
            t.set->load_state_dict(edited);
          }) == "[checkpoint] metadata: members[0] has no 'metadata'");
    CHECK(error_of([&] { t.set->load_state_dict(with_key("\\\"optimizer\\\":\\\"AdamW\\\"", ",\\\"beta3\\\":1")); }) ==
          "[checkpoint] member 'adamw': metadata has unknown key 'beta3' (expected optimizer, groups, "
          "param_steps, param_names, param_shards, param_kept)");
    CHECK(
        error_of([&] { t.set->load_state_dict(with_key("\\\"step\\\":1", ",\\\"lr_scale\\\":1")); }) ==
        "[checkpoint] member 'muon': metadata: groups[0] has unknown key 'lr_scale' (expected options, step, params)");
    CHECK(snapshot(*t.set, t.params) == before);
  }

  TEST_CASE(
      "a bare MuonWithAdamW and its swapped set write the same checkpoint and load each other's, resuming bitwise") {
    const std::string path = (std::filesystem::temp_directory_path() / "swapopt_bare_set.safetensors").string();
    auto bare_params = model();
    MuonWithAdamW bare(Stream(Device::cpu()), bare_params);
    Trained t;
    for (uint32_t step = 1; step <= 2; ++step) {
      set_grads(bare_params, step);
      set_grads(t.params, step);
      bare.step();
      t.set->step();
    }
    // One format: the same bytes from either, through either route.
    const std::string bare_bytes = serialize_state_dict(bare.state_dict());
    CHECK(bare_bytes == serialize_state_dict(t.set->state_dict()));
    bare.save_checkpoint(path);
    CHECK(serialize_state_dict(load_state_dict(path)) == bare_bytes);

    // The swapped run resumes from the bare file, and the bare one from the swapped run's: both
    // go on bitwise as the runs they left.
    auto resumed_params = model();
    MuonWithAdamW resumed_bare(Stream(Device::cpu()), resumed_params);
    Trained resumed;
    resumed.set->load_checkpoint(path);
    t.set->save_checkpoint(path);
    resumed_bare.load_checkpoint(path);
    for (size_t i = 0; i < bare_params.size(); ++i) {  // the weights, as a trainer saves them beside
      std::memcpy(resumed_params[i]->data.data_ptr(), bare_params[i]->data.data_ptr(), bare_params[i]->data.nbytes());
      std::memcpy(resumed.params[i]->data.data_ptr(), t.params[i]->data.data_ptr(), t.params[i]->data.nbytes());
    }
    for (uint32_t step = 3; step <= 4; ++step) {
      for (const auto* params : {&bare_params, &t.params, &resumed_params, &resumed.params}) set_grads(*params, step);
      bare.step();
      t.set->step();
      resumed_bare.step();
      resumed.set->step();
    }
    t.set->synchronize();
    resumed.set->synchronize();
    const std::string want = serialize_state_dict(bare.state_dict());
    CHECK(serialize_state_dict(resumed_bare.state_dict()) == want);
    CHECK(serialize_state_dict(t.set->state_dict()) == want);
    CHECK(serialize_state_dict(resumed.set->state_dict()) == want);
    CHECK(test::params_bitwise_equal(bare_params, resumed_params));
    CHECK(test::params_bitwise_equal(bare_params, t.params));
    CHECK(test::params_bitwise_equal(bare_params, resumed.params));

    // A bad part changes neither half, and its error names the member.
    StateDict broken = bare.state_dict();
    broken.tensors.erase("adamw/state.0.exp_avg");
    const std::string before = serialize_state_dict(resumed_bare.state_dict());
    const std::string error = error_of([&] { resumed_bare.load_state_dict(broken); });
    CHECK(error.rfind("[checkpoint] member 'adamw': ", 0) == 0);
    CHECK(serialize_state_dict(resumed_bare.state_dict()) == before);
    CHECK(error_of([&] { resumed_bare.load_state_dict(bare.muon().state_dict()); }) ==
          "[checkpoint] holds the state of one Muon optimizer, not of a set of optimizers (2 members)");
    // While a half is wrapped its state is in the wrapper's mirrors.
    CHECK(error_of([&] { t.opt.save_checkpoint(path); }) ==
          "[Muon] save_checkpoint() on an optimizer wrapped by a SwapOptimizer: call the wrapper's save_checkpoint() "
          "(the "
          "state lives in its host mirrors)");
    std::filesystem::remove(path);
  }

  TEST_CASE("SwapOptimizerSet: member names are unique and plain, and members share one stream") {
    auto params = model();
    MuonWithAdamW a(Stream(Device::cpu()), params);
    auto make = [&](const std::string& first, const std::string& second) {
      std::vector<SwapOptimizerSet::Member> members;
      members.emplace_back(first, swap_muon(a.muon(), small_config()));
      members.emplace_back(second, swap_adamw(a.adamw(), small_config()));
      SwapOptimizerSet set(std::move(members));
    };
    CHECK(error_of([&] { make("m", "m"); }) == "[swap] member name 'm' is used twice");
    CHECK(error_of([&] { make("m", "a/b"); }) ==
          "[swap] member name 'a/b' must be letters, digits, '_' or '-' (it prefixes checkpoint names)");
    auto other_params = model();
    MuonWithAdamW b(Stream(Device::cpu()), other_params);
    std::vector<SwapOptimizerSet::Member> members;
    members.emplace_back("muon", swap_muon(a.muon(), small_config()));
    members.emplace_back("adamw", swap_adamw(b.adamw(), small_config()));
    CHECK(error_of([&] { SwapOptimizerSet set(std::move(members)); }) ==
          "[swap] member 'adamw' runs on another stream than 'muon': the members of a set share one stream");
  }

  TEST_CASE("SwapOptimizerSet: a param in two members, or two sharing memory, is refused (it would be updated twice)") {
    Stream stream(Device::cpu());
    const Tensor storage = Tensor::zeros({8}, DType::f32, Device::cpu());
    ParamPtr p = make_param("p", storage.narrow(0, 0, 4)), q = make_param("q", storage.narrow(0, 2, 4));
    auto make = [&](const ParamPtr& first, const ParamPtr& second) {
      AdamW a(stream), b(stream);
      a.add_param_group({first});
      b.add_param_group({second});
      std::vector<SwapOptimizerSet::Member> members;
      members.emplace_back("a", swap_adamw(a));
      members.emplace_back("b", swap_adamw(b));
      SwapOptimizerSet set(std::move(members));
    };
    CHECK(error_of([&] { make(p, p); }) ==
          "[swap] parameter 'p' is in members 'a' and 'b': each param belongs to one member");
    CHECK(error_of([&] { make(p, q); }).rfind("[swap] parameters 'p' and 'q' share memory", 0) == 0);
  }

  TEST_CASE("swap_muon_with_adamw refused by either half or by the set leaves no layout fixed") {
    // The bias steps first (its AdamW layout fixed), the weight never has: it may still be cast.
    // Each refused wrap below wrapped Muon first, which fixes its layouts; they come undone.
    for (const char* refusal : {"adamw half", "set"}) {
      CAPTURE(refusal);
      Stream stream(Device::cpu());
      ParamPtr w = make_param("layer.weight", test::random_tensor({64, 32}, DType::f32, 1));
      ParamPtr b = make_param("layer.bias", test::random_tensor({64}, DType::f32, 2));
      MuonWithAdamW opt(stream, {w, b});
      b->grad = test::random_tensor({64}, DType::f32, 3);
      opt.step();
      const Tensor bias = b->data;
      if (std::string(refusal) == "adamw half") {
        b->data = Tensor::zeros({64}, DType::bf16, Device::cpu());  // a cast of a fixed layout
        CHECK(error_of([&] { swap_muon_with_adamw(opt); }).rfind("[AdamW] parameter 'layer.bias' is Tensor(bf16", 0) ==
              0);
      } else {
        b->data = w->data.view({2048}).narrow(0, 0, 64);  // memory shared with the weight: the set refuses
        CHECK(error_of([&] { swap_muon_with_adamw(opt); }).rfind("[swap] parameters", 0) == 0);
      }
      b->data = bias;
      CHECK_FALSE(opt.muon().wrapped());
      CHECK_FALSE(opt.adamw().wrapped());
      w->data = test::random_tensor({64, 32}, DType::bf16, 4);  // allowed: its layout is not fixed
      w->grad = test::random_tensor({64, 32}, DType::f32, 5);
      CHECK(error_of([&] { opt.step(); }) == "");
    }
  }
}
