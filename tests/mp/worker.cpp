// The program the multi-process tests launch once per rank: runs one scenario and exits 0 when
// every check on this rank held. Usage: swapopt-mp-worker SCENARIO [ARGS]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "swapopt/comm/communicator.h"
#include "swapopt/swapopt.h"

using namespace swapopt;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("rank check failed: %s\n", what.c_str());
  }
}

Tensor filled(int64_t n, float value) { return Tensor::from_floats(std::vector<float>(size_t(n), value), {n}); }

/** Every collective on the world group, and on the rows and columns of a 2-D mesh when size is 4. */
void collectives(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  Tensor b = filled(5, r == 1 % n ? 7.f : -1.f);
  comm.broadcast(b, 1 % n)->wait();
  expect(b.to_float_vector() == std::vector<float>(5, 7.f), "broadcast");

  Tensor in = filled(3, float(r + 1)), out = Tensor::zeros({3 * n}, DType::f32, Device::cpu());
  comm.all_gather(in, out)->wait();
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < 3; ++j) expect(out.to_float_vector()[size_t(3 * i + j)] == float(i + 1), "all_gather");

  Tensor sum = filled(4, float(r));
  WorkPtr pending = comm.all_reduce(sum);  // asynchronous: overlap with host work, then wait
  pending->wait();
  expect(sum.to_float_vector() == std::vector<float>(4, float(n * (n - 1) / 2)), "all_reduce");

  std::vector<float> values(size_t(2 * n));
  for (int i = 0; i < 2 * n; ++i) values[size_t(i)] = float(i + r);
  Tensor rs_in = Tensor::from_floats(values, {2 * n}), rs_out = Tensor::zeros({2}, DType::f32, Device::cpu());
  comm.reduce_scatter(rs_in, rs_out)->wait();
  for (int j = 0; j < 2; ++j)
    expect(rs_out.to_float_vector()[size_t(j)] == float(n * (2 * r + j) + n * (n - 1) / 2), "reduce_scatter");
  comm.barrier();

  // Stream-ordered: the grouped broadcasts start after a slow producer stream's writes, and a
  // consumer stream copies their result; the host waits only at the end.
  Stream producer(Device::cpu()), consumer(Device::cpu());
  const Tensor p0 = Tensor::zeros({6}, DType::f32, Device::cpu()), p1 = Tensor::zeros({3}, DType::f32, Device::cpu());
  producer.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });
  ops::copy(producer, filled(6, float(10 + r)), p0);
  ops::copy(producer, filled(3, float(20 + r)), p1);
  comm.start_after(producer);
  WorkPtr many = comm.broadcast_many({p0, p1}, {0, n - 1});
  const Tensor got0 = Tensor::zeros({6}, DType::f32, Device::cpu()),
               got1 = Tensor::zeros({3}, DType::f32, Device::cpu());
  many->finish_before(consumer);
  ops::copy(consumer, p0, got0);
  ops::copy(consumer, p1, got1);
  consumer.synchronize();
  many->wait();
  expect(got0.to_float_vector() == std::vector<float>(6, 10.f), "stream-ordered broadcast_many (root 0)");
  expect(got1.to_float_vector() == std::vector<float>(3, float(20 + n - 1)),
         "stream-ordered broadcast_many (last root)");

  if (n == 4) {  // mesh 2 x 2: row groups {0,1},{2,3}; column groups {0,2},{1,3}
    const int row = r / 2, col = r % 2;
    auto rows = comm.sub_group({2 * row, 2 * row + 1}, "row" + std::to_string(row));
    auto cols = comm.sub_group({col, col + 2}, "col" + std::to_string(col));
    Tensor x = filled(2, float(r));
    rows->all_reduce(x)->wait();
    expect(x.to_float_vector()[0] == float(4 * row + 1), "row all_reduce");
    Tensor y = filled(2, float(r));
    cols->all_reduce(y)->wait();
    expect(y.to_float_vector()[0] == float(2 * col + 2), "column all_reduce");
  }
}

/** NCCL over the Gloo bootstrap, one GPU per rank (LOCAL_RANK's): every collective on device
 *  tensors, and a sub-group. */
