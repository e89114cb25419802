// HSDP Muon in one process: the plan's greedy rules, a one-rank mesh, and every named error. The
// multi-process runs are in tests/mp.
#include <algorithm>

#include "swapopt/optim/hsdp_checkpoint.h"
#include "swapopt/optim/muon.h"
#include "test_util.h"

using namespace swapopt;

namespace {

/** A stand-in group with no process behind it: collectives work at size 1 (the identity) and
 *  throw otherwise; sub_group() records what it was asked for. */
class FakeCommunicator final : public Communicator {
 public:
  using SubGroupLog = std::vector<std::pair<std::vector<int>, std::string>>;
  explicit FakeCommunicator(int rank = 0, int size = 1, SubGroupLog* log = nullptr) : rank_(rank), size_(size), log_(log) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "fake"; }
  WorkPtr broadcast(const Tensor&, int) override { return done(); }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    Stream s(Device::cpu());
    ops::copy(s, in, out);
    s.synchronize();
    return done();
  }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) override { return all_gather(in, out); }
  WorkPtr all_reduce(const Tensor&) override { return done(); }
  void barrier() override {}
  std::unique_ptr<Communicator> sub_group(const std::vector<int>& ranks, const std::string& name) override {
    if (log_ != nullptr) log_->push_back({ranks, name});
    const int sub_rank = int(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
    return std::make_unique<FakeCommunicator>(sub_rank, int(ranks.size()));
  }

 private:
  struct Done final : Work {
    void wait() override {}
  };
  WorkPtr done() const {
    if (size_ != 1) throw Error("FakeCommunicator runs collectives at size 1 only");
    return std::make_shared<Done>();
  }
  int rank_, size_;
  SubGroupLog* log_;
};

ParamPtr matrix(const std::string& name, int64_t rows, int64_t cols, uint32_t seed) {
  return make_param(name, test::random_tensor({rows, cols}, DType::f32, seed));
}

}  // namespace

TEST_CASE("HSDP plan: soft cap per replica count, owners and NS ranks greedy by load") {
  // numel 64, 16, 36, 10, 9 (f32 bytes 256, 64, 144, 40, 36)
  std::vector<ParamPtr> keep = {matrix("a", 8, 8, 1), matrix("b", 4, 4, 2), matrix("c", 6, 6, 3), matrix("d", 2, 5, 4),
                                matrix("e", 3, 3, 5)};
  std::vector<Param*> params;
  for (const ParamPtr& p : keep) params.push_back(p.get());

  // One assignment: owners by (-numel, index) to the least loaded replica: a->0; c, b, d, e->1.
  // Then per owner, NS ranks the same way: a->0; c->0, b->1, d->1, e->1.
  const auto one = make_hsdp_assignments(0, params, 2, 1, 1 << 20, 2);
  REQUIRE(one.size() == 1);
  CHECK(one[0].params == std::vector<Param*>{params[0], params[2], params[1], params[3], params[4]});  // largest first
  CHECK(one[0].owners == std::vector<int64_t>{0, 1, 1, 1, 1});
  CHECK(one[0].ns_ranks == std::vector<int64_t>{0, 0, 1, 1, 1});
  CHECK(one[0].owned() == std::vector<Param*>{params[2], params[1], params[3], params[4]});
  CHECK(one[0].owns(params[1]));
  CHECK_FALSE(one[0].owns(params[0]));
  CHECK(one[0].logical_bytes() == 540);

  // Cap 100 B x 2 replicas: a batch closes once it reaches 200 B: [a], [c, b], [d, e].
  const auto split = make_hsdp_assignments(0, params, 2, 0, 100, 1);
  REQUIRE(split.size() == 3);
  CHECK(split[0].params == std::vector<Param*>{params[0]});
  CHECK(split[1].params == std::vector<Param*>{params[2], params[1]});
  CHECK(split[1].owners == std::vector<int64_t>{0, 1});
  CHECK(split[2].params == std::vector<Param*>{params[3], params[4]});
}

