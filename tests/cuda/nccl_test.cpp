// NCCL at world size 1 (one GPU): the collectives run and give the identity results. Skipped
// without a CUDA device or an NCCL build.
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "mp/launcher.h"
#include "test_util.h"

using namespace swapopt;

TEST_CASE("NCCL communicator at world size 1" * doctest::skip(test::no_gpu() || !nccl_built())) {
  LaunchEnv env;
  env.rendezvous_dir = test::make_temp_dir("swapopt_nccl_");
  std::shared_ptr<Communicator> bootstrap = make_gloo_communicator(env);
  Stream stream(Device::cuda(0));
  auto nccl = make_nccl_communicator(bootstrap, stream, std::chrono::seconds(30));
  CHECK(nccl->backend() == "nccl");
  CHECK(nccl->size() == 1);
  const Tensor x = test::random_tensor({1000}, DType::f32, 1, Device::cuda(0));
  const std::vector<float> before = x.to_float_vector();
  nccl->all_reduce(x)->wait();
  nccl->broadcast(x, 0)->wait();
  const Tensor gathered = Tensor::zeros({1000}, DType::f32, Device::cuda(0));
  nccl->all_gather(x, gathered)->wait();
  const Tensor scattered = Tensor::zeros({1000}, DType::f32, Device::cuda(0));
  nccl->reduce_scatter(x, scattered)->wait();
  nccl->barrier();
  CHECK(x.to_float_vector() == before);
  CHECK(gathered.to_float_vector() == before);
  CHECK(scattered.to_float_vector() == before);
  // Refused before issuing, as on Gloo: undefined, released, overlapping (NCCL's in-place
  // all_gather included).
  CHECK(test::error_of([&] { nccl->all_reduce(Tensor()); }) == "[comm] all_reduce: undefined tensor");
  const Tensor released = Tensor::zeros({4}, DType::f32, Device::cuda(0));
  released.storage()->release();
  CHECK(test::error_of([&] { nccl->broadcast(released, 0); }) ==
        "[comm] broadcast: released storage: Tensor(f32, [4], cuda:0)");
  CHECK(test::error_of([&] { nccl->all_gather(gathered, gathered); }) ==
        "[comm] all_gather: in Tensor(f32, [1000], cuda:0) and out Tensor(f32, [1000], cuda:0) share memory");
  CHECK(test::error_of([&] {
          nccl->broadcast_many({x.narrow(0, 0, 8), x.narrow(0, 4, 8)}, {0, 0});
        }) ==
        "[comm] broadcast_many: tensor 0 Tensor(f32, [8], cuda:0) and tensor 1 Tensor(f32, [8], cuda:0) share memory");
  CHECK(x.to_float_vector() == before);

  // Stream-ordered, the host waiting only at the end: a producer stream writes, the grouped
  // broadcasts start after it, a consumer stream copies their result after them; the event pool
  // hands out reused events across many works.
  Stream producer(Device::cuda(0)), consumer(Device::cuda(0));
  for (int round = 0; round < 3; ++round) {
    const Tensor a = Tensor::zeros({4096}, DType::f32, Device::cuda(0)),
                 b = Tensor::zeros({17}, DType::bf16, Device::cuda(0));
    const Tensor a_src = test::random_tensor({4096}, DType::f32, 10 + uint32_t(round), Device::cuda(0));
    const Tensor b_src = test::random_tensor({17}, DType::bf16, 20 + uint32_t(round), Device::cuda(0));
    ops::copy(producer, a_src, a);
    ops::copy(producer, b_src, b);
    nccl->start_after(producer);
    WorkPtr many = nccl->broadcast_many({a, b}, {0, 0});
    const Tensor a_out = Tensor::zeros({4096}, DType::f32, Device::cuda(0)),
                 b_out = Tensor::zeros({17}, DType::bf16, Device::cuda(0));
    many->finish_before(consumer);
    ops::copy(consumer, a, a_out);
    ops::copy(consumer, b, b_out);
    consumer.synchronize();
    many->wait();
    CHECK(test::same_bits(a_out.to(Device::cpu()), a_src.to(Device::cpu())));
    CHECK(test::same_bits(b_out.to(Device::cpu()), b_src.to(Device::cpu())));
  }
  CHECK_THROWS_WITH_AS(nccl->start_after(default_stream(Device::cpu())),
                       "[comm] NCCL on cuda:0 starts after streams of that device, got one on cpu", Error);
  std::system(("rm -rf " + env.rendezvous_dir).c_str());
}

namespace {

/** A bootstrap that claims a world of two but has nobody else: NCCL's init then waits for a
 *  rank that never comes. */
struct LonelyBootstrap final : Communicator {
  struct Done final : Work {
    void wait() override {}
  };
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend() const override { return "lonely"; }
  WorkPtr broadcast(const Tensor&, int) override { return std::make_shared<Done>(); }
  WorkPtr all_gather(const Tensor&, const Tensor&) override { throw Error("unused"); }
  WorkPtr all_reduce(const Tensor&) override { throw Error("unused"); }
  WorkPtr reduce_scatter(const Tensor&, const Tensor&) override { throw Error("unused"); }
  void barrier() override {}
  std::unique_ptr<Communicator> sub_group(const std::vector<int>&, const std::string&) override { throw Error("unused"); }
};

}  // namespace

TEST_CASE("NCCL init against a missing rank: a named error within the timeout, the communicator aborted, not destroyed" *
          doctest::skip(test::no_gpu() || !nccl_built())) {
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(make_nccl_communicator(std::make_shared<LonelyBootstrap>(), Stream(Device::cuda(0)), std::chrono::seconds(3)),
                       "[comm] NCCL rank 0 of 2: init (waiting for every rank to join) did not complete within 3000 ms (the "
                       "communicator was aborted)",
                       Error);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("NCCL init against a missing rank failed after %.2f s (timeout 3 s)\n", seconds);
  CHECK(seconds < 10.0);
}

TEST_CASE("NCCL on 2 ranks, one GPU each (two GPUs visible): every collective and a sub-group" *
          doctest::skip(cuda_device_count() < 2 || !nccl_built())) {
  const std::string dir = test::make_temp_dir("swapopt_nccl2_");
  const test::LaunchResult r = test::launch_ranks(2, {test::test_path(SWAPOPT_MP_WORKER, "swapopt-mp-worker"), "nccl"},
                                                  {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_TIMEOUT_MS", "30000"}},
                                                  std::chrono::seconds(120));
  CHECK_FALSE(r.timed_out);
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    CAPTURE(i);
    CAPTURE(r.ranks[i].output);
    CHECK(r.ranks[i].exit_code == 0);
  }
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("NCCL stand-in names what is missing" * doctest::skip(nccl_built())) {
  CHECK_THROWS_WITH_AS(make_nccl_communicator(nullptr, Stream(Device::cpu()), std::chrono::seconds(1)),
                       "[comm] swapopt was built without NCCL (needs CUDA, Gloo and libnccl; reconfigure with -Dnccl=enabled)",
                       Error);
}