void nccl_collectives(std::shared_ptr<Communicator> bootstrap, const LaunchEnv& env) {
  const Device device = env.device();
  expect(device.is_cuda(), "a GPU per rank");
  use_device(device);
  Stream stream(device);
  auto nccl = make_nccl_communicator(bootstrap, stream, env.timeout);
  const int r = nccl->rank(), n = nccl->size();
  auto on_gpu = [&](int64_t count, float value) { return filled(count, value).to(device); };
  Tensor b = on_gpu(5, r == 1 ? 7.f : -1.f);
  nccl->broadcast(b, 1)->wait();
  expect(b.to_float_vector() == std::vector<float>(5, 7.f), "nccl broadcast");
  Tensor in = on_gpu(3, float(r + 1)), out = Tensor::zeros({3 * n}, DType::f32, device);
  nccl->all_gather(in, out)->wait();
  for (int i = 0; i < n; ++i) expect(out.to_float_vector()[size_t(3 * i)] == float(i + 1), "nccl all_gather");
  Tensor sum = on_gpu(4, float(r));
  nccl->all_reduce(sum)->wait();
  expect(sum.to_float_vector() == std::vector<float>(4, float(n * (n - 1) / 2)), "nccl all_reduce");
  Tensor rs_in = on_gpu(2 * n, float(r)), rs_out = Tensor::zeros({2}, DType::f32, device);
  nccl->reduce_scatter(rs_in, rs_out)->wait();
  expect(rs_out.to_float_vector() == std::vector<float>(2, float(n * (n - 1) / 2)), "nccl reduce_scatter");
  std::vector<int> all(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) all[size_t(i)] = i;
  auto sub = nccl->sub_group(all, "nccl_all");
  Tensor x = on_gpu(2, 1.f);
  sub->all_reduce(x)->wait();
  expect(x.to_float_vector()[0] == float(n), "nccl sub-group all_reduce");
  nccl->barrier();
}

/** The model of the HSDP scenario, on a mesh replicate x shard: every kind of layout. */
struct ParamSpec {
  std::string name;
  Shape shape;
  std::vector<Placement> placements;  // empty: no layout (a no-comm param)
};

std::vector<ParamSpec> hsdp_specs() {
  using P = Placement;
  return {
      {"w0", {64, 48}, {P::Replicate(), P::Shard(0)}},   // rows sharded
      {"w1", {48, 64}, {P::Replicate(), P::Shard(1)}},   // columns sharded
      {"w2", {32, 40}, {}},                              // local
      {"w3", {13, 40}, {P::Replicate(), P::Shard(0)}},   // uneven shards
      {"w4", {3, 20, 12}, {P::Replicate(), P::Shard(2)}},  // a batch of matrices, columns sharded
      {"w5", {96, 40}, {P::Replicate(), P::Replicate()}},
      {"w6", {4, 8}, {P::Replicate(), P::Replicate()}},
      {"w7", {24, 36}, {P::Shard(1), P::Shard(0)}},      // sharded over both mesh dims
      {"w8", {40, 32}, {P::Replicate(), P::Shard(0)}},
  };
}

Tensor full_tensor(const Shape& shape, size_t i, int step) {
  std::vector<float> v(size_t(shape_numel(shape)));
  for (size_t j = 0; j < v.size(); ++j)
    v[j] = step == 0 ? std::sin(float(j * 7 + i * 13)) * 0.1f : std::cos(float(j * 3 + i * 5 + size_t(step) * 11));
  return Tensor::from_floats(v, shape);
}

/** This rank's block of `full` under `spec` (a contiguous copy); `full` itself without a layout. */
Tensor local_of(const Tensor& full, const ParamSpec& spec, const DeviceMesh& mesh) {
  if (spec.placements.empty()) return full;
  Shape offset;
  const Shape shape = DTensor::local_shape_at(spec.shape, mesh, spec.placements, mesh.coordinate(), &offset);
  return full.block(offset, shape).clone();
}

/** Whole tensors (`sharded` false: the single-process reference) or this rank's shards. */
std::vector<ParamPtr> hsdp_model(const std::shared_ptr<const DeviceMesh>& mesh, bool sharded) {
  std::vector<ParamPtr> params;
  const auto specs = hsdp_specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Tensor full = full_tensor(specs[i].shape, i, 0);
    if (!sharded) {
      params.push_back(make_param(specs[i].name, full));
      continue;
    }
    ParamPtr p = make_param(specs[i].name, local_of(full, specs[i], *mesh));
    if (!specs[i].placements.empty()) p->layout = DTensor(p->data, specs[i].shape, mesh, specs[i].placements);
    params.push_back(p);
  }
  return params;
}