TEST_CASE("HSDP plan ties: equal sizes keep their order; a tied load goes to the lowest coordinate") {
  auto plan = [](const std::vector<ParamPtr>& keep, int64_t replicas) {
    std::vector<Param*> params;
    for (const ParamPtr& p : keep) params.push_back(p.get());
    const auto out = make_hsdp_assignments(0, params, replicas, 0, 1 << 20, 2);
    REQUIRE(out.size() == 1);
    return out[0];
  };
  // Four 4x4 on 3 replicas: w0, w1, w2 to 0, 1, 2; then every load ties and w3 goes to 0. Per
  // owner, NS ranks over 2 shard ranks the same way: owner 0's w0 -> 0, w3 -> 1.
  const std::vector<ParamPtr> equal = {matrix("w0", 4, 4, 1), matrix("w1", 4, 4, 2), matrix("w2", 4, 4, 3),
                                       matrix("w3", 4, 4, 4)};
  const HsdpAssignment a = plan(equal, 3);
  CHECK(a.params == std::vector<Param*>{equal[0].get(), equal[1].get(), equal[2].get(), equal[3].get()});
  CHECK(a.owners == std::vector<int64_t>{0, 1, 2, 0});
  CHECK(a.ns_ranks == std::vector<int64_t>{0, 0, 0, 1});
  // numel 9, 16, 9, 16, 4 on 2 replicas: order b, d, a, c, e (equal sizes by index). b -> 0
  // (tie), d -> 1, a -> 0 (16 = 16), c -> 1 (25 > 16), e -> 0 (25 = 25). NS ranks per owner:
  // owner 0's b, a, e -> 0, 1, 1 (16 > 9); owner 1's d, c -> 0, 1.
  const std::vector<ParamPtr> mixed = {matrix("a", 3, 3, 5), matrix("b", 4, 4, 6), matrix("c", 3, 3, 7), matrix("d", 4, 4, 8),
                                       matrix("e", 2, 2, 9)};
  const HsdpAssignment m = plan(mixed, 2);
  CHECK(m.params == std::vector<Param*>{mixed[1].get(), mixed[3].get(), mixed[0].get(), mixed[2].get(), mixed[4].get()});
  CHECK(m.owners == std::vector<int64_t>{0, 1, 0, 1, 0});
  CHECK(m.ns_ranks == std::vector<int64_t>{0, 0, 1, 1, 1});
}

TEST_CASE("HSDP plan of bad or extreme arguments: named errors, no overflow, no allocation per replica") {
  const std::vector<ParamPtr> keep = {matrix("a", 8, 8, 1), matrix("b", 4, 4, 2)};
  std::vector<Param*> params = {keep[0].get(), keep[1].get()};
  CHECK(test::error_of([&] {
          make_hsdp_assignments(0, {params[0], nullptr}, 1, 0, 100);
        }) == "[Muon] HSDP param 1 is null");
  CHECK(test::error_of([&] { make_hsdp_assignments(0, params, 1, 0, 0); }) ==
        "[Muon] HSDP cap_bytes must be >= 1, got 0");
  // A cap times the replicas beyond int64 is no cap; 2^40 replicas for two params: two owners used.
  const auto huge = make_hsdp_assignments(0, params, int64_t(1) << 40, 0, int64_t(1) << 40, int64_t(1) << 40);
  REQUIRE(huge.size() == 1);
  CHECK(huge[0].owners == std::vector<int64_t>{0, 1});
  CHECK(huge[0].ns_ranks == std::vector<int64_t>{0, 0});
  CHECK(align_to_512_bytes(129, DType::f32) == 256);
  CHECK(align_to_512_bytes(0, DType::bf16) == 0);
  CHECK(test::error_of([] { align_to_512_bytes(-1000, DType::f32); }) ==
        "[Muon] cannot align -1000 elements to 512 bytes");
  CHECK(test::error_of([] { align_to_512_bytes(std::numeric_limits<int64_t>::max(), DType::f32); }) ==
        "[Muon] cannot align 9223372036854775807 elements to 512 bytes");
}

