// Sharded HSDP in one process, ranks as threads (thread_communicator.h): on the CPU, and on one
// GPU where the multi-process tests cannot go (Gloo moves host memory only).
#include <thread>

#include "optim/thread_communicator.h"
#include "test_util.h"

using namespace swapopt;

namespace {

struct Spec {
  std::string name;
  Shape shape;
  std::vector<Placement> placements;
};

const std::vector<Spec>& specs() {
  using P = Placement;
  static const std::vector<Spec> all = {
      {"w0", {64, 48}, {P::Replicate(), P::Shard(0)}},   {"w1", {48, 64}, {P::Replicate(), P::Shard(1)}},
      {"w2", {13, 40}, {P::Replicate(), P::Shard(0)}},   {"w3", {32, 40}, {P::Replicate(), P::Replicate()}},
      {"w4", {3, 20, 12}, {P::Replicate(), P::Shard(2)}}, {"w5", {24, 36}, {P::Shard(1), P::Shard(0)}},
  };
  return all;
}

/** The block of `full` this mesh coordinate holds under `spec` (a contiguous CPU copy). */
Tensor block_of(const Tensor& full, const Spec& spec, const DeviceMesh& mesh) {
  Shape offset;
  const Shape shape = DTensor::local_shape_at(spec.shape, mesh, spec.placements, mesh.coordinate(), &offset);
  return full.block(offset, shape).to(Device::cpu());
}

Tensor values(const Shape& shape, size_t i, int step) {
  return test::random_tensor(shape, DType::f32, uint32_t(1000 * step + i), Device::cpu());
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_float_vector(), y = b.to_float_vector();
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(double(x[i]) - double(y[i])));
  return worst;
}

/** One rank's bare HSDP Muon and swapped HSDP Muon (swap_times 2), each on its own copy of this
 *  rank's shards of specs(). */
struct RankPair {
  std::vector<ParamPtr> bare_params, swap_params;
  std::unique_ptr<Muon> bare, inner;
  std::unique_ptr<SwapOptimizer> swapped;

  RankPair(const std::shared_ptr<Communicator>& comm, const std::shared_ptr<DeviceMesh>& mesh, Device device,
           const MuonOptions& options) {
    for (size_t i = 0; i < specs().size(); ++i)
      for (auto* list : {&bare_params, &swap_params}) {
        ParamPtr p = make_param(specs()[i].name, block_of(values(specs()[i].shape, i, 0), specs()[i], *mesh).to(device));
        p->layout = DTensor(p->data, specs()[i].shape, mesh, specs()[i].placements);
        list->push_back(p);
      }
    bare = std::make_unique<Muon>(Stream(device));
    inner = std::make_unique<Muon>(Stream(device));
    bare->add_param_group(bare_params, options);
    inner->add_param_group(swap_params, options);
    HsdpOptions h;
    h.name = "bare";
    bare->enable_hsdp(comm, h);
    h.name = "swapped";
    inner->enable_hsdp(comm, h);
    SwapConfig config;
    config.swap_times = 2;
    config.min_numel = 1;
    swapped = swap_muon(*inner, config);
  }
  /** Both get this rank's block of the step's grads. */
  void set_grads(const DeviceMesh& mesh, Device device, int step) {
    for (size_t i = 0; i < specs().size(); ++i) {
      const Tensor g = block_of(values(specs()[i].shape, i, step), specs()[i], mesh);
      bare_params[i]->grad = g.to(device);
      swap_params[i]->grad = g.to(device);
    }
  }
};

/** 3 steps of single-process Muon on the full tensors and of bare and swapped HSDP Muon on
 *  `replicas` x `shards` thread ranks; returns per rank the largest |HSDP - reference| and whether
 *  swapped equalled bare bitwise (params and state). */
void run(Device device, int64_t replicas, int64_t shards, std::vector<double>& out_diff, std::vector<int>& out_swap_same,
         std::vector<std::string>& out_errors) {
  MuonOptions options;
  options.ns_dtype = DType::f32;
  Muon ref{Stream(device)};
  std::vector<ParamPtr> ref_params;
  for (size_t i = 0; i < specs().size(); ++i) ref_params.push_back(make_param(specs()[i].name, values(specs()[i].shape, i, 0).to(device)));
  ref.add_param_group(ref_params, options);
  for (int step = 1; step <= 3; ++step) {
    for (size_t i = 0; i < ref_params.size(); ++i) ref_params[i]->grad = values(specs()[i].shape, i, step).to(device);
    ref.step();
  }
  ref.stream().synchronize();

  const int n = int(replicas * shards);
  auto world = std::make_shared<test::ThreadWorld>();
  out_diff.assign(size_t(n), -1.0);
  out_swap_same.assign(size_t(n), 0);
  out_errors.assign(size_t(n), "");
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < n; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", rank, n);
        auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{replicas, shards},
                                                 std::vector<std::string>{"replicate", "shard"}, rank);
        RankPair pair(comm, mesh, device, options);
        const std::vector<ParamPtr>& bare_params = pair.bare_params;
        const std::vector<ParamPtr>& swap_params = pair.swap_params;
        for (int step = 1; step <= 3; ++step) {
          pair.set_grads(*mesh, device, step);
          pair.bare->step();
          pair.swapped->step();
        }
        pair.bare->stream().synchronize();
        pair.inner->stream().synchronize();
        double worst = 0;
        bool same = serialize_state_dict(pair.bare->state_dict()) == serialize_state_dict(pair.swapped->state_dict());
        for (size_t i = 0; i < specs().size(); ++i) {
          worst = std::max(worst, max_abs_diff(bare_params[i]->data, block_of(ref_params[i]->data, specs()[i], *mesh)));
          same = same && test::same_bits(bare_params[i]->data.to(Device::cpu()), swap_params[i]->data.to(Device::cpu()));
        }
        out_diff[size_t(rank)] = worst;
        out_swap_same[size_t(rank)] = same ? 1 : 0;
      } catch (const std::exception& e) {
        out_errors[size_t(rank)] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
}

}  // namespace