void hsdp_grads(const std::vector<ParamPtr>& params, int step, const DeviceMesh* mesh) {
  const auto specs = hsdp_specs();
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == 1 && step == 2) {  // no gradient this step
      params[i]->grad = Tensor();
      continue;
    }
    const Tensor full = full_tensor(specs[i].shape, i, step);
    params[i]->grad = mesh ? local_of(full, specs[i], *mesh) : full;
  }
}

bool same(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

bool same(const std::vector<ParamPtr>& a, const std::vector<ParamPtr>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!same(a[i]->data, b[i]->data)) return false;
  return true;
}

/** Each rank's shards equal the same block of the single-process reference. */
bool same_as_reference(const std::vector<ParamPtr>& local, const std::vector<ParamPtr>& ref, const DeviceMesh& mesh) {
  const auto specs = hsdp_specs();
  for (size_t i = 0; i < local.size(); ++i)
    if (!same(local[i]->data, local_of(ref[i]->data, specs[i], mesh))) return false;
  return true;
}

/** Mesh replicate x shard (R x S) on R * S ranks: HSDP Muon equals single-process Muon bitwise on
 *  every rank, non-owners keep no momentum, swapped HSDP equals bare HSDP bitwise, and the
 *  checkpoint helper gives every replica the reference's momentum. `replica_count` 0: unset. */