TEST_CASE("MeshGroups: indices along mesh dims, the members and names of each group, blocks, caching") {
  FakeCommunicator::SubGroupLog log;
  auto world = std::make_shared<FakeCommunicator>(4, 6, &log);
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 3}, std::vector<std::string>{"replicate", "shard"}, 4);
  MeshGroups groups(world, mesh, "t");  // rank 4 is at (1, 1)
  CHECK(groups.size({0}) == 2);
  CHECK(groups.size({1}) == 3);
  CHECK(groups.size({0, 1}) == 6);
  CHECK(groups.index({0}) == 1);
  CHECK(groups.index({1}) == 1);
  CHECK(groups.index({0, 1}) == 4);
  CHECK(groups.coordinate_at({1}, 2) == std::vector<int64_t>{1, 2});
  CHECK(groups.coordinate_at({0}, 0) == std::vector<int64_t>{0, 1});

  auto shards = groups.group({1}, 3);
  CHECK(shards->rank() == 1);
  CHECK(shards->size() == 3);
  auto replicas = groups.group({0}, 2);
  CHECK(replicas->rank() == 1);
  CHECK(groups.group({0, 1}, 6) == std::shared_ptr<Communicator>(world));  // the whole world: no new group
  auto pair = groups.group({0, 1}, 2);  // blocks of 2 over all 6: this rank's is {4, 5}
  CHECK(pair->rank() == 0);
  CHECK(groups.group({1}, 3) == shards);  // cached
  REQUIRE(log.size() == 3);
  CHECK(log[0] == FakeCommunicator::SubGroupLog::value_type{{3, 4, 5}, "t/dims.1/block3/first3"});
  CHECK(log[1] == FakeCommunicator::SubGroupLog::value_type{{1, 4}, "t/dims.0/block2/first1"});
  CHECK(log[2] == FakeCommunicator::SubGroupLog::value_type{{4, 5}, "t/dims.0.1/block2/first4"});
  CHECK_THROWS_WITH_AS(groups.group({1}, 2), "[MeshGroups] block 2 does not divide 3 ranks", Error);
  // Dims must be distinct mesh dims in ascending order, and an index one of theirs.
  for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{1, 1}, {1, 0}, {2}, {-1}}) {
    CAPTURE(shape_str(dims));
    const std::string want =
        "[MeshGroups] dims " + shape_str(dims) + " must be distinct dims of the mesh [2, 3], ascending";
    CHECK(test::error_of([&] { groups.size(dims); }) == want);
    CHECK(test::error_of([&] { groups.index(dims); }) == want);
    CHECK(test::error_of([&] { groups.coordinate_at(dims, 0); }) == want);
    CHECK(test::error_of([&] { groups.group(dims, 1); }) == want);
  }
  CHECK(test::error_of([&] { groups.coordinate_at({1}, 3); }) ==
        "[MeshGroups] index 3 is outside the 3 ranks along dims [1]");
  CHECK(test::error_of([&] {
          groups.coordinate_at({0, 1}, -1);
        }) == "[MeshGroups] index -1 is outside the 6 ranks along dims [0, 1]");
  CHECK(log.size() == 3);  // no group made by a refused call
}