TEST_CASE("sharded HSDP on thread ranks (CPU, meshes 1x2 and 2x2): bitwise the single-process Muon, swapped bitwise bare") {
  for (const auto& [replicas, shards] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 2}}) {
    CAPTURE(replicas);
    CAPTURE(shards);
    std::vector<double> diff;
    std::vector<int> swap_same;
    std::vector<std::string> errors;
    run(Device::cpu(), replicas, shards, diff, swap_same, errors);
    for (size_t r = 0; r < diff.size(); ++r) {
      CAPTURE(r);
      CHECK(errors[r] == "");
      CHECK(diff[r] == 0.0);
      CHECK(swap_same[r] == 1);
    }
  }
}

TEST_CASE("sharded HSDP on thread ranks on one GPU (mesh 2x2): the single-process Muon within f32 rounding, swapped bitwise bare" *
          doctest::skip(test::no_gpu())) {
  std::vector<double> diff;
  std::vector<int> swap_same;
  std::vector<std::string> errors;
  run(Device::cuda(0), 2, 2, diff, swap_same, errors);
  for (size_t r = 0; r < diff.size(); ++r) {
    CAPTURE(r);
    CHECK(errors[r] == "");
    std::printf("cuda rank %zu: max |HSDP - single-process| = %.3g\n", r, diff[r]);
    CHECK(diff[r] >= 0.0);
    CHECK(diff[r] < 1e-5);  // cuBLAS may pick other kernels for one matrix than for a batch
    CHECK(swap_same[r] == 1);
  }
}

/** One bare and one swapped step of every rank of a 2 x 2 mesh of thread ranks (sharded and
 *  replicated params), each logged; with `fail_issue` >= 0 that collective's wait fails in every
 *  step, with `fail_order` >= 0 its finish_before (in the middle of the step, on every rank). Returns per rank the two
 * logs and the errors of the two steps. */
struct LoggedSteps {
  std::vector<std::vector<std::string>> bare_logs, swap_logs;
  std::vector<std::string> bare_errors, swap_errors, errors;
};
LoggedSteps logged_steps(int fail_issue, int fail_order = -1) {
  constexpr int64_t kReplicas = 2, kShards = 2;
  const int n = int(kReplicas * kShards);
  auto world = std::make_shared<test::ThreadWorld>();
  LoggedSteps out;
  out.bare_logs.resize(size_t(n));
  out.swap_logs.resize(size_t(n));
  out.bare_errors.resize(size_t(n));
  out.swap_errors.resize(size_t(n));
  out.errors = test::run_on_thread_ranks(n, [&](int rank) {
    auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{kReplicas, kShards},
                                             std::vector<std::string>{"replicate", "shard"}, rank);
    auto log = std::make_shared<test::CallLog>();
    auto comm = std::make_shared<test::RecordingCommunicator>(
        std::make_shared<test::ThreadCommunicator>(world, "world", rank, n), log);
    RankPair pair(comm, mesh, Device::cpu(), MuonOptions());
    pair.set_grads(*mesh, Device::cpu(), 1);
    for (bool swapped : {false, true}) {
      *log = test::CallLog();
      log->fail_issue = fail_issue;
      log->fail_order = fail_order;
      try {
        swapped ? pair.swapped->step() : pair.bare->step();
      } catch (const std::exception& e) {
        (swapped ? out.swap_errors : out.bare_errors)[size_t(rank)] = e.what();
      }
      (swapped ? out.swap_logs : out.bare_logs)[size_t(rank)] = log->calls;
      // A failed step leaves its streams usable: a checkpoint reload must work.
      (swapped ? pair.swapped->synchronize() : pair.bare->synchronize());
    }
  });
  return out;
}

/** Positions of `what` in `log`. */
std::vector<size_t> positions(const std::vector<std::string>& log, const std::string& what) {
  std::vector<size_t> out;
  for (size_t k = 0; k < log.size(); ++k)
    if (log[k] == what) out.push_back(k);
  return out;
}