void hsdp(const std::shared_ptr<Communicator>& comm, int64_t replicas, int64_t shards, int64_t replica_count) {
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{replicas, shards},
                                           std::vector<std::string>{"replicate", "shard"}, comm->rank());
  auto ref_params = hsdp_model(mesh, false), bare_params = hsdp_model(mesh, true), swap_params = hsdp_model(mesh, true);
  Muon ref(Stream(Device::cpu())), bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
  ref.add_param_group(ref_params);
  bare.add_param_group(bare_params);
  inner.add_param_group(swap_params);
  HsdpOptions options;
  if (replica_count > 0) {
    options.replica_count = replica_count;
    options.broadcast_buffer_bytes = 4096;  // several broadcast buffers, large params in their own
  }
  if (replicas == 4) {  // checked before any sub-group is made: no rank enters a collective
    HsdpOptions bad;
    bad.replica_count = 3;
    try {
      bare.enable_hsdp(comm, bad);
      expect(false, "hsdp_replica_count 3 of 4 replicas accepted");
    } catch (const Error& e) {
      expect(
          std::string(e.what()) == "[Muon] HsdpOptions::replica_count 3 must divide the 4 replicas of parameter 'w0'",
          std::string("named error, got: ") + e.what());
    }
  }
  bare.enable_hsdp(comm, options);
  inner.enable_hsdp(comm, options);
  SwapConfig config;
  config.swap_times = 5;  // more batches than are in flight, where a rank has that many units
  auto swapped = swap_muon(inner, config);
  // Swapped again under a device budget just above this rank's largest unit workspace: a unit
  // with more state than 512 bytes beside it (replicated, sharded or local) streams it in chunks.
  auto chunk_params = hsdp_model(mesh, true);
  Muon chunk_inner(Stream(Device::cpu()));
  chunk_inner.add_param_group(chunk_params);
  chunk_inner.enable_hsdp(comm, options);
  SwapConfig chunk_config;
  chunk_config.min_numel = 64;
  int64_t workspace = 0;
  for (const UpdateUnit& u : MuonSwapAdapter(chunk_inner).plan_units(true)) workspace = std::max(workspace, u.workspace_bytes);
  chunk_config.device_budget_bytes = size_t(workspace) + 512;
  auto chunked = swap_muon(chunk_inner, chunk_config);
  for (int step = 1; step <= 3; ++step) {
    hsdp_grads(ref_params, step, nullptr);
    hsdp_grads(bare_params, step, mesh.get());
    hsdp_grads(swap_params, step, mesh.get());
    hsdp_grads(chunk_params, step, mesh.get());
    ref.step();
    bare.step();
    swapped->step();
    chunked->step();
    ref.stream().synchronize();
    bare.stream().synchronize();
    inner.stream().synchronize();
    chunk_inner.stream().synchronize();
    expect(same_as_reference(bare_params, ref_params, *mesh), "HSDP equals single-process Muon at step " + std::to_string(step));
    expect(same(bare_params, swap_params), "swapped HSDP equals bare HSDP at step " + std::to_string(step));
    expect(same(bare_params, chunk_params), "chunked swapped HSDP equals bare HSDP at step " + std::to_string(step));
  }
  {
    std::vector<UpdateUnit> units = chunked->adapter().plan_units(true);
    chunked->runtime().attach_slots(units, chunked->optimizer(), false);
    chunked->runtime().plan_batches(units, chunked->adapter().partition_costs(units));
    int64_t chunked_units = 0;
    for (const UpdateUnit& u : units) chunked_units += u.chunk_elements > 0 ? 1 : 0;
    std::printf("rank %d: %lld of %zu units chunked\n", comm->rank(), (long long)chunked_units, units.size());
    expect(chunked_units > 0, "some unit is chunked");
  }
  expect(serialize_state_dict(bare.state_dict()) == serialize_state_dict(chunked->state_dict()), "chunked swapped state equals bare");
  size_t owned = 0;
  for (const HsdpAssignment& a : bare.hsdp_schedule())
    for (size_t i = 0; i < a.params.size(); ++i) {
      const bool mine = a.owners[i] == a.local_coordinate;
      expect((bare.state().count(a.params[i]) != 0) == mine, "only owners keep momentum (" + a.params[i]->name + ")");
      owned += mine ? 1 : 0;
    }
  expect(owned > 0, "this rank owns some params");
  expect(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()), "swapped state equals bare");

  // Full copies: every replica gets the reference's momentum of its shards, bare or swapped.
  const StateDict full = broadcast_state_to_replicas(bare, bare.state_dict());
  const auto specs = hsdp_specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto it = full.tensors.find("state." + std::to_string(i) + ".momentum_buffer");
    const Tensor expected = local_of(ref.state().at(ref_params[i].get()).tensors.at("momentum_buffer"), specs[i], *mesh);
    expect(it != full.tensors.end() && same(it->second, expected), "full state of " + specs[i].name + " is the reference's");
  }
  // ... and each param's step from its owner (the proof, on load, that its momentum is there).
  const auto param_steps = [](const std::string& metadata) {
    const size_t at = metadata.find("\"param_steps\":");
    return at == std::string::npos ? std::string() : metadata.substr(at, metadata.find(']', at) - at);
  };
  expect(!param_steps(full.metadata).empty() && param_steps(full.metadata) == param_steps(ref.state_dict().metadata),
         "full param steps are the reference's");
  expect(serialize_state_dict(broadcast_state_to_replicas(inner, swapped->state_dict())) == serialize_state_dict(full),
         "the swapped optimizer's full state equals the bare one's");

  // Loading the full copy keeps the owned state only, and the run continues bitwise.
  std::vector<ParamPtr> resumed_params;
  for (const ParamPtr& p : bare_params) {
    ParamPtr q = make_param(p->name, p->data.clone());
    if (p->layout) q->layout = DTensor(q->data, p->layout->logical_shape(), mesh, p->layout->placements());
    resumed_params.push_back(q);
  }
  Muon resumed(Stream(Device::cpu()));
  resumed.add_param_group(resumed_params);
  resumed.enable_hsdp(comm, options);
  resumed.load_state_dict(full);
  expect(resumed.state().size() == bare.state().size(), "a loaded full copy keeps the owned state only");
  hsdp_grads(bare_params, 4, mesh.get());
  hsdp_grads(resumed_params, 4, mesh.get());
  bare.step();
  resumed.step();
  bare.stream().synchronize();
  resumed.stream().synchronize();
  expect(same(bare_params, resumed_params), "resumed from the full copy equals the uninterrupted run");
}

/** Mesh 1 x size: the ranks of the shard group step different sharded params; every rank fails
 *  with the named error instead of packing mismatched chunks (or hanging). Without `same_count`
 *  the last rank lacks w0's grad; with it rank 0 lacks w1's and the others w0's, so every rank
 *  steps as many params as the others and only which ones differs. */
