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

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    const LaunchEnv env = LaunchEnv::from_environment();
    auto comm = make_gloo_communicator(env);
    if (scenario == "collectives") {
      collectives(*comm);
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