TEST_CASE("an HSDP step waits on the host only for its checks' agreement and at its end") {
  const LoggedSteps steps = logged_steps(-1);
  for (size_t rank = 0; rank < steps.errors.size(); ++rank)
    for (const auto* log : {&steps.bare_logs[rank], &steps.swap_logs[rank]}) {
      CAPTURE(rank);
      CHECK(steps.errors[rank] == "");
      CHECK(steps.bare_errors[rank] == "");
      CHECK(steps.swap_errors[rank] == "");
      const std::vector<size_t> issues = positions(*log, "issue"), waits = positions(*log, "wait");
      // The checks' agreement, at least an all-gather and a broadcast per sharded assignment, and
      // the replicate broadcasts.
      REQUIRE(issues.size() >= 4);
      // The checks' agreement (one all-reduce) is waited for before anything changes, in one run
      // of waits; after it, no host wait until every collective of the step is issued, and then
      // one for each of them.
      REQUIRE(!waits.empty());
      size_t check_end = waits.front();
      while (check_end < log->size() && (*log)[check_end] == "wait") ++check_end;
      CHECK(issues.front() < check_end);
      CHECK(check_end < issues.back());
      // Its tensor is staged on the host, apart from the stream (which may hold an earlier
      // failure); each update collective starts after the stream's work so far.
      CHECK((issues.front() == 0 || (*log)[issues.front() - 1] != "start_after"));
      for (size_t k : issues)
        if (k > check_end) CHECK((*log)[k - 1] == "start_after");
      for (size_t w : waits) CHECK((w < check_end || w > issues.back()));
      const auto update_issues = std::count_if(issues.begin(), issues.end(), [&](size_t k) { return k > check_end; });
      const auto update_waits = std::count_if(waits.begin(), waits.end(), [&](size_t k) { return k > check_end; });
      CHECK(update_waits == update_issues);
      // Every update collective hands its result to the stream; the checks' agreement orders no
      // stream on the CPU (its tensor is host memory, waited for by the host: a stream shared by
      // ranks of one process would make them wait for each other).
      const std::vector<size_t> orders = positions(*log, "finish_before");
      CHECK(std::count_if(orders.begin(), orders.end(), [&](size_t k) { return k > check_end; }) == update_issues);
      CHECK(std::count_if(orders.begin(), orders.end(), [&](size_t k) { return k < check_end; }) == 0);
    }
}

TEST_CASE(
    "an HSDP step whose collective fails waits for every other one, throws the first error, leaves its streams "
    "usable") {
  // Issue 0 is the checks' agreement (one all-reduce) (a failed check changes nothing); 3 and 5 are
  // collectives of the update, waited for at the step's end.
  for (int fail_issue : {0, 3, 5}) {
    CAPTURE(fail_issue);
    const LoggedSteps steps = logged_steps(fail_issue);
    for (size_t rank = 0; rank < steps.errors.size(); ++rank) {
      CAPTURE(rank);
      CHECK(steps.errors[rank] == "");
      CHECK(steps.bare_errors[rank] == "[test] injected collective failure");
      CHECK(steps.swap_errors[rank] == "[test] injected collective failure");
      for (const auto* log : {&steps.bare_logs[rank], &steps.swap_logs[rank]}) {
        const std::vector<size_t> issues = positions(*log, "issue"), waits = positions(*log, "wait");
        // Every collective issued is waited for, also those after the failed one.
        CHECK(waits.size() == issues.size());
      }
    }
  }
}

TEST_CASE(
    "an HSDP step that throws in its middle waits for the collectives it issued before its streams are synchronised") {
  // The finish_before of collective 2 (an update collective in the middle of the step, the same
  // point on every rank) throws: the bare step and the swap runtime's unwind wait for every
  // collective issued so far.
  const LoggedSteps steps = logged_steps(-1, 2), whole = logged_steps(-1);
  for (size_t rank = 0; rank < steps.errors.size(); ++rank) {
    CAPTURE(rank);
    CHECK(steps.errors[rank] == "");
    CHECK(steps.bare_errors[rank] == "[test] injected failure to order a stream");
    CHECK(steps.swap_errors[rank] == "[test] injected failure to order a stream");
    for (const auto& [log, whole_log] : {std::pair(&steps.bare_logs[rank], &whole.bare_logs[rank]),
                                         std::pair(&steps.swap_logs[rank], &whole.swap_logs[rank])}) {
      // The failure came in the middle: after collective 2, before the step's last one.
      CHECK(positions(*log, "issue").size() >= 3);
      CHECK(positions(*log, "issue").size() < positions(*whole_log, "issue").size());
      CHECK(positions(*log, "wait").size() == positions(*log, "issue").size());
    }
  }
}