void hsdp_grad_mismatch(const std::shared_ptr<Communicator>& comm, bool same_count) {
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, comm->size()}, std::vector<std::string>{"replicate", "shard"},
                                           comm->rank());
  auto params = hsdp_model(mesh, true);
  Muon muon(Stream(Device::cpu()));
  muon.add_param_group(params);
  muon.enable_hsdp(comm);
  hsdp_grads(params, 1, mesh.get());
  if (same_count) {
    params[comm->rank() == 0 ? 1 : 0]->grad = Tensor();
  } else if (comm->rank() == comm->size() - 1) {
    params[0]->grad = Tensor();
  }
  const int with_w0 = same_count ? 1 : comm->size() - 1;  // the ranks holding w0's grad (first in the schedule)
  try {
    muon.step();
    expect(false, "ranks stepping other params went unnoticed");
  } catch (const Error& e) {
    std::printf("named error: %s\n", e.what());
    expect(std::string(e.what()) ==
               "[Muon] 'w0' has a grad on " + std::to_string(with_w0) + " of " + std::to_string(comm->size()) +
                   " ranks (a grad is missing on some ranks): every HSDP rank must step the same params",
           "the mismatch is named");
  }
}

/** Two Gloo ranks as threads of this process (mesh 1x2, HsdpOptions::name set, as that option
 *  allows), rank 1 reaching each step 50 ms after rank 0: every step completes within the
 *  collective timeout (3 s; a step takes about 0.3 s on 2 idle cores), bare and swapped. The ranks share the process's
 * default CPU stream, which the step's agreement must not make them wait on for each other. */
void thread_ranks(const std::string& rendezvous_dir) {
  for (const bool swap : {false, true}) {
    const std::string dir = rendezvous_dir + (swap ? "/swapped" : "/bare");
    std::filesystem::create_directories(dir);
    std::vector<std::string> errors(2);
    std::vector<double> slowest(2, 0.0);
    const auto rank_body = [&](int rank) {
      try {
        LaunchEnv env;
        env.rank = rank;
        env.world_size = 2;
        env.rendezvous_dir = dir;
        env.timeout = std::chrono::milliseconds(3000);
        std::shared_ptr<Communicator> comm = make_gloo_communicator(env);
        auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 2},
                                                 std::vector<std::string>{"replicate", "shard"}, rank);
        auto params = hsdp_model(mesh, true);
        Muon muon(Stream(Device::cpu()));
        muon.add_param_group(params);
        HsdpOptions options;
        options.name = "rank" + std::to_string(rank);
        muon.enable_hsdp(comm, options);
        std::unique_ptr<SwapOptimizer> swapped = swap ? swap_muon(muon) : nullptr;
        for (int step = 1; step <= 3; ++step) {
          hsdp_grads(params, step, mesh.get());
          if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
          const auto start = std::chrono::steady_clock::now();
          if (swapped) {
            swapped->step();
            swapped->synchronize();
          } else {
            muon.step();
            muon.stream().synchronize();
          }
          slowest[size_t(rank)] = std::max(
              slowest[size_t(rank)], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
      } catch (const std::exception& e) {
        errors[size_t(rank)] = e.what();
      }
    };
    std::thread rank0(rank_body, 0), rank1(rank_body, 1);
    rank0.join();
    rank1.join();
    for (int rank = 0; rank < 2; ++rank) {
      std::printf("thread rank %d (%s): slowest step %.3f s%s%s\n", rank, swap ? "swapped" : "bare",
                  slowest[size_t(rank)], errors[size_t(rank)].empty() ? "" : ", error: ", errors[size_t(rank)].c_str());
      expect(errors[size_t(rank)].empty(), "thread rank " + std::to_string(rank) + " stepped without an error");
      expect(slowest[size_t(rank)] < 2.5, "thread rank " + std::to_string(rank) + "'s steps took less than 2.5 s");
    }
  }
}

/** Mesh 1 x size: one good HSDP step, then the last rank leaves and the others' next step fails
 *  with the collective's error. The failure stays in that step: afterwards this rank's unrelated
 *  work (a clone, which runs on the process's default stream) does not throw it again. */