TEST_CASE("HSDP on a one-rank mesh equals plain Muon bitwise; loading skips no owned state") {
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 1}, std::vector<std::string>{"replicate", "shard"}, 0);
  std::vector<ParamPtr> plain_params, hsdp_params;
  const std::vector<std::vector<Placement>> layouts = {
      {Placement::Replicate(), Placement::Replicate()}, {Placement::Replicate(), Placement::Shard(1)}, {}};
  const char* names[] = {"w0", "w1", "w2"};
  for (uint32_t i = 0; i < 3; ++i) {
    plain_params.push_back(matrix(names[i], 12 + i, 9, 10 + i));
    hsdp_params.push_back(make_param(plain_params.back()->name, plain_params.back()->data.clone()));
    if (!layouts[i].empty())
      hsdp_params.back()->layout = DTensor(hsdp_params.back()->data, hsdp_params.back()->data.shape(), mesh, layouts[i]);
  }
  Muon plain(Stream(Device::cpu())), hsdp(Stream(Device::cpu()));
  plain.add_param_group(plain_params);
  hsdp.add_param_group(hsdp_params);
  hsdp.enable_hsdp(std::make_shared<FakeCommunicator>());
  CHECK(hsdp.hsdp_schedule().size() == 2);  // two domains, one assignment each; w2 stays local
  CHECK(hsdp.local_params(0) == std::vector<Param*>{hsdp_params[2].get()});
  for (int step = 1; step <= 2; ++step) {
    for (uint32_t i = 0; i < 3; ++i) {
      plain_params[i]->grad = test::random_tensor(plain_params[i]->data.shape(), DType::f32, 100 + 10 * uint32_t(step) + i);
      hsdp_params[i]->grad = plain_params[i]->grad.clone();
    }
    plain.step();
    hsdp.step();
  }
  plain.stream().synchronize();
  hsdp.stream().synchronize();
  for (uint32_t i = 0; i < 3; ++i) CHECK(test::same_bits(plain_params[i]->data, hsdp_params[i]->data));
  StateDict full = broadcast_state_to_replicas(hsdp, hsdp.state_dict());
  // The same file but for where the distributed params' shards lie (w2 has no layout).
  const std::string shards = "\"param_shards\":[[0,0],[0,0],null],";
  const size_t at = full.metadata.find(shards);
  REQUIRE(at != std::string::npos);
  full.metadata.erase(at, shards.size());
  CHECK(serialize_state_dict(full) == serialize_state_dict(plain.state_dict()));
}