TEST_CASE(
    "enable_hsdp refuses another rank's layout and params with state, on every rank when one refuses; a rank's "
    "checkpoint does not load on another rank's shard") {
  // Mesh 1x2, one 7x6 matrix sharded by rows (4 rows on rank 0, 3 on rank 1) and one 8x6 (4 each).
  const auto mesh_of = [](int rank) {
    return std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 2}, std::vector<std::string>{"replicate", "shard"},
                                        rank);
  };
  const std::vector<Placement> rows = {Placement::Replicate(), Placement::Shard(0)};
  const auto param_on = [&](const std::string& name, const Shape& shape, int layout_rank,
                            const std::vector<Placement>& placements) {
    const auto mesh = mesh_of(layout_rank);
    const Shape local = DTensor::local_shape_at(shape, *mesh, placements, mesh->coordinate());
    ParamPtr p = make_param(name, test::random_tensor(local, DType::f32, uint32_t(layout_rank + 1)));
    p->layout = DTensor(p->data, shape, mesh, placements);
    p->grad = test::random_tensor(local, DType::f32, uint32_t(layout_rank + 7));
    return p;
  };
  auto world = std::make_shared<test::ThreadWorld>();
  std::vector<StateDict> saved(2);
  const std::vector<std::string> errors = test::run_on_thread_ranks(2, [&](int rank) {
    auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", rank, 2);
    // Another rank's layout: named before any collective, nothing enabled.
    Muon crossed{Stream(Device::cpu())};
    crossed.add_param_group({param_on("a", {8, 6}, rank, rows), param_on("b", {7, 6}, 1 - rank, rows)});
    CHECK(test::error_of([&] { crossed.enable_hsdp(comm); }) ==
          "[Muon] enable_hsdp: parameter 'b' has the layout of mesh rank " + std::to_string(1 - rank) +
              ", this is rank " + std::to_string(rank) + " of the communicator");
    CHECK_FALSE(crossed.hsdp_enabled());
    // State before HSDP (a replicated param steps locally): the non-owners' momentum would go stale.
    Muon stepped{Stream(Device::cpu())};
    stepped.add_param_group({param_on("a", {8, 6}, rank, {Placement::Replicate(), Placement::Replicate()})});
    stepped.step();
    CHECK(test::error_of([&] { stepped.enable_hsdp(comm); }) ==
          "[Muon] enable_hsdp: parameter 'a' has state already (a step or a load before): enable HSDP before the first "
          "step, and load checkpoints after it");
    // One rank alone refuses: the other learns it before the sub-groups' rendezvous (where it would
    // wait for the refusing rank until the timeout), and neither enables HSDP.
    Muon lone{Stream(Device::cpu())};
    lone.add_param_group({param_on("a", {8, 6}, rank, {Placement::Replicate(), Placement::Replicate()})});
    if (rank == 1) lone.step();
    CHECK(test::error_of([&] { lone.enable_hsdp(comm); }) ==
          (rank == 1 ? "[Muon] enable_hsdp: parameter 'a' has state already (a step or a load before): enable HSDP "
                       "before the first step, and load checkpoints after it"
                     : "[Muon] enable_hsdp failed its checks on another rank (that rank's error says why): HSDP is not "
                       "enabled"));
    CHECK_FALSE(lone.hsdp_enabled());
    // Each rank's checkpoint names its shard: the other rank's file, of the same shape, is refused.
    Muon muon{Stream(Device::cpu())};
    muon.add_param_group({param_on("a", {8, 6}, rank, rows)});
    HsdpOptions named;
    named.name = "checkpoint";
    muon.enable_hsdp(comm, named);
    muon.step();
    saved[size_t(rank)] = muon.state_dict();
    comm->barrier();
    const std::string before = serialize_state_dict(muon.state_dict());
    CHECK(test::error_of([&] { muon.load_state_dict(saved[size_t(1 - rank)]); }) ==
          "[checkpoint] param 0 ('a') holds the shard at " + std::string(rank == 0 ? "[4, 0]" : "[0, 0]") +
              " of its tensor, this rank the shard at " + (rank == 0 ? "[0, 0]" : "[4, 0]") +
              " (another rank's checkpoint?)");
    CHECK(serialize_state_dict(muon.state_dict()) == before);
    muon.load_state_dict(saved[size_t(rank)]);
    CHECK(serialize_state_dict(muon.state_dict()) == before);
  });
  CHECK(errors == std::vector<std::string>{"", ""});
}

TEST_CASE("enable_hsdp: ranks whose HsdpOptions or layouts differ are refused on every rank, before any sub-group") {
  // Before, such ranks enabled HSDP and then stepped with different plans: a param no rank owned
  // was zeroed, or a rank waited for the others until the timeout.
  struct Case {
    const char* what;
    std::function<void(int rank, HsdpOptions&, std::vector<Placement>&, Shape&, std::string&)> change;
  };
  const std::vector<Case> cases = {
      {"cap_bytes", [](int rank, HsdpOptions& o, auto&, auto&, auto&) { o.cap_bytes = rank == 1 ? 1 : o.cap_bytes; }},
      {"broadcast_buffer_bytes",
       [](int rank, HsdpOptions& o, auto&, auto&, auto&) {
         if (rank == 1) o.broadcast_buffer_bytes = 4096;
       }},
      {"replica_count",
       [](int rank, HsdpOptions& o, auto&, auto&, auto&) {
         if (rank == 1) o.replica_count = 1;
       }},
      {"placements",
       [](int rank, auto&, std::vector<Placement>& p, auto&, auto&) {
         if (rank == 1) p[1] = Placement::Shard(1);
       }},
      {"logical shape",
       [](int rank, auto&, auto&, Shape& s, auto&) {
         if (rank == 1) s = {12, 8};
       }},
      {"name",
       [](int rank, auto&, auto&, auto&, std::string& n) {
         if (rank == 1) n = "c";
       }},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    auto world = std::make_shared<test::ThreadWorld>();
    std::vector<std::string> seen(4);
    const std::vector<std::string> errors = test::run_on_thread_ranks(4, [&](int rank) {
      auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", rank, 4);
      auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 2},
                                               std::vector<std::string>{"replicate", "shard"}, rank);
      HsdpOptions options;
      std::vector<Placement> placements = {Placement::Replicate(), Placement::Shard(0)};
      Shape shape = {12, 6};
      std::string name = "b";
      c.change(rank, options, placements, shape, name);
      const Shape local = DTensor::local_shape_at(shape, *mesh, placements, mesh->coordinate());
      ParamPtr a = make_param("a", test::random_tensor({8, 6}, DType::f32, 1));
      a->layout = DTensor(a->data, {8, 6}, mesh, {Placement::Replicate(), Placement::Replicate()});
      ParamPtr b = make_param(name, test::random_tensor(local, DType::f32, 2));
      b->layout = DTensor(b->data, shape, mesh, placements);
      Muon muon{Stream(Device::cpu())};
      muon.add_param_group({a, b});
      seen[size_t(rank)] = test::error_of([&] { muon.enable_hsdp(comm, options); });
      CHECK_FALSE(muon.hsdp_enabled());
    });
    CHECK(errors == std::vector<std::string>(4, ""));
    for (int rank = 0; rank < 4; ++rank) {
      CAPTURE(rank);
      CHECK(seen[size_t(rank)].rfind("[Muon] enable_hsdp: the ranks' setups differ (this rank: cap_bytes ", 0) == 0);
      CHECK(
          seen[size_t(rank)].find("; 2 params with layouts): every rank must pass the same HsdpOptions, with the same "
                                  "params (names, groups, dtypes, logical shapes, placements): HSDP is not enabled") !=
          std::string::npos);
    }
  }
  // A replica_count that does not divide the replicas, on one rank: that rank names it, the others
  // learn of it (they waited in the sub-groups' rendezvous).
  auto world = std::make_shared<test::ThreadWorld>();
  const std::vector<std::string> errors = test::run_on_thread_ranks(4, [&](int rank) {
    auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", rank, 4);
    auto mesh =
        std::make_shared<DeviceMesh>(std::vector<int64_t>{4, 1}, std::vector<std::string>{"replicate", "shard"}, rank);
    ParamPtr w = make_param("w", test::random_tensor({8, 6}, DType::f32, 1));
    w->layout = DTensor(w->data, {8, 6}, mesh, {Placement::Replicate(), Placement::Replicate()});
    Muon muon{Stream(Device::cpu())};
    muon.add_param_group({w});
    HsdpOptions options;
    if (rank == 1) options.replica_count = 3;
    CHECK(test::error_of([&] { muon.enable_hsdp(comm, options); }) ==
          (rank == 1 ? "[Muon] HsdpOptions::replica_count 3 must divide the 4 replicas of parameter 'w'"
                     : "[Muon] enable_hsdp failed its checks on another rank (that rank's error says why): HSDP is "
                       "not enabled"));
    CHECK_FALSE(muon.hsdp_enabled());
  });
  CHECK(errors == std::vector<std::string>(4, ""));
}