void hsdp_dead_rank(const std::shared_ptr<Communicator>& comm) {
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{1, comm->size()},
                                           std::vector<std::string>{"replicate", "shard"}, comm->rank());
  auto params = hsdp_model(mesh, true);
  Muon muon(Stream(Device::cpu()));
  muon.add_param_group(params);
  muon.enable_hsdp(comm);
  hsdp_grads(params, 1, mesh.get());
  muon.step();
  muon.stream().synchronize();
  comm->barrier();
  if (comm->rank() == comm->size() - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::_Exit(3);
  }
  hsdp_grads(params, 3, mesh.get());
  try {
    muon.step();
    muon.stream().synchronize();
    expect(false, "an HSDP step with a dead peer succeeded");
  } catch (const Error& e) {
    std::printf("named error: %s\n", e.what());
    expect(std::strstr(e.what(), "[comm] all_reduce on rank ") != nullptr, "the step's error names the collective");
  }
  try {
    const Tensor copy = Tensor::from_floats({1.f, 2.f}, {2}).clone();
    expect(copy.to_float_vector() == std::vector<float>{1.f, 2.f}, "the clone holds its values");
  } catch (const std::exception& e) {
    expect(false, std::string("unrelated work after the failed step threw: ") + e.what());
  }
}

}  // namespace

/** The group's last rank leaves before an all_reduce; the others must fail with a named error in
 *  time, which they print. The barrier and the pause first let every rank finish connecting (a
 *  rank that leaves during the rendezvous fails it instead, which is not what this tests). */
void peer_leaves(Communicator& group) {
  group.barrier();
  if (group.rank() == group.size() - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::_Exit(3);
  }
  Tensor t = filled(1024, 1.f);
  try {
    group.all_reduce(t)->wait();
    expect(false, "all_reduce with a dead peer succeeded");
  } catch (const Error& e) {
    std::printf("named error: %s\n", e.what());
    expect(std::strstr(e.what(), "[comm] all_reduce on rank ") != nullptr, "error names the collective and rank");
    expect(std::strstr(e.what(), " (world rank ") != nullptr, "error names the world rank");
  }
}

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    if (scenario == "thread_ranks") {  // its ranks are threads with their own rendezvous
      if (argc != 3) throw Error("usage: swapopt-mp-worker thread_ranks RENDEZVOUS_DIR");
      thread_ranks(argv[2]);
      std::printf("rank done: %d failures\n", failures);
      return failures == 0 ? 0 : 1;
    }
    const LaunchEnv env = LaunchEnv::from_environment();
    // The last rank arrives 4 s after the others (comm_test: the rendezvous timeout waits for it).
    if (scenario == "late_rank" && env.rank == env.world_size - 1) std::this_thread::sleep_for(std::chrono::seconds(4));
    auto comm = make_gloo_communicator(env);
    if (scenario == "collectives" || scenario == "late_rank") {
      collectives(*comm);
    } else if (scenario == "hsdp") {
      if (argc != 5) throw Error("usage: swapopt-mp-worker hsdp REPLICAS SHARDS REPLICA_COUNT");
      hsdp(std::shared_ptr<Communicator>(std::move(comm)), std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]));
      std::printf("rank done: %d failures\n", failures);
      return failures == 0 ? 0 : 1;
    } else if (scenario == "nccl") {
      nccl_collectives(std::shared_ptr<Communicator>(std::move(comm)), env);
    } else if (scenario == "hsdp_grad_mismatch") {
      hsdp_grad_mismatch(std::shared_ptr<Communicator>(std::move(comm)), argc > 2 && std::string(argv[2]) == "same_count");
    } else if (scenario == "hsdp_dead_rank") {
      hsdp_dead_rank(std::shared_ptr<Communicator>(std::move(comm)));
    } else if (scenario == "dead_rank") {
      peer_leaves(*comm);
    } else if (scenario == "dead_rank_in_group") {
      // World ranks 1 and 2 form the group 'pair', whose rank 1 (world rank 2) leaves: world rank
      // 1's error names the group, its members' world ranks and its own (comm_test checks).
      comm->barrier();
      if (comm->rank() == 0) return 0;
      peer_leaves(*comm->sub_group({1, 2}, "pair"));
    } else {
      std::printf("unknown scenario '%s'\n", scenario.c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    std::printf("rank error: %s\n", e.what());
    return 1;
  }
  std::printf("rank done: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
