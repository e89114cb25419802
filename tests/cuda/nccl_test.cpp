// NCCL at world size 1 (one GPU): the collectives run and give the identity results. Skipped
// without a CUDA device or an NCCL build.
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
  std::system(("rm -rf " + env.rendezvous_dir).c_str());
}

TEST_CASE("NCCL stand-in names what is missing" * doctest::skip(nccl_built())) {
  CHECK_THROWS_WITH_AS(make_nccl_communicator(nullptr, Stream(Device::cpu()), std::chrono::seconds(1)),
                       "[comm] swapopt was built without NCCL (needs CUDA, Gloo and libnccl; reconfigure with -Dnccl=enabled)",
                       Error);
}