/** One thread rank of a 2x1 mesh with two replicated matrices "a" and "b", each owned by one
 *  rank, after one HSDP Muon step; `mine` is the index of the param this rank owns. */
struct TwoOwners {
  std::shared_ptr<test::ThreadCommunicator> comm;
  std::vector<ParamPtr> params;
  Muon muon{Stream(Device::cpu())};
  size_t mine = 0;

  TwoOwners(const std::shared_ptr<test::ThreadWorld>& world, int rank)
      : comm(std::make_shared<test::ThreadCommunicator>(world, "world", rank, 2)) {
    auto mesh =
        std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 1}, std::vector<std::string>{"replicate", "shard"}, rank);
    for (const char* name : {"a", "b"}) {
      ParamPtr p = make_param(name, test::random_tensor({8, 6}, DType::f32, name[0]));
      p->layout = DTensor(p->data, {8, 6}, mesh, {Placement::Replicate(), Placement::Replicate()});
      p->grad = test::random_tensor({8, 6}, DType::f32, 10 + name[0]);
      params.push_back(p);
    }
    muon.add_param_group(params);
    muon.enable_hsdp(comm);
    muon.step();
    mine = muon.state().count(params[0].get()) ? 0 : 1;
  }
};

TEST_CASE(
    "a param's layout changed after enable_hsdp is refused by the step on every rank, bare and swapped, changing "
    "nothing") {
  // Mesh 1x2: 'a' (8x6) sharded by rows, 'v' (4x4) local, 'late' (4x4) local in a group added
  // after enable_hsdp (as it may be, without a layout). The plan is made once, at enable_hsdp;
  // the step read each param's layout as it is now: a dropped layout updated a replica twice (or a
  // shard as a whole matrix), an added one left a param without any update, and swapped, one rank
  // failed inside the runtime while the other waited for it (found by a hunting helper).
  enum class Change { drop_on_rank_1, drop_everywhere, add_on_rank_0, add_to_late_on_rank_0 };
  for (const Change change :
       {Change::drop_on_rank_1, Change::drop_everywhere, Change::add_on_rank_0, Change::add_to_late_on_rank_0})
    for (const bool swap : {false, true}) {
      CAPTURE(int(change));
      CAPTURE(swap);
      auto world = std::make_shared<test::ThreadWorld>();
      std::vector<std::string> seen(2);
      const std::vector<std::string> errors = test::run_on_thread_ranks(2, [&](int rank) {
        auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", rank, 2);
        auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 2},
                                                 std::vector<std::string>{"replicate", "shard"}, rank);
        const std::vector<Placement> rows = {Placement::Replicate(), Placement::Shard(0)};
        ParamPtr a = make_param("a", test::random_tensor({4, 6}, DType::f32, 1 + uint32_t(rank)));
        a->layout = DTensor(a->data, {8, 6}, mesh, rows);
        ParamPtr v = make_param("v", test::random_tensor({4, 4}, DType::f32, 5));
        Muon muon{Stream(Device::cpu())};
        muon.add_param_group({a, v});
        muon.enable_hsdp(comm, HsdpOptions{.name = "layout"});
        ParamPtr late = make_param("late", test::random_tensor({4, 4}, DType::f32, 6));
        muon.add_param_group({late});
        std::unique_ptr<SwapOptimizer> swapped;
        if (swap) swapped = swap_muon(muon, SwapConfig{.min_numel = 1});
        const auto step = [&](int n) {
          a->grad = test::random_tensor({4, 6}, DType::f32, 10 * uint32_t(n) + uint32_t(rank));
          v->grad = test::random_tensor({4, 4}, DType::f32, 10 * uint32_t(n) + 7);
          late->grad = test::random_tensor({4, 4}, DType::f32, 10 * uint32_t(n) + 8);
          return test::error_of([&] { swap ? swapped->step() : muon.step(); });
        };
        const auto state = [&] {
          swap ? swapped->synchronize() : muon.stream().synchronize();
          return serialize_state_dict(swap ? swapped->state_dict() : muon.state_dict());
        };
        CHECK(step(1) == "");
        const std::string state_before = state();  // synchronises: the data below is step 1's
        const Tensor a_before = a->data.clone(), v_before = v->data.clone(), late_before = late->data.clone();
        const std::optional<DTensor> a_layout = a->layout;
        if (change == Change::drop_everywhere || (change == Change::drop_on_rank_1 && rank == 1)) a->layout.reset();
        if (change == Change::add_on_rank_0 && rank == 0)
          v->layout = DTensor(v->data, {4, 4}, mesh, {Placement::Replicate(), Placement::Replicate()});
        if (change == Change::add_to_late_on_rank_0 && rank == 0)
          late->layout = DTensor(late->data, {4, 4}, mesh, {Placement::Replicate(), Placement::Replicate()});
        seen[size_t(rank)] = step(2);
        a->layout = a_layout;  // as planned again (a state dict describes each param's layout)
        v->layout.reset();
        late->layout.reset();
        CHECK(test::same_bits(a->data, a_before));
        CHECK(test::same_bits(v->data, v_before));
        CHECK(test::same_bits(late->data, late_before));
        CHECK(state() == state_before);
        CHECK(step(2) == "");  // as planned again: the step runs on every rank
      });
      CHECK(errors == std::vector<std::string>{"", ""});
      const std::string dropped =
          "[Muon] parameter 'a' has layout none, enable_hsdp planned its update for [8, 6] on mesh [1, 2] (rank R): "
          "Replicate() Shard(0): a param's layout is fixed once HSDP is enabled";
      const auto on_rank = [&](int rank) {
        std::string text = dropped;
        text.replace(text.find("rank R"), 6, "rank " + std::to_string(rank));
        return text;
      };
      const std::string added =
          "[Muon] parameter 'v' has layout [4, 4] on mesh [1, 2] (rank 0): Replicate() Replicate(), enable_hsdp "
          "planned its update for none: a param's layout is fixed once HSDP is enabled";
      for (int rank = 0; rank < 2; ++rank) {
        CAPTURE(rank);
        const bool changed = change == Change::drop_everywhere || (change == Change::drop_on_rank_1 && rank == 1) ||
                             (change == Change::add_on_rank_0 && rank == 0) ||
                             (change == Change::add_to_late_on_rank_0 && rank == 0);
        std::string late_added = added;
        late_added.replace(late_added.find("'v'"), 3, "'late'");
        if (changed) {
          CHECK(seen[size_t(rank)] == (change == Change::add_on_rank_0           ? added
                                       : change == Change::add_to_late_on_rank_0 ? late_added
                                                                                 : on_rank(rank)));
        } else {
          CHECK(seen[size_t(rank)] ==
                "[Muon] the step's checks failed on 1 of 2 ranks (their errors say why): the step changed nothing");
        }
      }
    }
}