TEST_CASE("HSDP errors are named") {
  auto solo = std::make_shared<FakeCommunicator>();
  auto mesh11 = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 1}, std::vector<std::string>{"replicate", "shard"}, 0);
  auto mesh21 = std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 1}, std::vector<std::string>{"replicate", "shard"}, 0);
  auto mesh12 = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 2}, std::vector<std::string>{"replicate", "shard"}, 0);
  const std::vector<Placement> replicated = {Placement::Replicate(), Placement::Replicate()};

  Muon none(Stream(Device::cpu()));
  none.add_param_group({matrix("a", 4, 4, 1)});
  CHECK_THROWS_WITH_AS(none.enable_hsdp(nullptr), "[Muon] enable_hsdp needs a communicator", Error);
  CHECK_THROWS_WITH_AS(none.enable_hsdp(solo), "[Muon] enable_hsdp: no parameter has a DTensor layout", Error);
  CHECK_THROWS_WITH_AS(broadcast_state_to_replicas(none, none.state_dict()),
                       "[Muon] broadcast_state_to_replicas needs HSDP (call enable_hsdp)", Error);
  HsdpOptions bad;
  bad.cap_bytes = 0;
  CHECK_THROWS_WITH_AS(none.enable_hsdp(solo, bad), "[Muon] HSDP cap_bytes must be >= 1, got 0", Error);
  bad = {};
  bad.broadcast_buffer_bytes = 0;
  CHECK_THROWS_WITH_AS(none.enable_hsdp(solo, bad), "[Muon] HSDP broadcast_buffer_bytes must be >= 1, got 0", Error);
  bad = {};
  bad.replica_count = 0;
  CHECK_THROWS_WITH_AS(none.enable_hsdp(solo, bad), "[Muon] HsdpOptions::replica_count must be >= 1, got 0", Error);

  // A Muon over params laid out on the given meshes (replicated).
  auto muon_on = [&](const std::vector<std::shared_ptr<DeviceMesh>>& meshes) {
    std::vector<ParamPtr> params;
    for (size_t i = 0; i < meshes.size(); ++i) {
      params.push_back(matrix(std::string(1, char('a' + i)), 4, 4, uint32_t(i)));
      params.back()->layout = DTensor(params.back()->data, {4, 4}, meshes[i], replicated);
    }
    auto muon = std::make_unique<Muon>(Stream(Device::cpu()));
    muon->add_param_group(params);
    return muon;
  };
  CHECK_THROWS_WITH_AS(muon_on({mesh11, mesh21})->enable_hsdp(solo),
                       "[Muon] enable_hsdp: parameter 'b' is on a mesh of shape [2, 1], 'a' on [1, 1]; HSDP needs one mesh", Error);
  CHECK_THROWS_WITH_AS(muon_on({mesh21})->enable_hsdp(solo),
                       "[MeshGroups] the mesh [2, 1] at rank 0 does not match the communicator (rank 0 of 1)", Error);
  auto twice = muon_on({mesh11});
  twice->enable_hsdp(solo);
  CHECK_THROWS_WITH_AS(twice->enable_hsdp(solo), "[Muon] HSDP is already enabled", Error);
  // A laid-out param added after enable_hsdp would be in no assignment, never stepped: refused.
  ParamPtr late = matrix("late", 4, 4, 7);
  late->layout = DTensor(late->data, {4, 4}, mesh11, replicated);
  CHECK_THROWS_WITH_AS(
      twice->add_param_group({late}),
      "[Muon] parameter 'late' has a DTensor layout but HSDP is already enabled: enable_hsdp plans the "
      "HSDP schedule from the groups it sees (add every group before it)",
      Error);
  CHECK(twice->param_groups().size() == 1);
  twice->add_param_group({matrix("local", 4, 4, 8)});  // without a layout: stepped locally
  // A param's data must be the shard its layout describes.
  ParamPtr half = matrix("half", 2, 4, 9);
  half->layout = DTensor(test::random_tensor({4, 4}, DType::f32, 10), {4, 4}, mesh11, replicated);
  Muon mismatched(Stream(Device::cpu()));
  mismatched.add_param_group({half});
  CHECK_THROWS_WITH_AS(
      mismatched.enable_hsdp(solo),
      "[Muon] enable_hsdp: parameter 'half' holds [2, 4] but its layout's local shard is [4, 4] (data must "
      "be the shard its layout describes)",
      Error);
  CHECK_FALSE(mismatched.hsdp_enabled());

  // A shard stepped without HSDP would be orthogonalised on its own: refused.
  ParamPtr shard = matrix("s", 4, 4, 5);
  shard->layout = DTensor(shard->data, {8, 4}, mesh12, {Placement::Replicate(), Placement::Shard(0)});
  shard->grad = test::random_tensor({4, 4}, DType::f32, 6);
  Muon unsharded(Stream(Device::cpu()));
  unsharded.add_param_group({shard});
  CHECK_THROWS_WITH_AS(unsharded.step(),
                       "[Muon] parameter 's' is a shard ([4, 4] of [8, 4]): call enable_hsdp so its update sees the whole matrix",
                       Error);
  CHECK(unsharded.param_groups()[0].step == 0);  // nothing changed
  // The same through the public update pieces, which must not create its momentum first.
  CHECK_THROWS_WITH_AS(
      unsharded.update_params(0, {shard.get()}),
      "[Muon] parameter 's' is a shard ([4, 4] of [8, 4]): call enable_hsdp so its update sees the whole matrix",
      Error);
  CHECK_THROWS_WITH_AS(
      unsharded.update_momentum(0, {shard.get()}),
      "[Muon] parameter 's' is a shard ([4, 4] of [8, 4]): call enable_hsdp so its update sees the whole matrix",
      Error);
  const Tensor before = shard->data.clone();
  CHECK_THROWS_WITH_AS(
      unsharded.process_unsharded_batch(0, {shard.get()}, Tensor::zeros({1, 4, 4}, DType::f32, Device::cpu())),
      "[Muon] parameter 's' is a shard ([4, 4] of [8, 4]): call enable_hsdp so its update sees the whole matrix",
      Error);
  CHECK(test::same_bits(shard->data, before));
  CHECK(unsharded.state().empty());
}
