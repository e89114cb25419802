// Bad input gets its named error and changes nothing: bare, swapped and 2-rank HSDP optimizers,
// every kind of bad grad, bad options, and checkpoints that must not load. Each case compares a
// snapshot of every byte a step or a load may change, taken before and after.
#include <chrono>
#include <future>
#include <thread>

#include "optim/thread_communicator.h"
#include "test_util.h"

using namespace swapopt;
using test::error_of;

namespace {

/** Params of both optimizers: square matrices (so a transposed grad keeps the shape) and a vector. */
std::vector<ParamPtr> model(bool with_vector) {
  std::vector<ParamPtr> out = {make_param("w0", test::random_tensor({32, 32}, DType::f32, 1)),
                               make_param("w1", test::random_tensor({16, 48}, DType::f32, 2)),
                               make_param("w2", test::random_tensor({32, 32}, DType::f32, 3))};
  if (with_vector) out.insert(out.begin() + 1, make_param("bias", test::random_tensor({64}, DType::f32, 4)));
  return out;
}

/** Replaces the first `from` in `text` by `to`; `from` must be there. */
void replace_once(std::string& text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
}

void set_grads(const std::vector<ParamPtr>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, uint32_t(100 * step + int(i)));
}

/** Every byte a step or a load may change. */
std::string snapshot(Optimizer& opt, const std::vector<ParamPtr>& params, SwapOptimizer* swapped) {
  if (swapped != nullptr) swapped->runtime().synchronize_copies();
  opt.stream().synchronize();
  std::ostringstream out;
  auto bytes = [&](const Tensor& t) {
    const Tensor host = t.to(Device::cpu());
    out << t.str() << ':' << std::string(static_cast<const char*>(host.data_ptr()), host.nbytes()) << ';';
  };
  for (const ParamPtr& p : params) bytes(p->data);
  for (const ParamGroup& g : opt.param_groups()) out << "group step " << g.step << ';';
  for (const ParamPtr& p : params) {  // in the params' order (the state map is ordered by address)
    const auto it = opt.state().find(p.get());
    if (it == opt.state().end()) continue;
    const Param* param = p.get();
    const ParamState& ps = it->second;
    out << param->name << " step " << ps.step << ';';
    for (const auto& [key, tensor] : ps.tensors) {
      out << key << ' ';
      const SwapSlot* slot = swapped ? swapped->runtime().find_slot(param, key) : nullptr;
      bytes(slot != nullptr ? slot->host : tensor);
    }
  }
  if (swapped != nullptr)
    for (const auto& slot : swapped->runtime().slots()) {
      out << slot->param->name << '.' << slot->key << " created " << slot->created << " state " << slot_state_name(slot->state);
      bytes(slot->host);
    }
  return out.str();
}

/** A Muon or AdamW, bare or swapped, stepped twice so that all its state exists. */
struct Subject {
  std::vector<ParamPtr> params;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<SwapOptimizer> swapped;

  Subject(bool adamw, bool swap) : params(model(adamw)) {
    if (adamw) {
      auto opt = std::make_unique<AdamW>(Stream(Device::cpu()));
      opt->add_param_group({params[0], params[1]});
      AdamWOptions amsgrad;
      amsgrad.amsgrad = true;
      opt->add_param_group({params[2], params[3]}, amsgrad);
      optimizer = std::move(opt);
    } else {
      auto opt = std::make_unique<Muon>(Stream(Device::cpu()));
      opt->add_param_group(params);
      optimizer = std::move(opt);
    }
    if (swap) {
      SwapConfig config;
      config.swap_times = 2;
      config.min_numel = 1;
      swapped = adamw ? swap_adamw(static_cast<AdamW&>(*optimizer), config) : swap_muon(static_cast<Muon&>(*optimizer), config);
    }
    for (int step = 1; step <= 2; ++step) {
      set_grads(params, step);
      this->step();
    }
  }
  void step() { swapped ? swapped->step() : optimizer->step(); }
  std::string snap() { return snapshot(*optimizer, params, swapped.get()); }
  StateDict state_dict() { return swapped ? swapped->state_dict() : optimizer->state_dict(); }
  void load(const StateDict& state) { swapped ? swapped->load_state_dict(state) : optimizer->load_state_dict(state); }
  std::string name() const { return optimizer->name() + (swapped ? " swapped" : " bare"); }
};


/** A bad grad for the last param, each kind with the message the optimizer named `opt` gives. */
struct BadGrad {
  std::string kind;
  std::function<Tensor(const Tensor& good)> make;
  std::string muon_message, adamw_message;  // "" : that optimizer accepts it
};

std::vector<BadGrad> bad_grads() {
  static float foreign[32 * 32];
  return {
      {"wrong shape", [](const Tensor&) { return Tensor::zeros({32, 31}, DType::f32, Device::cpu()); },
       "[Muon] grad of 'w2' is Tensor(f32, [32, 31], cpu), the param Tensor(f32, [32, 32], cpu)",
       "[AdamW] grad of 'w2' is Tensor(f32, [32, 31], cpu), the param Tensor(f32, [32, 32], cpu)"},
      {"non-contiguous", [](const Tensor& good) { return good.transpose(0, 1); },
       "[Muon] grad of 'w2' must be contiguous, got strides [1, 32]", "[AdamW] grad of 'w2' must be contiguous, got strides [1, 32]"},
      {"another device",
       [](const Tensor&) { return Tensor::from_blob(foreign, {32, 32}, DType::f32, Device::cuda(0)); },
       "[Muon] grad of 'w2' is on cuda:0, the optimizer on cpu", "[AdamW] grad of 'w2' is on cuda:0, the optimizer on cpu"},
      {"released",
       [](const Tensor& good) {
         Tensor t = good.clone();
         t.storage()->release();
         return t;
       },
       "[Muon] grad of 'w2' is released", "[AdamW] grad of 'w2' is released"},
  };
}

/** Runs `body(rank, world, error, unchanged)` on 2 thread ranks, the body filling in its rank's
 *  error message and whether the failing call changed nothing ("yes"/"no"); an exception of the
 *  body's own setup is its rank's error, "setup: ...". */
struct TwoRankOutcome {
  std::vector<std::string> errors = std::vector<std::string>(2), unchanged = std::vector<std::string>(2);
};
TwoRankOutcome on_two_ranks(const std::function<void(int rank, const std::shared_ptr<Communicator>& world,
                                                     std::string& error, std::string& unchanged)>& body) {
  auto threads = std::make_shared<test::ThreadWorld>();
  TwoRankOutcome out;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        body(rank, std::make_shared<test::ThreadCommunicator>(threads, "world", rank, 2), out.errors[size_t(rank)],
             out.unchanged[size_t(rank)]);
      } catch (const std::exception& e) {
        out.errors[size_t(rank)] = std::string("setup: ") + e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  return out;
}

/** on_two_ranks once bare and once swapped: `body` also gets `swap`; `check` gets each outcome. */
void bare_and_swapped_on_two_ranks(
    const std::function<void(int rank, const std::shared_ptr<Communicator>& world, bool swap, std::string& error,
                             std::string& unchanged)>& body,
    const std::function<void(const TwoRankOutcome&)>& check) {
  for (bool swap : {false, true}) {
    CAPTURE(swap);
    check(on_two_ranks([&](int rank, const std::shared_ptr<Communicator>& world, std::string& error,
                           std::string& unchanged) { body(rank, world, swap, error, unchanged); }));
  }
}

/** Gives every matrix of `params` a layout replicated over a 2x1 mesh (rank `rank` of it): each
 *  is updated by one owner and broadcast to the other replica. */
void replicate_matrices(const std::vector<ParamPtr>& params, int rank) {
  auto mesh =
      std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 1}, std::vector<std::string>{"replicate", "shard"}, rank);
  for (const ParamPtr& p : params)
    if (p->data.dim() == 2)
      p->layout = DTensor(p->data, p->data.shape(), mesh, {Placement::Replicate(), Placement::Replicate()});
}

/** On one of 2 thread ranks: model(false) replicated over a 2x1 mesh, in an HSDP Muon named
 *  `name`, swapped (min_numel 1) with `swap`. */
struct ReplicatedMuon {
  std::vector<ParamPtr> params = model(false);
  Muon muon{Stream(Device::cpu())};
  std::unique_ptr<SwapOptimizer> swapped;

  ReplicatedMuon(int rank, const std::shared_ptr<Communicator>& comm, const std::string& name, bool swap) {
    replicate_matrices(params, rank);
    muon.add_param_group(params);
    muon.enable_hsdp(comm, HsdpOptions{.name = name + (swap ? "S" : "B")});
    if (swap) swapped = swap_muon(muon, {.min_numel = 1});
  }
  void step() { swapped ? swapped->step() : muon.step(); }
  std::string snap() { return snapshot(muon, params, swapped.get()); }
};

}  // namespace