TEST_CASE("a rank's HSDP checkpoint does not load where a param it did not keep is updated; a full copy does") {
  // Mesh 2x1: two replicated matrices, one owned by each rank. Each rank's file holds only the
  // momentum it owns; loaded on the other rank, the param that rank updates had restarted from
  // zero momentum, silently.
  auto world = std::make_shared<test::ThreadWorld>();
  std::vector<StateDict> own(2), full(2);
  const std::vector<std::string> errors = test::run_on_thread_ranks(2, [&](int rank) {
    TwoOwners ranked(world, rank);
    Muon& muon = ranked.muon;
    const std::vector<ParamPtr>& params = ranked.params;
    const size_t mine = ranked.mine;
    REQUIRE(muon.state().count(params[1 - mine].get()) == 0);
    own[size_t(rank)] = muon.state_dict();
    full[size_t(rank)] = broadcast_state_to_replicas(muon, muon.state_dict());
    ranked.comm->barrier();
    const std::string before = serialize_state_dict(muon.state_dict());
    CHECK(test::error_of([&] { muon.load_state_dict(own[size_t(1 - rank)]); }) ==
          std::string("[checkpoint] param ") + std::to_string(mine) + " ('" + params[mine]->name +
              "') is updated by this rank, but the rank that saved the file did not keep its state (another HSDP "
              "plan or rank): load a full copy made by broadcast_state_to_replicas");
    CHECK(serialize_state_dict(muon.state_dict()) == before);
    CHECK(full[size_t(rank)].metadata.find("param_kept") == std::string::npos);
    muon.load_state_dict(full[size_t(1 - rank)]);  // the other rank's full copy holds this rank's momentum too
    CHECK(serialize_state_dict(muon.state_dict()) == before);
    muon.load_state_dict(own[size_t(rank)]);
    CHECK(serialize_state_dict(muon.state_dict()) == before);
  });
  CHECK(errors == std::vector<std::string>{"", ""});
}

