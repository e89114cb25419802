// The program the multi-process tests launch once per rank: runs one scenario and exits 0 when
// every check on this rank held. Usage: swapopt-mp-worker SCENARIO
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

std::vector<ParamPtr> hsdp_model(const std::shared_ptr<const DeviceMesh>& mesh) {
  std::vector<ParamPtr> params;
  const std::vector<Shape> shapes = {{64, 48}, {48, 64}, {32, 40}, {32, 40}, {96, 40}, {4, 8}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::vector<float> v(size_t(shape_numel(shapes[i])));
    for (size_t j = 0; j < v.size(); ++j) v[j] = std::sin(float(j * 7 + i * 13)) * 0.1f;
    ParamPtr p = make_param("w" + std::to_string(i), Tensor::from_floats(v, shapes[i]));
    if (i != 2)  // w2 stays local (no layout): a no-comm param
      p->layout = DTensor(p->data, shapes[i], mesh, {Placement::Replicate(), Placement::Replicate()});
    params.push_back(p);
  }
  return params;
}

void hsdp_grads(const std::vector<ParamPtr>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == 1 && step == 2) {  // no gradient this step
      params[i]->grad = Tensor();
      continue;
    }
    std::vector<float> g(size_t(params[i]->data.numel()));
    for (size_t j = 0; j < g.size(); ++j) g[j] = std::cos(float(j * 3 + i * 5 + size_t(step) * 11));
    params[i]->grad = Tensor::from_floats(g, params[i]->data.shape());
  }
}

bool same(const std::vector<ParamPtr>& a, const std::vector<ParamPtr>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(a[i]->data.data_ptr(), b[i]->data.data_ptr(), a[i]->data.nbytes()) != 0) return false;
  return true;
}

/** Mesh replicate x shard = size x 1: HSDP Muon equals single-process Muon bitwise on every rank,
 *  non-owners keep no momentum, and swapped HSDP equals bare HSDP bitwise. */
void hsdp(const std::shared_ptr<Communicator>& comm) {
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{comm->size(), 1}, std::vector<std::string>{"replicate", "shard"},
                                           comm->rank());
  auto ref_params = hsdp_model(mesh), bare_params = hsdp_model(mesh), swap_params = hsdp_model(mesh);
  Muon ref(Stream(Device::cpu())), bare(Stream(Device::cpu())), inner(Stream(Device::cpu()));
  ref.add_param_group(ref_params);
  bare.add_param_group(bare_params);
  inner.add_param_group(swap_params);
  bare.enable_hsdp(comm);
  inner.enable_hsdp(comm->sub_group([&] {
    std::vector<int> all(size_t(comm->size()));
    for (int r = 0; r < comm->size(); ++r) all[size_t(r)] = r;
    return all;
  }(), "swap-replicas"));
  SwapConfig config;
  config.swap_times = 3;
  auto swapped = swap_muon(inner, config);
  for (int step = 1; step <= 3; ++step) {
    hsdp_grads(ref_params, step);
    hsdp_grads(bare_params, step);
    hsdp_grads(swap_params, step);
    ref.step();
    bare.step();
    swapped->step();
    ref.stream().synchronize();
    bare.stream().synchronize();
    inner.stream().synchronize();
    expect(same(ref_params, bare_params), "HSDP equals single-process Muon at step " + std::to_string(step));
    expect(same(bare_params, swap_params), "swapped HSDP equals bare HSDP at step " + std::to_string(step));
  }
  size_t owned = 0;
  for (const HsdpAssignment& a : bare.hsdp_assignments(0))
    for (size_t i = 0; i < a.params.size(); ++i) {
      const bool has_state = bare.state().count(a.params[i]) != 0;
      expect(has_state == (a.owners[i] == comm->rank()), "only owners keep momentum (" + a.params[i]->name + ")");
      owned += a.owners[i] == comm->rank() ? 1 : 0;
    }
  expect(owned > 0, "this rank owns some params");
  expect(serialize_state_dict(bare.state_dict()) == serialize_state_dict(swapped->state_dict()), "swapped state equals bare");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    const LaunchEnv env = LaunchEnv::from_environment();
    auto comm = make_gloo_communicator(env);
    if (scenario == "collectives") {
      collectives(*comm);
    } else if (scenario == "hsdp") {
      hsdp(std::shared_ptr<Communicator>(std::move(comm)));
      std::printf("rank done: %d failures\n", failures);
      return failures == 0 ? 0 : 1;
    } else if (scenario == "dead_rank") {
      // The last rank leaves before the collective; the others must fail with a named error in time.
      if (comm->rank() == comm->size() - 1) std::_Exit(3);
      Tensor t = filled(1024, 1.f);
      try {
        comm->all_reduce(t)->wait();
        expect(false, "all_reduce with a dead peer succeeded");
      } catch (const Error& e) {
        std::printf("named error: %s\n", e.what());
        expect(std::strstr(e.what(), "[comm] all_reduce on rank ") != nullptr, "error names the collective and rank");
      }
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