TEST_SUITE("bad input") {
  TEST_CASE("a bad grad on the last param: named error, every byte unchanged (bare and swapped, Muon and AdamW)") {
    for (bool adamw : {false, true})
      for (bool swap : {false, true})
        for (const BadGrad& bad : bad_grads()) {
          Subject s(adamw, swap);
          CAPTURE(s.name());
          CAPTURE(bad.kind);
          set_grads(s.params, 3);
          s.params.back()->grad = bad.make(s.params.back()->grad);
          const std::string want = adamw ? bad.adamw_message : bad.muon_message;
          const std::string before = s.snap();
          CHECK(error_of([&] { s.step(); }) == want);
          CHECK(s.snap() == before);
        }
  }

  TEST_CASE("a grad sharing memory with a param's data: named error, every byte unchanged (bare, swapped, chunked)") {
    // The step writes params while it reads grads: the result would depend on the update order,
    // which a swapped step (batches, chunks) does not share with the bare one.
    const std::string why = " (the step writes the params while it reads the grads: give each grad its own memory)";
    for (bool adamw : {false, true})
      for (int swap = 0; swap < 3; ++swap)
        for (int kind = 0; kind < 3; ++kind) {
          Subject s(adamw, swap > 0);
          if (swap == 2) {  // small budgets: AdamW's units in chunks, Muon's one unit at a time
            s.swapped.reset();
            SwapConfig config{.min_numel = 1, .device_budget_bytes = size_t(adamw ? 8 << 10 : 40 << 10)};
            s.swapped = adamw ? swap_adamw(static_cast<AdamW&>(*s.optimizer), config)
                              : swap_muon(static_cast<Muon&>(*s.optimizer), config);
          }
          CAPTURE(s.name());
          CAPTURE(swap);
          CAPTURE(kind);
          set_grads(s.params, 3);
          const Param& last = *s.params.back();
          const std::string opt = adamw ? "[AdamW]" : "[Muon]";
          std::string want;
          if (kind == 0) {
            s.params.back()->grad = last.data;
            want = opt + " the grad of 'w2' shares memory with its own data" + why;
          } else if (kind == 1) {
            s.params.back()->grad = s.params[0]->data;
            want = opt + " the grad of 'w2' shares memory with the data of 'w0'" + why;
          } else {  // w2's data moved to a buffer one element longer, its grad one element on
            const Tensor buffer = Tensor::zeros({32 * 32 + 1}, DType::f32, Device::cpu());
            const Tensor data = buffer.narrow(0, 0, 32 * 32).view({32, 32});
            ops::copy(s.optimizer->stream(), last.data, data);
            s.optimizer->stream().synchronize();
            s.params.back()->data = data;
            s.params.back()->grad = buffer.narrow(0, 1, 32 * 32).view({32, 32});
            want = opt + " the grad of 'w2' shares memory with its own data" + why;
          }
          const std::string before = s.snap();
          CHECK(error_of([&] { s.step(); }) == want);
          CHECK(s.snap() == before);
          // Data moved away from its old buffer: that buffer is free to be a grad (the check
          // reads where the data is now, not where a step last saw it).
          const Tensor old_w0 = s.params[0]->data;
          s.params[0]->data = old_w0.clone();
          s.params[0]->grad = old_w0;
          s.params.back()->grad = test::random_tensor(s.params.back()->data.shape(), DType::f32, 7);
          CHECK(error_of([&] { s.step(); }) == "");
        }
  }

  TEST_CASE("a param's data pointed elsewhere after add_param_group: checked with the grads, every byte unchanged") {
    static float foreign[32 * 32];
    struct BadData {
      std::string kind;
      std::function<Tensor(const Tensor& good)> make;
      std::string message;  // after "[Muon] " or "[AdamW] "
    };
    const std::vector<BadData> cases = {
        {"non-contiguous", [](const Tensor& good) { return good.clone().transpose(0, 1); },
         "parameter 'w2' must be contiguous, got strides [1, 32]"},
        {"released",
         [](const Tensor& good) {
           Tensor t = good.clone();
           t.storage()->release();
           return t;
         },
         "parameter 'w2' has no data (undefined or released)"},
        {"undefined", [](const Tensor&) { return Tensor(); }, "parameter 'w2' has no data (undefined or released)"},
        {"another shape",
         [](const Tensor& good) {
           return good.clone().view({16, 64});
         },
         "parameter 'w2' is Tensor(f32, [16, 64], cpu), its state was laid out for f32 [32, 32]: data may point at "
         "another buffer of that shape and dtype, not be reshaped or cast"},
        {"another dtype",
         [](const Tensor& good) { return Tensor::from_floats(good.to_float_vector(), good.shape(), DType::bf16); },
         "parameter 'w2' is Tensor(bf16, [32, 32], cpu), its state was laid out for f32 [32, 32]: data may point at "
         "another buffer of that shape and dtype, not be reshaped or cast"},
        {"another device",
         [](const Tensor&) {
           return Tensor::from_blob(foreign, {32, 32}, DType::f32, Device::cuda(0));
         },
         "parameter 'w2' is on cuda:0, the optimizer on cpu"},
    };
    for (bool adamw : {false, true})
      for (bool swap : {false, true})
        for (const BadData& bad : cases) {
          Subject s(adamw, swap);
          CAPTURE(s.name());
          CAPTURE(bad.kind);
          set_grads(s.params, 3);
          const std::string before = s.snap();
          const Tensor good = s.params.back()->data;
          s.params.back()->data = bad.make(good);
          CHECK(error_of([&] { s.step(); }) == "[" + s.optimizer->name() + "] " + bad.message);
          s.params.back()->data = good;
          CHECK(s.snap() == before);
        }
  }

  TEST_CASE(
      "a param may be cast until the optimizer lays out its state: its first update, a checkpoint load or a swap "
      "wrapper fixes its shape and dtype") {
    const std::string fixed =
        "] parameter 'w' is Tensor(f32, [8, 8], cpu), its state was laid out for bf16 [8, 8]: data "
        "may point at another buffer of that shape and dtype, not be reshaped or cast";
    auto to_dtype = [](const Tensor& t, DType dtype) {
      return Tensor::from_floats(t.to_float_vector(), t.shape(), dtype);
    };
    auto make = [](bool adamw, const ParamPtr& param) -> std::unique_ptr<Optimizer> {
      if (adamw) {
        auto opt = std::make_unique<AdamW>(Stream(Device::cpu()));
        opt->add_param_group({param});
        return opt;
      }
      auto opt = std::make_unique<Muon>(Stream(Device::cpu()));
      opt->add_param_group({param});
      return opt;
    };
    for (bool adamw : {false, true}) {
      CAPTURE(adamw);
      const ParamPtr w = make_param("w", test::random_tensor({8, 8}, DType::f32, 1));
      std::unique_ptr<Optimizer> opt = make(adamw, w);
      const StateDict empty = opt->state_dict();
      // The trainer casts its model after building the optimizer: the first update lays out the
      // state for bf16 (Muon's momentum is bf16 then, AdamW's moments f32 as always).
      w->data = to_dtype(w->data, DType::bf16);
      w->grad = test::random_tensor({8, 8}, DType::f32, 2);
      opt->step();
      opt->synchronize();
      const DType momentum = opt->state().at(w.get()).tensors.begin()->second.dtype();
      CHECK(momentum == (adamw ? DType::f32 : DType::bf16));
      const Tensor bf16 = w->data;
      w->data = to_dtype(bf16, DType::f32);
      CHECK(error_of([&] { opt->step(); }) == "[" + opt->name() + fixed);
      w->data = bf16;
      opt->step();
      // A checkpoint load fixes it too (its tensors were checked against the data as it is then),
      // and so does wrapping, before any state exists.
      const ParamPtr w2 = make_param("w", to_dtype(w->data, DType::f32));
      w2->grad = w->grad;
      std::unique_ptr<Optimizer> loaded = make(adamw, w2);
      w2->data = to_dtype(w2->data, DType::bf16);
      loaded->load_state_dict(opt->state_dict());
      w2->data = to_dtype(w2->data, DType::f32);
      CHECK(error_of([&] { loaded->step(); }) == "[" + loaded->name() + fixed);
      // Nor can a load lay it out again (here a checkpoint without state, which fits any data).
      CHECK(error_of([&] { loaded->load_state_dict(empty); }) == "[" + loaded->name() + fixed);
      CHECK(loaded->state().count(w2.get()) == 1);
    }
    // Until fixed, a param still has to be what the optimizer takes: Muon a matrix, checked before
    // any group changes.
    const ParamPtr a = make_param("a", test::random_tensor({8, 8}, DType::f32, 3)),
                   b = make_param("b", test::random_tensor({8, 8}, DType::f32, 4));
    Muon two(Stream(Device::cpu()));
    two.add_param_group({a});
    two.add_param_group({b});
    a->grad = test::random_tensor({8, 8}, DType::f32, 5);
    b->data = b->data.view({64});
    b->grad = test::random_tensor({64}, DType::f32, 6);
    const std::string before = snapshot(two, {a, b}, nullptr);
    CHECK(error_of([&] { two.step(); }) == "[Muon] 1-D parameter 'b' (shape [64]) cannot use Muon");
    CHECK(snapshot(two, {a, b}, nullptr) == before);
    const ParamPtr w = make_param("w", test::random_tensor({8, 8}, DType::bf16, 1));
    Muon muon(Stream(Device::cpu()));
    muon.add_param_group({w});
    auto swapped = swap_muon(muon, {.min_numel = 1});
    w->data = to_dtype(w->data, DType::f32);
    w->grad = test::random_tensor({8, 8}, DType::f32, 2);
    CHECK(error_of([&] { swapped->step(); }) == "[Muon" + fixed);
  }

  TEST_CASE("a param put into param_groups() directly is a named error of the step, every byte unchanged") {
    Subject s(true, false);
    set_grads(s.params, 3);
    const std::string before = s.snap();
    ParamPtr stray = make_param("stray", test::random_tensor({8}, DType::f32, 7));
    stray->grad = test::random_tensor({8}, DType::f32, 8);
    s.optimizer->param_groups()[0].params.push_back(stray);
    CHECK(error_of([&] { s.step(); }) ==
          "[AdamW] parameter 'stray' was put into param_groups() directly: add params with add_param_group()");
    s.optimizer->param_groups()[0].params.pop_back();
    CHECK(s.snap() == before);
  }

  TEST_CASE("a param's data pointed at another buffer of its shape and dtype: the step updates it, swapped as bare") {
    for (bool adamw : {false, true}) {
      Subject bare(adamw, false), swapped(adamw, true);
      CAPTURE(adamw);
      for (Subject* s : {&bare, &swapped}) {
        s->snap();  // waits for the steps so far: clone() is not stream-ordered
        s->params.back()->data = s->params.back()->data.clone();  // the trainer reloads its weights elsewhere
        set_grads(s->params, 3);
        s->step();
        s->snap();  // waits for the step
      }
      CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped.state_dict()));
      for (size_t i = 0; i < bare.params.size(); ++i) {
        CAPTURE(i);
        CHECK(test::same_bits(bare.params[i]->data, swapped.params[i]->data));
      }
      Subject untouched(adamw, false);  // the same two steps, no third
      CHECK(!test::same_bits(bare.params.back()->data, untouched.params.back()->data));
    }
  }

  TEST_CASE("the update pieces the swap adapters call (public) check their params and sizes, changing nothing") {
    Stream stream(Device::cpu());
    const auto param = [](const std::string& name, uint32_t seed) {
      ParamPtr p = make_param(name, test::random_tensor({4, 4}, DType::f32, seed));
      p->grad = test::random_tensor({4, 4}, DType::f32, seed + 10);
      return p;
    };
    ParamPtr a = param("a", 1), b = param("b", 2), foreign = param("foreign", 3);
    AdamW adamw(stream);
    adamw.add_param_group({a});
    adamw.add_param_group({b});
    Muon muon(stream);
    ParamPtr m0 = param("m0", 4), m1 = param("m1", 5);
    muon.add_param_group({m0, m1});
    const auto unchanged = [&](const std::function<void()>& call) {
      const std::string before = serialize_state_dict(adamw.state_dict()) + serialize_state_dict(muon.state_dict());
      const std::string error = error_of(call);
      CHECK(serialize_state_dict(adamw.state_dict()) + serialize_state_dict(muon.state_dict()) == before);
      return error;
    };
    Param* const null_param[] = {nullptr};
    CHECK(unchanged([&] { adamw.update_params(0, null_param); }) == "[AdamW] update_params: null parameter");
    CHECK(unchanged([&] { adamw.update_param(0, *foreign); }) ==
          "[AdamW] update_param: parameter 'foreign' is not in this optimizer");
    CHECK(unchanged([&] { adamw.update_param(1, *a); }) ==
          "[AdamW] update_param: parameter 'a' is in group 0, not group 1");
    CHECK(unchanged([&] { adamw.update_param(2, *a); }) == "[AdamW] update_param: no group 2 (2 groups)");
    CHECK(unchanged([&] { muon.update_params(1, {m0.get()}); }) == "[Muon] update_params: no group 1 (1 group)");
    CHECK(unchanged([&] { adamw.update_param_chunk(1, *a, 0, 4, {}); }) ==
          "[AdamW] update_param_chunk: parameter 'a' is in group 0, not group 1");
    const Tensor out = Tensor::zeros({16}, DType::f32, Device::cpu());
    CHECK(unchanged([&] {
            muon.momentum_into(0, {m0.get(), m1.get()}, {out});
          }) == "[Muon] momentum_into: 1 outputs for 2 params");
    CHECK(unchanged([&] { muon.momentum_into(0, {m0.get()}, {Tensor::zeros({15}, DType::f32, Device::cpu())}); }) ==
          "[Muon] momentum_into: output 0 is Tensor(f32, [15], cpu), 'm0' has 16 elements");
    CHECK(unchanged([&] { muon.momentum_into(0, {foreign.get()}, {out}); }) ==
          "[Muon] momentum_into: parameter 'foreign' is not in this optimizer");
    CHECK(unchanged([&] { muon.momentum_chunk(0, *foreign, 0, 4, Tensor(), out.narrow(0, 0, 4)); }) ==
          "[Muon] momentum_chunk: parameter 'foreign' is not in this optimizer");
    CHECK(unchanged([&] { muon.update_params(0, {nullptr}); }) == "[Muon] update_params: null parameter");
    CHECK(unchanged([&] {
            muon.process_unsharded_batch(0, {m0.get(), m1.get()}, Tensor::zeros({1, 4, 4}, DType::f32, Device::cpu()));
          }) ==
          "[Muon] process_unsharded_batch: ns_input is Tensor(f32, [1, 4, 4], cpu), the params need a contiguous f32 "
          "[2, 4, 4] on cpu");
    const std::string need = ", the params need a contiguous f32 [2, 4, 4] on cpu";
    for (const Tensor& bad :
         {Tensor::zeros({2, 2, 8}, DType::f32, Device::cpu()), Tensor::zeros({2, 4, 4}, DType::bf16, Device::cpu()),
          Tensor::zeros({2, 4, 4}, DType::f32, Device::cpu()).transpose(1, 2)})
      CHECK(unchanged([&] {
              muon.process_unsharded_batch(0, {m0.get(), m1.get()}, bad);
            }) == "[Muon] process_unsharded_batch: ns_input is " + bad.str() + need);
    CHECK(unchanged([&] { muon.update_momentum(0, {foreign.get()}); }) ==
          "[Muon] update_momentum: parameter 'foreign' is not in this optimizer");
    // Every param's data is checked before any is written (a bad m1 left m0 updated; found by a
    // hunting helper), and ns_input may not be a param's memory.
    const Tensor ns_input = Tensor::zeros({2, 4, 4}, DType::f32, Device::cpu());
    const auto with_m1_data = [&](const Tensor& data, const std::function<void()>& call) {
      const Tensor good = m1->data, m0_before = m0->data.clone(), m1_before = m1->data.clone();
      m1->data = data;
      const std::string error = unchanged(call);
      m1->data = good;
      muon.synchronize();
      CHECK(test::same_bits(m0->data, m0_before));
      CHECK(test::same_bits(m1->data, m1_before));
      return error;
    };
    Tensor released = m1->data.clone();
    released.storage()->release();
    CHECK(with_m1_data(released, [&] {
            muon.process_unsharded_batch(0, {m0.get(), m1.get()}, ns_input);
          }) == "[Muon] parameter 'm1' has no data (undefined or released)");
    CHECK(with_m1_data(m1->data.clone().transpose(0, 1), [&] {
            muon.process_unsharded_batch(0, {m0.get(), m1.get()}, ns_input);
          }) == "[Muon] parameter 'm1' must be contiguous, got strides [1, 4]");
    CHECK(with_m1_data(ns_input.narrow(0, 1, 1).view({4, 4}), [&] {
            muon.process_unsharded_batch(0, {m0.get(), m1.get()}, ns_input);
          }) == "[Muon] process_unsharded_batch: ns_input shares memory with 'm1' (its update is read from there)");
    CHECK(with_m1_data(m1->data, [&] {
            muon.process_unsharded_batch(0, {m0.get(), m0.get()}, ns_input);
          }) == "[Muon] process_unsharded_batch: parameter 'm0' is listed twice");
    Tensor released_input = ns_input.clone();
    released_input.storage()->release();
    CHECK(with_m1_data(m1->data, [&] {
            muon.process_unsharded_batch(0, {m0.get(), m1.get()}, released_input);
          }).starts_with("[Muon] process_unsharded_batch: ns_input is Tensor("));
    // The good calls still work.
    adamw.update_param(1, *b);
    muon.update_params(0, {m0.get(), m1.get()});
    muon.synchronize();
    CHECK(adamw.state().count(b.get()) == 1);
    CHECK(muon.state().count(m1.get()) == 1);
  }

  TEST_CASE(
      "the update pieces check grads, outputs and staged state before anything changes, and are refused on a "
      "wrapped optimizer outside its step") {
    Stream stream(Device::cpu());
    const auto param = [](const std::string& name, uint32_t seed) {
      ParamPtr p = make_param(name, test::random_tensor({4, 6}, DType::f32, seed));
      p->grad = test::random_tensor({4, 6}, DType::f32, seed + 10);
      return p;
    };
    // Each piece runs once first, so that the refusals below meet params with state and without.
    ParamPtr a = param("a", 1), a2 = param("a2", 2), m = param("m", 3), m2 = param("m2", 4);
    AdamW adamw(stream);
    adamw.add_param_group({a, a2});
    Muon muon(stream);
    muon.add_param_group({m, m2});
    adamw.update_param(0, *a);
    muon.update_params(0, {m.get()});
    muon.synchronize();
    std::unique_ptr<SwapOptimizer> swapped_adamw, swapped_muon;  // set while wrapped
    const auto state = [&] {
      return serialize_state_dict(swapped_adamw ? swapped_adamw->state_dict() : adamw.state_dict()) +
             serialize_state_dict(swapped_muon ? swapped_muon->state_dict() : muon.state_dict());
    };
    const auto unchanged = [&](const std::function<void()>& call) {
      const std::string before = state();
      const std::vector<Tensor> data = {a->data.clone(), a2->data.clone(), m->data.clone(), m2->data.clone()};
      const std::string error = error_of(call);
      muon.synchronize();
      CHECK(state() == before);
      CHECK(test::same_bits(a->data, data[0]));
      CHECK(test::same_bits(a2->data, data[1]));
      CHECK(test::same_bits(m->data, data[2]));
      CHECK(test::same_bits(m2->data, data[3]));
      return error;
    };
    const Tensor out = Tensor::zeros({24}, DType::f32, Device::cpu());
    const Tensor strided = Tensor::zeros({6, 4}, DType::f32, Device::cpu()).transpose(0, 1);
    for (ParamPtr* p : {&a, &a2, &m, &m2}) {  // with state (a, m) and without (a2, m2)
      const Tensor grad = (*p)->grad;
      (*p)->grad = strided;
      const std::string bad_grad = "] grad of '" + (*p)->name + "' must be contiguous, got strides [1, 4]";
      if (p == &a || p == &a2) {
        CHECK(unchanged([&] { adamw.update_param(0, **p); }) == "[AdamW" + bad_grad);
        CHECK(unchanged([&] { adamw.update_params(0, std::vector<Param*>{p->get()}); }) == "[AdamW" + bad_grad);
        CHECK(unchanged([&] { adamw.update_param_chunk(0, **p, 0, 8, {}); }) == "[AdamW" + bad_grad);
      } else {
        CHECK(unchanged([&] { muon.update_params(0, {p->get()}); }) == "[Muon" + bad_grad);
        CHECK(unchanged([&] { muon.update_momentum(0, {p->get()}); }) == "[Muon" + bad_grad);
        CHECK(unchanged([&] { muon.momentum_into(0, {p->get()}, {out}); }) == "[Muon" + bad_grad);
        CHECK(unchanged([&] { muon.momentum_chunk(0, **p, 0, 8, Tensor(), out.narrow(0, 0, 8)); }) ==
              "[Muon" + bad_grad);
      }
      (*p)->grad = grad;
    }
    // Outputs and staged state the caller passes.
    CHECK(unchanged([&] {
            muon.momentum_into(0, {m2.get()}, {Tensor::zeros({4, 6}, DType::f32, Device::cpu()).transpose(0, 1)});
          }) == "[Muon] momentum_into's output 0 is Tensor(f32, [6, 4], cpu): it must be contiguous, on cpu");
    CHECK(unchanged([&] { muon.momentum_chunk(0, *m2, 0, 8, Tensor(), strided.narrow(1, 0, 2)); }) ==
          "[Muon] momentum_chunk's output is Tensor(f32, [4, 2], cpu): it must be contiguous, on cpu");
    for (const Tensor& staged :
         {Tensor::zeros({7}, DType::f32, Device::cpu()), Tensor::zeros({8}, DType::bf16, Device::cpu()),
          Tensor::zeros({2, 4}, DType::f32, Device::cpu())})
      CHECK(unchanged([&] { muon.momentum_chunk(0, *m2, 0, 8, staged, out.narrow(0, 0, 8)); }) ==
            "[Muon] momentum_chunk's staged buffer is " + staged.str() + ", the chunk needs f32 [8]");
    for (const Tensor& staged :
         {Tensor::zeros({7}, DType::f32, Device::cpu()), Tensor::zeros({8}, DType::bf16, Device::cpu()),
          Tensor::zeros({16}, DType::f32, Device::cpu()).narrow(0, 0, 8).view({8})})
      for (const std::string key : {"exp_avg", "exp_avg_sq"}) {
        if (staged.dtype() == DType::f32 && staged.numel() == 8) continue;  // the good one
        CHECK(unchanged([&] {
                adamw.update_param_chunk(0, *a2, 0, 8, {{key, staged}});
              }) == "[AdamW] update_param_chunk: staged '" + key + "' is " + staged.str() +
                        ", the chunk needs a contiguous f32 [8] on cpu");
      }
    CHECK(unchanged([&] {
            adamw.update_param_chunk(0, *a2, 0, 8, {{"max_exp_avg_sq", Tensor::zeros({8}, DType::f32, Device::cpu())}});
          }) ==
          "[AdamW] update_param_chunk: staged state 'max_exp_avg_sq' is not a state key of group 0 (exp_avg, "
          "exp_avg_sq)");

    // Outputs and staged state that share memory with the update's other operands: the op refuses
    // them, and the piece checks them before it creates state or counts a step (found by a hunting
    // helper: the state was created and the step counted, and the optimizer's own checkpoint no
    // longer loaded). m and a have state, m2 and a2 none.
    const Tensor grads = Tensor::zeros({48}, DType::f32, Device::cpu());
    const auto with_grad_in = [&](Param& p, const std::function<void()>& call) {
      return [&p, &grads, call] {
        const Tensor grad = p.grad;
        p.grad = grads.narrow(0, 0, 24).view({4, 6});
        try {
          call();
        } catch (...) {
          p.grad = grad;
          throw;
        }
        p.grad = grad;
      };
    };
    const std::string momentum_grad = "[muon_momentum] update and grad share memory without being the same view";
    for (Param* p : {m.get(), m2.get()}) {
      CHECK(unchanged(with_grad_in(*p, [&] {
              muon.momentum_into(0, {p}, {grads.narrow(0, 8, 24)});
            })).starts_with(momentum_grad));
      CHECK(unchanged(with_grad_in(*p, [&] {
              muon.momentum_chunk(0, *p, 0, 8, Tensor(), grads.narrow(0, 4, 8));
            })).starts_with(momentum_grad));
    }
    const Tensor m_buffer = muon.state()[m.get()].tensors.at("momentum_buffer");
    CHECK(unchanged([&] { muon.momentum_into(0, {m.get()}, {m_buffer.view({24})}); }).starts_with("[muon_momentum] "));
    CHECK(unchanged([&] {
            muon.momentum_chunk(0, *m, 0, 8, Tensor(), m_buffer.view({24}).narrow(0, 2, 8));
          }).starts_with("[muon_momentum] "));
    CHECK(unchanged([&] {
            muon.momentum_chunk(0, *m2, 0, 8, m2->grad.view({24}).narrow(0, 2, 8), out.narrow(0, 0, 8));
          }).starts_with("[muon_momentum] "));
    for (Param* p : {a.get(), a2.get()}) {
      CHECK(unchanged([&] {
              adamw.update_param_chunk(0, *p, 0, 8, {{"exp_avg", p->data.view({24}).narrow(0, 0, 8)}});
            }).starts_with("[adamw_update] param and exp_avg share memory"));
      CHECK(unchanged([&] {
              adamw.update_param_chunk(0, *p, 0, 8, {{"exp_avg_sq", p->grad.view({24}).narrow(0, 1, 8)}});
            }).starts_with("[adamw_update] exp_avg_sq and grad share memory"));
    }
    // A buffer placed through state() that overlaps the grad: the pieces that make their own NS
    // inputs check it too, before they count the step.
    {
      const Tensor buffer = muon.state()[m.get()].tensors.at("momentum_buffer"), m_grad = m->grad;
      m->grad = grads.narrow(0, 0, 24).view({4, 6});
      muon.state()[m.get()].tensors["momentum_buffer"] = grads.narrow(0, 8, 24).view({4, 6});
      const std::string buffer_grad =
          "[muon_momentum] momentum_buffer and grad share memory without being the same view";
      CHECK(unchanged([&] { muon.update_momentum(0, {m.get()}); }).starts_with(buffer_grad));
      CHECK(unchanged([&] { muon.update_params(0, {m.get()}); }).starts_with(buffer_grad));
      CHECK(unchanged([&] { muon.momentum_into(0, {m.get()}, {out}); }).starts_with(buffer_grad));
      muon.state()[m.get()].tensors["momentum_buffer"] = buffer;
      m->grad = m_grad;
    }
    // Across the params of one fused op (they run concurrently): a2's grad is a's exp_avg.
    const Tensor a2_grad = a2->grad;
    a2->grad = adamw.state()[a.get()].tensors.at("exp_avg");
    CHECK(unchanged([&] {
            adamw.update_params(0, std::vector<Param*>{a.get(), a2.get()});
          }) ==
          "[adamw_update_many] update 1's grad and update 0's exp_avg share memory: the updates run concurrently, so "
          "none may write what another reads or writes");
    a2->grad = a2_grad;

    // A param listed twice, a chunk past 0 before the param's first update, options a step refuses.
    CHECK(unchanged([&] {
            muon.update_params(0, {m.get(), m.get()});
          }) == "[Muon] update_params: parameter 'm' is listed twice");
    CHECK(unchanged([&] {
            muon.momentum_into(0, {m.get(), m.get()}, {out, out});
          }) == "[Muon] momentum_into: parameter 'm' is listed twice");
    CHECK(unchanged([&] { adamw.update_param_chunk(0, *a2, 8, 16, {}); }) ==
          "[AdamW] update_param_chunk: chunk [8, 16) of 'a2' before its first update's chunk at 0 (that chunk counts "
          "the step)");
    CHECK(unchanged([&] { muon.momentum_chunk(0, *m2, 8, 16, Tensor(), out.narrow(0, 0, 8)); }) ==
          "[Muon] momentum_chunk: chunk [8, 16) of 'm2' before its first update's chunk at 0 (that chunk counts the "
          "step)");
    // (the option is put back before the state is compared: state_dict() refuses bad options too)
    const auto with_option = [](auto& option, auto bad, const std::function<void()>& call) {
      return [&option, bad, call] {
        const auto good = option;
        option = bad;
        try {
          call();
        } catch (...) {
          option = good;
          throw;
        }
        option = good;
      };
    };
    CHECK(unchanged(with_option(muon.mutable_options(0).lr, std::nan(""), [&] {
            muon.update_params(0, {m2.get()});
          })) == "[Muon] group 0: lr must be finite and >= 0, got nan");
    // 'a' has state from a step without amsgrad.
    CHECK(unchanged(with_option(adamw.mutable_options(0).amsgrad, true, [&] {
            adamw.update_param(0, *a2);
          })).starts_with("[AdamW] group 0 cannot turn amsgrad on"));

    // Wrapped: the state is in the wrapper's mirrors, so no piece may run outside the wrapper's step.
    {
      swapped_adamw = swap_adamw(adamw, {.min_numel = 1});
      swapped_muon = swap_muon(muon, {.min_numel = 1});
      const std::string outside =
          "() on an optimizer wrapped by a SwapOptimizer, outside its step: the state lives in the wrapper's host "
          "mirrors, and the wrapper's step() updates the params";
      for (ParamPtr* p : {&a, &a2}) {
        CHECK(unchanged([&] { adamw.update_param(0, **p); }) == "[AdamW] update_param" + outside);
        CHECK(unchanged([&] { adamw.update_params(0, std::vector<Param*>{p->get()}); }) ==
              "[AdamW] update_params" + outside);
        CHECK(unchanged([&] { adamw.update_param_chunk(0, **p, 0, 8, {}); }) == "[AdamW] update_param_chunk" + outside);
      }
      for (ParamPtr* p : {&m, &m2}) {
        CHECK(unchanged([&] { muon.update_params(0, {p->get()}); }) == "[Muon] update_params" + outside);
        CHECK(unchanged([&] { muon.update_momentum(0, {p->get()}); }) == "[Muon] update_momentum" + outside);
        CHECK(unchanged([&] { muon.momentum_into(0, {p->get()}, {out}); }) == "[Muon] momentum_into" + outside);
        CHECK(unchanged([&] { muon.momentum_chunk(0, **p, 0, 8, Tensor(), out.narrow(0, 0, 8)); }) ==
              "[Muon] momentum_chunk" + outside);
      }
      swapped_adamw.reset();
      swapped_muon.reset();
    }
    // The good calls still work, unwrapped again.
    adamw.update_param_chunk(0, *a2, 0, 24, {});
    muon.update_params(0, {m2.get()});
    muon.synchronize();
    CHECK(adamw.state().at(a2.get()).step == 1);
    CHECK(muon.state().at(m2.get()).step == 1);
  }

  TEST_CASE("options finite as doubles but beyond f32, which the updates compute in, are refused") {
    CHECK(error_of([] { AdamWOptions{.lr = 1e39}.validate(); }) ==
          "[AdamW] lr 1e+39 is beyond the f32 range the updates compute in (at most 3.40282e+38)");
    CHECK(error_of([] { AdamWOptions{.eps = 1e300}.validate(); }) ==
          "[AdamW] eps 1e+300 is beyond the f32 range the updates compute in (at most 3.40282e+38)");
    CHECK(error_of([] { MuonOptions{.weight_decay = 4e38}.validate(); }) ==
          "[Muon] weight_decay 4e+38 is beyond the f32 range the updates compute in (at most 3.40282e+38)");
    CHECK(error_of([] { MuonOptions{.lr = 3e38}.validate(); }).empty());
    // A group's lr set beyond f32 changes nothing.
    Subject s(true, false);
    const std::string before = s.snap();
    CHECK(error_of([&] { static_cast<AdamW&>(*s.optimizer).set_lr(1e39); }) ==
          "[AdamW] lr 1e+39 is beyond the f32 range the updates compute in (at most 3.40282e+38)");
    CHECK(s.snap() == before);
  }

  TEST_CASE("options each within f32 whose products in the update are not: refused by name, changing nothing") {
    CHECK(error_of([] { AdamWOptions{.lr = 1e20, .weight_decay = 1e20}.validate(); }) ==
          "[AdamW] lr x weight_decay is 1e+40: beyond the f32 range the updates compute in (at most 3.40282e+38)");
    CHECK(error_of([] { AdamWOptions{.lr = 1e38, .weight_decay = 0}.validate(); }) ==
          "[AdamW] lr / (1 - beta1), the first step's size, is 1e+39: beyond the f32 range the updates compute in (at "
          "most 3.40282e+38)");
    CHECK(error_of([] { AdamWOptions{.lr = 3e37, .beta1 = 0.0, .weight_decay = 0}.validate(); }).empty());
    CHECK(error_of([] { MuonOptions{.lr = 1e30, .weight_decay = 1e10}.validate(); }) ==
          "[Muon] lr x weight_decay is 1e+40: beyond the f32 range the updates compute in (at most 3.40282e+38)");
    CHECK(error_of([] { MuonOptions{.lr = 1e30, .weight_decay = 0, .matched_adamw_rms = 1e9}.validate(); }) ==
          "[Muon] lr x matched_adamw_rms is 1e+39: beyond the f32 range the updates compute in (at most 3.40282e+38)");
    // lr x matched_adamw_rms fits, times sqrt(the larger side) it does not: the step names the param.
    for (bool swap : {false, true}) {
      Subject s(false, swap);
      CAPTURE(s.name());
      auto& muon = static_cast<Muon&>(*s.optimizer);
      MuonOptions o = muon.options(0);
      o.lr = 1e38;
      o.weight_decay = 0;
      o.matched_adamw_rms = 1;
      muon.set_options(0, o);
      set_grads(s.params, 3);
      const std::string before = s.snap();
      CHECK(
          error_of([&] { s.step(); }) ==
          "[Muon] parameter 'w0': lr x sqrt([32, 32]'s larger side) x matched_adamw_rms is 5.65685e+38: beyond the f32 "
          "range the updates compute in (at most 3.40282e+38)");
      CHECK(s.snap() == before);
    }
  }

  TEST_CASE("MuonWithAdamW: bad options are refused also for a half no param is routed to") {
    const std::vector<ParamPtr> matrices = {make_param("w", test::random_tensor({4, 4}, DType::f32, 1))};
    const std::vector<ParamPtr> vectors = {make_param("b", test::random_tensor({4}, DType::f32, 1))};
    CHECK(error_of([&] { MuonWithAdamW(Stream(Device::cpu()), matrices, {}, AdamWOptions{.lr = std::nan("")}); }) ==
          "[AdamW] lr must be finite and >= 0, got nan");
    CHECK(error_of([&] { MuonWithAdamW(Stream(Device::cpu()), vectors, MuonOptions{.lr = -1.0}); }) ==
          "[Muon] lr must be finite and >= 0, got -1");
  }

  TEST_CASE("MuonWithAdamW: a bad AdamW grad stops Muon's half too") {
    auto params = model(true);
    MuonWithAdamW opt(Stream(Device::cpu()), params);
    set_grads(params, 1);
    opt.step();
    set_grads(params, 2);
    params[1]->grad = Tensor::zeros({63}, DType::f32, Device::cpu());
    const std::string before = snapshot(opt.muon(), params, nullptr) + snapshot(opt.adamw(), params, nullptr);
    CHECK(error_of([&] { opt.step(); }) == "[AdamW] grad of 'bias' is Tensor(f32, [63], cpu), the param Tensor(f32, [64], cpu)");
    CHECK(snapshot(opt.muon(), params, nullptr) + snapshot(opt.adamw(), params, nullptr) == before);
  }

  TEST_CASE("options changed through mutable_options are checked at the next step and before state_dict") {
    for (bool adamw : {false, true})
      for (bool swap : {false, true}) {
        Subject s(adamw, swap);
        CAPTURE(s.name());
        set_grads(s.params, 3);
        if (adamw) {
          static_cast<AdamW&>(*s.optimizer).mutable_options(1).lr = std::nan("");
        } else {
          static_cast<Muon&>(*s.optimizer).mutable_options(0).momentum = 1.5;
        }
        const std::string want = adamw ? "[AdamW] group 1: lr must be finite and >= 0, got nan"
                                       : "[Muon] group 0: momentum must be in [0, 1), got 1.5";
        const std::string before = s.snap();
        CHECK(error_of([&] { s.step(); }) == want);
        CHECK(s.snap() == before);
        CHECK(error_of([&] { s.state_dict(); }) == want);  // never a non-finite value in the metadata
      }
  }

  TEST_CASE(
      "AdamW's amsgrad cannot change once its group has state: named error, every byte unchanged, the state still "
      "loads") {
    const std::string why =
        " (amsgrad decides which state a param keeps: choose it in add_param_group, or before the group's first step)";
    const std::string want_off =
        "[AdamW] group 1 cannot turn amsgrad off: param 'w1' has state from steps with it" + why;
    const std::string want_on =
        "[AdamW] group 0 cannot turn amsgrad on: param 'w0' has state from steps without it" + why;
    for (bool swap : {false, true}) {
      Subject s(true, swap);  // group 0 {w0, bias}, group 1 {w1, w2} with amsgrad, stepped twice
      CAPTURE(s.name());
      AdamW& adamw = static_cast<AdamW&>(*s.optimizer);
      const std::string before = s.snap();
      AdamWOptions off = adamw.options(1), on = adamw.options(0);
      off.amsgrad = false;
      on.amsgrad = true;
      CHECK(error_of([&] { adamw.set_options(1, off); }) == want_off);
      CHECK(error_of([&] { adamw.set_options(0, on); }) == want_on);
      CHECK(adamw.options(1).amsgrad);
      CHECK_FALSE(adamw.options(0).amsgrad);
      // Changed in place, it is caught by the next step and by a save, before anything changes.
      set_grads(s.params, 3);
      adamw.mutable_options(1).amsgrad = false;
      CHECK(error_of([&] { s.step(); }) == want_off);
      CHECK(error_of([&] { s.state_dict(); }) == want_off);
      CHECK(s.snap() == before);
      adamw.mutable_options(1).amsgrad = true;
      s.step();
      Subject other(true, swap);
      CHECK(error_of([&] { other.load(s.state_dict()); }).empty());
    }
    // Before a group's first step it may change either way.
    auto params = model(false);
    AdamW adamw(Stream(Device::cpu()));
    adamw.add_param_group(params);
    AdamWOptions amsgrad;
    amsgrad.amsgrad = true;
    adamw.set_options(0, amsgrad);
    set_grads(params, 1);
    adamw.step();
    CHECK(adamw.state().at(params[0].get()).tensors.count("max_exp_avg_sq") == 1);
  }

  TEST_CASE("a device budget below a unit's workspace and two chunks: named error before anything changes") {
    auto params = model(false);
    Muon muon(Stream(Device::cpu()));
    muon.add_param_group(params);
    SwapConfig config;
    config.min_numel = 1;
    config.device_budget_bytes = 1000;
    auto swapped = swap_muon(muon, config);
    set_grads(params, 1);
    const std::string before = snapshot(muon, params, swapped.get());
    CHECK(
        error_of([&] { swapped->step(); }) ==
        "[swap] device_budget_bytes 1000 is below an update unit even in chunks: 32776 bytes of workspace + 256 bytes "
        "for two chunks of 32 elements of its 8192 bytes of state (the unit of 'w0' and 1 more param); the least "
        "budget that runs this step is 33032 bytes");
    CHECK(snapshot(muon, params, swapped.get()) == before);
    CHECK(muon.state().empty());
  }

  TEST_CASE("the last step a group can take: its state loads, the step after it is refused, changing nothing") {
    for (const bool adamw : {true, false})
      for (const bool swap : {false, true}) {
        CAPTURE(adamw);
        CAPTURE(swap);
        std::vector<ParamPtr> params = model(adamw);
        std::unique_ptr<Optimizer> opt =
            adamw ? std::unique_ptr<Optimizer>(std::make_unique<AdamW>(Stream(Device::cpu())))
                  : std::unique_ptr<Optimizer>(std::make_unique<Muon>(Stream(Device::cpu())));
        adamw ? static_cast<AdamW&>(*opt).add_param_group(params) : static_cast<Muon&>(*opt).add_param_group(params);
        std::unique_ptr<SwapOptimizer> swapped;
        if (swap)
          swapped = adamw ? swap_adamw(static_cast<AdamW&>(*opt), {.min_numel = 1})
                          : swap_muon(static_cast<Muon&>(*opt), {.min_numel = 1});
        const auto step = [&] { swapped ? swapped->step() : opt->step(); };
        const auto state_dict = [&] { return swapped ? swapped->state_dict() : opt->state_dict(); };
        const auto load = [&](const StateDict& s) { swapped ? swapped->load_state_dict(s) : opt->load_state_dict(s); };
        set_grads(params, 1);
        step();
        StateDict late = state_dict();  // one step taken: every count 1, made INT64_MAX - 2
        const std::string big = "9223372036854775805";
        replace_once(late.metadata, "\"step\":1", "\"step\":" + big);
        std::string& meta = late.metadata;
        for (size_t at = meta.find("\"param_steps\":[") + 15; meta[at] != ']'; ++at)
          if (meta[at] == '1') meta.replace(at, 1, big), at += big.size() - 1;
        load(late);
        if (adamw && !swapped) {
          // A chunked update from the last countable step finishes: its first chunk counts the step.
          set_grads(params, 2);
          AdamW& pieces = static_cast<AdamW&>(*opt);
          const int64_t n = params[0]->data.numel();
          pieces.update_param_chunk(0, *params[0], 0, n / 2, {});
          CHECK_NOTHROW(pieces.update_param_chunk(0, *params[0], n / 2, n, {}));
          load(late);
        }
        set_grads(params, 2);
        step();  // to INT64_MAX - 1: its state still loads
        const StateDict last = state_dict();
        CHECK_NOTHROW(load(last));
        const std::string before = serialize_state_dict(state_dict()) + snapshot(*opt, params, swapped.get());
        CHECK(error_of(step) ==
              "[" + opt->name() + "] group 0 has taken 9223372036854775806 steps: no step can follow it");
        CHECK(serialize_state_dict(state_dict()) + snapshot(*opt, params, swapped.get()) == before);
        if (swapped) continue;
        // Nor can an update piece count another step of a param (its file would not load).
        const std::string piece = adamw ? "update_param" : "update_params";
        CHECK(error_of([&] {
                if (adamw) {
                  static_cast<AdamW&>(*opt).update_param(0, *params[0]);
                } else {
                  static_cast<Muon&>(*opt).update_params(0, {params[0].get()});
                }
              }) == "[" + opt->name() + "] " + piece +
                        ": parameter 'w0' has taken 9223372036854775806 steps: no update can follow it");
        CHECK(serialize_state_dict(state_dict()) + snapshot(*opt, params, swapped.get()) == before);
      }
  }

  TEST_CASE("checkpoints that must not load: named error, every byte unchanged") {
    struct Bad {
      std::string what;
      bool adamw;
      std::function<void(StateDict&)> edit;
      std::string message;
    };
    const std::vector<Bad> cases = {
        {"a missing state tensor", true, [](StateDict& s) { s.tensors.erase("state.1.exp_avg_sq"); },
         "[checkpoint] param 1 ('bias') has 'exp_avg' but not 'exp_avg_sq'"},
        {"the first state tensor missing", true, [](StateDict& s) { s.tensors.erase("state.1.exp_avg"); },
         "[checkpoint] param 1 ('bias') has 'exp_avg_sq' but not 'exp_avg'"},
        {"all state of a stepped param missing", true,
         [](StateDict& s) {
           s.tensors.erase("state.1.exp_avg");
           s.tensors.erase("state.1.exp_avg_sq");
         },
         "[checkpoint] param 1 ('bias') has no state but step 2"},
        {"state.00 aliasing state.0", true,
         [](StateDict& s) { s.tensors.emplace("state.00.exp_avg", s.tensors.at("state.0.exp_avg")); },
         "[checkpoint] tensor name 'state.00.exp_avg' is not canonical: the param index is written '0'"},
        {"max_exp_avg_sq for a group without amsgrad", true,
         [](StateDict& s) { s.tensors.emplace("state.0.max_exp_avg_sq", s.tensors.at("state.0.exp_avg").clone()); },
         "[checkpoint] tensor 'state.0.max_exp_avg_sq': group 0 does not use 'max_exp_avg_sq' with its options"},
        {"a param step beyond its group's", true,
         [](StateDict& s) { replace_once(s.metadata, "\"param_steps\":[2,", "\"param_steps\":[9,"); },
         "[checkpoint] param 0 ('w0') has step 9, beyond its group's 2"},
        {"a group step no step can follow", true,
         [](StateDict& s) { replace_once(s.metadata, "\"step\":2", "\"step\":9223372036854775807"); },
         "[checkpoint] group 0 has step 9223372036854775807: no step can follow it"},
        {"a missing momentum tensor", false, [](StateDict& s) { s.tensors.erase("state.1.momentum_buffer"); },
         "[checkpoint] param 1 ('w1') has no state but step 2"},
        {"a Muon param step beyond its group's", false,
         [](StateDict& s) { replace_once(s.metadata, "\"param_steps\":[2,2,2]", "\"param_steps\":[2,3,2]"); },
         "[checkpoint] param 1 ('w1') has step 3, beyond its group's 2"},
        {"a Muon param with state and step 0 among counted ones", false,
         [](StateDict& s) { replace_once(s.metadata, "\"param_steps\":[2,2,2]", "\"param_steps\":[2,0,2]"); },
         "[checkpoint] param 1 ('w1') has state but step 0"},
        {"Muon state under an AdamW key", false,
         [](StateDict& s) { s.tensors.emplace("state.0.exp_avg", s.tensors.at("state.0.momentum_buffer").clone()); },
         "[checkpoint] tensor 'state.0.exp_avg': 'exp_avg' is not Muon state"},
    };
    for (const Bad& bad : cases)
      for (bool swap : {false, true}) {
        Subject s(bad.adamw, swap);
        CAPTURE(s.name());
        CAPTURE(bad.what);
        StateDict state = s.state_dict();
        bad.edit(state);
        set_grads(s.params, 3);
        s.step();  // the state differs from the checkpoint's now
        const std::string before = s.snap();
        CHECK(error_of([&] { s.load(state); }) == bad.message);
        CHECK(s.snap() == before);
      }
  }

  TEST_CASE("a param renamed after it was added: saves and loads refuse it, naming both names, changing nothing") {
    for (bool adamw : {true, false})
      for (bool swap : {false, true}) {
        Subject s(adamw, swap);
        CAPTURE(s.name());
        const StateDict state = s.state_dict();
        const std::string saved = test::temp_file("named.safetensors"),
                          unsaved = test::temp_file("renamed.safetensors");
        s.swapped ? s.swapped->save_checkpoint(saved) : s.optimizer->save_checkpoint(saved);
        const std::string named = s.snap();
        const std::string old_name = s.params[1]->name;
        s.params[1]->name = s.params[0]->name;  // two params of one name: a file would name both alike
        const std::string message = "[" + s.optimizer->name() + "] parameter '" + old_name + "' was renamed '" +
                                    s.params[0]->name +
                                    "' after it was added: a param's name is fixed once added (checkpoints name its "
                                    "state by it)";
        const std::string before = s.snap();
        CHECK(error_of([&] { s.state_dict(); }) == message);
        CHECK(error_of([&] { s.load(state); }) == message);
        if (s.swapped) {
          CHECK(error_of([&] { s.swapped->save_checkpoint(unsaved); }) == message);
          CHECK(error_of([&] { s.swapped->save_async(unsaved); }) == message);
          CHECK(error_of([&] { s.swapped->load_checkpoint(saved); }) == message);
        } else {
          CHECK(error_of([&] { s.optimizer->save_checkpoint(unsaved); }) == message);
          CHECK(error_of([&] { s.optimizer->load_checkpoint(saved); }) == message);
        }
        CHECK(!std::filesystem::exists(unsaved));
        CHECK(s.snap() == before);
        s.params[1]->name = old_name;  // named back: the checkpoints load again
        s.load(state);
        s.swapped ? s.swapped->load_checkpoint(saved) : s.optimizer->load_checkpoint(saved);
        CHECK(s.snap() == named);
        std::filesystem::remove(saved);
      }
  }

  TEST_CASE("a Muon param re-pointed at 1-D data before its layout is fixed: a load or a swap wrapper refuses it") {
    Stream stream(Device::cpu());
    Muon saved(stream);
    ParamPtr w = make_param("w", test::random_tensor({4, 4}, DType::f32, 1));
    saved.add_param_group({w});
    w->grad = test::random_tensor({4, 4}, DType::f32, 2);
    saved.step();
    StateDict state = saved.state_dict();
    state.tensors["state.0.momentum_buffer"] = Tensor::zeros({16}, DType::f32, Device::cpu());
    const std::string message = "[Muon] 1-D parameter 'w' (shape [16]) cannot use Muon";
    for (bool load : {true, false}) {
      CAPTURE(load);
      Muon muon(stream);
      ParamPtr p = make_param("w", test::random_tensor({4, 4}, DType::f32, 1));
      muon.add_param_group({p});
      p->data = test::random_tensor({16}, DType::f32, 3);  // no step yet: its layout is not fixed
      const std::string before = snapshot(muon, {p}, nullptr);
      CHECK(error_of([&] { load ? muon.load_state_dict(state) : void(swap_muon(muon, {.min_numel = 1})); }) == message);
      CHECK(snapshot(muon, {p}, nullptr) == before);
      CHECK(!muon.wrapped());
      // Pointed back at a matrix, the param steps as a fresh one.
      p->data = test::random_tensor({4, 4}, DType::f32, 1);
      p->grad = test::random_tensor({4, 4}, DType::f32, 2);
      muon.step();
      CHECK(muon.param_groups()[0].step == 1);
    }
  }

  TEST_CASE(
      "a Muon file from before swapopt 0.4 (every param step 0) loads, each param with state stepped with its group") {
    for (bool swap : {false, true}) {
      Subject s(false, swap), resumed(false, swap);
      CAPTURE(s.name());
      const StateDict counted = s.state_dict();
      StateDict legacy = counted;
      replace_once(legacy.metadata, "\"param_steps\":[2,2,2]", "\"param_steps\":[0,0,0]");
      set_grads(resumed.params, 3);
      resumed.step();
      resumed.load(legacy);
      CHECK(serialize_state_dict(resumed.state_dict()) == serialize_state_dict(counted));
    }
  }

  TEST_CASE("file corruption: payload and header byte flips fail their checksums") {
    for (bool swap : {false, true}) {
      Subject s(false, swap);
      CAPTURE(s.name());
      const std::string file = serialize_state_dict(s.state_dict());
      std::string payload = file;
      payload[payload.size() - 3] ^= 0x10;  // inside the last tensor
      const std::string e1 = error_of([&] { parse_state_dict(payload.data(), payload.size()); });
      CHECK(e1.rfind("[checkpoint] 'state.2.momentum_buffer' fails its checksum (stored ", 0) == 0);
      CHECK(e1.find("): the file is corrupt") != std::string::npos);
      // lr 0.02 -> 1.02 in the metadata JSON inside the header
      std::string header = file;
      const size_t at = header.find("\\\"lr\\\":0.02");
      REQUIRE(at != std::string::npos);
      header[at + 8] = '1';
      const std::string e2 = error_of([&] { parse_state_dict(header.data(), header.size()); });
      CHECK(e2.rfind("[checkpoint] '__metadata__' fails its checksum (stored ", 0) == 0);
    }
  }

  TEST_CASE("a file without checksums loads only when the caller says so") {
    Muon fresh(Stream(Device::cpu()));
    fresh.add_param_group(model(false));
    std::string meta = fresh.metadata_json(), escaped;
    for (char c : meta) escaped += c == '"' ? std::string("\\\"") : std::string(1, c);
    std::string header = "{\"__metadata__\":{\"swapopt\":\"" + escaped + "\"}}";
    header.append((8 - header.size() % 8) % 8, ' ');
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
    file += header;
    CHECK(error_of([&] { parse_state_dict(file.data(), file.size()); }) ==
          "[checkpoint] the file has no checksums (written before swapopt 0.2, or by another tool): load it with "
          "CheckpointReadOptions::allow_missing_checksums to accept it unverified");
    CheckpointReadOptions trust;
    trust.allow_missing_checksums = true;
    const StateDict state = parse_state_dict(file.data(), file.size(), trust);
    CHECK(state.metadata == meta);
    CHECK(state.tensors.empty());
  }

  TEST_CASE(
      "a wrapped AdamW refuses amsgrad turned on (set, mutated or loaded), changing nothing; rewrapped, it is "
      "swapped") {
    // The wrapper lays out host mirrors for the keys each group keeps when it wraps: a key added
    // later would stay on the device, never swapped.
    const std::string want =
        "[AdamW] cannot turn amsgrad on while wrapped: group 0 would keep state [exp_avg, exp_avg_sq, max_exp_avg_sq], "
        "and the SwapOptimizer wrapping it laid out host mirrors only for [exp_avg, exp_avg_sq] (drop the wrapper, "
        "change the options, wrap again)";
    const std::string want_load =
        "[AdamW] cannot load this checkpoint's options while wrapped: group 0 would keep state [exp_avg, exp_avg_sq, "
        "max_exp_avg_sq], and the SwapOptimizer wrapping it laid out host mirrors only for [exp_avg, exp_avg_sq] (give "
        "the optimizer these options before wrapping it, or load the checkpoint unwrapped)";
    AdamWOptions amsgrad;
    amsgrad.amsgrad = true;
    auto source_params = model(true);
    AdamW source(Stream(Device::cpu()));
    source.add_param_group(source_params, amsgrad);
    set_grads(source_params, 1);
    source.step();
    const StateDict checkpoint = source.state_dict();

    for (bool stepped : {false, true}) {  // before the group's first step, set_options alone would take it
      CAPTURE(stepped);
      auto params = model(true);
      AdamW adamw(Stream(Device::cpu()));
      adamw.add_param_group(params);
      SwapConfig config;
      config.min_numel = 1;
      auto swapped = swap_adamw(adamw, config);
      if (stepped) {
        set_grads(params, 1);
        swapped->step();
      }
      set_grads(params, 2);
      const std::string before = snapshot(adamw, params, swapped.get());
      // Once the group has state, amsgrad is fixed anyway, and that error names a param.
      const std::string want_set = stepped ? "[AdamW] group 0 cannot turn amsgrad on: param 'w0' has state from steps "
                                             "without it (amsgrad decides which state a param keeps: choose it in "
                                             "add_param_group, or before the group's first step)"
                                           : want;
      CHECK(error_of([&] { adamw.set_options(0, amsgrad); }) == want_set);
      CHECK_FALSE(adamw.options(0).amsgrad);
      adamw.mutable_options(0).amsgrad = true;
      CHECK(error_of([&] { swapped->step(); }) == want_set);
      adamw.mutable_options(0).amsgrad = false;
      CHECK(error_of([&] { swapped->load_state_dict(checkpoint); }) == want_load);
      // A checkpoint wrong in itself (amsgrad on, no max_exp_avg_sq) gets the unwrapped message:
      // the wrapper's check came first and named the options instead.
      StateDict no_max = checkpoint;
      std::erase_if(no_max.tensors, [](const auto& t) { return t.first.ends_with(".max_exp_avg_sq"); });
      const std::string want_broken = "[checkpoint] param 0 ('w0') has 'exp_avg' but not 'max_exp_avg_sq'";
      CHECK(error_of([&] { swapped->load_state_dict(no_max); }) == want_broken);
      AdamW unwrapped(Stream(Device::cpu()));
      unwrapped.add_param_group(model(true));
      CHECK(error_of([&] { unwrapped.load_state_dict(no_max); }) == want_broken);
      CHECK_FALSE(adamw.options(0).amsgrad);
      CHECK(snapshot(adamw, params, swapped.get()) == before);

      // Unwrapped, the checkpoint loads; wrapped again, every state is swapped, bitwise as bare.
      swapped.reset();
      adamw.load_state_dict(checkpoint);
      swapped = swap_adamw(adamw, config);
      auto bare_params = model(true);
      AdamW bare(Stream(Device::cpu()));
      bare.add_param_group(bare_params);
      bare.load_state_dict(checkpoint);
      set_grads(bare_params, 2);
      bare.step();
      swapped->step();
      CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()));
      swapped->synchronize();
      CHECK(swapped->runtime().find_slot(params[0].get(), "max_exp_avg_sq") != nullptr);
      CHECK(swapped->last_report().state_bytes == size_t(3 * 4 * (32 * 32 + 64 + 16 * 48 + 32 * 32)));
    }
  }

  TEST_CASE("swapped amsgrad AdamW loading a non-amsgrad checkpoint holds the state set the bare one holds") {
    auto make = [](const std::vector<ParamPtr>& params, bool amsgrad) {
      auto opt = std::make_unique<AdamW>(Stream(Device::cpu()));
      AdamWOptions o;
      o.amsgrad = amsgrad;
      opt->add_param_group(params, o);
      return opt;
    };
    auto source_params = model(true);
    auto source = make(source_params, false);
    set_grads(source_params, 1);
    source->step();
    const StateDict checkpoint = source->state_dict();
    auto bare_params = model(true), swap_params = model(true);
    auto bare = make(bare_params, true);
    auto inner = make(swap_params, true);
    SwapConfig config;
    config.min_numel = 1;
    auto swapped = swap_adamw(*inner, config);
    bare->load_state_dict(checkpoint);
    swapped->load_state_dict(checkpoint);
    set_grads(bare_params, 2);
    set_grads(swap_params, 2);
    bare->step();
    swapped->step();
    CHECK(serialize_state_dict(bare->state_dict()) == serialize_state_dict(swapped->state_dict()));
    CHECK(swapped->state_dict().tensors.count("state.0.max_exp_avg_sq") == 0);
  }

  TEST_CASE(
      "2-rank HSDP: a bad grad, a check failing on one rank alone, or ranks stepping different params, fails on every "
      "rank with nothing changed") {
    // Mesh 1x2: w0 and w2 row-sharded over both ranks, w1 local. Mesh 2x1: w0 and w2 replicated
    // (a shard group of one rank), each updated by one owner and broadcast to the other.
    struct Case {
      std::string what;
      std::vector<int64_t> mesh;
      std::function<void(std::vector<ParamPtr>&, Muon&, int rank)> edit;
      std::string message;
      std::string rank0_message = "";  // "": rank 0 gets `message` too
    };
    const std::string missing = " ranks (a grad is missing on some ranks): every HSDP rank must step the same params";
    const std::string other_rank =
        "[Muon] the step's checks failed on 1 of 2 ranks (their errors say why): the step changed nothing";
    const std::vector<Case> cases = {
        {"wrong shape on both ranks",
         {1, 2},
         [](std::vector<ParamPtr>& p, Muon&, int) {
           p[2]->grad = Tensor::zeros({16, 31}, DType::f32, Device::cpu());
         },
         "[Muon] grad of 'w2' is Tensor(f32, [16, 31], cpu), the param Tensor(f32, [16, 32], cpu)"},
        {"a grad missing on rank 1 of a shard group",
         {1, 2},
         [](std::vector<ParamPtr>& p, Muon&, int rank) {
           if (rank == 1) p[2]->grad = Tensor();
         },
         "[Muon] 'w2' has a grad on 1 of 2" + missing},
        {"a grad missing on a replica",
         {2, 1},
         [](std::vector<ParamPtr>& p, Muon&, int rank) {
           if (rank == 1) p[2]->grad = Tensor();
         },
         "[Muon] 'w2' has a grad on 1 of 2" + missing},
        {"a grad missing on the other replica",
         {2, 1},
         [](std::vector<ParamPtr>& p, Muon&, int rank) {
           if (rank == 0) p[2]->grad = Tensor();
         },
         "[Muon] 'w2' has a grad on 1 of 2" + missing},
        // A check failing on one rank alone: the other rank would otherwise go on into the update's
        // collectives and wait there for the failed one until the timeout.
        {"a bad grad of a local param on rank 1 only",
         {1, 2},
         [](std::vector<ParamPtr>& p, Muon&, int rank) {
           if (rank == 1) p[1]->grad = p[1]->grad.view({48, 16});
         },
         "[Muon] grad of 'w1' is Tensor(f32, [48, 16], cpu), the param Tensor(f32, [16, 48], cpu)",
         other_rank},
        {"a bad option on rank 1 only",
         {2, 1},
         [](std::vector<ParamPtr>&, Muon& muon, int rank) {
           if (rank == 1) muon.mutable_options(0).momentum = 1.5;
         },
         "[Muon] group 0: momentum must be in [0, 1), got 1.5",
         other_rank},
        {"a schedule failing on rank 1 only",
         {1, 2},
         [](std::vector<ParamPtr>&, Muon& muon, int rank) {
           muon.set_schedule(
               [rank](int64_t step) { SWAPOPT_CHECK(rank != 1, "[test] no learning rate for step " << step); });
         },
         "[test] no learning rate for step 3",
         other_rank},
    };
    for (const Case& c : cases) {
      CAPTURE(c.what);
      bare_and_swapped_on_two_ranks(
          [&](int rank, const std::shared_ptr<Communicator>& comm, bool swap, std::string& error,
              std::string& unchanged) {
            auto mesh = std::make_shared<DeviceMesh>(c.mesh, std::vector<std::string>{"replicate", "shard"}, rank);
            const int64_t shards = c.mesh[1], shard = rank % shards;
            std::vector<ParamPtr> full = model(false), params;
            for (size_t i = 0; i < full.size(); ++i) {
              if (i == 1) {
                params.push_back(full[i]);
                continue;
              }
              const int64_t rows = full[i]->data.shape()[0] / shards;
              ParamPtr p = make_param(full[i]->name, full[i]->data.narrow(0, shard * rows, rows).clone());
              p->layout = DTensor(p->data, full[i]->data.shape(), mesh, {Placement::Replicate(), Placement::Shard(0)});
              params.push_back(p);
            }
            Muon muon(Stream(Device::cpu()));
            muon.add_param_group(params);
            HsdpOptions h;
            h.name = std::string("bad") + (swap ? "s" : "b");
            muon.enable_hsdp(comm, h);
            SwapConfig config;
            config.min_numel = 1;
            std::unique_ptr<SwapOptimizer> swapped = swap ? swap_muon(muon, config) : nullptr;
            auto step = [&] { swapped ? swapped->step() : muon.step(); };
            for (int s = 1; s <= 2; ++s) {
              set_grads(params, s);
              step();
            }
            set_grads(params, 3);
            c.edit(params, muon, rank);
            const std::string before = snapshot(muon, params, swapped.get());
            error = error_of(step);
            unchanged = snapshot(muon, params, swapped.get()) == before ? "yes" : "no";
          },
          [&](const TwoRankOutcome& out) {
            CHECK(out.errors[0] == (c.rank0_message.empty() ? c.message : c.rank0_message));
            CHECK(out.errors[1] == c.message);
            CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
          });
    }
  }

  TEST_CASE("2-rank HSDP: ranks stepping with different options fail on both ranks with nothing changed") {
    const std::string prefix =
        "[Muon] the ranks' settings, param groups, options or step counts differ (this rank: skip_nonfinite off, "
        "device budget unset; 1 group; group 0: steps taken 1, options {";
    const std::string suffix = "}): every HSDP rank must step the same groups with the same options and settings";
    bare_and_swapped_on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, bool swap, std::string& error,
            std::string& unchanged) {
          ReplicatedMuon r(rank, comm, "options", swap);
          set_grads(r.params, 1);
          r.step();
          set_grads(r.params, 2);
          if (rank == 1) r.muon.set_lr(0.03);  // rank 0 keeps the default 0.02
          const std::string before = r.snap();
          error = error_of([&] { r.step(); });
          unchanged = r.snap() == before ? "yes" : "no";
          // Set alike again, the ranks step together.
          r.muon.set_lr(0.02);
          r.step();
          if (r.swapped) r.swapped->synchronize();
          if (r.muon.param_groups()[0].step != 2) error += " (no second step)";
        },
        [&](const TwoRankOutcome& out) {
          for (size_t rank = 0; rank < 2; ++rank) {
            CAPTURE(rank);
            const std::string& e = out.errors[rank];
            CHECK(e.rfind(prefix, 0) == 0);
            CHECK(e.size() > suffix.size());
            CHECK(e.compare(e.size() - std::min(e.size(), suffix.size()), suffix.size(), suffix) == 0);
            CHECK(e.find(rank == 0 ? "\"lr\":0.02," : "\"lr\":0.03,") != std::string::npos);
          }
          CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
        });
  }

  TEST_CASE(
      "2-rank HSDP: a param group, a budget or skip_nonfinite on one rank only, or a bad option JSON cannot hold, "
      "fails on both ranks") {
    const std::string prefix =
        "[Muon] the ranks' settings, param groups, options or step counts differ (this rank: skip_nonfinite off, "
        "device "
        "budget ";
    const TwoRankOutcome extra = on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          ReplicatedMuon r(rank, comm, "groups", false);
          if (rank == 1) r.muon.add_param_group({make_param("extra", test::random_tensor({4, 4}, DType::f32, 9))});
          set_grads(r.params, 1);
          const std::string before = r.snap();
          error = error_of([&] { r.step(); });
          unchanged = r.snap() == before ? "yes" : "no";
        });
    CHECK(extra.errors[0].rfind(prefix + "unset; 1 group; group 0: steps taken 0, options {", 0) == 0);
    CHECK(extra.errors[1].rfind(prefix + "unset; 2 groups; group 0: steps taken 0, options {", 0) == 0);
    CHECK(extra.unchanged == std::vector<std::string>{"yes", "yes"});
    // A device budget on one rank's wrapper only: that rank alone would vote on its plan.
    const TwoRankOutcome budget = on_two_ranks([&](int rank, const std::shared_ptr<Communicator>& comm,
                                                   std::string& error, std::string& unchanged) {
      ReplicatedMuon r(rank, comm, "budget", false);
      auto swapped = swap_muon(
          r.muon,
          {.min_numel = 1, .device_budget_bytes = rank == 1 ? std::optional<size_t>(size_t(1) << 30) : std::nullopt});
      set_grads(r.params, 1);
      const std::string before = snapshot(r.muon, r.params, swapped.get());
      error = error_of([&] { swapped->step(); });
      unchanged = snapshot(r.muon, r.params, swapped.get()) == before ? "yes" : "no";
    });
    CHECK(budget.errors[0].rfind(prefix + "unset; 1 group;", 0) == 0);
    CHECK(budget.errors[1].rfind(prefix + "set; 1 group;", 0) == 0);
    CHECK(budget.unchanged == std::vector<std::string>{"yes", "yes"});
    // MuonWithAdamW skipping non-finite steps through its AdamW half on rank 0 only: that rank
    // alone would vote on the grads of both halves.
    const TwoRankOutcome half = on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          std::vector<ParamPtr> params = model(true);
          replicate_matrices(params, rank);
          MuonWithAdamW opt(Stream(Device::cpu()), params);
          opt.muon().enable_hsdp(comm, HsdpOptions{.name = "half"});
          if (rank == 0) opt.adamw().set_skip_nonfinite(true);
          set_grads(params, 1);
          const std::string before = snapshot(opt.muon(), params, nullptr) + snapshot(opt.adamw(), params, nullptr);
          error = error_of([&] { opt.step(); });
          unchanged =
              snapshot(opt.muon(), params, nullptr) + snapshot(opt.adamw(), params, nullptr) == before ? "yes" : "no";
        });
    CHECK(half.errors[0].rfind(
              "[Muon] the ranks' settings, param groups, options or step counts differ (this rank: skip_nonfinite on, "
              "device budget unset; 1 group;",
              0) == 0);
    CHECK(half.errors[1].rfind(prefix + "unset; 1 group;", 0) == 0);
    CHECK(half.unchanged == std::vector<std::string>{"yes", "yes"});
    // A bad option whose text the digest's JSON cannot hold: that rank's checks fail, it still
    // joins the agreement (describing its groups would throw), and the step fails on both.
    const TwoRankOutcome text = on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          ReplicatedMuon r(rank, comm, "text", false);
          if (rank == 1) r.muon.mutable_options(0).zero_rms_scale_mode = "\xff";
          set_grads(r.params, 1);
          const std::string before = r.snap();
          error = error_of([&] { r.step(); });
          unchanged = r.snap() == before ? "yes" : "no";
        });
    CHECK(text.errors[0] ==
          "[Muon] the step's checks failed on 1 of 2 ranks (their errors say why): the step changed nothing");
    CHECK(text.errors[1] == "[Muon] group 0: zero_rms_scale_mode must be 'zero' or 'use_lr', got '\xff'");
    CHECK(text.unchanged == std::vector<std::string>{"yes", "yes"});
  }

  TEST_CASE("2-rank HSDP skipping non-finite steps: a failure one rank's stream holds fails the step on both ranks") {
    bare_and_swapped_on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, bool swap, std::string& error,
            std::string& unchanged) {
          ReplicatedMuon r(rank, comm, "stream", swap);
          r.muon.set_skip_nonfinite(true);
          set_grads(r.params, 1);
          r.step();
          set_grads(r.params, 2);
          const std::string before = r.snap();
          // The trainer's backward, enqueued on the optimizer's stream, failed on rank 1 only: the
          // step's look for non-finite grads synchronises the stream and meets it there.
          if (rank == 1) r.muon.stream().enqueue([] { SWAPOPT_FAIL("[test] backward failed"); });
          error = error_of([&] { r.step(); });
          unchanged = r.snap() == before ? "yes" : "no";
        },
        [](const TwoRankOutcome& out) {
          CHECK(out.errors ==
                std::vector<std::string>{"[Muon] the non-finite grad check failed on another rank (its error says why)",
                                         "[test] backward failed"});
          CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
        });
  }

  TEST_CASE("2-rank HSDP swapped: a background save failed on one rank fails the next step on both, changing nothing") {
    const std::string path = "/nonexistent-dir/rank1.safetensors";
    const TwoRankOutcome out = on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          ReplicatedMuon r(rank, comm, "save", true);
          set_grads(r.params, 1);
          r.step();
          if (rank == 1) {
            r.swapped->save_async(path);  // its writer fails at once: the directory does not exist
            r.swapped->runtime().wait_mirror_reader();
            std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a step reports a finished save
          }
          set_grads(r.params, 2);
          const std::string before = r.snap();
          error = error_of([&] { r.step(); });
          unchanged = r.snap() == before ? "yes" : "no";
        });
    CHECK(out.errors == std::vector<std::string>{
                            "[Muon] the step's checks failed on 1 of 2 ranks (their errors say why): the step changed "
                            "nothing",
                            "[checkpoint] saving '" + path + "' in the background failed: [checkpoint] cannot create '" +
                                path + ".tmp': No such file or directory"});
    CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
  }

  TEST_CASE("2-rank HSDP: a replicated param without a grad keeps each rank's own values (its owner sends nothing)") {
    bare_and_swapped_on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, bool swap, std::string& error,
            std::string& unchanged) {
          ReplicatedMuon r(rank, comm, "frozen", swap);
          // A frozen param whose replicas differ (each rank's own copy): no step may touch it.
          const ParamPtr frozen = r.params[2];
          frozen->data = test::random_tensor(frozen->data.shape(), DType::f32, uint32_t(50 + rank));
          const Tensor before = frozen->data.clone();
          error = error_of([&] {
            for (int s = 1; s <= 2; ++s) {
              set_grads(r.params, s);
              frozen->grad = Tensor();
              r.step();
            }
            r.muon.synchronize();
          });
          unchanged = test::same_bits(frozen->data, before) ? "yes" : "no";
        },
        [](const TwoRankOutcome& out) {
          CHECK(out.errors == std::vector<std::string>{"", ""});
          CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
        });
  }

  TEST_CASE("2-rank HSDP: params sharded after add_param_group, before enable_hsdp, step as if sharded before") {
    bare_and_swapped_on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, bool swap, std::string& error,
            std::string& unchanged) {
          auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 2},
                                                   std::vector<std::string>{"replicate", "shard"}, rank);
          auto shard = [&](const ParamPtr& p) {
            if (p->name == "w1") return;  // stays local
            const Shape full = p->data.shape();
            p->data = p->data.narrow(0, rank * full[0] / 2, full[0] / 2).clone();
            p->layout = DTensor(p->data, full, mesh, {Placement::Replicate(), Placement::Shard(0)});
          };
          std::vector<ParamPtr> early = model(false), late = model(false);
          for (const ParamPtr& p : early) shard(p);
          Muon first(Stream(Device::cpu())), then(Stream(Device::cpu()));
          first.add_param_group(early);
          then.add_param_group(late);
          for (const ParamPtr& p : late) shard(p);  // the trainer shards its model after building the optimizer
          first.enable_hsdp(comm, HsdpOptions{.name = swap ? "earlyS" : "earlyB"});
          then.enable_hsdp(comm, HsdpOptions{.name = swap ? "lateS" : "lateB"});
          std::unique_ptr<SwapOptimizer> first_swapped = swap ? swap_muon(first, {.min_numel = 1}) : nullptr;
          std::unique_ptr<SwapOptimizer> then_swapped = swap ? swap_muon(then, {.min_numel = 1}) : nullptr;
          error = error_of([&] {
            for (int s = 1; s <= 2; ++s) {
              set_grads(early, s);
              set_grads(late, s);
              swap ? first_swapped->step() : first.step();
              swap ? then_swapped->step() : then.step();
            }
          });
          unchanged =
              snapshot(first, early, first_swapped.get()) == snapshot(then, late, then_swapped.get()) ? "yes" : "no";
        },
        [](const TwoRankOutcome& out) {
          CHECK(out.errors == std::vector<std::string>{"", ""});
          CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});  // here: bitwise the same steps
        });
  }

  TEST_CASE(
      "2-rank HSDP MuonWithAdamW, bare and as a SwapOptimizerSet of either member order: a bad or non-finite AdamW "
      "grad "
      "on one rank fails or skips the step on both ranks, changing nothing") {
    // Mesh 2x1: the matrices replicated (each updated by its owner, then broadcast), the vector in
    // AdamW. Only rank 1's AdamW grad is bad: rank 0 would otherwise go on into Muon's broadcasts,
    // also where AdamW comes first in the set and is checked, voted and planned first.
    enum class Form { bare, muon_first, adamw_first };
    for (Form form : {Form::bare, Form::muon_first, Form::adamw_first})
      for (bool nonfinite : {false, true}) {
        CAPTURE(int(form));
        CAPTURE(nonfinite);
        std::vector<std::string> skipped(2);
        const TwoRankOutcome out = on_two_ranks(
            [&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
              std::vector<ParamPtr> params = model(true);
              replicate_matrices(params, rank);
              MuonWithAdamW opt(Stream(Device::cpu()), params);
              opt.muon().enable_hsdp(comm,
                                     HsdpOptions{.name = "set" + std::to_string(int(form)) + (nonfinite ? "n" : "b")});
              std::unique_ptr<SwapOptimizerSet> swapped;
              if (form != Form::bare) {
                std::vector<SwapOptimizerSet::Member> members;
                members.emplace_back("muon", swap_muon(opt.muon(), {.min_numel = 1}));
                members.emplace_back("adamw", swap_adamw(opt.adamw(), {.min_numel = 1}));
                if (form == Form::adamw_first) std::swap(members[0], members[1]);
                swapped = std::make_unique<SwapOptimizerSet>(std::move(members));
                swapped->set_skip_nonfinite(true);
              } else {
                opt.muon().set_skip_nonfinite(true);
                opt.adamw().set_skip_nonfinite(true);
              }
              auto step = [&] { swapped ? swapped->step() : opt.step(); };
              auto snap = [&] {
                SwapOptimizer* muon = swapped ? &swapped->member("muon") : nullptr;
                SwapOptimizer* adamw = swapped ? &swapped->member("adamw") : nullptr;
                return snapshot(opt.muon(), params, muon) + snapshot(opt.adamw(), params, adamw);
              };
              for (int s = 1; s <= 2; ++s) {
                set_grads(params, s);
                step();
              }
              set_grads(params, 3);
              if (rank == 1)
                params[1]->grad = nonfinite ? Tensor::from_floats(std::vector<float>(64, std::nanf("")), {64})
                                            : Tensor::zeros({63}, DType::f32, Device::cpu());
              const std::string before = snap();
              error = error_of(step);
              unchanged = snap() == before ? "yes" : "no";
              skipped[size_t(rank)] = opt.muon().last_step_skipped() && opt.adamw().last_step_skipped() ? "yes" : "no";
            });
        if (nonfinite) {
          CHECK(out.errors == std::vector<std::string>{"", ""});
          CHECK(skipped == std::vector<std::string>{"yes", "yes"});
        } else {
          CHECK(out.errors[0] ==
                "[Muon] the step's checks failed on 1 of 2 ranks (their errors say why): the step changed nothing");
          CHECK(out.errors[1] == "[AdamW] grad of 'bias' is Tensor(f32, [63], cpu), the param Tensor(f32, [64], cpu)");
        }
        CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
      }
  }

  TEST_CASE(
      "2-rank HSDP SwapOptimizerSet, AdamW first: HSDP Muon's update runs first, and the set's events are AdamW's") {
    // Each rank owns one matrix; its NS hook enqueues a read of AdamW's param on the shared stream.
    // Muon running first, the read sees the param before AdamW's update: a failure of the
    // rank-local AdamW update cannot then leave the other rank waiting in Muon's broadcasts.
    const TwoRankOutcome out = on_two_ranks(
        [&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          std::vector<ParamPtr> params = model(true);
          replicate_matrices(params, rank);
          const std::vector<float> bias_before = params[1]->data.to_float_vector();
          std::vector<std::vector<float>> bias_at_ns;
          MuonHooks hooks;
          hooks.zeropower_fn = [&](Stream& stream, const Tensor&, int) {
            stream.enqueue([&] { bias_at_ns.push_back(params[1]->data.to_float_vector()); });
          };
          MuonWithAdamW opt(Stream(Device::cpu()), params, {}, {}, {}, hooks);
          opt.muon().enable_hsdp(comm, HsdpOptions{.name = "order"});
          std::vector<SwapOptimizerSet::Member> members;
          members.emplace_back("adamw", swap_adamw(opt.adamw(), {.min_numel = 1}));
          members.emplace_back("muon", swap_muon(opt.muon(), {.min_numel = 1}));
          SwapOptimizerSet set(std::move(members));
          set_grads(params, 1);
          error = error_of([&] {
            set.step();
            set.synchronize();
          });
          const bool events_last = &set.params_updated() == &set.member("adamw").params_updated() &&
                                   &set.grads_read() == &set.member("adamw").grads_read();
          const bool bias_updated = params[1]->data.to_float_vector() != bias_before;
          unchanged = !bias_at_ns.empty() && bias_updated && events_last &&
                              std::all_of(bias_at_ns.begin(), bias_at_ns.end(),
                                          [&](const std::vector<float>& b) { return b == bias_before; })
                          ? "yes"
                          : "no";
        });
    CHECK(out.errors == std::vector<std::string>{"", ""});
    CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});  // here: Muon ran first, AdamW last
  }

  TEST_CASE(
      "2-rank HSDP SwapOptimizerSet, AdamW first: an AdamW plan its budget does not hold on one rank fails the step on "
      "both ranks, changing nothing") {
    // Only rank 1 steps the vector (AdamW params are each rank's own), and AdamW's budget holds
    // none of its units: rank 0, whose AdamW has nothing to plan, would go on into Muon's
    // broadcasts alone.
    const TwoRankOutcome out = on_two_ranks([&](int rank, const std::shared_ptr<Communicator>& comm, std::string& error,
                                                std::string& unchanged) {
      std::vector<ParamPtr> params = model(true);
      replicate_matrices(params, rank);
      MuonWithAdamW opt(Stream(Device::cpu()), params);
      opt.muon().enable_hsdp(comm, HsdpOptions{.name = "setBudget"});
      std::vector<SwapOptimizerSet::Member> members;
      members.emplace_back("adamw", swap_adamw(opt.adamw(), {.min_numel = 1, .device_budget_bytes = 16}));
      members.emplace_back("muon", swap_muon(opt.muon(), {.min_numel = 1}));
      SwapOptimizerSet set(std::move(members));
      set_grads(params, 1);
      params[1]->grad = Tensor();
      set.step();
      set_grads(params, 2);
      if (rank == 0) params[1]->grad = Tensor();
      auto snap = [&] {
        return snapshot(opt.muon(), params, &set.member("muon")) + snapshot(opt.adamw(), params, &set.member("adamw"));
      };
      const std::string before = snap();
      error = error_of([&] { set.step(); });
      unchanged = snap() == before ? "yes" : "no";
    });
    CAPTURE(out.errors[1]);
    CHECK(out.errors[0] ==
          "[swap] device_budget_bytes 16 does not hold the step's plan on another rank (that rank's error names the "
          "unit): the step changed nothing");
    CHECK(out.errors[1].rfind("[swap] device_budget_bytes 16 is below an update unit", 0) == 0);
    CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
  }

  TEST_CASE(
      "2-rank HSDP swapped: a device budget one rank's plan does not fit fails the step on every rank, changing "
      "nothing") {
    // Mesh 2x1: both matrices replicated, each owned (NS workspace and momentum) by one rank. The
    // budget holds the small matrix's unit, not the large one's workspace: only its owner's plan
    // fails, and the ranks agree on it before the step's collectives (a rank going on alone would
    // wait in them until their timeout).
    const TwoRankOutcome out = on_two_ranks(
        [](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          std::vector<ParamPtr> params = {make_param("big", test::random_tensor({96, 96}, DType::f32, 1)),
                                          make_param("small", test::random_tensor({8, 8}, DType::f32, 2))};
          replicate_matrices(params, rank);
          Muon muon(Stream(Device::cpu()));
          muon.add_param_group(params);
          muon.enable_hsdp(comm, HsdpOptions{.name = "budget"});
          auto swapped = swap_muon(muon, SwapConfig{.min_numel = 1, .device_budget_bytes = 60000});
          swapped->prefetch_early();  // as a trainer would: its plan fails on the owner too, quietly
          set_grads(params, 1);
          const std::string before = snapshot(muon, params, swapped.get());
          error = error_of([&] { swapped->step(); });
          unchanged = snapshot(muon, params, swapped.get()) == before ? "yes" : "no";
        });
    const std::vector<std::string>& errors = out.errors;
    const size_t owner = errors[0].find("below an update unit") != std::string::npos ? 0 : 1;
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CHECK(errors[owner].rfind("[swap] device_budget_bytes 60000 is below an update unit", 0) == 0);
    CHECK(errors[1 - owner] ==
          "[swap] device_budget_bytes 60000 does not hold the step's plan on another rank (that rank's error names the "
          "unit): "
          "the step changed nothing");
    CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
  }

  TEST_CASE(
      "2-rank HSDP swapped: a budget below the buffers of an assignment a rank updates nothing of names the "
      "assignment") {
    // Mesh 2x1, one replicated matrix: its owner updates it, the other rank only receives its
    // broadcast, a unit with no params of its own. That rank's error named "the unit of ''",
    // said its 0 bytes of state were less than two chunks would take, and named its own least
    // budget as the step's (found by a hunting helper).
    const TwoRankOutcome out = on_two_ranks(
        [](int rank, const std::shared_ptr<Communicator>& comm, std::string& error, std::string& unchanged) {
          std::vector<ParamPtr> params = {make_param("w", test::random_tensor({40, 40}, DType::f32, 1))};
          replicate_matrices(params, rank);
          Muon muon(Stream(Device::cpu()));
          muon.add_param_group(params);
          muon.enable_hsdp(comm, HsdpOptions{.name = "noneOwned"});
          auto swapped = swap_muon(muon, SwapConfig{.device_budget_bytes = 4000});
          set_grads(params, 1);
          const std::string before = snapshot(muon, params, swapped.get());
          error = error_of([&] { swapped->step(); });
          unchanged = snapshot(muon, params, swapped.get()) == before ? "yes" : "no";
        });
    const std::vector<std::string>& errors = out.errors;
    const size_t owner = errors[0].find("(the unit of 'w')") != std::string::npos ? 0 : 1;
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CHECK(errors[owner].rfind("[swap] device_budget_bytes 4000 is below an update unit even in chunks: ", 0) == 0);
    CHECK(errors[1 - owner] ==
          "[swap] device_budget_bytes 4000 is below the workspace of an update unit that swaps no state: 6400 bytes "
          "(the HSDP assignment of 'w', none of whose params this rank updates); the least budget that runs this "
          "rank's part of the step is 6400 bytes (another rank's part may need more)");
    // Each rank's least budget is its own part's: the owner's is the step's here.
    CHECK(
        errors[owner].ends_with("; the least budget that runs this rank's part of the step is 32260 bytes (another "
                                "rank's part may need more)"));
    CHECK(out.unchanged == std::vector<std::string>{"yes", "yes"});
  }

  TEST_CASE(
      "a wrapped optimizer refuses its own step, state_dict, load, a new group, HSDP and a second wrap, changing "
      "nothing") {
    for (bool adamw : {false, true}) {
      Subject s(adamw, true);
      CAPTURE(s.name());
      const std::string name = s.optimizer->name();
      const StateDict checkpoint = s.state_dict();
      set_grads(s.params, 3);
      const std::string before = s.snap();
      CHECK(error_of([&] { s.optimizer->step(); }) ==
            "[" + name + "] step() on an optimizer wrapped by a SwapOptimizer: call the wrapper's step() (the state lives in its "
            "host mirrors)");
      CHECK(error_of([&] { s.optimizer->state_dict(); }) ==
            "[" + name + "] state_dict() on an optimizer wrapped by a SwapOptimizer: call the wrapper's state_dict() (the state "
            "lives in its host mirrors)");
      CHECK(error_of([&] { s.optimizer->load_state_dict(checkpoint); }) ==
            "[" + name + "] load_state_dict() on an optimizer wrapped by a SwapOptimizer: call the wrapper's load_state_dict() (the "
            "state lives in its host mirrors)");
      CHECK(error_of([&] {
              if (adamw) {
                swap_adamw(static_cast<AdamW&>(*s.optimizer));
              } else {
                swap_muon(static_cast<Muon&>(*s.optimizer));
              }
            }) == "[swap] " + name + " is already wrapped by a SwapOptimizer");
      if (!adamw) {
        CHECK(error_of([&] {
                auto world =
                    std::make_shared<test::ThreadCommunicator>(std::make_shared<test::ThreadWorld>(), "w", 0, 1);
                static_cast<Muon&>(*s.optimizer).enable_hsdp(world);
              }) ==
              "[Muon] enable_hsdp() on an optimizer wrapped by a SwapOptimizer: enable HSDP first, then wrap the "
              "optimizer");
        CHECK(!static_cast<Muon&>(*s.optimizer).hsdp_enabled());
      }
      // The mirrors are laid out when wrapped: a param added later would stay on the device.
      const size_t groups = s.optimizer->param_groups().size();
      ParamPtr extra = make_param("extra", Tensor::zeros({4, 4}, DType::f32, Device::cpu()));
      CHECK(error_of([&] {
              if (adamw) {
                static_cast<AdamW&>(*s.optimizer).add_param_group({extra});
              } else {
                static_cast<Muon&>(*s.optimizer).add_param_group({extra});
              }
            }) == "[" + name +
                      "] add_param_group() on an optimizer wrapped by a SwapOptimizer: its host mirrors hold the "
                      "state of the params it had when wrapped (drop the wrapper, add the group, wrap it again)");
      CHECK(s.optimizer->param_groups().size() == groups);
      CHECK(s.snap() == before);
    }
    // MuonWithAdamW whose AdamW half is wrapped: Muon's half does not step either.
    auto params = model(true);
    MuonWithAdamW opt(Stream(Device::cpu()), params);
    auto adamw = swap_adamw(opt.adamw());
    set_grads(params, 1);
    const std::string before = snapshot(opt.muon(), params, nullptr);
    CHECK(error_of([&] { opt.step(); }) ==
          "[AdamW] step() on an optimizer wrapped by a SwapOptimizer: call the wrapper's step() (the state lives in its host mirrors)");
    CHECK(snapshot(opt.muon(), params, nullptr) == before);
  }

  TEST_CASE("indexed accessors throw std::out_of_range naming the optimizer and its groups") {
    std::vector<ParamPtr> params = test::muon_adamw_model();
    MuonWithAdamW opt(Stream(Device::cpu()), params);
    REQUIRE(opt.adamw().param_groups().size() == 2);
    REQUIRE(opt.muon().param_groups().size() == 1);
    CHECK_THROWS_WITH_AS(opt.adamw().options(2), "[AdamW] no group 2 (2 groups)", std::out_of_range);
    CHECK_THROWS_WITH_AS(opt.adamw().mutable_options(7), "[AdamW] no group 7 (2 groups)", std::out_of_range);
    CHECK_THROWS_WITH_AS(opt.adamw().lr(2), "[AdamW] no group 2 (2 groups)", std::out_of_range);
    CHECK_THROWS_WITH_AS(opt.muon().options(2), "[Muon] no group 2 (1 group)", std::out_of_range);
    CHECK_THROWS_WITH_AS(opt.muon().mutable_options(1), "[Muon] no group 1 (1 group)", std::out_of_range);
    CHECK_THROWS_WITH_AS(opt.muon().lr(1), "[Muon] no group 1 (1 group)", std::out_of_range);
    CHECK(opt.muon().lr(0) == opt.muon().options(0).lr);
    // The public pieces that take a group index say the same.
    Muon& muon = opt.muon();
    CHECK_THROWS_WITH_AS(muon.ns_dtype(3), "[Muon] no group 3 (1 group)", std::out_of_range);
    CHECK_THROWS_WITH_AS(muon.params_with_grad(1), "[Muon] no group 1 (1 group)", std::out_of_range);
    CHECK_THROWS_WITH_AS(muon.local_params(1), "[Muon] no group 1 (1 group)", std::out_of_range);
    CHECK_THROWS_WITH_AS(muon.split_into_memory_safe_batches(1, {}, 1), "[Muon] no group 1 (1 group)",
                         std::out_of_range);
    CHECK_THROWS_WITH_AS(muon.workspace_bytes(1, {}), "[Muon] no group 1 (1 group)", std::out_of_range);
    CHECK_THROWS_WITH_AS(opt.adamw().group_state_keys(2), "[AdamW] no group 2 (2 groups)", std::out_of_range);
  }

  TEST_CASE("run_step takes the latest plan once: an older plan, a plan run already or a default one change nothing") {
    std::vector<ParamPtr> bare_params = test::muon_adamw_model(), swap_params = test::muon_adamw_model();
    AdamW bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
    bare.add_param_group(bare_params);
    inner.add_param_group(swap_params);
    auto swapped = swap_adamw(inner, {.min_numel = 1});
    set_grads(bare_params, 1);
    set_grads(swap_params, 1);
    const std::string want = "[swap] run_step() takes the plan the last plan_step() made, once: plan the step again";
    SwapOptimizer::PlannedStep older = swapped->plan_step();
    SwapOptimizer::PlannedStep latest = swapped->plan_step();
    SwapOptimizer::PlannedStep none;
    CHECK(error_of([&] { swapped->run_step(older); }) == want);
    CHECK(error_of([&] { swapped->run_step(none); }) == want);
    swapped->run_step(latest);
    CHECK(error_of([&] { swapped->run_step(latest); }) == want);
    bare.step();
    bare.synchronize();
    swapped->synchronize();
    for (size_t i = 0; i < bare_params.size(); ++i) CHECK(test::same_bits(bare_params[i]->data, swap_params[i]->data));
    CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()));
  }

  TEST_CASE("run_step refuses a plan made before a load: the loaded state is kept, and a new plan steps as bare") {
    // The state saved after one step, loaded into optimizers that have none yet (the plan would
    // create its slots as zeros) and into ones that have stepped (the plan would keep theirs).
    std::vector<ParamPtr> saved_params = test::muon_adamw_model();
    AdamW saved(Stream(Device::cpu()));
    saved.add_param_group(saved_params);
    set_grads(saved_params, 1);
    saved.step();
    const StateDict checkpoint = saved.state_dict();
    const std::string path = test::temp_file("plan_before_load.safetensors");
    saved.save_checkpoint(path);
    for (const bool from_file : {false, true})
      for (const int steps_before : {0, 1}) {
        CAPTURE(from_file);
        CAPTURE(steps_before);
        std::vector<ParamPtr> bare_params = test::muon_adamw_model(), swap_params = test::muon_adamw_model();
        AdamW bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
        bare.add_param_group(bare_params);
        inner.add_param_group(swap_params);
        auto swapped = swap_adamw(inner, {.min_numel = 1});
        for (int s = 1; s <= steps_before; ++s) {
          set_grads(bare_params, 5 + s);
          set_grads(swap_params, 5 + s);
          bare.step();
          swapped->step();
        }
        set_grads(bare_params, 2);
        set_grads(swap_params, 2);
        SwapOptimizer::PlannedStep plan = swapped->plan_step();
        bare.load_state_dict(checkpoint);
        from_file ? swapped->load_checkpoint(path) : swapped->load_state_dict(checkpoint);
        const std::string loaded = serialize_state_dict(swapped->state_dict());
        CHECK(error_of([&] { swapped->run_step(plan); }) ==
              "[swap] run_step() takes the plan the last plan_step() made, once: plan the step again");
        CHECK(serialize_state_dict(swapped->state_dict()) == loaded);
        SwapOptimizer::PlannedStep again = swapped->plan_step();
        swapped->run_step(again);
        bare.step();
        bare.synchronize();
        swapped->synchronize();
        for (size_t i = 0; i < bare_params.size(); ++i)
          CHECK(test::same_bits(bare_params[i]->data, swap_params[i]->data));
        CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()));
      }
    std::remove(path.c_str());
  }

  TEST_CASE("a param re-pointed at another param's memory is refused by the step, bare and swapped, changing nothing") {
    // add_param_group refuses params that share memory; `data` may later point at another
    // buffer, so the step checks again when some param moved (here one step after the first).
    const std::string shared = " share memory (an update of one would change the other)";
    struct Case {
      std::string what;
      bool with_vector;
      std::function<void(std::vector<ParamPtr>&)> alias;  // re-points one param into another's memory
      std::string message;
    };
    const std::vector<Case> cases = {
        {"AdamW: bias into w0", true,
         [](std::vector<ParamPtr>& p) { p[1]->data = p[0]->data.view({1024}).narrow(0, 100, 64); },
         "[AdamW] parameters 'w0' and 'bias'" + shared},
        {"Muon: w2 onto w0", false, [](std::vector<ParamPtr>& p) { p[2]->data = p[0]->data; },
         "[Muon] parameters 'w0' and 'w2'" + shared},
        {"MuonWithAdamW: an AdamW param into a Muon one", true,
         [](std::vector<ParamPtr>& p) { p[1]->data = p[3]->data.view({1024}).narrow(0, 960, 64); },
         "[Muon+AdamW] parameters 'w2' and 'bias'" + shared},
    };
    for (const Case& c : cases)
      for (const bool swap : {false, true}) {
        CAPTURE(c.what);
        CAPTURE(swap);
        std::vector<ParamPtr> params = model(c.with_vector), reference = model(c.with_vector);
        std::unique_ptr<Optimizer> single, single_ref;
        std::unique_ptr<MuonWithAdamW> pair, pair_ref;
        std::unique_ptr<SwapOptimizer> swapped;
        std::unique_ptr<SwapOptimizerSet> swapped_set;
        const bool is_pair = c.what.rfind("MuonWithAdamW", 0) == 0, is_adamw = c.what.rfind("AdamW", 0) == 0;
        if (is_pair) {
          pair = std::make_unique<MuonWithAdamW>(Stream(Device::cpu()), params);
          pair_ref = std::make_unique<MuonWithAdamW>(Stream(Device::cpu()), reference);
          if (swap) swapped_set = swap_muon_with_adamw(*pair, {.min_numel = 1});
        } else {
          single = is_adamw ? std::unique_ptr<Optimizer>(std::make_unique<AdamW>(Stream(Device::cpu())))
                            : std::unique_ptr<Optimizer>(std::make_unique<Muon>(Stream(Device::cpu())));
          single_ref = is_adamw ? std::unique_ptr<Optimizer>(std::make_unique<AdamW>(Stream(Device::cpu())))
                                : std::unique_ptr<Optimizer>(std::make_unique<Muon>(Stream(Device::cpu())));
          is_adamw ? static_cast<AdamW&>(*single).add_param_group(params)
                   : static_cast<Muon&>(*single).add_param_group(params);
          is_adamw ? static_cast<AdamW&>(*single_ref).add_param_group(reference)
                   : static_cast<Muon&>(*single_ref).add_param_group(reference);
          if (swap)
            swapped = is_adamw ? swap_adamw(static_cast<AdamW&>(*single), {.min_numel = 1})
                               : swap_muon(static_cast<Muon&>(*single), {.min_numel = 1});
        }
        const auto step = [&] {
          if (swapped_set) return swapped_set->step();
          if (swapped) return swapped->step();
          pair ? pair->step() : single->step();
        };
        const auto state = [&] {
          if (swapped_set) return serialize_state_dict(swapped_set->state_dict());
          if (swapped) return serialize_state_dict(swapped->state_dict());
          return serialize_state_dict(pair ? pair->state_dict() : single->state_dict());
        };
        const auto snap = [&] {
          std::string out = state();
          for (const ParamPtr& p : params)
            out += std::string(static_cast<const char*>(p->data.data_ptr()), p->data.nbytes());
          return out;
        };
        set_grads(params, 1);
        set_grads(reference, 1);
        step();
        pair_ref ? pair_ref->step() : single_ref->step();
        set_grads(params, 2);
        set_grads(reference, 2);
        std::vector<Tensor> own;
        for (const ParamPtr& p : params) own.push_back(p->data);
        c.alias(params);
        const std::string before = snap();
        CHECK(error_of(step) == c.message);
        CHECK(snap() == before);
        for (size_t i = 0; i < params.size(); ++i) params[i]->data = own[i];  // each at its own buffer again
        step();
        pair_ref ? pair_ref->step() : single_ref->step();
        const std::string expected = serialize_state_dict(pair_ref ? pair_ref->state_dict() : single_ref->state_dict());
        CHECK(state() == expected);
        for (size_t i = 0; i < params.size(); ++i) CHECK(test::same_bits(params[i]->data, reference[i]->data));
      }
    // A check of one half alone passes (the alias spans both halves) and must not hide it from the
    // next step of both, bare or swapped.
    for (const bool swap : {false, true}) {
      CAPTURE(swap);
      std::vector<ParamPtr> params = model(true);
      MuonWithAdamW pair(Stream(Device::cpu()), params);
      std::unique_ptr<SwapOptimizerSet> set = swap ? swap_muon_with_adamw(pair, {.min_numel = 1}) : nullptr;
      const auto step = [&] { set ? set->step() : pair.step(); };
      set_grads(params, 1);
      step();
      params[1]->data = params[3]->data.view({1024}).narrow(0, 960, 64);
      CHECK_NOTHROW(set ? set->member("adamw").optimizer().check_step() : pair.adamw().check_step());
      CHECK(error_of(step) == "[Muon+AdamW] parameters 'w2' and 'bias'" + shared);
    }
  }

  TEST_CASE(
      "prefetch_early with a param whose data lost its shape prefetches nothing; step() names it, changing nothing") {
    std::vector<ParamPtr> params = model(false);
    Muon muon(Stream(Device::cpu()));
    muon.add_param_group(params);
    auto swapped = swap_muon(muon, {.min_numel = 1});
    set_grads(params, 1);
    swapped->step();
    set_grads(params, 2);
    const Tensor own = params[1]->data;
    params[1]->data = Tensor::zeros({16 * 48}, DType::f32, Device::cpu());
    const std::string before = snapshot(muon, params, swapped.get());
    CHECK_NOTHROW(swapped->prefetch_early());
    CHECK(
        error_of([&] { swapped->step(); }) ==
        "[Muon] parameter 'w1' is Tensor(f32, [768], cpu), its state was laid out for f32 [16, 48]: data may point at "
        "another buffer of that shape and dtype, not be reshaped or cast");
    CHECK(snapshot(muon, params, swapped.get()) == before);
    params[1]->data = own;
    swapped->prefetch_early();
    CHECK_NOTHROW(swapped->step());
  }

  TEST_CASE("run_step refuses another wrapper's plan, changing nothing") {
    std::vector<ParamPtr> first_params = test::muon_adamw_model(), second_params = test::muon_adamw_model();
    AdamW first(Stream(Device::cpu())), second(Stream(Device::cpu()));
    first.add_param_group(first_params);
    second.add_param_group(second_params);
    auto swapped_first = swap_adamw(first, {.min_numel = 1}), swapped_second = swap_adamw(second, {.min_numel = 1});
    set_grads(first_params, 1);
    set_grads(second_params, 1);
    SwapOptimizer::PlannedStep plan = swapped_first->plan_step();
    SwapOptimizer::PlannedStep own = swapped_second->plan_step();
    const std::string before = serialize_state_dict(swapped_second->state_dict());
    CHECK(error_of([&] { swapped_second->run_step(plan); }) ==
          "[swap] run_step() takes the plan the last plan_step() made, once: plan the step again");
    CHECK(serialize_state_dict(swapped_second->state_dict()) == before);
    CHECK(second.param_groups()[0].step == 0);
    swapped_second->run_step(own);
    swapped_first->run_step(plan);
    swapped_first->synchronize();
    swapped_second->synchronize();
    CHECK(serialize_state_dict(swapped_first->state_dict()) == serialize_state_dict(swapped_second->state_dict()));
  }

  TEST_CASE("swap_muon_with_adamw with one half wrapped already wraps neither: the other half's layouts stay free") {
    for (bool adamw_wrapped : {true, false}) {
      CAPTURE(adamw_wrapped);
      std::vector<ParamPtr> params = test::muon_adamw_model();
      MuonWithAdamW opt(Stream(Device::cpu()), params);
      std::unique_ptr<SwapOptimizer> half = adamw_wrapped ? swap_adamw(opt.adamw()) : swap_muon(opt.muon());
      CHECK(error_of([&] { swap_muon_with_adamw(opt); }) ==
            std::string("[swap] ") + (adamw_wrapped ? "AdamW" : "Muon") + " is already wrapped by a SwapOptimizer");
      Optimizer& other = adamw_wrapped ? static_cast<Optimizer&>(opt.muon()) : static_cast<Optimizer&>(opt.adamw());
      CHECK(!other.wrapped());
      // Never wrapped and never stepped, its params may still change dtype (a wrap fixes layouts).
      Stream cast_stream(Device::cpu());
      for (const ParamGroup& group : other.param_groups())
        for (const ParamPtr& p : group.params) {
          Tensor bf16 = Tensor::empty(p->data.shape(), DType::bf16, Device::cpu());
          ops::cast(cast_stream, p->data, bf16);
          p->data = bf16;
          p->grad = Tensor::zeros(p->data.shape(), DType::f32, Device::cpu());
        }
      cast_stream.synchronize();
      other.step();
      other.synchronize();
      CHECK(!other.state().empty());
      half.reset();  // with neither half wrapped, the set is built
      auto set = swap_muon_with_adamw(opt);
      CHECK(error_of([&] { set->member("sgd"); }) == "[swap] no member 'sgd' in the set (its members: muon, adamw)");
    }
  }

  TEST_CASE("dropping the wrapper hands the state back: the optimizer goes on bare, bitwise the never-wrapped run") {
    for (bool adamw : {false, true}) {
      CAPTURE(adamw);
      Subject plain(adamw, false), wrapped(adamw, true);  // both stepped twice
      wrapped.swapped.reset();
      CHECK_FALSE(wrapped.optimizer->wrapped());
      CHECK(snapshot(*plain.optimizer, plain.params, nullptr) == snapshot(*wrapped.optimizer, wrapped.params, nullptr));
      set_grads(plain.params, 3);
      set_grads(wrapped.params, 3);
      plain.step();
      wrapped.step();
      CHECK(snapshot(*plain.optimizer, plain.params, nullptr) == snapshot(*wrapped.optimizer, wrapped.params, nullptr));
    }
  }

  TEST_CASE("dropping the wrapper does not wait for the caller's work on the optimizer's stream") {
    for (bool adamw : {false, true}) {
      CAPTURE(adamw);
      Subject plain(adamw, false), wrapped(adamw, true);  // both stepped twice, the wrapped one not waited for
      // The trainer's own work, queued after the step, holds the stream until released.
      std::promise<void> release;
      std::shared_future<void> released = release.get_future().share();
      wrapped.optimizer->stream().enqueue([released] { released.wait(); });
      auto dropped = std::async(std::launch::async, [&] { wrapped.swapped.reset(); });
      const bool returned = dropped.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
      release.set_value();
      dropped.wait();
      CHECK(returned);
      // The state came back in stream order: the next bare step sees it, bitwise the never-wrapped run.
      set_grads(plain.params, 3);
      set_grads(wrapped.params, 3);
      plain.step();
      wrapped.step();
      CHECK(snapshot(*plain.optimizer, plain.params, nullptr) == snapshot(*wrapped.optimizer, wrapped.params, nullptr));
    }
  }
}