TEST_CASE("broadcast_state_to_replicas refuses a bad state on every rank before it broadcasts anything") {
  // Mesh 2x1, two replicated matrices owned one by each rank. Rank 1 passes a state dict that is
  // wrong in one way; it used to throw alone (or broadcast a tensor of the wrong size) and leave
  // rank 0 waiting in a collective until the timeout.
  struct Case {
    const char* what;
    std::function<void(StateDict&, const std::string& owned)> spoil;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"no param_steps",
       [](StateDict& s, const std::string&) {
         const size_t at = s.metadata.find("\"param_steps\":[");
         REQUIRE(at != std::string::npos);
         REQUIRE(s.metadata[at - 1] == ',');  // keys are sorted: the last one, after a comma
         s.metadata.erase(at - 1, s.metadata.find(']', at) + 1 - (at - 1));
       },
       "[checkpoint] metadata has no 'param_steps'"},
      {"a misspelt param_steps",
       [](StateDict& s, const std::string&) {
         const size_t at = s.metadata.find("\"param_steps\"");
         REQUIRE(at != std::string::npos);
         s.metadata.replace(at, 13, "\"param_stops\"");
       },
       "[checkpoint] metadata has unknown key 'param_stops'"},
      {"metadata not JSON", [](StateDict& s, const std::string&) { s.metadata = "{"; },
       "[checkpoint] bad JSON at byte "},
      {"an unknown metadata key", [](StateDict& s, const std::string&) { s.metadata.insert(1, "\"extra\":1,"); },
       "[checkpoint] metadata has unknown key 'extra'"},
      {"a negative param step",
       [](StateDict& s, const std::string&) {
         const size_t at = s.metadata.find("\"param_steps\":[");
         REQUIRE(at != std::string::npos);
         s.metadata.insert(at + 15, "-1");
       },
       "[Muon] broadcast_state_to_replicas: negative param step -"},
      {"a momentum of the wrong shape",
       [](StateDict& s, const std::string& owned) {
         s.tensors[owned] = Tensor::zeros({6, 8}, DType::f32, Device::cpu());
       },
       "' is Tensor(f32, [6, 8], cpu), 'b' needs f32 [8, 6]"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    auto world = std::make_shared<test::ThreadWorld>();
    const std::vector<std::string> errors = test::run_on_thread_ranks(2, [&](int rank) {
      TwoOwners ranked(world, rank);
      Muon& muon = ranked.muon;
      StateDict state = muon.state_dict();
      if (rank == 1) c.spoil(state, muon.state_name(ranked.params[ranked.mine].get(), "momentum_buffer"));
      const std::string error = test::error_of([&] { broadcast_state_to_replicas(muon, state); });
      if (rank == 0) {
        CHECK(error ==
              "[Muon] broadcast_state_to_replicas failed its checks on another rank (that rank's error says why): "
              "nothing was broadcast");
      } else {
        CAPTURE(error);
        CHECK(error.rfind("[", 0) == 0);
        CHECK(error.find(c.want) != std::string::npos);
      }
      // Both ranks go on: a good state broadcasts.
      CHECK(broadcast_state_to_replicas(muon, muon.state_dict()).metadata.find("param_kept") == std::string::npos);
    });
    CHECK(errors == std::vector<std::string>{"", ""});
  }
}

TEST_CASE("broadcast_state_to_replicas refuses another rank's state dict on every rank") {
  // Rank 1 passes rank 0's state dict (same params and shapes, the other owner): its momentum
  // would have gone to rank 1's replicas as if it were rank 1's (found by a hunting helper).
  auto world = std::make_shared<test::ThreadWorld>();
  std::vector<StateDict> states(2);
  const std::vector<std::string> errors = test::run_on_thread_ranks(2, [&](int rank) {
    TwoOwners ranked(world, rank);
    states[size_t(rank)] = ranked.muon.state_dict();
    ranked.comm->barrier();
    const std::string error = test::error_of([&] { broadcast_state_to_replicas(ranked.muon, states[0]); });
    CHECK(error == (rank == 1 ? "[Muon] broadcast_state_to_replicas: the state's 'param_kept' is not this rank's: "
                                "pass this rank's own state_dict()"
                              : "[Muon] broadcast_state_to_replicas failed its checks on another rank (that rank's "
                                "error says why): nothing was broadcast"));
    // A full copy may be completed again.
    const StateDict full = broadcast_state_to_replicas(ranked.muon, ranked.muon.state_dict());
    CHECK(serialize_state_dict(broadcast_state_to_replicas(ranked.muon, full)) == serialize_state_dict(full));
  });
  CHECK(errors == std::vector<std::string>{"", ""});
}

namespace {

/** Two replicated params on a 1x1 mesh, of two core shapes: one HSDP assignment of two NS batches. */
std::vector<ParamPtr> two_batch_replicated_model(uint32_t seed) {
  auto mesh =
      std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 1}, std::vector<std::string>{"replicate", "shard"}, 0);
  std::vector<ParamPtr> params;
  const Shape shapes[] = {{64, 48}, {32, 40}};
  for (uint32_t i = 0; i < 2; ++i) {
    ParamPtr p = make_param("w" + std::to_string(i), test::random_tensor(shapes[i], DType::f32, seed + i));
    p->layout = DTensor(p->data, shapes[i], mesh, {Placement::Replicate(), Placement::Replicate()});
    params.push_back(p);
  }
  return params;
}

/** Gives `bare` and `inner` (the Muon a swap wrapper will hold) their params, then HSDP over `comm`. */
void enable_bare_and_inner(Muon& bare, const std::vector<ParamPtr>& bare_params, Muon& inner,
                           const std::vector<ParamPtr>& inner_params, const std::shared_ptr<Communicator>& comm) {
  bare.add_param_group(bare_params);
  inner.add_param_group(inner_params);
  HsdpOptions options;
  options.name = "bare";
  bare.enable_hsdp(comm, options);
  options.name = "swapped";
  inner.enable_hsdp(comm, options);
}

}  // namespace

TEST_CASE("HSDP swapped: a zeropower_fn throwing at the params' first update keeps the momentum the bare step kept") {
  // One replicated assignment of two NS batches (two core shapes) on a 1x1 mesh: the hook throws
  // at the k-th NS call of step 1, after the optimizer created and counted the momentum of the
  // params before it. The swapped step removed all of the assignment's new state (found by a
  // hunting helper); it keeps each param's the bare step kept. Chunked (a budget below the
  // assignment's state plus workspace), its momentum streams NS batch by NS batch: written for all
  // batches before the first Newton-Schulz, a throw left the later batch's momentum advanced.
  for (const bool chunked : {false, true})
    for (int throw_at = 0; throw_at < 2; ++throw_at) {
      CAPTURE(chunked);
      CAPTURE(throw_at);
      auto world = std::make_shared<test::ThreadWorld>();
      auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", 0, 1);
      const auto model = [] { return two_batch_replicated_model(10); };
      const auto hooks = [throw_at](int* calls) {
        MuonHooks h;
        h.zeropower_fn = [calls, throw_at](Stream&, const Tensor&, int) {
          if ((*calls)++ == throw_at) throw Error("zeropower_fn failed");
        };
        return h;
      };
      int bare_calls = 0, swap_calls = 0;
      auto bare_params = model(), swap_params = model();
      Muon bare(Stream(Device::cpu()), hooks(&bare_calls)), inner(Stream(Device::cpu()), hooks(&swap_calls));
      enable_bare_and_inner(bare, bare_params, inner, swap_params, comm);
      SwapConfig config{.min_numel = 1};
      if (chunked) config.device_budget_bytes = 80000;
      auto swapped = swap_muon(inner, config);
      for (int step = 1; step <= 3; ++step) {
        CAPTURE(step);
        for (size_t i = 0; i < bare_params.size(); ++i) {
          bare_params[i]->grad =
              test::random_tensor(bare_params[i]->data.shape(), DType::f32, 100 * uint32_t(step) + uint32_t(i));
          swap_params[i]->grad = bare_params[i]->grad.clone();
        }
        std::vector<std::string> seen;
        swapped->runtime().set_trace([&](const std::string& e) { seen.push_back(e); });
        const std::string bare_error = test::error_of([&] { bare.step(); });
        const std::string swap_error = test::error_of([&] { swapped->step(); });
        swapped->runtime().set_trace(nullptr);
        // Every arena allocated is freed, also when a hook threw between the unit's parts.
        const auto storages = [&](const std::string& what) {
          int n = 0;
          for (const std::string& e : seen)
            if (e.starts_with(what)) n += std::stoi(e.substr(what.size()));
          return n;
        };
        CHECK(storages("allocate_arenas ") == storages("free_arenas "));
        if (chunked) CHECK(storages("allocate_arenas ") > 0);
        bare.stream().synchronize();
        swapped->synchronize();
        CHECK(bare_error == (step == 1 ? "zeropower_fn failed" : ""));
        CHECK(swap_error == bare_error);
        for (size_t i = 0; i < bare_params.size(); ++i)
          CHECK(test::same_bits(bare_params[i]->data, swap_params[i]->data));
        CHECK(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()));
        if (step > 1) CHECK(swapped->last_report().chunked_units == (chunked ? 1 : 0));
      }
    }
}

TEST_CASE("HSDP swapped: a chunked replicated assignment allocates its arenas once for all of its NS batches") {
  // Two core shapes, two NS batches: the assignment streams its momentum batch by batch, each
  // batch a part of the unit's chunks. Each part allocated and freed the unit's arenas until
  // 2026-12-07 (a CUDA review found it): a pool that may not reuse memory across streams held two
  // parts' arenas at once. Now both arenas come once, before the first part, and go after the last.
  auto world = std::make_shared<test::ThreadWorld>();
  auto comm = std::make_shared<test::ThreadCommunicator>(world, "world", 0, 1);
  const auto model = [] { return two_batch_replicated_model(20); };
  auto bare_params = model(), swap_params = model();
  Muon bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
  enable_bare_and_inner(bare, bare_params, inner, swap_params, comm);
  const size_t budget = 80000;
  auto swapped = swap_muon(inner, SwapConfig{.min_numel = 1, .device_budget_bytes = budget});
  std::vector<std::string> seen;
  swapped->runtime().set_trace([&](const std::string& e) { seen.push_back(e); });
  for (int step = 1; step <= 3; ++step) {
    CAPTURE(step);
    for (size_t i = 0; i < bare_params.size(); ++i) {
      bare_params[i]->grad =
          test::random_tensor(bare_params[i]->data.shape(), DType::f32, 200 * uint32_t(step) + uint32_t(i));
      swap_params[i]->grad = bare_params[i]->grad.clone();
    }
    seen.clear();
    bare.step();
    swapped->step();
    bare.stream().synchronize();
    swapped->synchronize();
    const auto count = [&](const std::string& prefix) {
      return std::count_if(seen.begin(), seen.end(), [&](const std::string& e) { return e.starts_with(prefix); });
    };
    REQUIRE(!seen.empty());
    CHECK(count("h2d 0") == 2);  // one part per NS batch
    CHECK(count("allocate_arenas ") == 1);
    CHECK(count("free_arenas ") == 1);
    CHECK(seen.front().starts_with("allocate_arenas "));
    CHECK(seen.back().starts_with("free_arenas "));
    if (step > 1) CHECK(swapped->last_report().chunked_units == 1);
    CHECK(swapped->last_report().peak_resident_bytes + swapped->last_report().peak_workspace_bytes <= budget);
    for (size_t i = 0; i < bare_params.size(); ++i) CHECK(test::same_bits(bare_params[i]->data, swap_params[i]->data));
  }
}
